"""The stage cache: a small key -> StageResult index next to the artifacts it references.

    key = stage_key("train", spec)        # digests of input artifacts + parameters + code version
    cache = StageCache(artifact_root)      # <artifact_root>/stage-cache/<stage>/<key>.json (local or s3://...)
    hit = cache.get("train", key)          # StageResult, or None (absent, an artifact gone, or stale state)
    cache.put("train", key, result)

The key ignores where a stage writes and logs (run_dir, artifact_root, tracking_uri, experiment, parent run,
tags) and reads input artifacts by digest only (`kind:sha256`; the URI and metadata do not matter). The code
version is a digest of the sources and data of `lopd_core` and `components` plus the versions of the numerical
packages, or `$LOPD_CODE_VERSION` when set (e.g. an image tag). Entries hold small JSON only, never tensors.

`state` covers inputs that live outside the spec: the bank stage records the bank version it snapshotted, and
an entry whose recorded state differs from the current one (the bank has grown) is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel

from components.common import StageResult
from components.inputs import STAGE_CACHE_DIR
from lopd_core.artifacts import sha256_json

CODE_VERSION_ENV = "LOPD_CODE_VERSION"
CACHE_DIR = STAGE_CACHE_DIR  # components.inputs reads results from here too
FORMAT = 1
# Where a stage writes and logs, not what it computes.
BOOKKEEPING = frozenset(
    {"run_dir", "artifact_root", "tracking_uri", "experiment", "parent_run_id", "tags", "tracking", "progress"}
)
CODE_PACKAGES = ("lopd_core", "components")
CODE_SUFFIXES = frozenset({".py", ".json", ".jsonl", ".yaml", ".yml", ".jinja", ".txt"})
DEPENDENCIES = ("torch", "transformers", "peft", "qdrant-client", "qdrant-edge-py", "sentence-transformers")
_code_version: dict[str, str] = {}


def code_version() -> str:
    """$LOPD_CODE_VERSION, else a digest of the stage code (lopd_core, components) and key dependency versions."""
    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    if "v" not in _code_version:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for package in CODE_PACKAGES:
            files = sorted(
                p
                for p in (root / package).rglob("*")
                if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
            )
            for path in files:
                h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        for dist in DEPENDENCIES:
            try:
                h.update(f"{dist}=={metadata.version(dist)}\n".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{dist} missing\n".encode())
        _code_version["v"] = h.hexdigest()
    return _code_version["v"]


def _is_ref(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and {"uri", "kind", "sha256"} <= set(value)
        and set(value) <= {"uri", "kind", "sha256", "metadata"}
    )


def normalize(value: Any) -> Any:
    """JSON data with every ArtifactRef replaced by `kind:sha256` (what a stage consumes, not where it lies)."""
    if _is_ref(value):
        return f"{value['kind']}:{value['sha256']}"
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def key_material(stage: str, spec: BaseModel) -> dict[str, Any]:
    data = {k: v for k, v in spec.model_dump(mode="json").items() if k not in BOOKKEEPING}
    return {"format": FORMAT, "stage": stage, "spec": normalize(data), "code": code_version()}


def stage_key(stage: str, spec: BaseModel) -> str:
    """The cache key of running `stage` with `spec`."""
    return sha256_json(key_material(stage, spec))


class StageCache:
    """StageResults by (stage, key) under `<root>/stage-cache/` on any fsspec filesystem."""

    def __init__(self, root: str) -> None:
        self.fs, path = fsspec.core.url_to_fs(root)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.root = f"{path.rstrip('/')}/{CACHE_DIR}"

    def path(self, stage: str, key: str) -> str:
        return f"{self.root}/{stage}/{key}.json"

    def entry(self, stage: str, key: str) -> dict[str, Any] | None:
        path = self.path(stage, key)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as fh:
            return json.load(fh)

    def get(self, stage: str, key: str, state: dict[str, Any] | None = None) -> StageResult | None:
        """The stored result when it is usable: every artifact it names still exists, and its state matches."""
        entry = self.entry(stage, key)
        if entry is None:
            return None
        if state is not None and entry.get("state") != state:
            return None
        result = StageResult.model_validate(entry["result"])
        for ref in result.artifacts.values():
            fs, path = fsspec.core.url_to_fs(ref.uri)
            if not fs.exists(path):
                return None
        return result

    def put(
        self,
        stage: str,
        key: str,
        result: StageResult,
        state: dict[str, Any] | None = None,
        material: dict[str, Any] | None = None,
    ) -> str:
        """Record a result (atomically on a local filesystem); `material` (the key's inputs) helps explain misses."""
        entry = {
            "stage": stage,
            "key": key,
            "result": result.model_dump(mode="json"),
            "state": state,
            "material": material,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        path = self.path(stage, key)
        text = json.dumps(entry, indent=2, sort_keys=True, default=str)
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{path}.tmp-{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)
        else:
            with self.fs.open(path, "w") as fh:
                fh.write(text)
        return path

    def drop(self, stage: str, key: str) -> None:
        path = self.path(stage, key)
        if self.fs.exists(path):
            self.fs.rm(path)
