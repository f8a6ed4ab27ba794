"""Markdown tables in the shape of the paper's: tool use (tab. 1), code (tab. 2), student behaviour (tab. 3), plus a
detail table with n and 95% intervals. The evaluate stage, the Prefect artifact and the report stage all build
their tables here, from evaluation metrics (the `benchmarks` dict of a metrics JSON).

    rows = [("Vanilla", base_metrics["benchmarks"]), ("LOPD", lopd_metrics["benchmarks"])]
    print(tool_use_table(rows)); print(code_table(rows)); print(behaviour_table(rows))

Columns follow the paper's order and appear only when some row has the benchmark: EnvScaler-format suites
(mean reward), BFCL-v3 subsets and their mean, ACEBench; LiveCodeBench windows and their task-weighted mean,
HumanEval, HumanEval+, MBPP+ and the task-weighted EvalPlus mean. A cell a row lacks is "—". Scores are on the
0-100 scale; a footnote gives the number of tasks behind each column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lopd_core.evaluation.stats import Estimate, weighted_mean

Rows = Sequence[tuple[str, dict[str, Any]]]  # (row label, {benchmark key: aggregate})
DASH = "—"
BFCL_SUBSETS = ("base", "miss_func", "miss_param", "long_context")
LABELS = {
    "toolworld": "Built-in (toolworld)",
    "toolworld-compact": "Built-in (toolworld, compact prompts)",
    "toolworld-minimal": "Built-in (toolworld, minimal prompts)",
    "toolworld-rules": "Built-in (toolworld with house rules, the positive control)",
    "envscaler": "EnvScaler",
    "bfcl": "BFCL-v3",
    "acebench": "ACEBench",
    "livecodebench": "LiveCodeBench",
    "humaneval": "HumanEval",
    "humaneval_plus": "HumanEval+",
    "mbpp_plus": "MBPP+",
}  # also the column order (the paper's)


def label(key: str) -> str:
    return LABELS.get(key, key)


def _table(header: Sequence[str], body: Sequence[Sequence[str]], notes: Sequence[str] = ()) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


def _cell(est: dict[str, Any] | Estimate | None, digits: int, interval: bool) -> str:
    if est is None:
        return DASH
    e = est if isinstance(est, Estimate) else Estimate(**{k: est[k] for k in ("value", "lo", "hi", "n", "method")})
    return e.format(digits, interval) if e.n > 0 else DASH


def _family(rows: Rows, key: str) -> str:
    """The benchmark a key is an instance of (e.g. "livecodebench" for "lcb_v6")."""
    return next((str(b[key].get("family") or key) for _, b in rows if key in b), key)


def _keys(rows: Rows, kinds: set[str]) -> list[str]:
    """Benchmark keys of these kinds present in some row, in the paper's column order (by family, then key)."""
    seen: list[str] = []
    for _, benchmarks in rows:
        for key, data in benchmarks.items():
            if data.get("kind") in kinds and key not in seen:
                seen.append(key)
    order = list(LABELS)

    def rank(key: str) -> tuple[int, str]:
        family = _family(rows, key)
        return (order.index(family) if family in order else len(order), key)

    return sorted(seen, key=rank)


def _n_note(columns: Sequence[tuple[str, list[int]]]) -> str:
    parts = []
    for name, ns in columns:
        distinct = sorted(set(ns))
        parts.append(f"{name} {'/'.join(str(n) for n in distinct) if distinct else DASH}")
    return "n (tasks per column, per row where they differ): " + "; ".join(parts)


def tool_use_table(rows: Rows, interval: bool = False) -> str:
    """Tab. 1: tool use, 0-100 (mean reward for EnvScaler-format suites, accuracy for BFCL-v3 subsets and mean)."""
    header, getters = ["Method"], []
    for key in _keys(rows, {"agent", "bfcl"}):
        kind = next(b[key]["kind"] for _, b in rows if key in b)
        if kind == "bfcl" or _family(rows, key) == "bfcl":
            subsets = [s for s in BFCL_SUBSETS if any(s in (b.get(key, {}).get("by_subset") or {}) for _, b in rows)]
            for s in subsets:
                header.append(f"{label(key)} {s}")
                getters.append((key, s, 2))
            header.append(f"{label(key)} avg")
            getters.append((key, None, 2))
        else:
            header.append(f"{label(key)} (mean reward)")
            getters.append((key, None, 1))
    return _render(rows, header, getters, interval)


