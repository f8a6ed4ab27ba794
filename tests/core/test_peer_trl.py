"""bench/peer_trl.py runs both pairs (our distillation and GRPO steps beside TRL's) and prints their ratios; a
smoke run on the tiny backbone (the figures are SmolLM2's, in the notes and docs/)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[2]


def test_peer_trl_prints_both_ratios() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "peer_trl.py"), "--backbone", "tiny", "--steps", "2",
                           "--length", "256"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert set(report["ratios"]) == {"distill", "grpo"}
    for r in report["ratios"].values():
        assert r["time_ours_over_trl"] > 0 and r["memory_ours_over_trl"] > 0
    rows = report["rows"]
    assert len({row["tokens"] for row in rows.values()}) == 1  # the same batch on every side
    assert all(math.isfinite(row["last_loss"]) for row in rows.values())
    assert rows["trl-distill"]["last_loss"] > 0  # TRL's JSD on the fixed batch is a real loss, not an empty mask
