"""Artifact inputs given as paths: `python -m components.train dataset=runs/local ...`.

A stage's artifact fields (`dataset`, `bank_snapshot`, `composer`, `warm_start`, `checkpoint`) hold ArtifactRefs,
which is what flows pass. On the command line each also takes a path:

- a stage's result JSON (the `--out` file, a stage folder's `result.json`, or an entry of a pipeline's stage
  cache): the artifact of that name in it;
- a directory holding such results: a stage folder, or a pipeline's run directory (its stage cache, under the
  artifact root: `RUN_DIR/artifacts/stage-cache/`). The one artifact of the field's stage found there is used;
  several different ones are an error listing them, and a run directory without one is an error too;
- otherwise the artifact itself, a file or folder, hashed here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lopd_core.artifacts import ArtifactRef, sha256_path

STAGE_CACHE_DIR = "stage-cache"  # a pipeline's results: ARTIFACT_ROOT/stage-cache/STAGE/KEY.json (flows.cache)
RUN_DIR_MARKS = ("mlflow.db", "artifacts", STAGE_CACHE_DIR, "result.json")  # a run or stage folder, not an artifact

# field -> (the stage whose result holds it, the artifact's name in that result, its kind)
ARTIFACT_FIELDS: dict[str, tuple[str, str, str]] = {
    "dataset": ("collect", "dataset", "dataset"),
    "bank_snapshot": ("bank", "bank_snapshot", "bank_snapshot"),
    "composer": ("cold_start", "composer", "checkpoint"),
    "warm_start": ("sft", "model", "model"),
    "checkpoint": ("train", "checkpoint", "checkpoint"),
}
HINT = "give an ArtifactRef mapping, a stage's result JSON (--out), a run directory, or the artifact's file or folder"


def _result(path: Path) -> dict[str, Any] | None:
    """The StageResult mapping in a result JSON or a stage-cache entry, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("result"), dict):  # a stage-cache entry
        data = data["result"]
    return data if isinstance(data, dict) and isinstance(data.get("artifacts"), dict) else None


def _results_in(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    caches = [folder / STAGE_CACHE_DIR, folder / "artifacts" / STAGE_CACHE_DIR]  # an artifact root, a run directory
    files = [folder / "result.json", *sorted(f for cache in caches for f in cache.glob("*/*.json"))]
    return [(f, r) for f in files if f.is_file() and (r := _result(f)) is not None]


def artifact_from_path(field: str, value: str) -> ArtifactRef:
    """The ArtifactRef that `field=value` names (see the module docstring); a clear ValueError otherwise."""
    stage, name, kind = ARTIFACT_FIELDS[field]
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"{path} does not exist: {HINT}")
    if path.is_file() and (result := _result(path)) is not None:
        if name not in result["artifacts"]:
            raise ValueError(f"the result in {path} has no {name!r} artifact (it has {sorted(result['artifacts'])})")
        return ArtifactRef.from_dict(result["artifacts"][name])
    if path.is_dir() and any((path / mark).exists() for mark in RUN_DIR_MARKS):
        results = _results_in(path)
        found: dict[str, tuple[Path, dict[str, Any]]] = {}
        for file, result in results:
            ref = result["artifacts"].get(name)
            if result.get("stage") == stage and isinstance(ref, dict):
                found.setdefault(ref["sha256"], (file, ref))
        if not found:
            stages = sorted({str(r.get("stage")) for _, r in results})
            held = f"results of {stages}" if stages else "no stage results"
            raise ValueError(f"{path} holds {held}, none of stage {stage!r} (its {name!r}): run it first, or {HINT}")
        if len(found) > 1:
            files = "\n".join(f"    {file}" for file, _ in found.values())
            raise ValueError(f"{path} holds {len(found)} different {stage} results; pass one of these files:\n{files}")
        return ArtifactRef.from_dict(next(iter(found.values()))[1])
    metadata = {"is_dir": True} if path.is_dir() else {}
    return ArtifactRef(uri=str(path.resolve()), kind=kind, sha256=sha256_path(path), metadata=metadata)