def code_table(rows: Rows, interval: bool = False) -> str:
    """Tab. 2: code, pass@1 in percent; LiveCodeBench and EvalPlus averages weighted by task count."""
    keys = _keys(rows, {"code"})
    lcb = [k for k in keys if _family(rows, k) == "livecodebench"]
    plus = [k for k in keys if _family(rows, k) in ("humaneval_plus", "mbpp_plus")]
    header, getters = ["Method"], []
    for key in keys:
        header.append(label(key))
        getters.append((key, None, 1))
        if len(lcb) > 1 and key == lcb[-1]:
            header.append("LCB avg")
            getters.append((tuple(lcb), "avg", 1))
        if len(plus) > 1 and key == plus[-1]:
            header.append("EvalPlus avg")
            getters.append((tuple(plus), "avg", 1))
    return _render(rows, header, getters, interval)


def _render(rows: Rows, header: list[str], getters: list[tuple[Any, Any, int]], interval: bool) -> str:
    body, ns = [], [[] for _ in getters]
    for name, benchmarks in rows:
        row = [name]
        for i, (key, sub, digits) in enumerate(getters):
            est = _lookup(benchmarks, key, sub)
            row.append(_cell(est, digits, interval))
            if est is not None and est["n"]:
                ns[i].append(int(est["n"]))
        body.append(row)
    return _table(header, body, [_n_note(list(zip(header[1:], ns, strict=True)))])


def _lookup(benchmarks: dict[str, Any], key: Any, sub: str | None) -> dict[str, Any] | None:
    """The estimate a cell shows: a benchmark's headline, a BFCL subset's accuracy, or a task-weighted average."""
    if isinstance(key, tuple):
        parts = [benchmarks[k]["headline"] for k in key if k in benchmarks]
        if len(parts) != len(key):
            return None
        return weighted_mean([Estimate(p["value"], p["lo"], p["hi"], p["n"], p["method"]) for p in parts]).to_dict()
    data = benchmarks.get(key)
    if data is None:
        return None
    if sub is None:
        return data["headline"]
    block = (data.get("by_subset") or {}).get(sub)
    return None if block is None else block["success_rate"]


def behaviour_table(rows: Rows) -> str:
    """Tab. 3: steps per task and tool calls per step (also errors per episode), per agent benchmark."""
    header = ["Method", "Benchmark", "n", "Steps / task", "Calls / step", "Errors / episode"]
    body = []
    for name, benchmarks in rows:
        for key in _keys([(name, benchmarks)], {"agent", "bfcl"}):
            o = benchmarks[key]["overall"]
            body.append([
                name, label(key), str(o["episodes"]), f"{o['steps_per_task']:.2f}", f"{o['calls_per_step']:.2f}",
                f"{o['errors_per_episode']:.2f}",
            ])  # fmt: skip
    return _table(header, body)


def detail_table(benchmarks: dict[str, Any]) -> str:
    """Every benchmark and group: n and the scores with their 95% intervals (method in the last column)."""
    header = ["Benchmark", "Group", "n", "Score", "Mean reward", "Success rate", "Interval"]
    body = []
    for key, data in benchmarks.items():
        head = data["headline"]
        body.append([
            label(key), f"**{head['metric']}**", str(head["n"]), _cell(head, 2, True), "", "", head["method"],
        ])  # fmt: skip
        groups = [("overall", data["overall"])]
        for group in ("by_subset", "by_env", "by_difficulty"):
            prefix = group.removeprefix("by_")
            groups += [(f"{prefix}={name}", block) for name, block in (data.get(group) or {}).items()]
        for name, block in groups:
            passes = [f"{k} {_cell(v, 1, True)}" for k, v in block.items() if k.startswith("pass@")]
            body.append([
                "", name, str(block["n"]), "; ".join(passes), _cell(block["mean_reward"], 1, True),
                _cell(block["success_rate"], 1, True), "t / Wilson",
            ])  # fmt: skip
    notes = [
        "Scores in percent (mean reward x 100). Intervals: 95%, Wilson for rates, Student's t for mean rewards and "
        "multi-sample pass@k, normal for means over subsets or task-weighted means."
    ]
    return _table(header, body, notes)


def report_markdown(title: str, rows: Rows, details: dict[str, Any] | None = None) -> str:
    """The evaluation report: tab. 1/2/3 shapes for the rows present, and the detail table of `details`."""
    parts = [f"# {title}\n"]
    has = {data.get("kind") for _, b in rows for data in b.values()}
    if has & {"agent", "bfcl"}:
        parts += ["## Tool use (tab. 1 shape, 0-100)\n", tool_use_table(rows), "## Behaviour (tab. 3 shape)\n"]
        parts.append(behaviour_table(rows))
    if "code" in has:
        parts += ["## Code (tab. 2 shape, pass@1 %)\n", code_table(rows)]
    if details:
        parts += ["## Details (n, 95% intervals)\n", detail_table(details)]
    return "\n".join(parts)
