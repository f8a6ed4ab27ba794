"""EnvScaler files: environment items and scenario items (from files or loaded JSON), and a seeded train/eval split
of one scenario list. The formats are described in the package docstring (`lopd_core.envs.envscaler`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lopd_core.envs.tools import normalize_tools


def _read_json(source: str | Path | Any) -> Any:
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as fh:
            return json.load(fh)
    return source


def load_env_items(source: str | Path | dict[str, Any] | list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Environment items keyed by env_id, from a file (object keyed by env_id, or a list) or loaded JSON."""
    data = _read_json(source)
    items = data.items() if isinstance(data, dict) else ((item.get("env_id"), item) for item in data)
    out: dict[str, dict[str, Any]] = {}
    for key, item in items:
        if not isinstance(item, dict):
            raise ValueError(f"environment item {key!r} is not an object")
        env_id = str(item.get("env_id") or key)
        missing = [f for f in ("env_class_code", "tools") if f not in item]
        if missing:
            raise ValueError(f"environment {env_id!r} lacks {missing}")
        out[env_id] = {**item, "env_id": env_id, "tools": normalize_tools(item["tools"])}
    return out


def load_scenarios(source: str | Path | list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """Scenario items from a file (a list, or an object whose values are items) or loaded JSON."""
    data = _read_json(source)
    items = list(data.values()) if isinstance(data, dict) else list(data)
    for i, item in enumerate(items):
        missing = [f for f in ("env_id", "task", "checklist_with_func") if f not in item]
        if missing:
            raise ValueError(f"scenario #{i} ({item.get('task_id', '?')}) lacks {missing}")
    return items


def split_scenarios(
    items: Sequence[dict[str, Any]], n_eval: int = 200, seed: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """Split one scenario list into train/eval by a seeded shuffle (for users with a single EnvScaler file)."""
    import random

    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    eval_ids = set(order[:n_eval])
    return {
        "train": [it for i, it in enumerate(items) if i not in eval_ids],
        "eval": [it for i, it in enumerate(items) if i in eval_ids],
    }
