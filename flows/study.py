"""The study: arms (methods and ablation variants) x seeds from one warm start, at one equal generation budget.

    lopd study configs/study-cpu.yaml                 # the grid; an interrupted study resumes (stage cache)
    lopd study configs/study-cpu.yaml --ablation      # plus fig. 3: m in {0, 0.01, 0.1} and a frozen composer
    lopd study configs/study-cpu.yaml --family        # plus the OPD family's options as arms (docs/methods.md)

The study is the pipeline (flows/pipeline.py) on a config with a warm start (`sft`), a `budget` and seeds; its
report gains what a comparison of methods needs (`study_section`):

* a table per agent benchmark: held-out mean reward and success with 95% intervals over tasks and over seeds,
  the paired difference to the warm start ("vanilla") with its interval over tasks, generations used, wall time;
* training reward vs cumulative generations, the mean over seeds with a +-1 sd band, one line per arm
  (study_curves.png);
* the sample-efficiency figure: the generations each arm needs to reach the reference arm's (GRPO's) final
  training reward, the paper's "< 30% of GRPO's rollouts" claim tested at this scale.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from prefect import flow

from components.tracking import Tracker, run_series, train_metric
from flows.config import PipelineConfig, Variant
from flows.report import CALIBRATION
from flows.verdicts import read_episodes, verdicts, verdicts_markdown
from lopd_core.evaluation.study import Band, arm_summary, final_value, generations_to_reach, seed_band

STUDY_FILES = ("study.json", "study_curves.png")
REWARD = train_metric("reward_mean")


def fig3_variants(margins: tuple[float, ...] = (0.0, 0.01, 0.1)) -> dict[str, Variant]:
    """The paper's fig. 3 ablation as extra arms beside `lopd` (m = 0.05): other margins, a frozen composer."""
    out = {f"lopd m={m:g}": Variant(method="lopd", overrides={"lopd.margin_target": m}) for m in margins}
    out["lopd frozen composer"] = Variant(method="lopd", overrides={"lopd.freeze_composer": True})
    return out


def family_variants() -> dict[str, Variant]:
    """The OPD family's options (docs/methods.md) as arms: four ways to distil on OPSD's teacher (it reads the
    verified solution, a context known to carry the house rule on the positive control), and LOPD with the
    order-consistent margin and with reward-aligned filtering."""
    return {
        "opsd forward-kl": Variant(method="opsd", overrides={"lopd.opd.divergence": "forward_kl"}),
        "opsd jsd": Variant(method="opsd", overrides={"lopd.opd.divergence": "jsd"}),
        "opsd vopd": Variant(method="opsd", overrides={"lopd.opd.distill_form": "vopd"}),
        "opsd sign": Variant(method="opsd", overrides={"lopd.opd.distill_form": "sign"}),
        "lopd balanced": Variant(method="lopd", overrides={"lopd.margin_advantage": "balanced"}),
        "lopd ra-opd": Variant(method="lopd", overrides={"lopd.opd.reward_aligned": True}),
    }


HYBRIDS = {"hybrid diffgate": "diffgate", "hybrid diffgate-latent": "diffgate_latent", "hybrid scope": "scope"}


def hybrid_arms(cfg: PipelineConfig) -> dict[str, Variant]:
    """The hybrids (RL + a teacher's guidance on failures) as arms, on GRPO's group schedule: the config's
    `train.schedule.*` overrides of grpo (they need several rollouts per task, as GRPO does)."""
    group = {k: v for k, v in cfg.overrides.get("grpo", {}).items() if k.startswith("train.schedule.")}
    return {arm: Variant(method=method, overrides=dict(group)) for arm, method in HYBRIDS.items()}


CONTROL = "grpo shuffled"  # the control arm of `--controls`


