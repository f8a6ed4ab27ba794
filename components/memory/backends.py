"""Storage engines behind the experience bank (`components.memory`).

Three engines share one small interface (`Backend`):

- `EdgeBackend`: Qdrant Edge (`qdrant-edge-py`), the Qdrant shard engine in-process. The default for a
  directory: real HNSW and payload indexes, filters evaluated inside the engine.
- `ClientBackend` on qdrant-client's local mode (`:memory:`, or a directory when Qdrant Edge is not
  installed): pure Python and numpy, always exact, and it evaluates filters point by point in Python
  (slow past ~10k entries; see docs/memory.md).
- `ClientBackend` on a Qdrant server (an http(s) URL): payload indexes, HNSW, the snapshot API.

Vectors are L2-normalised by the embedder and compared by inner product (Distance.DOT), as in the paper.
The bank's filters: "task_id is not X" (the self-retrieval guard), "env_id is X" (LOPD's environment scope) and
"not a superseded era" (an environment's entries older than its latest era, docs/memory.md "Eras"). They always run
inside the engine, so a query still returns k results when the filters exclude many entries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from qdrant_client import QdrantClient, models

# Payload fields with an index (server and Qdrant Edge): the ones used in filters, facets and audits.
KEYWORD_FIELDS = ("task_id", "env_id", "split", "source_run")
INTEGER_FIELDS = ("bank_version", "era")
FLOAT_FIELDS = ("reward",)
SCROLL_BATCH = 512


@dataclass(frozen=True)
class SearchSettings:
    """How the bank searches: the one place for these values. Fixed when a bank is created (its manifest
    records them); `bench/retrieval.py` measures them (figures in docs/memory.md, "Search").

    The rule: exact search below `exact_below` entries; at and above it, HNSW only where it has been
    measured on this bank's own vectors to keep recall@3 >= `min_recall`, and exact search otherwise.
    HNSW's recall depends on the data, not only on (m, ef): on embedding-like (clustered) 384-d vectors
    m=16/ef=128 gives recall@3 1.0 at 100k in 1.4-4 ms, while on uniformly random directions it gives
    0.15-0.23, and even ef=2048 only 0.85 at ~22 ms, slower than the exact scan (9-16 ms on busy cores).
    HNSW cannot promise recall 0.95 within 5 ms on such data, so the bank measures it on its own vectors
    instead (`probe_hnsw_recall`); figures and commands in docs/memory.md.
    """

    # Exact search below this many entries: the exact scan costs a few ms there (p50 1.6-6.8 ms at 10k,
    # ~3 ms at 20k, 2 busy cores), so HNSW buys little; it is also the size at which the engine builds HNSW.
    exact_below: int = 20_000
    # HNSW graph degree and build beam. Qdrant's defaults; m=16 reaches recall 1.0 on clustered data.
    hnsw_m: int = 16
    hnsw_ef_construct: int = 100
    # HNSW search beam: recall@3 1.0 on clustered 100k at p50 ~4 ms. Raising it does not rescue uniform
    # data within the latency budget (ef 512: 0.48 at ~5 ms; ef 2048: 0.85 at ~22 ms, 100k, 2 busy cores).
    # Nor does m=32/ef_construct=200 (13 min to build 100k; ef 1024: 0.93 at ~20 ms).
    hnsw_ef: int = 128
    # Qdrant's filtered-search switch to a full scan, in KB of vectors (the server's default): a segment
    # whose matching vectors are fewer (~6.6k entries at 384-d) is scanned exactly. Our only filter
    # ("task_id is not X") excludes a handful of entries, so larger segments keep HNSW for it.
    full_scan_threshold_kb: int = 10_000
    # HNSW is used only where its measured recall@3 against exact search is at least this.
    min_recall: float = 0.95
    # Stored entries used as queries (own task excluded, as `retrieve` does) to measure that recall:
    # 64 queries x 3 neighbours tell 0.9 from 1.0 reliably and cost ~0.5-1 s at 100k, once per 10% growth.
    recall_probes: int = 64
    # Re-measure once the bank has grown by this factor since the last measurement.
    reprobe_growth: float = 1.1

    def indexing_threshold_kb(self, dim: int) -> int:
        """Segment size (KB of float32 vectors) at which the engine builds HNSW: about `exact_below` entries."""
        return max(1, self.exact_below * dim * 4 // 1024)

    def use_exact(self, count: int, hnsw_recall: float | None) -> bool:
        """Exact search for a bank of `count` entries whose HNSW recall@3 was measured as `hnsw_recall`."""
        return count < self.exact_below or hnsw_recall is None or hnsw_recall < self.min_recall

    def to_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSettings:
        """Settings from a manifest; fields an older manifest lacks take today's defaults."""
        kinds = {name: type(getattr(cls, name)) for name in cls.__dataclass_fields__}
        return cls(**{k: kinds[k](v) for k, v in data.items() if k in kinds})


