"""Retrieval from an `ExperienceBank`: top-k search that never returns the query's own task (`retrieve`),
exact or HNSW search by measured recall, and `Retriever`, the callable the train step consumes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from components.memory.backends import Backend, SearchSettings, probe_hnsw_recall
from components.memory.embedders import Embedder
from components.memory.records import QUERY_CACHE_SIZE, TIE_MARGIN, Experience

if TYPE_CHECKING:
    from components.memory.bank import ExperienceBank


logger = logging.getLogger(__name__)


class Retriever:
    """The callable the train step consumes: `(task, task_id) -> list[str]` of retrieved documents."""

    def __init__(
        self,
        bank: ExperienceBank,
        k: int = 3,
        allow_self_retrieval: bool = False,
        env_of: Callable[[str], str | None] | None = None,
    ) -> None:
        """`env_of` (task id -> its environment): retrieve only from the query task's own environment (LOPD's
        `retrieval_scope: environment`); a task it does not know searches the whole bank."""
        self.bank = bank
        self.k = k
        self.allow_self_retrieval = allow_self_retrieval
        self.env_of = env_of
        self._env_of: dict[str, str] = {}  # document -> environment, of every document returned so far
        if allow_self_retrieval:
            bank._warn_self_retrieval()

    def experiences(self, task: str, task_id: str) -> list[Experience]:
        env_id = self.env_of(task_id) if self.env_of is not None else None
        found = self.bank.retrieve(task, task_id, k=self.k, allow_self_retrieval=self.allow_self_retrieval,
                                   env_id=env_id)  # fmt: skip
        self._env_of.update((e.document, e.env_id) for e in found)
        return found

    def __call__(self, task: str, task_id: str) -> list[str]:
        return [e.document for e in self.experiences(task, task_id)]

    def source_env(self, document: str) -> str | None:
        """The environment of a document this retriever returned (None for any other text)."""
        return self._env_of.get(document)


class RetrievalMixin:
    """The retrieval methods of `ExperienceBank` (components.memory.bank), which provides these attributes."""

    _backend: Backend
    embedder: Embedder
    name: str
    search: SearchSettings
    _count: int
    _hnsw_recall: float | None
    _probed_count: int
    _query_cache: dict[str, np.ndarray]
    _warned_self_retrieval: bool
    _eras: tuple[int, dict[str, dict[int, int]]] | None = None  # (count, era_counts) when last read

    def _warn_self_retrieval(self) -> None:
        if not self._warned_self_retrieval:
            logger.warning(
                "bank %s: allow_self_retrieval=True lets a task retrieve its own successes (the reference "
                "code's setting); this leaks the answer to the teacher. Use it only to reproduce that code.",
                self.name,
            )
            self._warned_self_retrieval = True

    def _query_vector(self, task: str) -> np.ndarray:
        vector = self._query_cache.get(task)
        if vector is None:
            vector = self.embedder.embed_queries([task])[0]
            if len(self._query_cache) >= QUERY_CACHE_SIZE:
                self._query_cache.pop(next(iter(self._query_cache)))
            self._query_cache[task] = vector
        return vector

    def retrieve(
        self, task: str, task_id: str, k: int = 3, *, allow_self_retrieval: bool = False, env_id: str | None = None
    ) -> list[Experience]:
        """Top-k entries by inner product, best first, never from `task_id` (unless self-retrieval is allowed);
        with `env_id`, only entries of that environment."""
        if not isinstance(task_id, str) or not task_id:
            raise ValueError("retrieve needs the query's task_id (a non-empty str) to exclude its own entries")
        if allow_self_retrieval:
            self._warn_self_retrieval()
        if k <= 0:
            return []
        hits = self._backend.search(
            self._query_vector(task),
            k + TIE_MARGIN,
            exclude_task_id=None if allow_self_retrieval else task_id,
            exact=self._exact(),
            env_id=env_id,
            latest_eras=self.superseding_eras(),
        )
        # Equal scores come back in storage order, which differs between engines and after a restore:
        # order ties by point id so the same bank content always gives the same top k.
        hits.sort(key=lambda h: (-round(h.score, 6), h.point_id))
        return [Experience.from_payload(h.payload, score=h.score) for h in hits[:k]]

    def era_counts(self) -> dict[str, dict[int, int]]:
        """Entries per environment and era (read again when the bank's size changed)."""
        if self._eras is None or self._eras[0] != self._count:
            self._eras = (self._count, self._backend.era_counts())
        return self._eras[1]

    def superseding_eras(self) -> dict[str, int]:
        """Eras (docs/memory.md): environment -> its latest era, for every environment that also holds entries of an
        earlier one. Retrieval returns only that era's entries there: once a later era (`<suite>-era<n>`, a change
        of the environment's rules) has a success in an environment, that environment's older successes, which may
        carry rules it no longer has, are no longer retrieved. They stay in the bank (and its snapshots)."""
        return {env: max(eras) for env, eras in self.era_counts().items() if len(eras) > 1}

    def _exact(self) -> bool:
        """Exact search, or HNSW where it was measured to keep recall (see `SearchSettings`)."""
        settings = self.search
        if self._count < settings.exact_below or not self._backend.approximate:
            return True
        if self._hnsw_recall is None or self._count >= settings.reprobe_growth * self._probed_count:
            self._hnsw_recall = probe_hnsw_recall(self._backend, settings)
            self._probed_count = self._count
            logger.info(
                "bank %s: HNSW recall@3 %.3f on %d of its %d entries (minimum %.2f): %s search",
                self.name,
                self._hnsw_recall,
                min(settings.recall_probes, self._count),
                self._count,
                settings.min_recall,
                "exact" if self._hnsw_recall < settings.min_recall else "HNSW",
            )
        return settings.use_exact(self._count, self._hnsw_recall)

    def retriever(
        self, k: int = 3, *, allow_self_retrieval: bool = False, env_of: Callable[[str], str | None] | None = None
    ) -> Retriever:
        return Retriever(self, k=k, allow_self_retrieval=allow_self_retrieval, env_of=env_of)
