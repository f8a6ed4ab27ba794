"""toolworld-rules, the positive control: house rules that are hidden, enforced, shared, unknown to the warm start,
of several kinds and drawn from a seed (lopd_core/envs/toolworld/rules.py)."""

from __future__ import annotations

import copy
import importlib
import json
import random
import re
from collections import Counter

import pytest

from lopd_core.backbone import _tiny_tokenizer, _toolworld_corpus
from lopd_core.envs.base import WithValidation
from lopd_core.envs.toolworld import DATA_DIR, ENV_FILE, SPLIT_FILES, is_toolworld, open_toolworld
from lopd_core.envs.toolworld.rules import (
    CODE_PREFIX,
    CODE_STYLES,
    CODES,
    DIGIT_CODES,
    RULE_ARGUMENT,
    HouseRules,
    RuledSuite,
    is_write_tool,
    parse_rules_name,
    rules_suite_name,
)
from lopd_core.envs.toolworld.scenarios import ENVIRONMENTS
from lopd_core.evaluation.harness import ScriptedPolicy
from lopd_core.sft import demonstrations, reference_actions

ALTERNATIVES = [code for codes in CODES.values() for code in codes]
VALUES = [code.removeprefix(CODE_PREFIX) for code in ALTERNATIVES]
SAMPLE = 6  # tasks per environment, split and level (1, 2) in the episode tests


@pytest.fixture(
    scope="module", params=["toolworld-rules", "toolworld-rules-s1-digits", "toolworld-rules-s1-digits-era1"]
)
def suite(request) -> RuledSuite:
    """Both code styles, words (the default) and digit pairs (`-digits`), and a later era (`-era1`): hidden, enforced
    and shared like the rules it changed."""
    ruled = open_toolworld(request.param)
    assert isinstance(ruled, RuledSuite)
    return ruled


@pytest.fixture(scope="module")
def plain():
    return open_toolworld("toolworld-minimal")


def _sample(suite, split: str) -> list:
    out = []
    for env_id in CODES:
        for level in (1, 2):
            out += [t for t in suite.tasks(split) if t.env_id == env_id and t.difficulty == level][:SAMPLE]
    return out


def _words(text: str, needle: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(needle)}(?![A-Za-z0-9_])", text) is not None


def _prefixed(text: str) -> bool:
    """Whether the code prefix starts a word of `text` (inside MSG-21 it is no prefix: MSG- is one token)."""
    return re.search(rf"(?<![A-Za-z]){re.escape(CODE_PREFIX)}", text) is not None


def _play(suite, tasks, actions):
    return ScriptedPolicy(actions)([suite.episode(t) for t in tasks])


# ---------------------------------------------------------------------------------------------------- hidden


def test_no_prompt_task_schema_example_or_state_names_the_rule(suite):
    """The data the policy can see (every task of both splits, its prompts, the tools' schemas, the usage examples
    of the full prompt, the initial states that observations are made of) never holds the argument or a code."""
    data = [(DATA_DIR / ENV_FILE).read_text()] + [(DATA_DIR / f).read_text() for f in SPLIT_FILES.values()]
    visible = []
    for item in json.loads(data[0]).values():
        visible += [item["environment_introduction"], json.dumps(item["tools"]), json.dumps(item["usage_examples"])]
        visible += item["constraints_rules"]
    for f in SPLIT_FILES.values():
        for scenario in json.loads((DATA_DIR / f).read_text()):
            visible += [scenario["task"], json.dumps(scenario["init_config"])]
    for split in ("train", "eval"):
        for task in suite.tasks(split)[::25]:
            episode = suite.episode(task)
            visible += [m.content for m in episode.initial_messages()]
            episode.close()
    text = "\n".join(visible)
    assert not _prefixed(text)  # no id of the data is written with the code's prefix
    for value in VALUES:
        assert not _words(text, value), f"the code {value!r} appears in what the policy sees"
        assert not _words(text, value.split()[0]), f"the word {value.split()[0]!r} appears in what the policy sees"
    assert f'"{RULE_ARGUMENT}"' not in text  # no schema, example or state has a "code" field
    assert not any(RULE_ARGUMENT in t["function"]["parameters"]["properties"]
                   for item in json.loads(data[0]).values() for t in item["tools"])  # fmt: skip


