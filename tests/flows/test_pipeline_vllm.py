"""The tiny preset's whole pipeline with rollout.engine=vllm in collect, train and evaluate (the real vLLM engine,
`make venv-vllm`): every stage runs, train syncs the student's weights into the engine after its step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.core.test_vllm import needs_vllm
from tests.flows.test_pipeline import LEAN, ROOT, ran

pytestmark = [pytest.mark.slow, needs_vllm]

VLLM = ["collect.rollout.engine=vllm", "train.rollout.engine=vllm", "evaluate.rollout.engine=vllm"]


@pytest.mark.usefixtures("harness")
def test_vllm_tiny_pipeline(tmp_path: Path) -> None:
    from flows.config import load_config
    from flows.pipeline import lopd_pipeline

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*LEAN, f"run_dir={tmp_path}", *VLLM])
    assert cfg.collect.rollout.engine == cfg.train.rollout.engine == cfg.evaluate.rollout.engine == "vllm"
    summary = lopd_pipeline(config=cfg)
    assert ran(summary) == [
        "collect", "bank", "cold-start seed 0", "train lopd seed 0", "evaluate base", "evaluate lopd seed 0", "report",
    ]  # fmt: skip
    history = json.loads(next(tmp_path.rglob("train/*.history.json")).read_text())
    assert history and all(row["sync_seconds"] > 0 for row in history if row.get("updated"))
    assert "toolworld" in summary["evaluation"]
