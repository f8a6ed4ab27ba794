"""Retrieval: recall@3 against brute-force numpy inner product, and query latency, per embedded engine.

Engines: Qdrant Edge (`qdrant-edge-py`, the default for directory banks) and qdrant-client local mode
(the embedded Qdrant of qdrant-client, run in memory), driven through the bank's own backends
(`components.memory.backends`) with the bank's default `SearchSettings` and the bank's rule: exact below
20k entries; at and above, HNSW (m=16, ef_construct=100, ef=128) only if `probe_hnsw_recall` measures
recall@3 >= 0.95 on the loaded vectors, exact search otherwise ("mode"; "hnsw_probe_recall"). For Qdrant
Edge at and above 20k the other mode is measured as well on 50 queries ("hnsw_forced" / "exact_forced"),
so both figures are always reported. Every query runs as `ExperienceBank.retrieve` does,
minus the text embedding: k=3, the query's own task excluded by a filter inside the engine (3 entries per
task), ties ordered by point id.

Vectors are synthetic 384-d unit vectors, not MiniLM embeddings (embedding 100k texts on 2 CPU cores would
dominate the run and measure the model, not the engine):
- "clustered": points on a 24-dimensional Gaussian mixture (500 components) mapped into 384-d plus a little
  noise, the shape of real sentence embeddings (low intrinsic dimension, topical clusters);
- "uniform": uniformly random directions, the worst case for any graph index (no neighbourhood structure).
Queries are noisy copies of random bank entries; ground truth is numpy `X @ q` over all entries with the
query's own task masked out. Latency covers the engine call only, after a short warm-up.

    python bench/retrieval.py                                   # 10k and 100k, both engines, both distributions
    python bench/retrieval.py --sizes 10000 --queries 100 --out runs/bench/retrieval.json
Prints one JSON object.
"""

from __future__ import annotations

import os

# One BLAS thread: queries run one at a time, and two cores are shared with the engines' own threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

# This checkout's `components`, not whichever one the virtualenv's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.memory import TIE_MARGIN
from components.memory.backends import (
    Backend,
    ClientBackend,
    EdgeBackend,
    SearchSettings,
    edge_available,
    probe_hnsw_recall,
)

DIM = 384
K = 3
PER_TASK = 3