def test_observations_do_not_depend_on_the_code(suite):
    """The environment never sees the code: the same calls with the right and a wrong code give the same
    observations and the same final state; only the verifier's house-rule check differs."""
    tasks = _sample(suite, "train")[::4]
    right = _play(suite, tasks, lambda t: reference_actions(suite.scenario(t.task_id)))
    wrong = _play(suite, tasks, lambda t: [_with_code(a, _other(suite, t.env_id)) for a in
                                           reference_actions(suite.scenario(t.task_id))])  # fmt: skip
    for r, w in zip(right, wrong, strict=True):
        observed = [[m.content for m in t.messages if m.role == "tool"] for t in (r, w)]
        assert observed[0] == observed[1]
        assert r.checks[:-1] == w.checks[:-1] and all(c["passed"] for c in r.checks)
        assert not w.checks[-1]["passed"] and w.checks[-1]["rule"]
        for code in CODES[r.env_id]:  # the feedback that SDPO's teacher reads names no code
            value = code.removeprefix(CODE_PREFIX)
            assert not _words(w.checks[-1]["detail"], value) and not _words(w.checks[-1]["name"], value)


def _other(suite, env_id: str) -> str:
    rule = suite.rules.rules[env_id]
    return next(c for c in rule.alternatives if c != rule.code)


def _with_code(action: str, code: str) -> str:
    try:
        call = json.loads(action)
    except json.JSONDecodeError:
        return action
    if RULE_ARGUMENT in call:
        call[RULE_ARGUMENT] = code
    return json.dumps(call)


# -------------------------------------------------------------------------------------------------- enforced


def test_reference_solutions_obey_the_rules_and_verify(suite):
    for split in ("train", "eval"):
        tasks = _sample(suite, split)
        replays = _play(suite, tasks, lambda t: reference_actions(suite.scenario(t.task_id)))
        assert [r.reward for r in replays] == [1.0] * len(tasks), split
        for r in replays:
            writes = sum(is_write_tool(c["name"]) for c in suite.scenario(r.task_id)["reference_solution"])
            assert r.checks[-1] == {"name": f"house rule of {r.env_id}", "passed": True, "detail": "", "rule": True,
                                    "calls": writes, "reward_without_rule": 1.0}  # fmt: skip
            code = suite.rules.rules[r.env_id].code
            assert f'"{RULE_ARGUMENT}": "{code}"' in r.trace  # a success shows the code in its trace


def test_a_broken_rule_fails_the_task_without_partial_credit(suite, plain):
    tasks = _sample(suite, "eval")
    missing = _play(suite, tasks, lambda t: reference_actions(plain.scenario(t.task_id)))
    wrong = _play(suite, tasks, lambda t: [_with_code(a, _other(suite, t.env_id)) for a in
                                           reference_actions(suite.scenario(t.task_id))])  # fmt: skip
    for replays in (missing, wrong):
        assert all(r.reward == 0.0 for r in replays)
        assert all(all(c["passed"] for c in r.checks[:-1]) for r in replays)  # the task's own checks passed
    # the rule applies to state-changing calls only: a code on a read call is ignored, none is needed there
    task = next(t for t in tasks if any(not is_write_tool(c["name"]) for c in plain.scenario(t.task_id)
                                        ["reference_solution"]))  # fmt: skip
    calls = suite.scenario(task.task_id)["reference_solution"]
    reads_coded = [{**c, "arguments": {**c["arguments"], RULE_ARGUMENT: "anything"}} if not is_write_tool(c["name"])
                   else c for c in calls]  # fmt: skip
    (replay,) = _play(suite, [task], lambda t: reference_actions({"reference_solution": reads_coded}))
    assert replay.reward == 1.0