def control_arms(cfg: PipelineConfig) -> dict[str, Variant]:
    """The shuffled-reward control (issue 41): GRPO on its own schedule with its rewards permuted across each batch
    (`baseline.shuffle_rewards`): what an update does without the reward's information. A method's gain counts only
    against it."""
    group = {k: v for k, v in cfg.overrides.get("grpo", {}).items() if k.startswith("train.schedule.")}
    return {CONTROL: Variant(method="grpo", overrides={**group, "lopd.baseline.shuffle_rewards": True})}


def with_arms(
    cfg: PipelineConfig, ablation: bool = False, family: bool = False, controls: bool = False
) -> PipelineConfig:
    """The config with fig. 3's LOPD arms (`ablation`), the OPD family's arms (`family`: its options on OPSD
    and LOPD, and the hybrids) and the shuffled-reward control (`controls`) added to its variants. An option's arm
    is read beside its method's own arm, so that method must be in `methods`."""
    options: dict[str, Variant] = control_arms(cfg) if controls else {}
    for wanted, arms in ((ablation, fig3_variants), (family, family_variants)):
        if wanted:
            options |= arms()
    missing = sorted({v.method for v in options.values()} - set(cfg.methods))
    if missing:
        raise ValueError(f"these arms vary {', '.join(missing)}: add it to methods (e.g. -s methods=[grpo,opsd,lopd])")
    hybrids = hybrid_arms(cfg) if family else {}
    return cfg.model_copy(update={"variants": {**cfg.variants, **options, **hybrids}})


# ------------------------------------------------------------------------------------------------ the report


def read_records(path: Path, benchmark: str, contexts: tuple[str, ...] = ("none",)) -> dict[str, float]:
    """task id -> reward on `benchmark` from an evaluation's records.jsonl: of the student acting alone (context
    "none"), or of the teacher acting with its context ("latent", "teacher")."""
    out = {}
    with open(path / "records.jsonl") as fh:
        for line in fh:
            r = json.loads(line)
            if r["benchmark"] == benchmark and r.get("context", "none") in contexts and int(r.get("sample", 0)) == 0:
                out[r["task_id"]] = float(r["reward"])
    return out


# the teacher diagnostics every distillation run logs per step (lopd_core.diagnostics), in the report's order
DIAGNOSTICS = ("privilege_success", "privilege_failure", "privilege_rule_success", "privilege_rule_failure",
               "privilege_other", "order_auc", "retrieval_same_env")  # fmt: skip
TEACHER_CONTEXTS = ("latent", "teacher")
DIAGNOSTICS_NOTE = """\
δ = log pT(a) − log pS(a) on the student's sampled tokens (nats per token), each run's mean over its steps, averaged
over seeds. Rule tokens: the tokens that realise a house rule (toolworld-rules); a teacher that knows the rule has
δ > 0 on those of successes and δ < 0 on those of failures. Order AUC: the probability that a success's mean δ
exceeds a failure's (0.5: no ranking). Teacher as a policy: the teacher acting with its context on the held-out tasks
(LOPD: its latents; OPSD and SDFT: the task's verified solution; Skill-SD: the environment's note), after training; a
teacher that loses to its student as a policy cannot teach it.
"""


