"""Artifact references: how stages hand each other datasets, bank snapshots, checkpoints and metrics.

Stages exchange a small typed record `{uri, kind, sha256, metadata}` (Kubeflow style); the bytes live in
an artifact store (`components.artifacts`). `sha256` covers the file's bytes, or for a directory every file's
relative path and bytes in sorted order, so equal content gives an equal digest wherever it is stored.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ARTIFACT_KINDS = (
    "dataset",  # trajectories (jsonl)
    "bank_snapshot",  # experience memory snapshot
    "checkpoint",  # student / composer / optimizer state
    "model",  # a Hugging Face model folder (the sft stage's warm start)
    "latent_cache",  # cold-start latents c_phi0
    "metrics",  # evaluation or training metrics (json)
    "report",  # markdown / plots
    "config",
)


@dataclass(frozen=True)
class ArtifactRef:
    uri: str
    kind: str
    sha256: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ARTIFACT_KINDS:
            raise ValueError(f"ArtifactRef.kind must be one of {ARTIFACT_KINDS}, got {self.kind!r}")
        if len(self.sha256) != 64:
            raise ValueError(f"ArtifactRef.sha256 must be a 64-char hex digest, got {self.sha256!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArtifactRef:
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArtifactRef:
        return cls.from_dict(json.loads(text))


def sha256_path(path: str | Path) -> str:
    """Digest of a file's bytes, or of a directory's (relative path, bytes) pairs in sorted order."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    if not path.is_dir():
        raise FileNotFoundError(f"cannot digest {path}: no such file or directory")
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(sha256_path(f).encode() + b"\n")
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Digest of a JSON-serialisable object in canonical form (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def cache_dir() -> Path:
    """The directory for converted models and other rebuildable caches (`$LOPD_CACHE`, default ~/.cache/lopd)."""
    return Path(os.environ.get("LOPD_CACHE", Path.home() / ".cache" / "lopd")).expanduser()