def test_evaluation_records_measure_the_rule_directly(suite):
    """Each record carries the house rule's check (lopd_core.evaluation.harness.record): the state-changing calls,
    whether all carried the right code, and the reward of the task's other checks; a score block's rule pass rate
    is the share of passing episodes among those with at least one such call (hand-checked: 1 of 2)."""
    from lopd_core.evaluation.harness import record
    from lopd_core.evaluation.stats import score_block

    task = next(t for t in _sample(suite, "eval") if t.difficulty == 1 and any(
        is_write_tool(c["name"]) for c in suite.scenario(t.task_id)["reference_solution"]))  # fmt: skip
    (right,) = _play(suite, [task], lambda t: reference_actions(suite.scenario(t.task_id)))
    (wrong,) = _play(suite, [task], lambda t: [_with_code(a, _other(suite, t.env_id)) for a in
                                               reference_actions(suite.scenario(t.task_id))])  # fmt: skip
    records = [record("rules", right, task), record("rules", wrong, task)]
    assert [(r.rule_calls, r.rule_passed, r.reward_without_rule, r.reward) for r in records] == [
        (1, True, 1.0, 1.0), (1, False, 1.0, 0.0)]  # fmt: skip
    block = score_block(records)
    assert block["rule_pass_rate"]["value"] == 50.0 and block["rule_pass_rate"]["n"] == 2
    plain = record("plain", _play(suite, [task], lambda t: ["Done."])[0], task)  # no call: not in the rate
    assert plain.rule_calls == 0 and score_block([plain]).get("rule_pass_rate") is None


def test_write_tools_are_the_state_changing_ones():
    """`is_write_tool` (by name) agrees with what the reference calls do: every read call leaves the state as it
    was, every other call changes it (simulated in-process on our own environment classes)."""
    scenarios = json.loads((DATA_DIR / SPLIT_FILES["train"]).read_text())
    specs = {spec.env_id: spec for spec in ENVIRONMENTS}
    seen = Counter()
    for scenario in scenarios[::3]:
        spec = specs[scenario["env_id"]]
        cls = getattr(importlib.import_module(f"lopd_core.envs.toolworld.envs.{spec.module}"), spec.class_name)
        env = cls(copy.deepcopy(scenario["init_config"]))
        for call in scenario["reference_solution"]:
            before = copy.deepcopy(vars(env))
            getattr(env, call["name"])(**copy.deepcopy(call["arguments"]))
            changed = vars(env) != before
            assert changed == is_write_tool(call["name"]), (scenario["task_id"], call["name"])
            seen[is_write_tool(call["name"])] += 1
    assert seen[True] > 100 and seen[False] > 20


# ---------------------------------------------------------------------------------------------------- shared


def test_every_task_of_an_environment_shares_its_rule_in_every_split(suite):
    validation = WithValidation(suite, 0.2)
    for split, tasks in (("train", validation.tasks("train")), ("validation", validation.tasks("validation")),
                         ("eval", suite.tasks("eval"))):  # fmt: skip
        for task in tasks[::40]:
            episode = validation.episode(task)
            assert episode.rule is suite.rules.rules[task.env_id], split
            episode.close()
    # what a training success shows (its code) is what a held-out task of the same environment needs
    train = {t.env_id: t for t in suite.tasks("train") if t.difficulty == 1}
    for env_id, task in train.items():
        (success,) = _play(suite, [task], lambda t: reference_actions(suite.scenario(t.task_id)))
        shown = re.search(rf'"{RULE_ARGUMENT}": "([^"]+)"', success.trace)[1]
        held_out = next(t for t in suite.tasks("eval") if t.env_id == env_id and t.difficulty == 1)
        actions = [_with_code(a, shown) for a in reference_actions(suite.scenario(held_out.task_id))]
        (replay,) = _play(suite, [held_out], lambda t, actions=actions: actions)
        assert replay.reward == 1.0, env_id


# ---------------------------------------------------------------------------------- unknown to the warm start