@dataclass
class Hit:
    point_id: str
    score: float
    payload: dict[str, Any]


class Backend(Protocol):
    kind: str  # "edge" | "local" | "memory" | "server"
    approximate: bool  # whether `search(..., exact=False)` may use HNSW (local mode is always exact)

    def existing_eras(self, ids: list[str]) -> dict[str, int]: ...  # the stored ones among ids -> their era

    def set_era(self, ids: list[str], era: int, version: int) -> None: ...  # re-verified in a later era: moved there

    def insert(self, ids: list[str], vectors: np.ndarray, payloads: list[dict[str, Any]]) -> None: ...

    def optimize(self) -> None: ...  # after a batch of inserts: build or merge indexes where the engine asks

    def search(
        self,
        vector: np.ndarray,
        k: int,
        exclude_task_id: str | None,
        exact: bool,
        env_id: str | None = None,
        latest_eras: dict[str, int] | None = None,
    ) -> list[Hit]: ...  # env_id: only entries of that environment; latest_eras: env -> the only era searched there

    def era_counts(self) -> dict[str, dict[int, int]]: ...  # env -> era -> entries (entries without an era: era 0)

    def count(self) -> int: ...

    def version_counts(self) -> dict[int, int]: ...

    def scroll(self, with_vectors: bool = False) -> Iterator[tuple[str, dict[str, Any], np.ndarray | None]]: ...

    def close(self) -> None: ...


def norm_id(point_id: Any) -> str:
    return str(uuid.UUID(str(point_id)))


def _vector_list(vector: Any) -> list[float]:
    if isinstance(vector, dict):  # named vectors: ours is the default (unnamed) one
        vector = vector.get("", next(iter(vector.values())))
    return [float(x) for x in vector]


def _with_era_zero(counts: dict[int, int], total: int) -> dict[int, int]:
    """An environment's entries per era, those without an era (a bank from before eras) counted as era 0."""
    missing = total - sum(counts.values())
    return dict(sorted({**counts, 0: counts.get(0, 0) + missing}.items())) if missing else dict(sorted(counts.items()))


def probe_hnsw_recall(backend: Backend, settings: SearchSettings, k: int = 3) -> float:
    """recall@k of the engine's HNSW search against its exact search, on this bank's own vectors.

    The first `settings.recall_probes` stored entries (in point-id order: ids are hashes, so a fixed
    pseudo-random sample) are the queries, each with its own task excluded as `retrieve` does; a hit
    counts as found when it scores at least the exact k-th score (ties count). 1.0 for an engine that
    is always exact. On a server that is still indexing in the background the figure describes the
    index as it stands (unindexed segments are searched exactly).
    """
    if not backend.approximate:
        return 1.0
    found = total = 0
    probes = backend.scroll(with_vectors=True)
    for _, (_pid, payload, vector) in zip(range(settings.recall_probes), probes, strict=False):
        own = payload.get("task_id")
        truth = backend.search(vector, k, own, exact=True)
        if not truth:
            continue
        kth = min(h.score for h in truth)
        got = backend.search(vector, k, own, exact=False)[:k]
        found += sum(h.score >= kth - 1e-5 for h in got)
        total += len(truth)
    return found / total if total else 1.0


# ---------------------------------------------------------------------------------------------------------
# Qdrant Edge
# ---------------------------------------------------------------------------------------------------------


def edge_available() -> bool:
    try:
        import qdrant_edge  # noqa: F401
    except ImportError:
        return False
    return True


