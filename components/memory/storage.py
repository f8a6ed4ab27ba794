"""Where a bank lives: its manifest (`bank.json`), its directory lock, its engine (Qdrant Edge, qdrant-client local
mode or a server) and the damaged-bank error; `ExperienceBank.open` and `restore` are built on these."""

from __future__ import annotations

import fcntl
import json
import logging
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from components.memory.backends import (
    Backend,
    ClientBackend,
    EdgeBackend,
    SearchSettings,
    edge_available,
)
from components.memory.embedders import Embedder, SentenceTransformerEmbedder, make_embedder
from components.memory.records import (
    ENGINE_DIRS,
    LOCAL_COLLECTION,
    LOCK_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    METADATA_KEY,
    TRAIN_SPLIT,
    BankDamagedError,
    BankMismatchError,
    _now,
)

if TYPE_CHECKING:
    pass


logger = logging.getLogger(__name__)


def new_manifest(
    name: str, kind: str, embedder: Embedder, min_reward: float, search: SearchSettings | None
) -> dict[str, Any]:
    if not 0.0 <= min_reward <= 1.0:
        raise ValueError(f"min_reward must lie in [0, 1], got {min_reward}")
    return {
        "format": MANIFEST_FORMAT,
        "name": name,
        "backend": kind,
        "embedder": embedder.name,
        "dim": embedder.dim,
        "query_prompt": embedder.query_prompt,
        "min_reward": min_reward,
        "split": TRAIN_SPLIT,
        "search": (search or SearchSettings()).to_dict(),
        "created": _now(),
    }


def check_embedder(manifest: dict[str, Any], embedder: Embedder | None) -> Embedder:
    if embedder is None:
        return make_embedder(manifest["embedder"], manifest.get("query_prompt"))
    if embedder.name != manifest["embedder"]:
        raise BankMismatchError(
            f"bank {manifest['name']!r} was built with embedder {manifest['embedder']!r}; "
            f"reopening it with {embedder.name!r} would mix embedding spaces"
        )
    return embedder


def open_client(
    location: str,
    name: str,
    embedder: Embedder | None,
    min_reward: float,
    search: SearchSettings | None,
    api_key: str | None,
    create: bool = True,
) -> tuple[Backend, dict[str, Any], Embedder]:
    """The engine, manifest and embedder of an in-memory bank or of a bank on a Qdrant server."""
    if location == ":memory:":
        embedder = embedder or SentenceTransformerEmbedder()
        manifest = new_manifest(name, "memory", embedder, min_reward, search)
        backend = ClientBackend.connect(location, name, manifest["dim"], search_settings(manifest))
        return backend, manifest, embedder
    # Server: the manifest lives in the collection's metadata.
    from qdrant_client import QdrantClient

    probe = QdrantClient(url=location, api_key=api_key, timeout=60)
    try:
        existing = (
            dict(probe.get_collection(name).config.metadata or {}).get(METADATA_KEY)
            if probe.collection_exists(name)
            else None
        )
    finally:
        probe.close()
    if not existing and not create:
        raise FileNotFoundError(f"no bank {name!r} on {location}")
    if existing:
        manifest = dict(existing)
        embedder = check_embedder(manifest, embedder)
    else:
        embedder = embedder or SentenceTransformerEmbedder()
        manifest = new_manifest(name, "server", embedder, min_reward, search)
    backend = ClientBackend.connect(location, name, manifest["dim"], search_settings(manifest), api_key=api_key)
    if not existing:
        backend.set_metadata({METADATA_KEY: manifest})
    return backend, manifest, embedder


def search_settings(manifest: dict[str, Any]) -> SearchSettings:
    return SearchSettings.from_dict(manifest["search"])


def lock_dir(bank_dir: Path) -> IO[str]:
    bank_dir.mkdir(parents=True, exist_ok=True)
    fh = open(bank_dir / LOCK_FILE, "a")  # noqa: SIM115 - held for the bank's lifetime
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise RuntimeError(
            f"bank directory {bank_dir} is in use by another process; embedded banks have one writer "
            "(use a Qdrant server URL for several processes)"
        ) from None
    return fh