def diagnostics_section(
    tracker: Tracker, rows: list[dict[str, Any]], arms: list[str], episodes: dict[str, Path], benchmark: str
) -> tuple[str, dict[str, Any]]:
    """Per arm: each diagnostic's mean over a run's steps, averaged over seeds; and the teacher as a policy on
    `benchmark` (success of the teacher acting with its context beside the student's), where it was evaluated."""
    table: dict[str, Any] = {}
    for arm in arms:
        members = [r for r in rows if r["arm"] == arm and r["train_run_id"]]
        per_key: dict[str, list[float]] = {}
        for r in members:
            series = run_series(tracker, r["train_run_id"], [train_metric(k) for k in DIAGNOSTICS])
            for key in DIAGNOSTICS:
                values = [v for _, v in series.history.get(train_metric(key), [])]
                if values:
                    per_key.setdefault(key, []).append(statistics.fmean(values))
        teacher, student = [], []
        for r in members:
            if r["run_id"] in episodes:
                acted = read_records(episodes[r["run_id"]], benchmark, TEACHER_CONTEXTS)
                if acted:
                    teacher.append(100 * statistics.fmean(v >= 1.0 for v in acted.values()))
                    alone = read_records(episodes[r["run_id"]], benchmark)
                    student.append(100 * statistics.fmean(v >= 1.0 for v in alone.values()))
        if per_key or teacher:
            table[arm] = {k: statistics.fmean(v) for k, v in per_key.items()} | {"per_seed": per_key}
            if teacher:
                table[arm] |= {
                    "teacher_success": statistics.fmean(teacher),
                    "student_success": statistics.fmean(student),
                }
    if not table:
        return "", {}
    header = ["Arm", "δ successes", "δ failures", "δ rule tokens, successes", "δ rule tokens, failures",
              "δ other tokens", "Order AUC", "Retrieval from own env", f"Teacher as a policy: success % ({benchmark})",
              "Student success %"]  # fmt: skip
    body = []
    for arm, d in table.items():
        cells = [f"{d[k]:+.3f}" if k in d and k.startswith("privilege") else f"{d[k]:.2f}" if k in d else "-"
                 for k in DIAGNOSTICS]  # fmt: skip
        policy = (
            [f"{d['teacher_success']:.1f}", f"{d['student_success']:.1f}"] if "teacher_success" in d else ["-", "-"]
        )
        body.append([arm, *cells, *policy])
    text = "### Teacher diagnostics\n\n" + _table(header, body) + "\n" + DIAGNOSTICS_NOTE
    return text, table


PROBE = ("own", "other", "none", "rewritten")  # the latent-dependence probe's figures (lopd_core.latent_probe)
PROBE_NOTE = """\
The latent-dependence probe (lopd_core.latent_probe) on validation tasks' verified replays: the teacher's probability of
its environment's right code reading the latents of (a) J successes of its own environment, (b) another
environment's, (c) none; (d) the share that follows the code when (a)'s documents are rewritten to the other
alternative. A teacher that reads its latents has (a) well above (b) and (c) and (d) near 1 (the gate: (a) - (b) >=
0.3, (d) >= 0.7); one whose knowledge sits in its weights has (a) = (b) = (c) and (d) = 1 - (a). Latent change: the
relative distance of the latents from (a)'s to (b)'s documents. Drift: the teacher reading (a)'s latents minus the
plain warm start, mean log-probability over the non-code action tokens (below 0: distilling it makes the student worse
there). Each seed's cold-started and trained teacher, averaged.
"""


def probe_section(tracker: Tracker, rows: list[dict[str, Any]], arms: list[str]) -> tuple[str, dict[str, Any]]:
    """Per arm whose teacher reads latents: the probe of its cold-started and of its trained teacher (the train
    run's `cold_probe_*` and `probe_*`), averaged over seeds."""
    table: dict[str, Any] = {}
    for arm in arms:
        found: dict[str, list[float]] = {}
        for r in rows:
            if r["arm"] != arm or not r["train_run_id"]:
                continue
            metrics = tracker.call("reading a run", lambda r=r: tracker.client.get_run(r["train_run_id"])).data.metrics
            for when in ("cold_probe", "probe"):
                for key in (*PROBE, "change_other", "drift"):
                    value = metrics.get(train_metric(f"{when}_{key}"))
                    if value is not None:
                        found.setdefault(f"{when}_{key}", []).append(value)
        if found:
            table[arm] = {k: statistics.fmean(v) for k, v in found.items()} | {"seeds": len(found.get("probe_own", []))}
    if not table:
        return "", {}
    header = ["Arm", "Seeds", *(f"cold start ({x})" for x in "abcd"), "cold start latent change", "cold start drift",
              *(f"trained ({x})" for x in "abcd"), "trained latent change", "trained drift"]  # fmt: skip
    keys = [f"{when}_{x}" for when in ("cold_probe", "probe") for x in (*PROBE, "change_other", "drift")]
    body = [[arm, str(d["seeds"]), *(("-" if k not in d or d[k] != d[k] else f"{d[k]:+.3f}" if k.endswith("drift")
                                      else f"{d[k]:.2f}") for k in keys)] for arm, d in table.items()]  # fmt: skip
    return "### Latent-dependence probe\n\n" + _table(header, body) + "\n" + PROBE_NOTE, table


