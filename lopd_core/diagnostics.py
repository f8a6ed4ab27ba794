"""Teacher diagnostics (DESIGN.md §6): does the privileged teacher know something its student does not?

Logged every step of every distillation method (`TrainStep`), from the privilege delta = log pT(a) - log pS(a) on the
student's sampled tokens (eq. 11), which the loss head computes anyway:

* `privilege_success` / `privilege_failure`: the token mean of delta over successful (r >= 1) and failed rollouts;
* `privilege_rule` / `privilege_other`: over the tokens that realise a rule of the suite (toolworld-rules: the
  value of each `"code"` argument; `token_marks` says which) and over the rest; `privilege_rule_success` and
  `privilege_rule_failure` split the rule tokens by outcome. A teacher that knows the rule scores delta > 0 on the
  rule tokens of successes (it agrees with the right code) and delta < 0 on those of failures (it disagrees with
  a wrong one); the mean over all rule tokens mixes the two and can have either sign;
* `order_auc`: the AUC of the sequence-level delta (the mean of delta over a rollout's tokens) between successes
  and failures: the probability that a random success has a higher sequence delta than a random failure (ties
  count one half). A useful teacher ranks successes above failures (AUC > 0.5); a teacher worse than its student
  by the same amount everywhere scores 0.5. Undefined (not logged) when a batch holds only one outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from lopd_core.conversation import Trajectory
from lopd_core.serialization import ChatSerializer, TokenView

if TYPE_CHECKING:
    from lopd_core.envs.toolworld.rules import HouseRules

TokenMarks = Callable[[str], list[tuple[int, int]]]  # an action's text -> character spans of the marked tokens


def marked_positions(
    view: TokenView, trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase, marks: TokenMarks
) -> list[int]:
    """Positions in `view` (a view of `trajectory`) of the assistant tokens whose characters overlap a span that
    `marks` finds in their message's text. A token's characters are those its prefix adds when decoded."""
    assistant = [m for m in trajectory.messages if m.role == "assistant"]
    if len(assistant) != len(view.assistant_spans):
        raise ValueError(f"view of {trajectory.task_id!r} has {len(view.assistant_spans)} assistant segments for "
                         f"{len(assistant)} assistant messages")  # fmt: skip
    out = []
    for message, (start, end) in zip(assistant, view.assistant_spans, strict=True):
        spans = marks(message.content)
        if not spans:
            continue
        ids = view.input_ids[start:end]
        ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
        begin = 0
        for i, stop in enumerate(ends):
            if any(s < stop and begin < e for s, e in spans):
                out.append(start + i)
            begin = stop
    return out


def order_auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """P(score of a random positive > score of a random negative), ties one half; None without both kinds."""
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def teacher_diagnostics(
    privilege: torch.Tensor,
    rows: torch.Tensor,
    rewards: torch.Tensor,
    marked: torch.Tensor | None = None,
    success_threshold: float = 1.0,
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, their weights: the token or record counts behind each mean) for one step; see the module
    docstring. `privilege` and `marked` (0/1) are per supervised token, `rows` its record, `rewards` per record."""
    delta = privilege.detach().double()
    success = (rewards.detach() >= success_threshold)[rows]
    groups: dict[str, torch.Tensor] = {"success": success, "failure": ~success}
    if marked is not None:
        rule = marked.bool()
        groups.update(rule=rule, other=~rule, rule_success=rule & success, rule_failure=rule & ~success)
    metrics, weights = {}, {}
    for name, where in groups.items():
        n = int(where.sum())
        if n:
            metrics[f"privilege_{name}"] = delta[where].mean().item()
            weights[f"privilege_{name}"] = float(n)
    if marked is not None:
        metrics["n_rule_tokens"] = float(marked.sum())
    n_records = rewards.numel()
    sums = torch.zeros(n_records, dtype=delta.dtype, device=delta.device).index_add(0, rows, delta)
    counts = torch.bincount(rows, minlength=n_records).to(delta.dtype)
    has = counts > 0
    sequence = (sums[has] / counts[has]).tolist()
    auc = order_auc(sequence, (rewards.detach()[has] >= success_threshold).tolist())
    if auc is not None:
        metrics["order_auc"] = auc
        weights["order_auc"] = float(len(sequence))
    return metrics, weights


def copy_probe(
    model: Any, serializer: ChatSerializer, rules: HouseRules, demos: Sequence[Trajectory]
) -> dict[str, float | int]:
    """OPSD's precondition on a suite with house rules: does a teacher read the code that the solution in its
    context shows? For every verified demonstration `d` (its calls obey the rule) and every alternative `shown` of
    its environment, the teacher's view of `d` with a solution showing `shown` in front (`with_privileged_solution`)
    is scored once per alternative `written` that its own calls could write; P(shown) = the softmax over `written`
    of those sequence log-probabilities, taken at `written = shown` (the calls differ only in the code's tokens).
    Returns `p_shown`, the mean of P(shown) over every (demonstration, shown) pair: exactly 1/k for a teacher that
    ignores its context (its P(written) does not depend on `shown`, and sums to 1 over the k alternatives), 1 for
    one that copies; the same mean over right and over wrong shown codes (a context-blind teacher that prefers the
    right code scores high on the first and low on the second); and how many demonstrations were probed."""
    from lopd_core.sft import nll_sum, with_privileged_solution  # sft imports the loss head; keep this one light

    right, wrong = [], []
    with torch.no_grad():
        for d in demos:
            rule = rules.rules[d.env_id]
            for shown in rule.alternatives:
                solution = rules.recode(d, shown).trace
                views = [
                    with_privileged_solution(replace(rules.recode(d, w), trace=solution)) for w in rule.alternatives
                ]
                logp = torch.stack([-nll_sum(model, serializer, [v])[0].double() for v in views])
                p = torch.softmax(logp, 0)[rule.alternatives.index(shown)].item()
                (right if shown == rule.code else wrong).append(p)
    return {
        "p_shown": sum(right + wrong) / max(len(right + wrong), 1),
        "p_shown_right": sum(right) / max(len(right), 1),
        "p_shown_wrong": sum(wrong) / max(len(wrong), 1),
        "chance": 1 / len(next(iter(rules.rules.values())).alternatives),
        "n_demonstrations": len(demos),
    }
