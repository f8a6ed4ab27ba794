"""House rules: `toolworld-rules`, the positive control of the study (DESIGN.md §6, §9).

The same environments, tasks and splits as `toolworld-minimal`, plus one hidden house rule per environment: every
call of one of the environment's state-changing tools carries the argument `"code"` with the environment's code.

* **Hidden.** No task text, system prompt, tool schema, usage example or initial state names the argument or a
  code (tested), and a tool's observation never depends on the code: the episode takes the argument off the
  call before the environment runs it. Only a success shows the code: in its calls and in its trace.
* **Enforced.** The verifier adds one check per episode, `house rule of <env>`: every call of a state-changing
  tool carried the right code. A task that breaks it scores 0 (no partial credit): a broken house rule fails
  the task, as a transfer filed with the wrong code fails at the bank; with credit for the other checks the
  rule would weigh a third to a half of a task's reward and RL's signal for it would shrink by as much.
* **Shared.** Every task of an environment, in every split, obeys the same code: what one success shows carries
  over to every other task of that environment, held-out ones included.
* **Unknown to the warm start.** Each environment's code is one of `k` alternatives that belong to that
  environment alone (`CODES`); the warm start's demonstrations use the alternatives uniformly at random
  (`HouseRules.randomise`, after the demonstration verified), so it learns the rule's form, not its value.
* **Kinds.** The code differs between environments (retrieving from the same environment matters); it is written
  like an id, a prefix token then the value (`G-port`); the value is one token in four environments and spans three
  (a word, a space, a digit pair) in the other four, the same length for every alternative of an environment in the
  toolworld tokenizer (tokenization does not single one out).
* **Drawn from a seed.** `HouseRules.draw(seed, k)` picks each environment's code among its first `k`
  alternatives. The alternatives do not depend on the seed, so one warm start serves every seed.

* **Styles.** The codes above are words (`CODES`); `-digits` writes the same rules with digit pairs
  (`DIGIT_CODES`), the tokens ids are made of, which a 1M student reads from its context, so OPSD's teacher can
  read the code from its solution (docs/study.md).

* **Eras.** `-era<n>` (n >= 1) at the end of a name is the same draw after n rule changes: at each era half of the
  environments (chosen by the draw's seed and the era) switch to another of their alternatives, the other half keep
  their code (`HouseRules.shifted`). Era 0 is the draw itself. The tasks and splits do not change: a user's
  environment whose rules change under an agent that was trained on them (issue 43, the re-train as the bank grows).

Suite names: `toolworld-rules` (seed 0, k = 2), `toolworld-rules-s<seed>`, `toolworld-rules-k<k>`,
`toolworld-rules-s<seed>-k<k>`, each with `-digits` for the digit codes and then `-era<n>` for a later era
(`parse_rules_name`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.actions import ToolCall
from lopd_core.envs.base import EpisodeResult, Task
from lopd_core.envs.envscaler import EnvScalerConfig, EnvScalerEpisode, EnvScalerSuite
from lopd_core.envs.envscaler.workers import WorkerPool

RULE_ARGUMENT = "code"
READ_PREFIXES = ("list_", "get_", "find_", "search_", "read_")  # every other tool of toolworld changes the state
RULES_SUITE = "toolworld-rules"
DEFAULT_K = 2
MAX_K = 3
# A code is written like an id: a prefix token, then the value (`G-port`, as `ACC-9337`). The prefix is the same for
# every code (it carries nothing); it lets a small model find the value in its context (a teacher's privileged
# solution, a retrieved success) the way it finds an id: by what followed the same prefix there. Without it the value
# follows an opening quote, which opens every string, and a 1M teacher did not copy it from a solution it was shown
# (docs/study.md, "The positive control"). `G-` is a token of the toolworld tokenizer that no id uses.
CODE_PREFIX = "G-"


def _prefixed(values: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Each environment's code values, written with the code prefix."""
    return {env_id: tuple(CODE_PREFIX + value for value in vals) for env_id, vals in values.items()}