def _cell(est: Any, digits: int = 1) -> str:
    return "-" if est is None else est.format(digits)


def _seconds(values: list[float]) -> str:
    return f"{statistics.fmean(values):.0f}" if values else "-"


def study_section(
    tracker: Tracker,
    rows: list[dict[str, Any]],
    episodes: dict[str, Path],
    train: list[dict[str, Any]],
    train_seconds: dict[str, float],
    out_dir: Path,
    reference: str = "grpo",
    against: tuple[str, ...] = ("lopd", "grpo"),
) -> tuple[str, dict[str, Any]]:
    """Markdown and data of the study (see the module docstring); writes study_curves.png into `out_dir`. Arms
    that are variants (another arm's method with options) are also compared, paired per task, with their method's
    own arm and with the arms `against` (the paper's method and the RL reference)."""
    agent = [b for b in dict.fromkeys(b for r in rows for b in r["benchmarks"]) if not _is_code(b)]
    base = next((r for r in rows if r["method"] == "base"), None)
    oracle = next((r for r in rows if r["method"] == "oracle"), None)
    arms = list(dict.fromkeys(r["arm"] for r in rows if r["method"] not in CALIBRATION))
    generations = {t["run_id"]: t["final_generations"] for t in train}
    parts, data = ["## Study: arms x seeds at an equal budget\n"], {"benchmarks": {}, "arms": arms}
    for bench in agent:
        baseline = read_records(episodes[base["run_id"]], bench) if base and base["run_id"] in episodes else None
        body, table, per_arm = [], {}, {}
        if baseline:
            s = arm_summary({None: baseline})
            table["vanilla"] = _json(s)
            body.append(["vanilla (warm start)", "-", _cell(s["reward_tasks"]), "-", _cell(s["success_tasks"]), "-",
                         "0 (reference)", "0", "-"])  # fmt: skip
        if oracle and oracle["run_id"] in episodes:  # the ceiling: a warm start that knows the house rules
            s = arm_summary({None: read_records(episodes[oracle["run_id"]], bench)}, baseline)
            table["oracle"] = _json(s)
            body.append(["oracle warm start (ceiling)", "-", _cell(s["reward_tasks"]), "-", _cell(s["success_tasks"]),
                         "-", _cell(s["delta_reward"]), "0", "-"])  # fmt: skip
        for arm in arms:
            members = [r for r in rows if r["arm"] == arm and r["run_id"] in episodes]
            if not members:
                continue
            per_seed = {r["seed"]: read_records(episodes[r["run_id"]], bench) for r in members}
            per_arm[arm] = (members[0]["method"], per_seed)
            s = arm_summary(per_seed, baseline)
            gens = [generations[r["train_run_id"]] for r in members if generations.get(r["train_run_id"]) is not None]
            secs = [train_seconds[r["train_run_id"]] for r in members if r["train_run_id"] in train_seconds]
            table[arm] = {**_json(s), "generations": gens, "train_seconds": secs}
            body.append([arm, str(len(members)), _cell(s["reward_tasks"]), _cell(s["reward_seeds"]),
                         _cell(s["success_tasks"]), _cell(s["success_seeds"]), _cell(s["delta_reward"]),
                         f"{statistics.fmean(gens):.0f}" if gens else "-", _seconds(secs)])  # fmt: skip
        header = ["Arm", "Seeds", "Reward [95% CI tasks]", "Reward [95% CI seeds]", "Success % [tasks]",
                  "Success % [seeds]", "Δ reward vs vanilla [95% CI tasks]", "Generations",
                  "Train wall time (s)"]  # fmt: skip
        n_tasks = next((row["n_tasks"] for row in table.values() if "n_tasks" in row), "?")  # any arm's count
        parts += [f"### {bench} ({n_tasks} tasks)\n", _table(header, body)]
        data["benchmarks"][bench] = table
        data.setdefault("episodes", {})[bench] = episode_paths(rows, episodes, base, arms)
        verdict = bench_verdicts(rows, episodes, bench, base, arms)
        if verdict:
            parts.append(verdicts_markdown(verdict, bench))
            data.setdefault("verdicts", {})[bench] = _jsonable(verdict)
        text, paired = variants_section(per_arm, against)
        if text:
            parts.append(text)
            data.setdefault("variants", {})[bench] = paired
    parts.append(
        "Reward: mean reward x 100; success: % of tasks solved. Intervals over tasks average each task over the "
        "seeds; intervals over seeds use the seeds' means (t, n_seeds - 1 df). Δ: paired per task against the "
        "warm start; an arm improves on it when the interval's lower end is above 0.\n"
    )
    if agent:
        text, diagnostics = diagnostics_section(tracker, rows, arms, episodes, agent[0])
        if text:
            parts.append(text)
            data["diagnostics"] = diagnostics
    text, probes = probe_section(tracker, rows, arms)
    if text:
        parts.append(text)
        data["latent_probe"] = probes
    bands = _curves(tracker, rows, arms)
    if bands:
        path = out_dir / "study_curves.png"
        plot_bands(bands, path, "training reward vs generations (mean over seeds, ±1 sd)")
        parts += ["### Training reward vs generations\n", f"![training reward]({path.name})\n"]
        data["curves"] = {arm: band.to_dict() for arm, band in bands.items()}
        efficiency = sample_efficiency(bands, reference)
        if efficiency:
            data["sample_efficiency"] = efficiency
            parts.append(_efficiency_markdown(efficiency, reference))
    (out_dir / "study.json").write_text(json.dumps(data, indent=2, default=str))
    return "\n".join(parts), data