def test_demonstrations_use_the_alternatives_uniformly_after_they_verified(suite):
    tasks = [t for t in suite.tasks("train") if t.difficulty in (1, 2)]
    demos, dropped = demonstrations(suite, tasks)
    assert not dropped and all(d.reward == 1.0 for d in demos)  # verified first, with the right codes
    rng = random.Random(0)
    randomised = [suite.rules.randomise(d, rng) for d in demos]
    counts = {env_id: Counter() for env_id in CODES}
    for before, after in zip(demos, randomised, strict=True):
        drawn = after.metadata["house_code"]
        counts[after.env_id][drawn] += 1
        actions = [m.content for m in after.messages if m.role == "assistant"]
        written = {v for a in actions for v in re.findall(rf'"{RULE_ARGUMENT}": "([^"]+)"', a)}
        assert written == {drawn} and f'"{RULE_ARGUMENT}": "{drawn}"' in after.trace  # actions and trace agree
        assert [m for m in after.messages if m.role != "assistant"] == [m for m in before.messages
                                                                        if m.role != "assistant"]  # fmt: skip
    for env_id, counter in counts.items():
        n, k = sum(counter.values()), suite.rules.k
        assert set(counter) == set(CODE_STYLES[suite.rules.style][env_id][:k])
        for code in counter:  # binomial(n, 1/k): 4 standard deviations
            assert abs(counter[code] - n / k) < 4 * (n * (1 / k) * (1 - 1 / k)) ** 0.5, (env_id, counter)


def test_the_tokenizer_gives_no_alternative_away():
    """The toolworld tokenizer is fit on the plain training split, which holds no code; within an environment
    every alternative is the same number of tokens (DESIGN.md §9, pitfall 2)."""
    corpus = "\n".join(_toolworld_corpus())
    tok = _tiny_tokenizer(1024, 0, "toolworld")
    lengths = {}
    prefix = tok.tokenize(CODE_PREFIX)
    assert len(prefix) == 1 and not _prefixed(corpus)  # one token, which no id of the data uses
    for env_id, codes in CODES.items():
        sizes = {len(tok.tokenize(f'"{RULE_ARGUMENT}": "{c}"')) for c in codes}
        assert len(sizes) == 1, (env_id, codes)
        assert all(tok.tokenize(c)[0] == prefix[0] for c in codes)  # the code is tokenised like an id
        lengths[env_id] = len(tok.tokenize(codes[0])) - 1
        for code in codes:
            value = code.removeprefix(CODE_PREFIX)
            assert not _words(corpus, value) and not _words(corpus, value.split()[0])
    assert min(lengths.values()) == 1 and max(lengths.values()) > 1  # one-token and multi-token rules


# ------------------------------------------------------------------------------------------- kinds and seeds


def test_rules_differ_between_environments_and_are_drawn_from_a_seed():
    assert len(set(ALTERNATIVES)) == len(ALTERNATIVES)  # disjoint: each environment its own codes
    assert len({v.split()[0] for v in VALUES}) == len(VALUES)  # the first token decides
    draws = {seed: HouseRules.draw(seed) for seed in range(6)}
    assert HouseRules.draw(3) == draws[3]
    codes = {seed: tuple(r.code for r in rules.rules.values()) for seed, rules in draws.items()}
    assert len(set(codes.values())) == len(codes)  # six seeds, six different rule sets
    for rules in draws.values():  # the alternatives do not depend on the seed: one warm start serves every seed
        assert {e: r.alternatives for e, r in rules.rules.items()} == {e: c[:2] for e, c in CODES.items()}
        assert all(r.code in r.alternatives for r in rules.rules.values())
    assert HouseRules.draw(0, k=3).rules["toolworld_bank"].alternatives == CODES["toolworld_bank"]
    with pytest.raises(ValueError, match="k must lie in"):
        HouseRules.draw(0, k=4)


