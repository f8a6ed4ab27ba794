"""Shared fixtures. Tests run on CPU with one thread (faster than two here, and deterministic)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Prefect's test servers would otherwise send telemetry off the machine (tests talk only to 127.0.0.1)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
torch.set_num_threads(1)


@pytest.fixture
def tiny():
    """A fresh tiny backbone and tokenizer (random Llama weights, locally trained BPE; ~0.2 s)."""
    from lopd_core.backbone import load_backbone

    return load_backbone("tiny")
