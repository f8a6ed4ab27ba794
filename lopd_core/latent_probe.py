"""The latent-dependence probe (DESIGN.md §11): does LOPD's teacher read its latents?

On a suite with house rules (each environment's hidden code; lopd_core/envs/toolworld/rules.py), for every probe
trajectory `t` (a verified success of environment e: its calls carry e's right code) the teacher scores `t` with each
alternative code of e written in it (`HouseRules.recode`: only the code's tokens differ), and its probability of a code
is the softmax of those sequence log-probabilities over the alternatives, as in `diagnostics.copy_probe`. Four
latent contexts, each from J experience documents:

* (a) `own`: J successes of other tasks of e (never t's own task): P(right code); a target whose environment has no
  success in the bank is left out (`skipped`): there is nothing to read;
* (b) `other`: J successes of another environment: P(right code);
* (c) `none`: no experience (the composer's fixed "none" items): P(right code);
* (d) `rewritten`: the documents of (a) with their code rewritten to another alternative of e
  (`HouseRules.recode_text`): P(the rewritten code), the share that follows what the latents say.

The probe also measures what the latents cost elsewhere: `drift`, the mean over the targets' action tokens outside
the code's value of log pT(token | (a)'s latents) - log p0(token), p0 the plain backbone (every adapter off, no
context: the warm start, the student's start) on the student's view. A teacher fitted only where the code is (the
cold start's `token_selection`) can drift below its student on every other token, and distilling it then teaches
the student to be worse there.

A teacher that reads its latents has (a) well above (b) and (c), and (d) near 1. A teacher whose knowledge sits in
its weights (a reader fitted to the bank) gives the same (a), (b), (c), and (d) near 1 - (a). The probe also measures
how much the latents themselves move: the mean relative distance ||c(own) - c(other)|| / ||c(own)|| and the same to
c(none) (`change_other`, `change_none`); a composer whose queries dominate what it reads scores ~0.01.

    result = latent_probe(models, serializer, rules, targets, experiences)   # LatentProbe
    result.metrics()   # {"probe_own": ..., "probe_other": ..., "probe_none": ..., "probe_rewritten": ..., ...}

Targets and experiences must come from the training split or its validation slice, never from held-out tasks.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from lopd_core.conversation import Trajectory
from lopd_core.envs.base import VALIDATION, Suite, Task
from lopd_core.loss_head import token_logprobs
from lopd_core.models import LOPDModels
from lopd_core.serialization import ChatSerializer, TeacherContext, aligned_action_positions
from lopd_core.sft import verified_replays

if TYPE_CHECKING:
    from lopd_core.envs.toolworld.rules import HouseRules

# (task, task_id, env_id) -> up to J experience documents of env_id's successes, never task_id's own
Experiences = Callable[[str, str, str], list[str]]
CONDITIONS = ("own", "other", "none", "rewritten")


@dataclass(frozen=True)
class LatentProbe:
    """The probe's figures (module docstring), each a mean over the probe trajectories."""

    own: float  # (a) P(right code | latents of J successes of its environment)
    other: float  # (b) P(right code | latents of another environment's successes)
    none: float  # (c) P(right code | no experience)
    rewritten: float  # (d) P(rewritten code | its environment's successes with that code written in)
    change_other: float  # ||c(own) - c(other)|| / ||c(own)||
    change_none: float  # ||c(own) - c(none)|| / ||c(own)||
    n: int  # probe trajectories
    skipped: int = 0  # targets left out: their environment has no success in the bank to read
    drift: float = float("nan")  # mean log pT - log p0 over the non-code action tokens, with (a)'s latents

    @property
    def reads(self) -> float:
        """(a) - (b): what the right experiences add over another environment's."""
        return self.own - self.other

    def passes(self, min_reads: float = 0.3, min_rewritten: float = 0.7) -> bool:
        """The gate of issue 40: (a) - (b) >= 0.3 and (d) >= 0.7."""
        return self.reads >= min_reads and self.rewritten >= min_rewritten

    def summary(self) -> str:
        return (
            f"(a) own {self.own:.2f}, (b) other {self.other:.2f}, (c) none {self.none:.2f}, "
            f"(d) rewritten {self.rewritten:.2f}, drift on other tokens {self.drift:+.3f} on {self.n} replays "
            f"({self.skipped} without own experience)"
        )

    def metrics(self, prefix: str = "probe_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in {**asdict(self), "reads": self.reads}.items()}


def sequence_logprobs(
    models: LOPDModels, serializer: ChatSerializer, batch: Sequence[Trajectory], latents: torch.Tensor
) -> torch.Tensor:
    """log pT of each trajectory's action tokens [B] under the latent teacher (its adapter: none or the reader)
    reading `latents` [B, J*K, d]."""
    context = TeacherContext.latent(models.cfg.n_latents)
    s_batch = serializer.collate([serializer.student_view(t) for t in batch])
    t_batch = serializer.collate([serializer.teacher_view(t, context) for t in batch])
    rows, _, t_pos, targets = aligned_action_positions(s_batch, t_batch)
    hidden = models.teacher_hidden(t_batch, latents, models.teacher_adapter)[rows, t_pos]
    head = models.backbone.get_output_embeddings().weight
    logp = token_logprobs(hidden, targets.to(hidden.device), head, models.cfg.head_chunk_size).double()
    return torch.zeros(len(batch), dtype=logp.dtype, device=logp.device).index_add(0, rows.to(logp.device), logp)


def probe_contexts(
    rules: HouseRules, target: Trajectory, experiences: Experiences, envs: Sequence[str]
) -> tuple[dict[str, list[str]], str]:
    """The four experience sets of `target` (module docstring) and the code written into (d)'s documents."""
    env = target.env_id
    rule = rules.rules[env]
    own = experiences(target.task, target.task_id, env)
    others = [e for e in envs if e != env]
    first = envs.index(env) % len(others)  # a fixed other environment per environment: the next one with documents
    other: list[str] = []
    for other_env in others[first:] + others[:first]:
        other = experiences(target.task, target.task_id, other_env)
        if other:
            break
    wrong = [c for c in rule.alternatives if c != rule.code]
    rewritten_code = wrong[len(target.task_id) % len(wrong)]
    rewritten = [rules.recode_text(doc, rewritten_code) for doc in own]
    return {"own": own, "other": other, "none": [], "rewritten": rewritten}, rewritten_code


def probe_targets(suite: Suite, tasks: Sequence[Task], n: int, seed: int = 0) -> list[Trajectory]:
    """Up to `n` probe trajectories: the verified reference replays of `tasks` (their calls obey the rule), drawn
    evenly over environments. Pass validation or training tasks, never held-out ones."""
    if any(t.split not in ("train", VALIDATION) for t in tasks):
        raise ValueError("the latent probe reads training or validation tasks only, never held-out ones")
    by_env: dict[str, list[Task]] = {}
    for t in sorted(tasks, key=lambda t: t.task_id):
        by_env.setdefault(t.env_id, []).append(t)
    rng = random.Random(seed)
    for group in by_env.values():
        rng.shuffle(group)
    order = [t for row in itertools.zip_longest(*by_env.values()) for t in row if t is not None]  # round robin
    replays, _ = verified_replays(suite, order[: 2 * n])  # a few do not verify; keep n
    kept = {r.task_id: r for r in replays}
    return [kept[t.task_id] for t in order if t.task_id in kept][:n]


@torch.no_grad()
def latent_probe(
    models: LOPDModels,
    serializer: ChatSerializer,
    rules: HouseRules,
    targets: Sequence[Trajectory],
    experiences: Experiences,
    batch_size: int = 16,
) -> LatentProbe:
    """Run the probe (module docstring) on `targets`, verified successes whose calls obey their environment's rule.
    `experiences` gives each environment's documents; (b) reads the next environment that has some."""
    if not targets:
        raise ValueError("the latent probe needs target trajectories (verified successes of training/validation tasks)")
    envs = sorted(rules.rules)
    readable = {e for e in envs if any(experiences(t.task, t.task_id, e) for t in targets if t.env_id == e)}
    skipped = sum(1 for t in targets if t.env_id not in readable)  # no success of its environment to read
    targets = [t for t in targets if t.env_id in readable]
    if not targets:
        raise ValueError("the latent probe found no experience of the targets' environments to read")
    was_training = models.backbone.training, models.composer.training
    models.backbone.eval()
    models.composer.eval()
    sums = dict.fromkeys(CONDITIONS, 0.0)
    change = {"other": 0.0, "none": 0.0}
    drift_sum, drift_count = 0.0, 0
    try:
        for start in range(0, len(targets), batch_size):
            chunk = list(targets[start : start + batch_size])
            contexts = [probe_contexts(rules, t, experiences, envs) for t in chunk]
            latents = {c: models.composer([t.task for t in chunk], [ctx[c] for ctx, _ in contexts]) for c in CONDITIONS}
            for c in ("other", "none"):
                gap = (latents["own"] - latents[c]).flatten(1).norm(dim=1) / latents["own"].flatten(1).norm(dim=1)
                change[c] += float(gap.sum())
            gaps = _other_token_gaps(models, serializer, rules, chunk, latents["own"])
            drift_sum, drift_count = drift_sum + float(gaps.sum()), drift_count + gaps.numel()
            for c in CONDITIONS:
                probs = _code_probs(models, serializer, rules, chunk, latents[c])
                for i, (t, (_, rewritten_code)) in enumerate(zip(chunk, contexts, strict=True)):
                    alternatives = rules.rules[t.env_id].alternatives
                    code = rewritten_code if c == "rewritten" else rules.rules[t.env_id].code
                    sums[c] += float(probs[i][alternatives.index(code)])
    finally:
        models.backbone.train(was_training[0])
        models.composer.train(was_training[1])
    n = len(targets)
    return LatentProbe(
        own=sums["own"] / n,
        other=sums["other"] / n,
        none=sums["none"] / n,
        rewritten=sums["rewritten"] / n,
        change_other=change["other"] / n,
        change_none=change["none"] / n,
        n=n,
        skipped=skipped,
        drift=drift_sum / drift_count if drift_count else float("nan"),
    )


def _other_token_gaps(
    models: LOPDModels, serializer: ChatSerializer, rules: HouseRules, chunk: list[Trajectory], latents: torch.Tensor
) -> torch.Tensor:
    """log pT - log p0 at every action token of `chunk` outside the code's value (`rules.spans`), float64."""
    from lopd_core.diagnostics import marked_positions

    context = TeacherContext.latent(models.cfg.n_latents)
    s_batch = serializer.collate([serializer.student_view(t) for t in chunk])
    t_batch = serializer.collate([serializer.teacher_view(t, context) for t in chunk])
    rows, s_pos, t_pos, targets = aligned_action_positions(s_batch, t_batch)
    head = models.backbone.get_output_embeddings().weight
    teacher = models.teacher_hidden(t_batch, latents, models.teacher_adapter)[rows, t_pos]
    plain = models.teacher_hidden(s_batch, None, None)[rows, s_pos]
    targets = targets.to(teacher.device)
    gap = (token_logprobs(teacher, targets, head, models.cfg.head_chunk_size).double()
           - token_logprobs(plain, targets, head, models.cfg.head_chunk_size).double())  # fmt: skip
    code = torch.zeros(s_batch.action_mask.shape, dtype=torch.bool)
    for b, t in enumerate(chunk):  # a code token's target sits one after the position that predicts it
        for pos in marked_positions(serializer.student_view(t), t, serializer.tok, rules.spans):
            code[b, pos] = True
    keep = ~code[rows.cpu(), (s_pos + 1).cpu()].to(gap.device)
    return gap[keep]


def _code_probs(
    models: LOPDModels, serializer: ChatSerializer, rules: HouseRules, chunk: list[Trajectory], latents: torch.Tensor
) -> list[torch.Tensor]:
    """For each target, the teacher's softmax over its environment's alternatives (each written into its calls)."""
    written, owner = [], []
    for i, t in enumerate(chunk):
        for code in rules.rules[t.env_id].alternatives:
            written.append(rules.recode(t, code))
            owner.append(i)
    index = torch.tensor(owner, device=latents.device)
    logp = sequence_logprobs(models, serializer, written, latents[index])
    out, at = [], 0
    for t in chunk:
        k = len(rules.rules[t.env_id].alternatives)
        out.append(torch.softmax(logp[at : at + k], 0).cpu())
        at += k
    return out