def episode_paths(
    rows: list[dict[str, Any]], episodes: dict[str, Path], base: dict[str, Any] | None, arms: list[str]
) -> dict[str, Any]:
    """Where each arm's and seed's evaluation records are (study.json), for a report that pools several studies."""
    return {
        "base": str(episodes[base["run_id"]]) if base and base["run_id"] in episodes else None,
        "arms": {arm: {str(r["seed"]): str(episodes[r["run_id"]]) for r in rows
                       if r["arm"] == arm and r["run_id"] in episodes} for arm in arms},
    }  # fmt: skip


def bench_verdicts(
    rows: list[dict[str, Any]], episodes: dict[str, Path], bench: str, base: dict[str, Any] | None, arms: list[str]
) -> dict[str, Any] | None:
    """flows.verdicts' tables of one benchmark: every arm's seeds, the warm start, the shuffled-reward control."""
    per_arm = {}
    for arm in arms:
        members = [r for r in rows if r["arm"] == arm and r["run_id"] in episodes]
        if members:
            per_arm[arm] = {r["seed"]: read_episodes(episodes[r["run_id"]], bench) for r in members}
    if not per_arm:
        return None
    warm = read_episodes(episodes[base["run_id"]], bench) if base and base["run_id"] in episodes else None
    return verdicts(per_arm, warm, control=CONTROL if CONTROL in per_arm else None)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def variants_section(
    per_arm: dict[str, tuple[str, dict[Any, dict[str, float]]]], against: tuple[str, ...]
) -> tuple[str, dict[str, Any]]:
    """Each variant arm (an arm named otherwise than its method) against its method's own arm and against each arm
    of `against`: the paired per-task difference of the seed means, with its 95% interval over tasks."""

    def seed_mean(per_seed: dict[Any, dict[str, float]]) -> dict[str, float]:
        tasks = set.intersection(*(set(r) for r in per_seed.values()))
        return {t: statistics.fmean(r[t] for r in per_seed.values()) for t in tasks}

    body, data = [], {}
    for arm, (method, per_seed) in per_arm.items():
        if arm == method:
            continue
        cells, row = [], {}
        for ref in (method, *against):
            if ref in per_arm and ref != arm:
                delta = arm_summary(per_seed, seed_mean(per_arm[ref][1]))["delta_reward"]
                row[ref] = _json({"delta_reward": delta})["delta_reward"]
                cells.append(_cell(delta))
            else:
                cells.append("-")
        body.append([arm, method, *cells])
        data[arm] = row
    if not body:
        return "", {}
    header = ["Variant arm", "Method", "Δ reward vs the method's own arm [95% CI tasks]",
              *(f"Δ reward vs {ref} [95% CI tasks]" for ref in against)]  # fmt: skip
    return "#### Variants, paired per task\n\n" + _table(header, body), data