def test_digit_codes_are_tokenised_like_ids_and_differ_from_their_first_pair():
    """`-digits`: every value is digit pairs (the tokens ids are made of), the same number of pairs within an
    environment, one pair in four environments and two in the rest; every first pair (the token that decides) is
    its own; the prefix, which the data never uses, stays the code's first token."""
    tok = _tiny_tokenizer(1024, 0, "toolworld")
    prefix = tok.tokenize(CODE_PREFIX)
    firsts, lengths = [], {}
    for env_id, codes in DIGIT_CODES.items():
        assert all(c.removeprefix(CODE_PREFIX).isdigit() for c in codes)
        pieces = [tok.tokenize(c) for c in codes]
        assert all(p[0] == prefix[0] and all(len(x) == 2 and x.isdigit() for x in p[1:]) for p in pieces)
        assert len({len(p) for p in pieces}) == 1, env_id
        lengths[env_id] = len(pieces[0]) - 1
        firsts += [p[1] for p in pieces]
    assert len(set(firsts)) == len(firsts) == 24
    assert sorted(lengths.values()) == [1] * 4 + [2] * 4
    assert set(DIGIT_CODES) == set(CODES)


def test_suite_names():
    assert parse_rules_name("toolworld-rules-s1-digits") == HouseRules.draw(1, 2, "digits")
    assert parse_rules_name("toolworld-rules-digits").rules["toolworld_bank"].alternatives == DIGIT_CODES[
        "toolworld_bank"][:2]  # fmt: skip
    assert (
        rules_suite_name(1, 2, "digits") == "toolworld-rules-s1-digits"
        and parse_rules_name("toolworld-rules-s1-words") is None
    )
    with pytest.raises(ValueError, match="style must be one of"):
        HouseRules.draw(0, 2, "emoji")
    assert parse_rules_name("toolworld-rules") == HouseRules.draw(0, 2)
    assert parse_rules_name("toolworld-rules-s7-k3") == HouseRules.draw(7, 3)
    assert parse_rules_name("toolworld-rules-k3") == HouseRules.draw(0, 3)
    assert parse_rules_name("toolworld-minimal") is None and parse_rules_name("toolworld-rules-x") is None
    assert rules_suite_name(7, 3) == "toolworld-rules-s7-k3" and rules_suite_name() == "toolworld-rules"
    assert is_toolworld("toolworld-rules-s2") and is_toolworld("toolworld") and not is_toolworld("bfcl")
    ruled = open_toolworld("toolworld-rules-s1")
    assert ruled.name == "toolworld-rules-s1" and ruled.tasks("eval")[0].suite == "toolworld-rules-s1"
    assert len(ruled.tasks("eval")) == 680 and ruled.rules == HouseRules.draw(1)


def test_an_era_shifts_half_the_environments_to_another_alternative():
    """`-era<n>`: the draw after n rule changes. Each change moves half of the environments (drawn from the seed and
    the era) to another of their alternatives and keeps the rest; the same name gives the same rules."""
    era0, era1 = parse_rules_name("toolworld-rules-s1-digits"), parse_rules_name("toolworld-rules-s1-digits-era1")
    assert era1 == HouseRules.draw(1, 2, "digits", era=1) == era0.next_era() and era1.era == 1
    assert era1.name == "toolworld-rules-s1-digits-era1" and rules_suite_name(1, 2, "digits", 1) == era1.name
    moved = [e for e in CODES if era1.rules[e].code != era0.rules[e].code]
    assert era1.shifted() == sorted(moved) and len(moved) == len(CODES) // 2
    for env_id, rule in era1.rules.items():
        assert rule.alternatives == era0.rules[env_id].alternatives and rule.code in rule.alternatives
    era2 = parse_rules_name("toolworld-rules-s1-digits-era2")
    assert len(era2.shifted(since=1)) == len(CODES) // 2 and era2.shifted(since=2) == []
    assert parse_rules_name("toolworld-rules-s2-digits-era1").shifted() != era1.shifted()  # the seed draws them
    assert parse_rules_name("toolworld-rules-s1-digits-era0") is None  # era 0 is the name without -era
    with pytest.raises(ValueError, match="since must lie in"):
        era1.shifted(since=2)
    with pytest.raises(ValueError, match="era must be >= 0"):
        HouseRules.draw(1, era=-1)


