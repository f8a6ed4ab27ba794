"""The fused loss head's peak memory does not grow with the number of positions, in every objective.

Each measurement is bench/loss_memory.py's child: a fresh process (glibc serving large blocks by mmap, so the
resident high-water mark follows live memory) that builds the inputs, runs the head and its backward, and prints
its peak above the inputs. Between T = 1024 and 4096 one [T, V] fp32 tensor grows by 3072 x 16384 x 4 bytes =
201 MB; what the head must hold grows by [T, d] and [T, M] tensors only (~8 MB here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lopd_core.memory_model import measuring_env

BENCH = Path(__file__).resolve().parents[2] / "bench" / "loss_memory.py"

V, D, CHUNK = 16384, 64, 256
SHORT, LONG = 1024, 4096
ONE_TV_GROWTH = (LONG - SHORT) * V * 4
TOLERANCE = 0.2 * ONE_TV_GROWTH  # 40 MB: a fifth of one [T, V] tensor's growth


def peak(kind: str, case: str, T: int) -> int:
    cmd = [sys.executable, str(BENCH), "--child", kind, case, str(T), str(V), str(D), str(CHUNK), "float32", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=measuring_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]


@pytest.mark.parametrize("case", ["lopd", "opsd", "grpo", "grpo_kl"])
def test_fused_head_peak_is_flat_in_T(case):
    short, long = peak("fused", case, SHORT), peak("fused", case, LONG)
    assert long - short < TOLERANCE, (
        f"{case}: the fused head's peak grew by {(long - short) / 1e6:.0f} MB from T={SHORT} to {LONG} "
        f"({short / 1e6:.0f} -> {long / 1e6:.0f} MB); one [T, V] fp32 tensor grows by {ONE_TV_GROWTH / 1e6:.0f} MB"
    )


def test_the_measurement_sees_a_head_that_grows():
    """The naive head holds [T, V] logits: the same measurement must see it grow, or the test above proves nothing."""
    short, long = peak("naive", "opsd", SHORT), peak("naive", "opsd", LONG)
    assert long - short > 2 * ONE_TV_GROWTH
