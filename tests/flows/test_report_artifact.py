"""The Prefect report artifact's figures load in a browser: small PNGs embedded, large ones linked or named."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flows.pipeline import EMBED_MAX_BYTES, browser_images

IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]*)\)")


def _png(path: Path, pixels: int) -> Path:
    fig, ax = plt.subplots(figsize=(pixels / 100, pixels / 100), dpi=100)
    ax.imshow(__import__("numpy").random.default_rng(0).random((pixels, pixels)))  # noise: does not compress
    fig.savefig(path)
    plt.close(fig)
    return path


def loadable(text: str) -> list[str]:
    """Image targets a browser on the Prefect UI cannot open (relative paths, file://)."""
    return [t for t in IMAGE.findall(text) if not t.startswith(("data:image/png;base64,", "http://", "https://"))]


def test_small_figures_are_embedded_and_large_ones_linked_or_named(tmp_path):
    small = _png(tmp_path / "curves_step.png", 200)
    large = _png(tmp_path / "curves_generations.png", 1200)
    assert small.stat().st_size <= EMBED_MAX_BYTES < large.stat().st_size
    text = "# report\n\n![vs step](curves_step.png)\n\n![vs generations](curves_generations.png)\n"

    local = browser_images(text, tmp_path, None, "abc123")
    assert not loadable(local) and "file://" not in local
    (embedded,) = IMAGE.findall(local)
    assert base64.b64decode(embedded.split(",", 1)[1]) == small.read_bytes()
    assert "vs generations: curves_generations.png" in local and "report/curves_generations.png of run abc123" in local

    served = browser_images(text, tmp_path, "http://127.0.0.1:5000", "abc123")
    assert not loadable(served)
    assert "](http://127.0.0.1:5000/get-artifact?path=report/curves_generations.png&run_uuid=abc123)" in served