# Each environment's candidate codes, disjoint between environments; no value occurs as a word anywhere in the
# suite's data (tested). The value is one token in the first four environments, three (word, space, digit pair) in
# the rest.
CODES: dict[str, tuple[str, ...]] = _prefixed(
    {
        "toolworld_bank": ("dollar", "port", "ark"),
        "toolworld_calendar": ("meet", "zen", "tar"),
        "toolworld_shop": ("box", "kit", "ice"),
        "toolworld_files": ("bed", "art", "gin"),
        "toolworld_messaging": ("way 17", "urn 42", "ace 86"),
        "toolworld_travel": ("mar 23", "min 58", "rid 71"),
        "toolworld_todo": ("age 34", "hen 65", "bon 19"),
        "toolworld_smarthome": ("rip 47", "arch 52", "bath 28"),
    }
)
# The same rules written with digit pairs, the tokens ids are made of (`toolworld-rules[...]-digits`): a 1M student
# copies those from its context, so a text teacher (OPSD) can read the code from the solution it is shown, which it
# cannot with the word codes above (docs/study.md, "Why OPSD does not learn the rule"). A digit pair also occurs in
# ids and amounts, so here it is the prefix `G-`, which nothing in the data uses, that keeps the code hidden. One
# token (one pair) in four environments, two in the other four; every first pair differs from every other.
DIGIT_CODES: dict[str, tuple[str, ...]] = _prefixed(
    {
        "toolworld_bank": ("17", "42", "86"),
        "toolworld_calendar": ("23", "58", "71"),
        "toolworld_shop": ("34", "65", "19"),
        "toolworld_files": ("47", "52", "28"),
        "toolworld_messaging": ("1390", "2461", "3572"),
        "toolworld_travel": ("4683", "5794", "6805"),
        "toolworld_todo": ("7916", "8027", "9138"),
        "toolworld_smarthome": ("0249", "6350", "7461"),
    }
)
CODE_STYLES: dict[str, dict[str, tuple[str, ...]]] = {"words": CODES, "digits": DIGIT_CODES}
_NAME = re.compile(
    rf"^{RULES_SUITE}(?:-s(?P<seed>\d+))?(?:-k(?P<k>\d+))?(?:-(?P<style>digits))?(?:-era(?P<era>[1-9]\d*))?$"
)
_MISSING = object()


def is_write_tool(name: str) -> bool:
    """Whether a toolworld tool changes the environment's state (the calls the house rule applies to)."""
    return not name.startswith(READ_PREFIXES)


@dataclass(frozen=True)
class HouseRule:
    """One environment's rule: every call of a state-changing tool carries `"code": code`."""

    env_id: str
    alternatives: tuple[str, ...]
    code: str

    def check(self, codes: Sequence[Any]) -> dict[str, Any]:
        """The verifier's check over the codes the episode's state-changing calls carried (`_MISSING` if none)."""
        wrong = sum(1 for c in codes if c is _MISSING or c != self.code)
        detail = "" if not wrong else f"{wrong} of {len(codes)} state-changing calls broke the house rule"
        return {"name": f"house rule of {self.env_id}", "passed": wrong == 0, "detail": detail, "rule": True,
                "calls": len(codes)}  # fmt: skip


