"""Snapshots of an `ExperienceBank`: `snapshot` writes a restorable copy of the current version (an
`ArtifactRef(kind="bank_snapshot")`), `ExperienceBank.restore` brings one back, checking its digest."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.memory.backends import Backend, ClientBackend, edge_available
from components.memory.embedders import Embedder, make_embedder
from components.memory.records import LOCK_FILE, MANIFEST_FILE, METADATA_KEY, _now
from components.memory.storage import (
    check_embedder,
    copy_points,
    dir_backend,
    path_from_uri,
    search_settings,
    write_json,
)
from lopd_core.artifacts import ArtifactRef, sha256_path

if TYPE_CHECKING:
    from components.memory.bank import ExperienceBank


class SnapshotMixin:
    """The snapshot and restore methods of `ExperienceBank` (components.memory.bank), which provides these
    attributes."""

    _backend: Backend
    manifest: dict[str, Any]
    name: str
    bank_dir: Path | None

    def snapshot(self, dest_dir: str | Path) -> ArtifactRef:
        """Write a restorable copy of the current version under `dest_dir`; returns its artifact reference.

        Embedded: a consistent copy of the bank directory (the engine is closed during the copy) in
        `<dest_dir>/<name>-v<version>-<digest>/`; a ":memory:" bank is written out as a directory bank.
        Server: the collection snapshot API; the snapshot file is downloaded into `dest_dir`.
        """
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        count, versions = self.count(), self.versions()
        version = versions[-1].version if versions else 0
        meta: dict[str, Any] = {
            "name": self.name,
            "backend": self.backend_kind,
            "version": version,
            "count": count,
            "versions": [asdict(v) for v in versions],
            "embedder": self.manifest["embedder"],
            "dim": self.manifest["dim"],
            "created": _now(),
        }
        if isinstance(self._backend, ClientBackend) and self._backend.kind == "server":
            path = self._backend.download_snapshot(dest_dir)
            meta.update(format="qdrant-collection-snapshot", manifest=self.manifest)
            uri = path.resolve().as_uri()
            return ArtifactRef(uri=uri, kind="bank_snapshot", sha256=sha256_path(path), metadata=meta)

        tmp = Path(tempfile.mkdtemp(prefix=f".{self.name}-v{version}-", dir=dest_dir))
        try:
            if self.bank_dir is not None:
                self._backend.close()  # flush and release the engine so the copy is consistent
                try:
                    shutil.copytree(self.bank_dir, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(LOCK_FILE))
                finally:
                    self._backend = dir_backend(self.bank_dir, self.manifest, create=False)
                kind = self.manifest["backend"]
            else:  # ":memory:" -> a directory bank with the default embedded engine
                kind = "edge" if edge_available() else "local"
                manifest = {**self.manifest, "backend": kind}
                target = dir_backend(tmp, manifest, create=True)
                try:
                    copy_points(self._backend, target)
                finally:
                    target.close()
                write_json(tmp / MANIFEST_FILE, manifest)
            digest = sha256_path(tmp)
            final = dest_dir / f"{self.name}-v{version}-{digest[:12]}"
            if final.exists():
                shutil.rmtree(tmp)  # same content already there (a retried snapshot)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        meta.update(format=f"{kind}-dir", engine=kind)
        return ArtifactRef(uri=final.resolve().as_uri(), kind="bank_snapshot", sha256=digest, metadata=meta)

    @classmethod
    def restore(
        cls,
        ref: ArtifactRef,
        location: str | Path,
        name: str,
        embedder: Embedder | str | None = None,
        *,
        overwrite: bool = False,
        api_key: str | None = None,
    ) -> ExperienceBank:
        """Bring back a snapshot as bank `name` at `location` (":memory:", a directory, or a server URL).

        The snapshot's digest is checked against `ref.sha256` first. A directory snapshot restored into a
        directory is copied as is; into ":memory:" or a server its entries (vectors, payloads, versions)
        are copied. A server snapshot is uploaded to a server.
        """
        if ref.kind != "bank_snapshot":
            raise ValueError(f"not a bank snapshot: kind={ref.kind!r}")
        source = path_from_uri(ref.uri)
        actual = sha256_path(source)
        if actual != ref.sha256:
            raise ValueError(f"bank snapshot {source} is corrupt or changed: sha256 {actual} != {ref.sha256}")
        location = str(location)
        is_server = location.startswith(("http://", "https://"))
        if ref.metadata.get("format") == "qdrant-collection-snapshot":
            if not is_server:
                raise ValueError("a Qdrant server snapshot can only be restored to a server URL")
            manifest = {**ref.metadata["manifest"], "name": name}
            if isinstance(embedder, str):
                embedder = make_embedder(embedder)
            embedder = check_embedder(manifest, embedder)
            backend = ClientBackend.connect(location, name, manifest["dim"], search_settings(manifest), api_key=api_key)
            backend.upload_snapshot(source)
            backend.set_metadata({METADATA_KEY: manifest})
            backend.close()
            return cls.open(location, name, embedder, api_key=api_key)

        manifest = json.loads((source / MANIFEST_FILE).read_text())
        if isinstance(embedder, str):
            embedder = make_embedder(embedder)
        embedder = check_embedder(manifest, embedder)
        if location != ":memory:" and not is_server:
            target = Path(location) / name
            if target.exists() and any(target.iterdir()):
                if not overwrite:
                    raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
                shutil.rmtree(target)
            shutil.copytree(source, target, dirs_exist_ok=True)
            write_json(target / MANIFEST_FILE, {**manifest, "name": name})
            return cls.open(location, name, embedder)

        # Into ":memory:" or a server: open a scratch copy (opening an engine writes to its directory).
        with tempfile.TemporaryDirectory(prefix="bank-restore-") as scratch:
            copy = Path(scratch) / "bank"
            shutil.copytree(source, copy)
            src_backend = dir_backend(copy, manifest, create=False)
            try:
                bank = cls.open(
                    location,
                    name,
                    embedder,
                    min_reward=float(manifest["min_reward"]),
                    search=search_settings(manifest),
                    api_key=api_key,
                )
                copy_points(src_backend, bank._backend)
                bank._count = bank._backend.count()
            finally:
                src_backend.close()
        return bank