def _is_code(benchmark: str) -> bool:
    return benchmark in ("humaneval", "humaneval_plus", "mbpp_plus", "livecodebench") or benchmark.startswith("lcb")


def _json(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in summary.items()}


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body]) + "\n"


def _curves(tracker: Tracker, rows: list[dict[str, Any]], arms: list[str]) -> dict[str, Band]:
    bands = {}
    for arm in arms:
        curves = []
        for r in rows:
            if r["arm"] == arm and r["train_run_id"]:
                series = run_series(tracker, r["train_run_id"], [REWARD])
                xs, ys = series.xy(REWARD, "generations")
                if xs:
                    curves.append((xs, ys))
        if curves:
            window = max(1, round(0.1 * min(len(y) for _, y in curves)))
            bands[arm] = seed_band(curves, window)
    return bands


def sample_efficiency(bands: dict[str, Band], reference: str = "grpo") -> dict[str, Any] | None:
    """Generations each arm needs to reach the reference arm's final training reward (smoothed, seed mean)."""
    if reference not in bands:
        return None
    target = final_value(bands[reference])
    budget = bands[reference].x[-1]
    start = bands[reference].mean[0]
    out: dict[str, Any] = {"reference": reference, "target_reward": target, "reference_generations": budget,
                           "reference_start": start, "reference_improved": target > start, "arms": {}}  # fmt: skip
    for arm, band in bands.items():
        reached = generations_to_reach(band.x, band.mean, target)
        out["arms"][arm] = {"generations": reached, "fraction": reached / budget if reached is not None else None,
                            "final_reward": final_value(band)}  # fmt: skip
    return out


def _efficiency_markdown(eff: dict[str, Any], reference: str) -> str:
    lines = [f"### Sample efficiency: generations to reach {reference}'s final training reward "
             f"({eff['target_reward']:.3f}, over its {eff['reference_generations']:.0f} generations)\n",
             "| Arm | Final training reward | Generations to reach it | Fraction of the reference's |",
             "|---|---|---|---|"]  # fmt: skip
    for arm, e in eff["arms"].items():
        gens = "not reached" if e["generations"] is None else f"{e['generations']:.0f}"
        frac = "-" if e["fraction"] is None else f"{100 * e['fraction']:.0f}%"
        lines.append(f"| {arm} | {e['final_reward']:.3f} | {gens} | {frac} |")
    if not eff.get("reference_improved", True):
        lines.append(f"\n**{reference}'s training reward did not rise** (smoothed start "
                     f"{eff['reference_start']:.3f}, final {eff['target_reward']:.3f}): every arm 'reaches' it at "
                     "its first point, so this table says nothing about sample efficiency in this study.")  # fmt: skip
    lines.append(
        "\nThe paper claims LOPD passes GRPO's final reward at under 30% of GRPO's generations (fig. 4, Qwen3-4B, "
        "EnvScaler). This table is that test at this scale, whatever it says.\n"
    )
    return "\n".join(lines)