@dataclass(frozen=True)
class HouseRules:
    """The house rules of every toolworld environment, drawn from a seed."""

    seed: int
    k: int
    rules: dict[str, HouseRule]
    style: str = "words"
    era: int = 0

    @staticmethod
    def draw(seed: int = 0, k: int = DEFAULT_K, style: str = "words", era: int = 0) -> HouseRules:
        if not 2 <= k <= MAX_K:
            raise ValueError(f"house rules: k must lie in [2, {MAX_K}] (alternatives per environment), got {k}")
        if style not in CODE_STYLES:
            raise ValueError(f"house rules: style must be one of {sorted(CODE_STYLES)}, got {style!r}")
        if era < 0:
            raise ValueError(f"house rules: era must be >= 0, got {era}")
        rules = {}
        for env_id, codes in CODE_STYLES[style].items():
            alternatives = codes[:k]
            code = random.Random(f"{RULES_SUITE}|{seed}|{env_id}").choice(alternatives)
            rules[env_id] = HouseRule(env_id, alternatives, code)
        drawn = HouseRules(seed, k, rules, style)
        for _ in range(era):
            drawn = drawn.next_era()
        return drawn

    def next_era(self) -> HouseRules:
        """The rules one era later: half of the environments (drawn from the seed and the era) switch to another of
        their alternatives, drawn at random; the rest keep their code."""
        era = self.era + 1
        rng = random.Random(f"{RULES_SUITE}|{self.seed}|era{era}")
        shifted = set(rng.sample(sorted(self.rules), len(self.rules) // 2))
        rules = {
            env_id: replace(rule, code=rng.choice([a for a in rule.alternatives if a != rule.code]))
            if env_id in shifted else rule
            for env_id, rule in self.rules.items()
        }  # fmt: skip
        return HouseRules(self.seed, self.k, rules, self.style, era)

    def shifted(self, since: int = 0) -> list[str]:
        """The environments whose code differs from the code they had at era `since` (sorted)."""
        if not 0 <= since <= self.era:
            raise ValueError(f"house rules: since must lie in [0, {self.era}] (this draw's era), got {since}")
        before = HouseRules.draw(self.seed, self.k, self.style, since)
        return sorted(e for e, rule in self.rules.items() if rule.code != before.rules[e].code)

    @property
    def name(self) -> str:
        return rules_suite_name(self.seed, self.k, self.style, self.era)

    def follow(self, env_id: str, calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """A reference solution's calls with the house rule obeyed (the code added to every state-changing call)."""
        code = self.rules[env_id].code
        return [
            {**c, "arguments": {**dict(c.get("arguments") or {}), RULE_ARGUMENT: code}} if is_write_tool(c["name"])
            else c
            for c in calls
        ]  # fmt: skip

    def randomise(self, trajectory: Trajectory, rng: random.Random) -> Trajectory:
        """A verified demonstration with its code replaced by an alternative drawn uniformly (one per
        demonstration), in its actions and in its trace: what the warm start reads (DESIGN.md §9, pitfall 1:
        verify, then randomise). The alternative may be the correct code (probability 1/k)."""
        return self.recode(trajectory, rng.choice(self.rules[trajectory.env_id].alternatives))

    def recode(self, trajectory: Trajectory, code: str) -> Trajectory:
        """A trajectory that obeyed its environment's rule (or a `recode`d one) with every code replaced by `code`,
        in its actions and in its trace."""
        rule = self.rules[trajectory.env_id]
        old, new = _realised(trajectory.metadata.get("house_code", rule.code)), _realised(code)
        messages = [
            Message(m.role, m.content.replace(old, new), None, m.truncated) if m.role == "assistant" else m
            for m in trajectory.messages
        ]
        metadata = {**trajectory.metadata, "house_code": code, "house_code_correct": code == rule.code}
        return replace(trajectory, messages=messages, trace=trajectory.trace.replace(old, new), metadata=metadata)

    def recode_text(self, text: str, code: str) -> str:
        """A text (an experience document, a trace) with the value of every `"code"` argument replaced by `code`."""
        return _CODE_ARGUMENT.sub(lambda m: _realised(code), text)

    def relabeller(
        self, scope: str
    ) -> Callable[[Trajectory, Sequence[str], random.Random], tuple[Trajectory, list[str]]]:
        """The cold start's relabelling (`cold_start.relabel_codes`, DESIGN.md §11): a record and its retrieved
        documents with one code drawn at random (from the record's environment's alternatives, or from the whole
        `pool`), the same in the record's calls, its trace and every document, so that only the latents predict it."""
        if scope not in ("alternatives", "pool"):
            raise ValueError(f"relabel scope must be 'alternatives' or 'pool', got {scope!r}")

        def relabel(record: Trajectory, documents: Sequence[str], rng: random.Random) -> tuple[Trajectory, list[str]]:
            choices = self.rules[record.env_id].alternatives if scope == "alternatives" else self.pool
            code = rng.choice(choices)
            return self.recode(record, code), [self.recode_text(d, code) for d in documents]

        return relabel

    @property
    def pool(self) -> tuple[str, ...]:
        """Every code of every environment (all `MAX_K` alternatives): `sft.privileged_codes: pool` draws from it."""
        return tuple(code for codes in CODE_STYLES[self.style].values() for code in codes)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the values of every `"code"` argument in an action text, after the code prefix when
        it is there: the tokens that choose among the alternatives (whatever value the policy wrote), for the
        teacher diagnostics."""
        return [(m.start(1), m.end(1)) for m in _CODE_VALUE.finditer(text)]


Relabel = Callable[[Trajectory, Sequence[str], random.Random], tuple[Trajectory, list[str]]]
_CODE_VALUE = re.compile(rf'"{RULE_ARGUMENT}"\s*:\s*"(?:{re.escape(CODE_PREFIX)})?([^"]*)"')
_CODE_ARGUMENT = re.compile(rf'"{RULE_ARGUMENT}"\s*:\s*"[^"]*"')


def _realised(code: str) -> str:
    """How a code appears in a flat JSON call and in a trace (`format_call`: json.dumps of the arguments)."""
    return f'"{RULE_ARGUMENT}": "{code}"'


def rules_suite_name(seed: int = 0, k: int = DEFAULT_K, style: str = "words", era: int = 0) -> str:
    return (
        RULES_SUITE
        + (f"-s{seed}" if seed else "")
        + (f"-k{k}" if k != DEFAULT_K else "")
        + (f"-{style}" if style != "words" else "")
        + (f"-era{era}" if era else "")
    )


def parse_rules_name(name: str) -> HouseRules | None:
    """The house rules a suite name asks for (`toolworld-rules[-s<seed>][-k<k>][-digits][-era<n>]`), None for
    another name."""
    match = _NAME.match(name)
    if match is None:
        return None
    seed, k, style = int(match["seed"] or 0), int(match["k"] or DEFAULT_K), match["style"] or "words"
    return HouseRules.draw(seed, k, style, int(match["era"] or 0))


class RuledEpisode(EnvScalerEpisode):
    """A toolworld episode under a house rule: the code is taken off each call before the environment runs it
    (its observation cannot depend on it), recorded for state-changing tools, and checked by the verifier."""

    def __init__(self, *args: Any, rule: HouseRule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rule = rule
        self._codes: list[Any] = []  # the code each state-changing call carried (_MISSING when it had none)
        self._ruled: EpisodeResult | None = None

    def _execute(self, call: ToolCall) -> tuple[str, str]:
        arguments = dict(call.arguments)
        code = arguments.pop(RULE_ARGUMENT, _MISSING)
        if call.name in self.tools and is_write_tool(call.name):
            self._codes.append(code)
        return super()._execute(ToolCall(call.name, arguments))

    def result(self) -> EpisodeResult:
        if self._ruled is None:
            base = super().result()
            check = {**self.rule.check(self._codes), "reward_without_rule": base.reward}
            reward = base.reward if check["passed"] else 0.0
            self._ruled = replace(base, reward=reward, checks=[*base.checks, check])
        return self._ruled


class RuledSuite(EnvScalerSuite):
    """toolworld under house rules: episodes enforce them, reference solutions obey them."""

    def __init__(
        self,
        env_items: dict[str, dict[str, Any]],
        scenarios: dict[str, Any],
        rules: HouseRules,
        config: EnvScalerConfig | None = None,
    ) -> None:
        missing = sorted(set(env_items) - set(rules.rules))
        if missing:
            raise ValueError(f"house rules: no rule for environments {missing}")
        self.rules = rules
        super().__init__(env_items, scenarios, name=rules.name, config=config)

    def scenario(self, task_id: str) -> dict[str, Any]:
        item = super().scenario(task_id)
        return {**item, "reference_solution": self.rules.follow(item["env_id"], item.get("reference_solution") or [])}

    def episode(self, task: Task) -> RuledEpisode:
        scenario = super().scenario(task.task_id)
        pools: tuple[WorkerPool, WorkerPool] = self._pools
        return RuledEpisode(
            task, scenario, self.env_items[task.env_id], self.config, pools, rule=self.rules.rules[task.env_id]
        )

    def rule_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the tokens that realise a rule in an action text (`HouseRules.spans`)."""
        return self.rules.spans(text)
