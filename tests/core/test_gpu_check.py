"""bench/gpu_check.sh runs on any machine: without CUDA its three checks (the train step, FSDP2 on one rank, the
loss head) run at toy sizes on the CPU, so the script a GPU machine will run is the one tested here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_three_checks(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by = {}
    for c in checks:
        by.setdefault(c["check"], []).append(c)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert by["environment"][0]["device"] == device
    steps = by["step"]
    assert {s["method"] for s in steps} == {"lopd", "opsd", "grpo"}
    for s in steps:  # a measured step: memory, time and the model's prediction beside it
        assert s["peak_mb"] > 0 and s["predicted_mb"] > 0 and s["step_s"] > 0 and s["tokens_per_s"] > 0, s
    fsdp = by["fsdp2_one_rank"][0]
    assert fsdp["sharded"] is True and fsdp["agrees"] is True, fsdp  # sharded on one rank, the same loss
    head = by["loss_head"][0]
    assert [r["T"] for r in head["rows"]] == sorted(r["T"] for r in head["rows"]) and len(head["rows"]) == 2
    assert all(r["fused_gb"] > 0 for r in head["rows"])
    assert by["done"][0]["failed"] == []
    assert (tmp_path / "step.jsonl").exists() and (tmp_path / "fsdp.jsonl").exists()