class EdgeBackend:
    """One Qdrant Edge shard in a directory. Single process: the bank holds a lock file beside it."""

    kind = "edge"
    approximate = True

    def __init__(self, path: Path, dim: int, search: SearchSettings, create: bool) -> None:
        import qdrant_edge as qe

        self._qe = qe
        self.path = Path(path)
        self.search_settings = search
        if create:
            config = qe.EdgeConfig(
                vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Dot),
                hnsw_config=qe.HnswIndexConfig(
                    m=search.hnsw_m,
                    ef_construct=search.hnsw_ef_construct,
                    full_scan_threshold=search.full_scan_threshold_kb,
                ),
                optimizers=qe.EdgeOptimizersConfig(indexing_threshold=search.indexing_threshold_kb(dim)),
            )
            self.path.mkdir(parents=True, exist_ok=True)
            self.shard = qe.EdgeShard.create(str(self.path), config)
        else:
            self.shard = qe.EdgeShard.load(str(self.path))
        # Every indexed field, on a loaded shard too: a bank from before a field was indexed (`era`) gains its index.
        for names, schema in ((KEYWORD_FIELDS, qe.PayloadSchemaType.Keyword),
                              (INTEGER_FIELDS, qe.PayloadSchemaType.Integer),
                              (FLOAT_FIELDS, qe.PayloadSchemaType.Float)):  # fmt: skip
            for name in names:
                self.shard.update(qe.UpdateOperation.create_field_index(name, schema))
        self.shard.flush()

    def existing_eras(self, ids: list[str]) -> dict[str, int]:
        if not ids:
            return {}
        records = self.shard.retrieve(list(ids), with_payload=True, with_vector=False)
        return {norm_id(r.id): int((r.payload or {}).get("era", 0)) for r in records}

    def set_era(self, ids: list[str], era: int, version: int) -> None:
        self.shard.update(self._qe.UpdateOperation.set_payload(list(ids), {"era": era, "bank_version": version}))
        self.shard.flush()

    def insert(self, ids: list[str], vectors: np.ndarray, payloads: list[dict[str, Any]]) -> None:
        qe = self._qe
        rows = zip(ids, vectors, payloads, strict=True)
        points = [qe.Point(pid, vec.tolist(), payload) for pid, vec, payload in rows]
        self.shard.update(qe.UpdateOperation.upsert_points(points, update_mode=qe.UpdateMode.InsertOnly))
        self.shard.flush()

    def optimize(self) -> None:
        # Edge runs its optimizers only when asked: this builds HNSW once a segment passes the indexing
        # threshold (about `exact_below` entries) and returns at once when there is nothing to do.
        self.shard.optimize()

    def search(
        self,
        vector: np.ndarray,
        k: int,
        exclude_task_id: str | None,
        exact: bool,
        env_id: str | None = None,
        latest_eras: dict[str, int] | None = None,
    ) -> list[Hit]:
        qe = self._qe
        must = [qe.FieldCondition(key="env_id", match=qe.MatchValue(env_id))] if env_id is not None else []
        must_not: list[Any] = []
        if exclude_task_id is not None:
            must_not.append(qe.FieldCondition(key="task_id", match=qe.MatchValue(exclude_task_id)))
        for env, era in (latest_eras or {}).items():  # an entry of env from before its latest era (or without one)
            of_env = qe.FieldCondition(key="env_id", match=qe.MatchValue(env))
            must_not.append(
                qe.Filter(must=[of_env], must_not=[qe.FieldCondition(key="era", range=qe.RangeFloat(gte=era))])
            )
        flt = qe.Filter(must=must or None, must_not=must_not or None) if must or must_not else None
        params = qe.SearchParams(exact=exact, hnsw_ef=None if exact else self.search_settings.hnsw_ef)
        request = qe.QueryRequest(
            limit=k, query=qe.Query.Nearest(vector.tolist()), filter=flt, with_payload=True, params=params
        )
        return [Hit(norm_id(p.id), float(p.score), dict(p.payload or {})) for p in self.shard.query(request)]

    def count(self) -> int:
        return int(self.shard.count(self._qe.CountRequest(exact=True)))

    def version_counts(self) -> dict[int, int]:
        response = self.shard.facet(self._qe.FacetRequest(key="bank_version", limit=1_000_000, exact=True))
        return {int(h.value): int(h.count) for h in response.hits}

    def era_counts(self) -> dict[str, dict[int, int]]:
        qe = self._qe
        out = {}
        for env in self.shard.facet(qe.FacetRequest(key="env_id", limit=1_000_000, exact=True)).hits:
            of_env = qe.Filter(must=[qe.FieldCondition(key="env_id", match=qe.MatchValue(env.value))])
            hits = self.shard.facet(qe.FacetRequest(key="era", limit=1_000_000, exact=True, filter=of_env)).hits
            out[str(env.value)] = _with_era_zero({int(h.value): int(h.count) for h in hits}, int(env.count))
        return out

    def scroll(self, with_vectors: bool = False) -> Iterator[tuple[str, dict[str, Any], np.ndarray | None]]:
        offset = None
        while True:
            records, offset = self.shard.scroll(
                self._qe.ScrollRequest(offset=offset, limit=SCROLL_BATCH, with_payload=True, with_vector=with_vectors)
            )
            for r in records:
                vec = np.asarray(_vector_list(r.vector), dtype=np.float32) if with_vectors else None
                yield norm_id(r.id), dict(r.payload or {}), vec
            if offset is None:
                return

    def close(self) -> None:
        self.shard.flush()
        self.shard.close()