def plot_bands(bands: dict[str, Band], out: Path, title: str) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, (arm, band) in enumerate(bands.items()):
        color = f"C{i % 10}"
        ax.plot(band.x, band.mean, color=color, label=arm, linestyle="-" if i < 10 else "--")
        shown = band.clipped()  # a reward lies in [0, 1]; mean +- sd need not
        ax.fill_between(shown.x, shown.lo, shown.hi, color=color, alpha=0.15, linewidth=0)
    ax.set_xlabel("cumulative generations (student rollouts)")
    ax.set_ylabel("training reward (smoothed)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(out, dpi=110)
    return out


# ------------------------------------------------------------------------------------------------- the flow


@flow(name="lopd-study", log_prints=True)
def lopd_study(
    config: PipelineConfig, ablation: bool = False, family: bool = False, controls: bool = False
) -> dict[str, Any]:
    """The study: the pipeline over every arm x seed at the config's equal budget, from its warm start; with
    `ablation`, fig. 3's LOPD variants (margins 0, 0.01, 0.1 and a frozen composer) join the grid; with `family`,
    the OPD family's options (forward KL, JSD, vOPD and sign on OPSD; the balanced margin and RA-OPD on LOPD) and
    the hybrids (DiffGate with OPSD's and with LOPD's teacher, SCOPE).

    Args:
        config: The pipeline config of the study (it needs a budget).
        ablation: Add fig. 3's LOPD variants: margins 0, 0.01, 0.1 and a frozen composer.
        family: Add the OPD family's arms (docs/methods.md).
        controls: Add the shuffled-reward control: GRPO with its rewards permuted across each batch.
    """
    from flows.lifecycle import stop_stages_on_sigterm
    from flows.pipeline import lopd_pipeline

    if config.budget is None:
        raise ValueError("a study compares methods at an equal generation budget: set budget (e.g. 1600)")
    cfg = with_arms(config, ablation, family, controls)
    with stop_stages_on_sigterm():  # SIGTERM stops the stages first, then the flows (flows.lifecycle)
        if not cfg.draws:
            return lopd_pipeline(config=cfg)
        summaries = {draw: lopd_pipeline.with_options(flow_run_name=f"study draw {draw}")(config=cfg.for_draw(draw))
                     for draw in cfg.draws}  # fmt: skip
    pooled = pooled_report(summaries, Path(cfg.resolved_run_dir()) / "study-pooled")
    return {**summaries[cfg.draws[-1]], "draws": {d: s["report"] for d, s in summaries.items()}, "report": pooled}


def pooled_report(summaries: dict[int, dict[str, Any]], out_dir: Path) -> str:
    """The verdict tables of every draw and of the draws pooled (flows.verdicts: keys and clusters marked by the
    draw, since each draw's rule in an environment is its own instance); returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    per_draw = {d: json.loads((Path(s["report"]).parent / "study.json").read_text()) for d, s in summaries.items()}
    benches = list(dict.fromkeys(b for data in per_draw.values() for b in data.get("episodes", {})))
    parts, data = [f"# Study over rule draws {', '.join(map(str, summaries))}\n"], {}
    for bench in benches:
        arms: dict[str, dict[Any, Any]] = {}
        base: dict[str, Any] = {}
        for draw, study in per_draw.items():
            where = study["episodes"].get(bench)
            if not where:
                continue
            prefix = f"(s{draw}) "
            if where.get("base"):
                base |= read_episodes(Path(where["base"]), bench, prefix)
            for arm, seeds in where["arms"].items():  # a seed's run on every draw: one replicate over all tasks
                for seed, path in seeds.items():
                    arms.setdefault(arm, {}).setdefault(seed, {}).update(read_episodes(Path(path), bench, prefix))
        verdict = verdicts(arms, base or None, control=CONTROL if CONTROL in arms else None)
        parts.append(verdicts_markdown(verdict, f"{bench}, draws pooled"))
        data[bench] = _jsonable(verdict)
    parts.append("Per draw: " + ", ".join(f"draw {d}: {s['report']}" for d, s in summaries.items()) + "\n")
    (out_dir / "study.json").write_text(json.dumps(data, indent=2, default=str))
    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return str(path)
