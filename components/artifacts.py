"""The artifact store: content-addressed bytes behind `ArtifactRef`s (a local directory, or any fsspec URL).

    store = ArtifactStore("runs/artifacts")          # embedded default
    store = ArtifactStore("s3://lopd/artifacts")     # at scale (MinIO / S3; needs s3fs and the AWS_* settings)
    ref = store.put(path, kind="dataset", metadata={...})   # file or directory
    local = store.get(ref)                                  # a local path; digest verified

Objects live at `<root>/<kind>/<sha256>/<name>`: putting the same content twice stores it once, and a
reference says exactly which bytes a stage consumed. `get` on a remote store downloads into a local cache
(`$LOPD_CACHE/artifacts`) once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec

from lopd_core.artifacts import ArtifactRef, cache_dir, sha256_path
from lopd_core.timing import section


def local_path(uri: str | os.PathLike[str]) -> Path:
    """A local path from a plain path or a file: / file:// URI."""
    text = str(uri)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if text.startswith("file:"):
        return Path(text[len("file:") :])
    if "://" in text:
        raise ValueError(f"{text} is not a local path")
    return Path(text)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = str(root)
        self.fs, path = fsspec.core.url_to_fs(root)
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.protocol = protocols[0]
        self.local = "file" in protocols
        self.root = str(Path(path).resolve()) if self.local else path.rstrip("/")
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def _key(self, kind: str, digest: str, name: str) -> str:
        return f"{self.root}/{kind}/{digest}/{name}"

    def _uri(self, key: str) -> str:
        return key if self.local else f"{self.protocol}://{key}"

    def put(
        self, path: str | Path, kind: str, metadata: dict[str, Any] | None = None, name: str | None = None
    ) -> ArtifactRef:
        """Store a file or a directory; returns its reference (idempotent for equal content)."""
        with section("stage/cache"):
            return self._put(path, kind, metadata, name)

    def _put(self, path: str | Path, kind: str, metadata: dict[str, Any] | None, name: str | None) -> ArtifactRef:
        path = local_path(path)
        digest = sha256_path(path)
        key = self._key(kind, digest, name or path.name)
        if not self.fs.exists(key):
            if self.local:
                tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".put-"))
                try:
                    target = tmp / path.name
                    shutil.copytree(path, target) if path.is_dir() else shutil.copy2(path, target)
                    Path(key).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(target, key)  # atomic: a reader never sees a half-written object
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                self.fs.put(str(path), key, recursive=path.is_dir())
        meta = {"name": name or path.name, "is_dir": path.is_dir(), **(metadata or {})}
        return ArtifactRef(uri=self._uri(key), kind=kind, sha256=digest, metadata=meta)

    def put_json(self, obj: Any, kind: str, name: str, metadata: dict[str, Any] | None = None) -> ArtifactRef:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
            return self.put(path, kind, metadata)

    def exists(self, ref: ArtifactRef) -> bool:
        fs, path = fsspec.core.url_to_fs(ref.uri)
        return fs.exists(path)

    def get(self, ref: ArtifactRef, verify: bool = True) -> Path:
        """A local path holding the artifact's bytes (downloaded once for remote stores)."""
        with section("stage/cache"):
            return self._get(ref, verify)

    def _get(self, ref: ArtifactRef, verify: bool) -> Path:
        fs, path = fsspec.core.url_to_fs(ref.uri)
        if not fs.exists(path):
            raise FileNotFoundError(f"artifact {ref.kind} {ref.sha256[:12]} is missing from its store: {ref.uri}")
        if "file" in fs.protocol:
            local = Path(path)
        else:
            local = cache_dir() / "artifacts" / ref.kind / ref.sha256 / Path(path).name
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get(path, str(local), recursive=bool(ref.metadata.get("is_dir")))
        if verify and sha256_path(local) != ref.sha256:
            raise ValueError(f"artifact {ref.uri} does not match its digest {ref.sha256}: it was modified or corrupted")
        return local

    def read_json(self, ref: ArtifactRef) -> Any:
        return json.loads(self.get(ref).read_text())