# ---------------------------------------------------------------------------------------------------------
# qdrant-client: local mode (":memory:" or a directory) and a server (URL)
# ---------------------------------------------------------------------------------------------------------


class ClientBackend:
    """A collection through qdrant-client: a server (`url`), or local mode (`path` or ":memory:")."""

    def __init__(
        self,
        client: QdrantClient,
        collection: str,
        kind: str,
        dim: int,
        search: SearchSettings,
        url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.client = client
        self.collection = collection
        self.kind = kind
        self.approximate = kind == "server"  # local mode is always exact
        self.search_settings = search
        self.url = url
        self.api_key = api_key
        if not client.collection_exists(collection):
            try:
                client.create_collection(
                    collection,
                    vectors_config=models.VectorParams(size=dim, distance=models.Distance.DOT),
                    hnsw_config=models.HnswConfigDiff(
                        m=search.hnsw_m,
                        ef_construct=search.hnsw_ef_construct,
                        full_scan_threshold=search.full_scan_threshold_kb,
                    ),
                    optimizers_config=models.OptimizersConfigDiff(indexing_threshold=search.indexing_threshold_kb(dim)),
                )
            except Exception:
                # Another process created it first (server); anything else surfaces on the next call.
                if not client.collection_exists(collection):
                    raise
        if kind == "server":  # local mode has no payload indexes (it warns and ignores them)
            schemas = (
                [(f, models.PayloadSchemaType.KEYWORD) for f in KEYWORD_FIELDS]
                + [(f, models.PayloadSchemaType.INTEGER) for f in INTEGER_FIELDS]
                + [(f, models.PayloadSchemaType.FLOAT) for f in FLOAT_FIELDS]
            )
            for field_name, schema in schemas:
                client.create_payload_index(collection, field_name, field_schema=schema, wait=True)

    @classmethod
    def connect(
        cls,
        location: str,
        collection: str,
        dim: int,
        search: SearchSettings,
        api_key: str | None = None,
    ) -> ClientBackend:
        if location == ":memory:":
            return cls(QdrantClient(location=":memory:"), collection, "memory", dim, search)
        if location.startswith(("http://", "https://")):
            client = QdrantClient(url=location, api_key=api_key, timeout=60)
            return cls(client, collection, "server", dim, search, url=location, api_key=api_key)
        return cls(QdrantClient(path=location), collection, "local", dim, search)

    def existing_eras(self, ids: list[str]) -> dict[str, int]:
        if not ids:
            return {}
        records = self.client.retrieve(self.collection, ids=list(ids), with_payload=["era"], with_vectors=False)
        return {norm_id(r.id): int((r.payload or {}).get("era", 0)) for r in records}

    def set_era(self, ids: list[str], era: int, version: int) -> None:
        payload = {"era": era, "bank_version": version}
        self.client.set_payload(self.collection, payload=payload, points=list(ids), wait=True)

    def insert(self, ids: list[str], vectors: np.ndarray, payloads: list[dict[str, Any]]) -> None:
        self.client.upsert(
            self.collection,
            points=models.Batch(ids=list(ids), vectors=vectors.tolist(), payloads=payloads),
            update_mode=models.UpdateMode.INSERT_ONLY,
            wait=True,
        )

    def optimize(self) -> None:
        """Nothing to do: a server indexes in the background, local mode has no index."""

    def search(
        self,
        vector: np.ndarray,
        k: int,
        exclude_task_id: str | None,
        exact: bool,
        env_id: str | None = None,
        latest_eras: dict[str, int] | None = None,
    ) -> list[Hit]:
        must = (
            [models.FieldCondition(key="env_id", match=models.MatchValue(value=env_id))] if env_id is not None else []
        )
        must_not: list[Any] = []
        if exclude_task_id is not None:
            must_not.append(models.FieldCondition(key="task_id", match=models.MatchValue(value=exclude_task_id)))
        for env, era in (latest_eras or {}).items():  # an entry of env from before its latest era (or without one)
            must_not.append(models.Filter(
                must=[models.FieldCondition(key="env_id", match=models.MatchValue(value=env))],
                must_not=[models.FieldCondition(key="era", range=models.Range(gte=era))],
            ))  # fmt: skip
        flt = models.Filter(must=must or None, must_not=must_not or None) if must or must_not else None
        params = None
        if self.kind == "server":  # local mode is always exact and warns about search params
            params = models.SearchParams(exact=exact, hnsw_ef=None if exact else self.search_settings.hnsw_ef)
        response = self.client.query_points(
            self.collection, query=vector.tolist(), limit=k, query_filter=flt, search_params=params, with_payload=True
        )
        return [Hit(norm_id(p.id), float(p.score), dict(p.payload or {})) for p in response.points]

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)

    def version_counts(self) -> dict[int, int]:
        response = self.client.facet(self.collection, key="bank_version", limit=1_000_000, exact=True)
        return {int(h.value): int(h.count) for h in response.hits}

    def era_counts(self) -> dict[str, dict[int, int]]:
        out = {}
        for env in self.client.facet(self.collection, key="env_id", limit=1_000_000, exact=True).hits:
            of_env = models.Filter(must=[models.FieldCondition(key="env_id", match=models.MatchValue(value=env.value))])
            hits = self.client.facet(self.collection, key="era", facet_filter=of_env, limit=1_000_000, exact=True).hits
            out[str(env.value)] = _with_era_zero({int(h.value): int(h.count) for h in hits}, int(env.count))
        return out

    def scroll(self, with_vectors: bool = False) -> Iterator[tuple[str, dict[str, Any], np.ndarray | None]]:
        offset = None
        while True:
            records, offset = self.client.scroll(
                self.collection, limit=SCROLL_BATCH, offset=offset, with_payload=True, with_vectors=with_vectors
            )
            for r in records:
                vec = np.asarray(_vector_list(r.vector), dtype=np.float32) if with_vectors else None
                yield norm_id(r.id), dict(r.payload or {}), vec
            if offset is None:
                return

    # Server-only helpers -------------------------------------------------------------------------------

    def get_metadata(self) -> dict[str, Any]:
        return dict(self.client.get_collection(self.collection).config.metadata or {})

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        self.client.update_collection(self.collection, metadata=metadata)

    def _headers(self) -> dict[str, str]:
        return {"api-key": self.api_key} if self.api_key else {}

    def download_snapshot(self, dest_dir: Path) -> Path:
        """Create a collection snapshot on the server (snapshot API) and download it into `dest_dir`."""
        import httpx

        description = self.client.create_snapshot(self.collection, wait=True)
        if description is None:
            raise RuntimeError(f"server did not return a snapshot description for {self.collection!r}")
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / description.name
        url = f"{self.url.rstrip('/')}/collections/{self.collection}/snapshots/{description.name}"
        with httpx.stream("GET", url, headers=self._headers(), timeout=600) as response:
            response.raise_for_status()
            with open(target, "wb") as fh:
                for chunk in response.iter_bytes():
                    fh.write(chunk)
        return target

    def upload_snapshot(self, snapshot_file: Path) -> None:
        """Recover this collection from a snapshot file on this machine (upload; the server need not see it)."""
        import httpx

        url = f"{self.url.rstrip('/')}/collections/{self.collection}/snapshots/upload"
        with open(snapshot_file, "rb") as fh:
            response = httpx.post(
                url,
                params={"priority": "snapshot", "wait": "true"},
                files={"snapshot": (snapshot_file.name, fh)},
                headers=self._headers(),
                timeout=600,
            )
        response.raise_for_status()

    def close(self) -> None:
        self.client.close()
