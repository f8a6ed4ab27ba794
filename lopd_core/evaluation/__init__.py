"""Evaluation: the student alone (no context) on held-out tasks and benchmarks, scored with intervals.

Pure library parts of the `evaluate` stage (components/evaluate.py), reused by the report stage:

* `stats`: estimates with 95% intervals (Wilson, Student's t, normal), pass@k, per-episode records, score blocks;
* `code`: code benchmarks as a suite (prompts, code extraction, sandboxed test programs);
* `loaders`: HumanEval, EvalPlus HumanEval+/MBPP+, LiveCodeBench, ACEBench and EnvScaler files;
* `harness`: task sampling, policies over episodes, per-benchmark aggregates, a scripted (replay) policy;
* `latent`: the latent teacher's generation loop (the "latent eval" diagnostic);
* `tables`: markdown tables in the shape of the paper's tab. 1, 2 and 3.
"""

from lopd_core.evaluation.harness import ScriptedPolicy, aggregate, flat_metrics, run_tasks, select_tasks
from lopd_core.evaluation.stats import EpisodeRecord, Estimate, mean_interval, pass_at_k, wilson
from lopd_core.evaluation.tables import behaviour_table, code_table, detail_table, report_markdown, tool_use_table

__all__ = [
    "EpisodeRecord",
    "Estimate",
    "ScriptedPolicy",
    "aggregate",
    "behaviour_table",
    "code_table",
    "detail_table",
    "flat_metrics",
    "mean_interval",
    "pass_at_k",
    "report_markdown",
    "run_tasks",
    "select_tasks",
    "tool_use_table",
    "wilson",
]