def test_an_era_enforces_its_new_codes_and_only_there():
    """On era 1, era 0's solutions still succeed in the environments that kept their code and fail in the ones that
    changed it: only era 1's successes show its new codes."""
    era0, era1 = open_toolworld("toolworld-rules-s1-digits"), open_toolworld("toolworld-rules-s1-digits-era1")
    assert [t.task_id for t in era1.tasks("eval")] == [t.task_id for t in era0.tasks("eval")]
    tasks = _sample(era1, "train")
    old = _play(era1, tasks, lambda t: reference_actions(era0.scenario(t.task_id)))
    new = _play(era1, tasks, lambda t: reference_actions(era1.scenario(t.task_id)))
    shifted = set(era1.rules.shifted())
    assert all(r.reward == 1.0 for r in new)
    assert {r.env_id for r in old if r.reward == 0.0} == shifted
    assert all(r.reward == 1.0 for r in old if r.env_id not in shifted)


def test_spans_find_the_code_values():
    rules = HouseRules.draw(0)
    action = '{"tool": "transfer", "amount": 5, "code": "G-way 17"}'
    ((start, end),) = rules.spans(action)
    assert action[start:end] == "way 17"  # the part that differs between the alternatives
    assert rules.spans('{"tool": "get_balance", "account_id": "ACC-1"}') == []
    two = '{"code": "a"} {"code":"bb"}'
    assert [two[s:e] for s, e in rules.spans(two)] == ["a", "bb"]


def test_pool_privileged_copies_show_and_write_one_pool_code_each(suite):
    """sft.privileged_codes: pool. Each privileged copy shows in its solution, and writes in its own calls, one code
    drawn from every environment's alternatives, so only reading the solution predicts it; the copies are drawn
    from the demonstrations as with `own`, and their task and prompts are unchanged."""
    from lopd_core.sft import privileged_copies

    tasks = [t for t in suite.tasks("train") if t.difficulty in (1, 2)]
    demos, _ = demonstrations(suite, tasks)
    pool = suite.rules.pool
    assert len(pool) == len(set(pool)) == sum(len(c) for c in CODES.values())
    copies = privileged_copies(demos, 0.5, 7, lambda d, rng: suite.rules.recode(d, rng.choice(pool)))
    own = privileged_copies(demos, 0.5, 7)
    assert [c.task_id for c in copies] == [o.task_id for o in own] and len(copies) == round(0.5 * len(demos))
    drawn = Counter()
    for copy_ in copies:
        code = copy_.metadata["house_code"]
        drawn[code] += 1
        actions = [m.content for m in copy_.messages if m.role == "assistant"]
        written = {v for a in actions for v in re.findall(rf'"{RULE_ARGUMENT}": "([^"]+)"', a)}
        first_user = next(m.content for m in copy_.messages if m.role == "user")
        shown = set(re.findall(rf'"{RULE_ARGUMENT}": "([^"]+)"', first_user))
        assert written == shown == {code}  # the solution in front shows what the calls write
    assert set(drawn) == set(pool)  # 24 codes over ~200 copies: every one drawn
    with_own = {v for o in own for m in o.messages if m.role == "assistant"
                for v in re.findall(rf'"{RULE_ARGUMENT}": "([^"]+)"', m.content)}  # fmt: skip
    assert with_own <= {r.code for r in suite.rules.rules.values()}  # `own` keeps the demonstration's code


def test_recode_round_trips_and_marks_the_right_code(suite):
    (demo,) = demonstrations(suite, [t for t in suite.tasks("train") if t.difficulty == 1][:1])[0]
    rule = suite.rules.rules[demo.env_id]
    wrong = next(c for c in rule.alternatives if c != rule.code)
    there = suite.rules.recode(demo, wrong)
    assert there.metadata["house_code_correct"] is False and f'"{RULE_ARGUMENT}": "{wrong}"' in there.trace
    back = suite.rules.recode(there, rule.code)
    assert back.messages == demo.messages and back.trace == demo.trace and back.metadata["house_code_correct"]
