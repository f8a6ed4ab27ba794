"""The study's verdict tables (issue 41): what was learnt, against what, and what the design can tell apart.

From each evaluation's records.jsonl (the student alone, the first sample), per agent benchmark:

* **arms**: reward and success per arm (each task averaged over seeds), the **rule pass rate** (episodes with at least
  one state-changing call that wrote the right code on every such call, pooled over seeds, Wilson), and the paired
  difference to the warm start with two intervals: t over tasks, and the **cluster bootstrap** over environments
  (the house rule is per environment), then tasks, then seeds (lopd_core.evaluation.hierarchy);
* **pairs**: every arm against every other, paired per task, with both intervals and the **minimum detectable
  difference** (2.80 x the bootstrap's standard error: a paired test at 5% finds a difference this large with 80%
  power); "differs" only when the bootstrap interval excludes 0; the tasks a 5-point difference would need;
* **gains**: per arm, the (task, seed) pairs it solves that the warm start failed, split into those the warm start
  failed only by the code (its other checks all passed: `reward_without_rule` = 1) and those it failed otherwise,
  and the pairs it lost;
* **rule by environment**: the rule pass rate of each arm in each environment.

The same functions pool several rule draws: keys become "(draw) task" and clusters "(draw) environment", since each
draw's rule in an environment is its own instance.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lopd_core.evaluation.hierarchy import hierarchical_bootstrap, minimum_detectable, tasks_needed
from lopd_core.evaluation.stats import Estimate, mean_interval, wilson

TARGET_DIFFERENCE = 5.0  # points: the difference the study should be able to detect (issue 41)


@dataclass(frozen=True)
class Episode:
    """What the verdicts read of one evaluated episode."""

    env: str
    reward: float
    rule_calls: int | None = None
    rule_passed: bool | None = None
    reward_without_rule: float | None = None

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


Episodes = dict[str, Episode]  # task key -> episode
PerSeed = dict[Any, Episodes]  # seed -> the arm's episodes


def read_episodes(folder: Path, benchmark: str, prefix: str = "") -> Episodes:
    """task key -> its episode on `benchmark` from an evaluation's records.jsonl (the student alone, sample 0);
    `prefix` marks the keys and environments of one rule draw when several are pooled."""
    out = {}
    with open(folder / "records.jsonl") as fh:
        for line in fh:
            r = json.loads(line)
            if r["benchmark"] != benchmark or r.get("context", "none") != "none" or int(r.get("sample", 0)) != 0:
                continue
            out[prefix + r["task_id"]] = Episode(prefix + (r.get("env_id") or ""), float(r["reward"]),
                                                 r.get("rule_calls"), r.get("rule_passed"),
                                                 r.get("reward_without_rule"))  # fmt: skip
    return out


def rule_rate(episodes: list[Episode]) -> Estimate | None:
    """The share of episodes with a state-changing call that wrote the right code on every one (Wilson, %)."""
    ruled = [e for e in episodes if e.rule_calls]
    return wilson(sum(1 for e in ruled if e.rule_passed), len(ruled)) if ruled else None


def paired(a: list[Episodes], b: list[Episodes], tasks: list[str]) -> dict[str, list[float]]:
    """task -> per-seed differences of reward: a's i-th run minus b's i-th run (b's one run, like the warm start,
    is subtracted from every run of a)."""
    if len(b) == 1:
        return {t: [run[t].reward - b[0][t].reward for run in a] for t in tasks}
    return {t: [x[t].reward - y[t].reward for x, y in zip(a, b, strict=False)] for t in tasks}


def difference(diffs: Mapping[str, list[float]], env_of: Mapping[str, str]) -> dict[str, Any]:
    """A paired difference (points): the t interval over tasks (seed means), the cluster bootstrap's interval, its
    standard error and the minimum detectable difference."""
    design: dict[str, dict[str, list[float]]] = {}
    for t, values in diffs.items():
        design.setdefault(env_of[t], {})[t] = values
    boot, se = hierarchical_bootstrap(design, scale=100.0)
    t_est = mean_interval([statistics.fmean(v) for v in diffs.values()], bounds=(-1.0, 1.0))
    mde = minimum_detectable(se)
    return {"t": t_est, "cluster": boot, "se": se, "mde": mde, "n_tasks": len(diffs), "n_clusters": len(design)}


def _common(*runs: Episodes) -> list[str]:
    return sorted(set.intersection(*(set(r) for r in runs)))


def verdicts(arms: Mapping[str, PerSeed], base: Episodes | None, control: str | None = None) -> dict[str, Any]:
    """The data of every table (module docstring): `arms` maps an arm to its seeds' episodes, `base` the warm start's;
    `control`: the arm every other is also compared with (the shuffled-reward GRPO)."""
    runs = [r for per_seed in arms.values() for r in per_seed.values()] + ([base] if base else [])
    tasks = _common(*runs)
    env_of = {t: runs[0][t].env for t in tasks}
    out: dict[str, Any] = {"n_tasks": len(tasks), "n_clusters": len(set(env_of.values())), "arms": {}, "pairs": {}}
    if base is not None:
        out["warm_start"] = {"rule_pass": rule_rate([base[t] for t in tasks])}
    for arm, per_seed in arms.items():
        episodes = [run[t] for run in per_seed.values() for t in tasks]
        row: dict[str, Any] = {
            "seeds": len(per_seed),
            "reward": mean_interval([statistics.fmean(run[t].reward for run in per_seed.values()) for t in tasks]),
            "success": mean_interval([statistics.fmean(run[t].success for run in per_seed.values()) for t in tasks]),
            "rule_pass": rule_rate(episodes),
            "rule_by_env": {
                env: rule_rate([e for e in episodes if e.env == env]) for env in sorted(set(env_of.values()))
            },
        }
        if base is not None:
            row["vs_warm_start"] = difference(paired(list(per_seed.values()), [base], tasks), env_of)
            row["gains"] = gains(per_seed, base, tasks)
        if control and control in arms and arm != control:
            row["vs_control"] = difference(paired(list(per_seed.values()), list(arms[control].values()), tasks), env_of)
        out["arms"][arm] = row
    names = list(arms)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            d = difference(paired(list(arms[a].values()), list(arms[b].values()), tasks), env_of)
            d["tasks_for_target"] = tasks_needed(d["se"], len(tasks), TARGET_DIFFERENCE) if d["se"] > 0 else None
            out["pairs"][f"{a} vs {b}"] = d
    return out


def gains(per_seed: PerSeed, base: Episodes, tasks: list[str]) -> dict[str, float]:
    """Per seed (averaged): tasks the arm solves that the warm start failed, by the code alone (the warm start's
    other checks all passed) or otherwise, and tasks the warm start solved that the arm fails."""
    counts = {"solved_by_code": [], "solved_otherwise": [], "lost": []}
    for run in per_seed.values():
        by_code = sum(1 for t in tasks if run[t].success and not base[t].success
                      and (base[t].reward_without_rule or 0.0) >= 1.0)  # fmt: skip
        solved = sum(1 for t in tasks if run[t].success and not base[t].success)
        counts["solved_by_code"].append(by_code)
        counts["solved_otherwise"].append(solved - by_code)
        counts["lost"].append(sum(1 for t in tasks if base[t].success and not run[t].success))
    return {k: statistics.fmean(v) for k, v in counts.items()}


# ---------------------------------------------------------------------------------------------------- markdown


def _est(e: Estimate | None, digits: int = 1) -> str:
    return "-" if e is None else e.format(digits)


def _signed(e: Estimate) -> str:
    return f"{e.value:+.1f} [{e.lo:+.1f}, {e.hi:+.1f}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def verdicts_markdown(data: dict[str, Any], title: str) -> str:
    """The tables of `verdicts` as markdown under `title`."""
    parts = [f"#### {title}: arms ({data['n_tasks']} tasks in {data['n_clusters']} environment clusters)\n"]
    rows = []
    if "warm_start" in data:
        rows.append(["warm start", "-", "-", "-", _est(data["warm_start"]["rule_pass"]), "0", "0", "-", "-"])
    for arm, r in data["arms"].items():
        vs = r.get("vs_warm_start")
        control = r.get("vs_control")
        rows.append([arm, str(r["seeds"]), _est(r["reward"]), _est(r["success"]), _est(r["rule_pass"]),
                     _signed(vs["t"]) if vs else "-", _signed(vs["cluster"]) if vs else "-",
                     _signed(control["cluster"]) if control else "-",
                     f"{vs['mde']:.1f}" if vs else "-"])  # fmt: skip
    parts.append(_table(["Arm", "Seeds", "Reward", "Success %", "Rule pass % (Wilson)", "Δ vs warm start [t, tasks]",
                         "Δ vs warm start [cluster bootstrap]", "Δ vs shuffled control [cluster bootstrap]",
                         "Min. detectable Δ"], rows))  # fmt: skip
    pairs = []
    for name, d in data["pairs"].items():
        verdict = "differs" if d["cluster"].lo > 0 or d["cluster"].hi < 0 else "cannot be told apart"
        needed = d.get("tasks_for_target")
        pairs.append([name, _signed(d["t"]), _signed(d["cluster"]), f"{d['mde']:.1f}", verdict,
                      str(needed) if needed is not None else "-"])  # fmt: skip
    if pairs:
        parts.append(f"#### {title}: method against method, paired per task\n")
        parts.append(_table(["Pair", "Δ [t, tasks]", "Δ [cluster bootstrap]", "Min. detectable Δ", "Verdict",
                             f"Tasks for a {TARGET_DIFFERENCE:g}-point MDE"], pairs))  # fmt: skip
    gain_rows = [[arm, f"{r['gains']['solved_by_code']:.1f}", f"{r['gains']['solved_otherwise']:.1f}",
                  f"{r['gains']['lost']:.1f}"] for arm, r in data["arms"].items() if "gains" in r]  # fmt: skip
    if gain_rows:
        parts.append(f"#### {title}: where the gain comes from (tasks per seed)\n")
        parts.append(_table(["Arm", "Solved, the warm start failed only the code", "Solved, failed otherwise",
                             "Lost"], gain_rows))  # fmt: skip
    envs = sorted({env for r in data["arms"].values() for env in r["rule_by_env"]})
    if envs and any(r["rule_pass"] for r in data["arms"].values()):
        env_rows = [[arm, *(_est(r["rule_by_env"].get(env), 0) for env in envs)] for arm, r in data["arms"].items()]
        parts.append(f"#### {title}: rule pass % by environment\n")
        parts.append(_table(["Arm", *(e.removeprefix("toolworld_") for e in envs)], env_rows))
    parts.append(
        "Δ in points, paired per task. The cluster bootstrap resamples environments, then tasks, then seeds; the "
        "minimum detectable Δ is 2.80 x its standard error (a paired test at 5% with 80% power). Two arms differ "
        "only when the bootstrap interval excludes 0. Rule pass: episodes with a state-changing call that wrote the "
        "right code on every one.\n"
    )
    return "\n".join(parts)
