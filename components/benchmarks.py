"""The evaluate stage's machinery: the model under test, each benchmark's suite and tasks, the rollout settings per
benchmark, and one run of every benchmark under one kind of policy. `components.evaluate` (the stage, its spec and
CLI) imports this module when it runs, so its `--help` stays light.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.artifacts import ArtifactStore
from components.common import open_suite
from components.evaluate import DEFAULT_LIMITS, BenchmarkSpec, EvaluateSpec
from lopd_core.artifacts import ArtifactRef, sha256_path
from lopd_core.config import RolloutConfig
from lopd_core.conversation import Trajectory
from lopd_core.envs.base import Suite, Task, WithValidation
from lopd_core.evaluation.code import CodeExecConfig, CodeSuite
from lopd_core.evaluation.harness import Policy, aggregate, run_tasks, select_tasks
from lopd_core.evaluation.stats import EpisodeRecord

# ------------------------------------------------------------------------------------------------ models


@dataclass
class Loaded:
    model: Any  # the acting policy (a causal LM)
    tokenizer: Any
    lopd: Any  # LOPDModels or None
    description: dict[str, Any]


def resolve(ref: dict[str, Any] | str, store: ArtifactStore, what: str) -> tuple[Path, str | None]:
    """A local path for an ArtifactRef dict (digest verified) or a path string, and the digest when known."""
    if isinstance(ref, dict):
        artifact = ArtifactRef.from_dict(ref)
        return store.get(artifact), artifact.sha256
    path = Path(ref).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path, None


@contextlib.contextmanager
def policy_model(spec: EvaluateSpec, store: ArtifactStore) -> Iterator[Loaded]:
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import load_student

    warm = resolve(spec.warm_start, store, "warm start") if spec.warm_start is not None else None
    source = str(warm[0]) if warm is not None else spec.backbone
    if spec.checkpoint is None:
        model, tok = load_backbone(source)
        # as components.common.backbone_label names it in the other stages' runs
        label = spec.backbone if warm is None else f"{spec.backbone}+sft" + (f":{warm[1][:12]}" if warm[1] else "")
        yield Loaded(model, tok, None, {"kind": "base", "backbone": label})
        return
    path, digest = resolve(spec.checkpoint, store, "checkpoint")
    if (path / "state.json").exists():
        state = json.loads((path / "state.json").read_text())
        given = "backbone" in spec.model_fields_set or spec.warm_start is not None
        backbone = source if given else None
        models = load_student(path, backbone=backbone)
        desc = {
            "kind": "lopd_checkpoint", "backbone": backbone or state.get("backbone"), "path": str(path),
            "sha256": digest, "step": state.get("step"), "method": state.get("config", {}).get("method"),
            "seed": state.get("config", {}).get("seed"),  # the training seed (spec.seed samples the tasks)
        }  # fmt: skip
        with models.acting_student() as student:
            yield Loaded(student, models.tokenizer, models, desc)
        return
    if (path / "config.json").exists():
        model, tok = load_backbone(str(path))
        yield Loaded(
            model, tok, None, {"kind": "hf_folder", "backbone": str(path), "path": str(path), "sha256": digest}
        )
        return
    raise ValueError(f"checkpoint {path} is neither an LOPD checkpoint (state.json) nor a Hugging Face folder")


# --------------------------------------------------------------------------------------------- benchmarks


def build_benchmark(bench: BenchmarkSpec, spec: EvaluateSpec) -> tuple[Suite, list[Task]]:
    """The suite and the (sampled) tasks of one benchmark entry."""
    from lopd_core.evaluation import loaders

    code_cfg = CodeExecConfig(
        timeout_s=spec.code.timeout_s,
        per_case_timeout_s=spec.code.per_case_timeout_s,
        memory_mb=spec.code.memory_mb,
        sandbox=spec.code.sandbox,
    )
    if bench.name.startswith("toolworld"):  # toolworld, -compact, -minimal, -rules[-s<seed>][-k<k>]
        suite: Suite = open_suite(bench.name)  # the one suite opener, as training uses it
    elif bench.name == "envscaler":
        suite = loaders.load_envscaler(bench.env_metadata, bench.path, name=bench.label)
    elif bench.name == "bfcl":
        from lopd_core.envs.bfcl import SUBSETS, BFCLSuite

        bfcl = BFCLSuite(subsets=tuple(bench.subsets or SUBSETS))
        tasks = select_tasks(bfcl.tasks("eval"), bench.sample, spec.seed, bench.label, by="subset")
        return bfcl, tasks
    elif bench.name == "humaneval":
        suite = CodeSuite(loaders.with_benchmark(loaders.load_humaneval(bench.path), bench.label), config=code_cfg)
    elif bench.name in ("humaneval_plus", "mbpp_plus"):
        problems = loaders.load_evalplus(bench.path, bench.name)
        suite = CodeSuite(loaders.with_benchmark(problems, bench.label), config=code_cfg)
    elif bench.name == "livecodebench":
        problems = loaders.load_livecodebench(bench.path, bench.start_date, bench.end_date)
        if not problems:
            raise ValueError(f"{bench.label}: no LiveCodeBench problem in {bench.path} within the date window")
        suite = CodeSuite(loaders.with_benchmark(problems, bench.label), config=code_cfg)
    else:  # pragma: no cover - the spec's Literal rules it out
        raise ValueError(bench.name)
    if bench.split == "validation":
        if spec.validation_fraction <= 0:
            raise ValueError(f"{bench.label}: split 'validation' needs validation_fraction > 0")
        suite = WithValidation(suite, spec.validation_fraction)
    tasks = suite.tasks(bench.split)
    if bench.difficulties is not None:
        tasks = [t for t in tasks if t.difficulty in set(bench.difficulties)]
    return suite, select_tasks(tasks, bench.sample, spec.seed, bench.label)


def rollout_config(bench: BenchmarkSpec, spec: EvaluateSpec) -> RolloutConfig:
    """The spec's rollout settings with the benchmark's own limits (its defaults, then the entry's fields)."""
    limits = dict(DEFAULT_LIMITS.get(bench.name, {}))
    if bench.kind == "code":
        limits.update(max_turns=1, max_new_tokens=spec.code.max_new_tokens)
    for name in ("max_turns", "max_new_tokens", "max_total_tokens"):
        if getattr(bench, name) is not None:
            limits[name] = getattr(bench, name)
    return spec.rollout.model_copy(update=limits).seeded(spec.seed, spec.progress)


def evaluate_benchmark(
    bench: BenchmarkSpec, spec: EvaluateSpec, policy: Policy, suite: Suite, tasks: list[Task]
) -> tuple[dict[str, Any], list[EpisodeRecord], list[Trajectory]]:
    samples = spec.decoding.n if bench.kind == "code" else 1
    records, trajectories = run_tasks(policy, suite, tasks, bench.label, samples=samples)
    subsets = tuple(bench.subsets) if bench.subsets else None
    if bench.name == "bfcl" and subsets is None:
        from lopd_core.envs.bfcl import SUBSETS

        subsets = SUBSETS
    metrics = aggregate(bench.label, bench.kind, records, ks=spec.decoding.k, subsets=subsets, family=bench.name)
    return metrics, records, trajectories


def latent_policy(
    spec: EvaluateSpec, loaded: Loaded, tmp: Path, plan: list[tuple[BenchmarkSpec, Suite, list[Task]]]
) -> tuple[Any, Callable[[BenchmarkSpec, RolloutConfig], Policy]]:
    """The restored bank (close it after use) and a policy factory for the latent teacher."""
    from components.memory import ExperienceBank
    from lopd_core.evaluation.latent import LatentRollout, composed_latents

    if loaded.lopd is None:
        raise ValueError("latent_eval needs the checkpoint of an LOPD run (a directory with state.json)")
    assert spec.bank is not None
    if isinstance(spec.bank, dict):
        ref = ArtifactRef.from_dict(spec.bank)
        name = str(ref.metadata.get("name") or "bank")
    else:  # a snapshot directory (ExperienceBank.snapshot's output)
        path = Path(spec.bank).expanduser().resolve()
        if not (path / "bank.json").exists():
            raise FileNotFoundError(f"bank snapshot {path} does not exist (no bank.json)")
        name = str(json.loads((path / "bank.json").read_text()).get("name") or "bank")
        ref = ArtifactRef(uri=str(path), kind="bank_snapshot", sha256=sha256_path(path), metadata={"name": name})
    bank = ExperienceBank.restore(ref, str(tmp / "bank"), name)
    cfg = loaded.lopd.cfg
    env_of = {t.task_id: t.env_id for _, _, tasks in plan for t in tasks}.get
    retrieve = bank.retriever(k=cfg.n_retrieved, env_of=env_of if cfg.retrieval_scope == "environment" else None)

    def make(bench: BenchmarkSpec, cfg: RolloutConfig) -> Policy:
        return LatentRollout(loaded.lopd, cfg, composed_latents(loaded.lopd, retrieve))

    return bank, make


def text_teacher_policy(
    spec: EvaluateSpec, loaded: Loaded, plan: list[tuple[BenchmarkSpec, Suite, list[Task]]], store: ArtifactStore
) -> Callable[[BenchmarkSpec, RolloutConfig], Policy]:
    """A policy factory for the frozen text teacher of an OPSD / SDFT / Skill-SD checkpoint, reading the context
    its method gives it: the task's verified solution (OPSD, SDFT) or the environment's skill note (Skill-SD,
    from the collect stage's `dataset`)."""
    from components.common import read_trajectories
    from lopd_core import skills
    from lopd_core.conversation import Message
    from lopd_core.evaluation.teacher import TextTeacherRollout
    from lopd_core.method_rules import METHOD_RULES
    from lopd_core.methods import build_method
    from lopd_core.sft import reference_traces

    models = loaded.lopd
    method = loaded.description.get("method")
    if models is None or method not in METHOD_RULES or not METHOD_RULES[method].acting_teacher:
        acting = "/".join(name for name, rules in METHOD_RULES.items() if rules.acting_teacher)
        raise ValueError(f"teacher_eval acts with a text teacher: it needs the checkpoint of a {acting} run, got "
                         f"{method or 'a model without a method'}")  # fmt: skip
    notes: dict[str, str] = {}
    if METHOD_RULES[method].reads_notes:
        if spec.dataset is None:
            raise ValueError("teacher_eval of a skill_sd run needs `dataset` (the collect stage's trajectories)")
        notes = skills.skill_notes(read_trajectories(resolve(spec.dataset, store, "dataset")[0]))
    traces: dict[str, str] = {}
    for bench, suite, tasks in plan:
        if bench.kind != "code":
            traces.update(reference_traces(suite, tasks))
    strategy, _ = build_method(models, models.cfg, solutions=traces.get, skills=notes.get)
    if strategy.teacher_adapter is not None:
        raise ValueError(f"teacher_eval: the {method} run's teacher is an EMA of its student (teacher_sync), which "
                         "its checkpoint does not hold; only frozen teachers can be evaluated")  # fmt: skip
    contexts = {}
    for bench, _, tasks in plan:
        probes = [Trajectory(task_id=t.task_id, env_id=t.env_id, task=t.instruction,
                             messages=[Message("user", t.instruction)]) for t in tasks]  # fmt: skip
        if bench.kind != "code" and probes:
            contexts.update(zip([t.task_id for t in tasks], strategy.contexts(probes), strict=True))

    def make(bench: BenchmarkSpec, cfg: RolloutConfig) -> Policy:
        engine = TextTeacherRollout(models.backbone, models.tokenizer, cfg, contexts)

        def play(episodes: list[Any]) -> list[Trajectory]:
            with models.switch.use(None):  # the frozen teacher: every adapter off
                return engine(episodes)

        return play

    return make


def run_plan(
    plan: list[tuple[BenchmarkSpec, Suite, list[Task]]],
    spec: EvaluateSpec,
    make_policy: Callable[[BenchmarkSpec, RolloutConfig], Policy],
    context: str,
    seconds: dict[str, float],
    records_out: list[dict[str, Any]],
    trajectories_out: list[dict[str, Any]],
) -> dict[str, Any]:
    """Every benchmark of `plan` under one kind of policy; metrics by key (records, trajectories, times appended)."""
    metrics_by_key: dict[str, Any] = {}
    for bench, suite, tasks in plan:
        t0 = time.monotonic()
        metrics, records, trajectories = evaluate_benchmark(
            bench, spec, make_policy(bench, rollout_config(bench, spec)), suite, tasks
        )
        metrics_by_key[bench.label] = metrics
        records_out += [{**r.to_dict(), "context": context} for r in records]
        trajectories_out += [{**t.to_dict(), "benchmark": bench.label, "context": context} for t in trajectories]
        seconds[bench.label if context == "none" else f"{context}/{bench.label}"] = round(time.monotonic() - t0, 2)
    return metrics_by_key


@contextlib.contextmanager
def student_policy(
    loaded: Loaded, spec: EvaluateSpec, plan: list[tuple[BenchmarkSpec, Suite, list[Task]]]
) -> Iterator[Callable[[BenchmarkSpec, RolloutConfig], Policy]]:
    """The student as a policy per benchmark. With rollout.engine=vllm one vLLM worker serves every benchmark: it
    starts on first use and is closed on exit."""
    from lopd_core.engines import make_engine, make_server

    servers: dict[str, Any] = {}  # per engine kind: vLLM's worker, started on first use, serves every benchmark
    longest = max((rollout_config(b, spec).max_total_tokens for b, *_ in plan), default=4096)

    def make(bench: BenchmarkSpec, cfg: RolloutConfig) -> Policy:
        if cfg.engine not in servers:  # None for hf, whose engines share nothing
            servers[cfg.engine] = make_server(loaded.model, cfg, max_model_len=longest + 1, seed=spec.seed)
        engine = make_engine(loaded.model, loaded.tokenizer, cfg, server=servers[cfg.engine])
        return lambda episodes: engine.run(episodes, desc=bench.label)

    try:
        yield make
    finally:
        for server in servers.values():
            if server is not None:
                server.close()
