"""Values as MLflow takes them: configs flattened to params, length limits, metric keys."""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mlflow.entities import Param
from mlflow.utils.validation import (
    MAX_PARAM_VAL_LENGTH,
    MAX_TAG_VAL_LENGTH,
)

from components.tracking.names import CONFIG_ARTIFACT, T
from lopd_core.artifacts import sha256_json
from lopd_core.method_rules import METHOD_RULES, applies

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- values


def _config_data(config: Any) -> dict[str, Any]:
    """A config (pydantic model, dataclass or mapping) as plain JSON-compatible data."""
    if hasattr(config, "model_dump"):
        data = config.model_dump(mode="json")
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        data = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"config must be a pydantic model, a dataclass or a mapping, got {type(config).__name__}")
    return json.loads(json.dumps(data, default=str))


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (the same keys as StrictModel.flat())."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# The params a compare view plots and filters on: the method's hyperparameters, backbone, seed, budget, suite, the
# schedule and the stage's own optimisation knobs. Everything else (artifact refs and their metadata, paths, URIs,
# tags, compute knobs) stays in the config.yaml artifact, which holds the full resolved config.
PARAM_NAMES = frozenset({"backbone", "suite", "seed", "seeds", "method", "methods", "budget", "success_threshold"})
PARAM_GROUPS = ("lopd.", "schedule.", "train.schedule.", "cold.", "cold_start.", "sft.")
LEFT_OUT = frozenset(
    {"target_modules", "fail_on_overlength", "gradient_checkpointing", "head_chunk_size", "answer", "threads"}
)
_LOPD_FIELDS = frozenset({"top_m", "margin_target", "dual_lr", "n_retrieved", "n_queries"})  # an LOPDConfig itself


def curated_params(flat: Mapping[str, Any], method: str | None = None) -> dict[str, Any]:
    """The curated subset of a flattened config (see PARAM_NAMES, PARAM_GROUPS); an LOPDConfig logged on its
    own (top-level top_m, margin_target, ...) keeps all its hyperparameters. With `method` (a run of one method),
    the method's hyperparameters are only those that apply to it (`lopd_core.method_rules.applies`): a GRPO run
    has no `lopd.margin_target`."""
    bare_method = set(flat) >= _LOPD_FIELDS
    method = method if method in METHOD_RULES else None
    out = {}
    for key, value in flat.items():
        last = key.rsplit(".", 1)[-1]
        if last in LEFT_OUT or ".metadata." in key:
            continue
        if method is not None:
            field = key if bare_method else key.removeprefix("lopd.") if key.startswith("lopd.") else None
            if field is not None and not applies(method, field):
                continue
        if key in PARAM_NAMES or key.startswith(PARAM_GROUPS) or bare_method:
            out[key] = value
    return out


def config_hash(config: Any) -> str:
    return sha256_json(_config_data(config))


def param_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return str(value)


def format_params(params: Mapping[str, Any]) -> tuple[list[Param], list[str]]:
    """MLflow params, values cut to MLflow's length limit with a note; also the names of the cut ones."""
    out: list[Param] = []
    truncated: list[str] = []
    for key, value in params.items():
        text = param_text(value)
        if len(text) > MAX_PARAM_VAL_LENGTH:
            note = f"...[truncated from {len(text)} chars; full value in {CONFIG_ARTIFACT}]"
            text = text[: MAX_PARAM_VAL_LENGTH - len(note)] + note
            truncated.append(key)
        out.append(Param(key, text))
    return out, truncated


def _clip_tag(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_TAG_VAL_LENGTH else text[: MAX_TAG_VAL_LENGTH - 3] + "..."


_KEY_CHARS = re.compile(r"^[/\w.\- :]+$")


def valid_metric_key(key: Any) -> bool:
    """Whether MLflow accepts `key` as a metric name."""
    if not isinstance(key, str) or not key or len(key) > 250 or not _KEY_CHARS.match(key):
        return False
    return posixpath.normpath(key) == key and key != "." and not key.startswith(("/", ".."))


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _now_ms() -> int:
    return int(time.time() * 1000)