def open_dir(
    root: Path,
    name: str,
    embedder: Embedder | None,
    min_reward: float,
    search: SearchSettings | None,
    backend: str,
) -> tuple[Backend, dict[str, Any], Embedder, Path, IO[str]]:
    """The engine, manifest, embedder, directory and held lock of a bank in `root/name/` (created when new)."""
    if backend not in ("auto", "edge", "local"):
        raise ValueError(f"backend must be 'auto', 'edge' or 'local', got {backend!r}")
    bank_dir = root / name
    lock = lock_dir(bank_dir)
    try:
        manifest_path = bank_dir / MANIFEST_FILE
        if manifest_path.exists():
            manifest = read_manifest(root, name)
            embedder = check_embedder(manifest, embedder)
            kind = manifest["backend"]
            engine_dir = bank_dir / ENGINE_DIRS.get(kind, kind)
            if kind in ENGINE_DIRS and not engine_dir.is_dir():
                raise BankDamagedError(damaged(root, name, f"{engine_dir} is missing"))
            if kind == "edge" and not edge_available():
                raise RuntimeError(f"bank {bank_dir} uses Qdrant Edge: install qdrant-edge-py")
            try:
                engine = dir_backend(bank_dir, manifest, create=False)
                engine.count()  # a damaged engine fails here, named as such
                return engine, manifest, embedder, bank_dir, lock
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise BankDamagedError(damaged(root, name, f"{engine_dir} cannot be read ({first})")) from exc
        else:
            kind = backend if backend != "auto" else ("edge" if edge_available() else "local")
            embedder = embedder or SentenceTransformerEmbedder()
            manifest = new_manifest(name, kind, embedder, min_reward, search)
            engine = dir_backend(bank_dir, manifest, create=True)
            write_json(manifest_path, manifest)
        return engine, manifest, embedder, bank_dir, lock
    except BaseException:
        lock.close()
        raise


def read_manifest(root: Path, name: str) -> dict[str, Any]:
    path = root / name / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BankDamagedError(
            damaged(root, name, f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BankDamagedError(damaged(root, name, f"{path} cannot be read ({exc})")) from None
    if not isinstance(manifest, dict):
        raise BankDamagedError(damaged(root, name, f"{path} is not a JSON object"))
    missing = [k for k in ("name", "backend", "embedder", "dim", "min_reward", "search") if k not in manifest]
    if missing:
        raise BankDamagedError(damaged(root, name, f"{path} lacks the field(s) {', '.join(missing)}"))
    return manifest


def dir_backend(bank_dir: Path, manifest: dict[str, Any], create: bool) -> Backend:
    kind = manifest["backend"]
    search = search_settings(manifest)
    if kind == "edge":
        if not edge_available():
            raise RuntimeError(f"bank {bank_dir} uses Qdrant Edge: install qdrant-edge-py")
        return EdgeBackend(bank_dir / ENGINE_DIRS["edge"], manifest["dim"], search, create=create)
    if kind == "local":
        path = str(bank_dir / ENGINE_DIRS["local"])
        return ClientBackend.connect(path, LOCAL_COLLECTION, manifest["dim"], search)
    raise ValueError(f"unknown embedded backend {kind!r} in {bank_dir / MANIFEST_FILE}")


def copy_points(source: Backend, target: Backend, batch: int = 512) -> None:
    ids: list[str] = []
    vectors: list[np.ndarray] = []
    payloads: list[dict[str, Any]] = []
    for pid, payload, vector in source.scroll(with_vectors=True):
        ids.append(pid)
        vectors.append(vector)
        payloads.append(payload)
        if len(ids) >= batch:
            target.insert(ids, np.stack(vectors), payloads)
            ids, vectors, payloads = [], [], []
    if ids:
        target.insert(ids, np.stack(vectors), payloads)
    target.optimize()


def damaged(root: Path, name: str, problem: str) -> str:
    return (
        f"bank {name!r} in {root} is damaged: {problem}. Restore it from a snapshot: lopd bank restore SNAPSHOT.json "
        f"--location {root} --name {name} --overwrite"
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def path_from_uri(uri: str) -> Path:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return Path(uri)