def make_vectors(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        x = rng.standard_normal((n, DIM))
    else:
        latent_dim, n_clusters = 24, 500
        centres = rng.standard_normal((n_clusters, latent_dim))
        z = centres[rng.integers(0, n_clusters, n)] + 0.5 * rng.standard_normal((n, latent_dim))
        basis = np.linalg.qr(rng.standard_normal((DIM, latent_dim)))[0]
        x = z @ basis.T + 0.02 * rng.standard_normal((n, DIM))
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def make_queries(x: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    src = rng.integers(0, len(x), n)
    q = x[src] + (0.3 / np.sqrt(DIM)) * rng.standard_normal((n, DIM)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True), src // PER_TASK  # vectors, own task index


def point_id(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def load(backend: Backend, x: np.ndarray, batch: int = 2000) -> float:
    start = time.perf_counter()
    for lo in range(0, len(x), batch):
        idx = range(lo, min(lo + batch, len(x)))
        payloads = [{"task_id": f"t{i // PER_TASK}", "split": "train", "bank_version": 1} for i in idx]
        backend.insert([point_id(i) for i in idx], x[lo : lo + batch], payloads)
    backend.optimize()  # as the bank does at the end of an `add`: Edge builds its HNSW here
    return time.perf_counter() - start


def run_queries(
    backend: Backend, x: np.ndarray, q: np.ndarray, own: np.ndarray, exact: bool, warmup: int = 5
) -> dict[str, float]:
    uuid_index = {point_id(i): i for i in range(len(x))}
    for v, t in zip(q[:warmup], own[:warmup], strict=True):
        backend.search(v, K + TIE_MARGIN, f"t{t}", exact)
    latencies, found = [], 0
    for v, t in zip(q, own, strict=True):
        start = time.perf_counter()
        hits = backend.search(v, K + TIE_MARGIN, f"t{t}", exact)
        latencies.append(time.perf_counter() - start)
        hits.sort(key=lambda h: (-round(h.score, 6), h.point_id))
        got = [uuid_index[h.point_id] for h in hits[:K]]
        scores = x @ v
        scores[t * PER_TASK : (t + 1) * PER_TASK] = -np.inf  # the own task's entries are excluded
        kth = np.partition(-scores, K - 1)[K - 1] * -1
        assert all(i // PER_TASK != t for i in got), "self-retrieval leaked"
        found += sum(scores[i] >= kth - 1e-5 for i in got)
    ms = sorted(1000 * s for s in latencies)
    return {
        "recall_at_3": round(found / (K * len(q)), 4),
        "p50_ms": round(statistics.median(ms), 3),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 3),
        "queries": len(q),
    }


def numpy_reference(x: np.ndarray, q: np.ndarray, own: np.ndarray) -> dict[str, float]:
    """Brute force in numpy: the ground truth's own cost (what an exact flat index pays)."""
    latencies = []
    for v, t in zip(q, own, strict=True):
        start = time.perf_counter()
        scores = x @ v
        scores[t * PER_TASK : (t + 1) * PER_TASK] = -np.inf
        np.argpartition(-scores, K)[:K]
        latencies.append(time.perf_counter() - start)
    ms = sorted(1000 * s for s in latencies)
    return {"p50_ms": round(statistics.median(ms), 3), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 3)}


def bench_engine(engine: str, x: np.ndarray, q: np.ndarray, own: np.ndarray, settings: SearchSettings) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{engine}-"))
    try:
        if engine == "qdrant-edge":
            backend: Backend = EdgeBackend(workdir / "edge", DIM, settings, create=True)
        else:
            # In memory: a directory would add sqlite writes per point to the ingest time, not to queries.
            backend = ClientBackend.connect(":memory:", "bench", DIM, settings)
        ingest_s = load(backend, x)
        result: dict = {"ingest_and_index_s": round(ingest_s, 1)}
        recall = None
        if len(x) >= settings.exact_below and backend.approximate:  # as ExperienceBank._exact decides
            start = time.perf_counter()
            recall = probe_hnsw_recall(backend, settings, K)
            result |= {"hnsw_probe_recall": round(recall, 4), "probe_s": round(time.perf_counter() - start, 1)}
        exact = settings.use_exact(len(x), recall)
        result["mode"] = "exact" if exact or not backend.approximate else "hnsw"  # local mode is always exact
        result |= run_queries(backend, x, q, own, exact)
        if recall is not None:
            result["exact_forced" if not exact else "hnsw_forced"] = run_queries(
                backend, x, q[:50], own[:50], exact=not exact
            )
        backend.close()
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dists", nargs="+", default=["clustered", "uniform"], choices=["clustered", "uniform"])
    parser.add_argument("--engines", nargs="+", default=["qdrant-edge", "qdrant-local"])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--local-queries", type=int, default=30, help="qdrant-local filters in Python: slow")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    settings = SearchSettings()
    engines = [e for e in args.engines if e != "qdrant-edge" or edge_available()]
    report: dict = {
        "bench": "retrieval",
        "dim": DIM,
        "k": K,
        "entries_per_task": PER_TASK,
        "search_settings": settings.to_dict(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "results": [],
    }
    for dist in args.dists:
        for n in args.sizes:
            x = make_vectors(dist, n, args.seed)
            q, own = make_queries(x, args.queries, args.seed)
            row: dict = {"dist": dist, "entries": n, "numpy_bruteforce": numpy_reference(x, q, own)}
            for engine in engines:
                nq = args.local_queries if engine == "qdrant-local" else args.queries
                row[engine] = bench_engine(engine, x, q[:nq], own[:nq], settings)
                print(json.dumps({"progress": [dist, n, engine, row[engine]]}), flush=True)
            report["results"].append(row)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
