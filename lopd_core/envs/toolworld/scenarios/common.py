"""What every environment's scenario templates share: `Goal`, `World`, `EnvSpec`, the people, check helpers."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Call = tuple[str, dict[str, Any]] | Callable[[Any], tuple[str, dict[str, Any]]]

PEOPLE = [
    "Maria Lopez",
    "James Chen",
    "Aisha Khan",
    "Tom Becker",
    "Sofia Rossi",
    "Noah Smith",
    "Emma Dubois",
    "Yuki Tanaka",
    "Omar Haddad",
    "Lena Novak",
    "Carlos Silva",
    "Priya Patel",
    "Ben Walker",
    "Hana Kim",
    "Ivan Petrov",
    "Grace Obi",
    "Lucas Moreau",
    "Zara Ahmed",
    "Felix Wagner",
    "Nina Berg",
]


@dataclass
class Goal:
    text: str
    calls: list[Call]
    checks: list[tuple[str, str]]  # (check item, body of check_func returning a bool)
    touches: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return len(self.calls)


class World:
    """An initial state under construction plus the entities goals have claimed."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.used: set[str] = set()

    def free(self, keys: Any) -> list[Any]:
        return [k for k in keys if k not in self.used]


def ret(expr: str) -> str:
    return f"return {expr}"


def close(a: str, b: str) -> str:
    return f"abs(({a}) - ({b})) < 0.005"


def pick(rng: random.Random, items: list[Any]) -> Any:
    return rng.choice(items) if items else None


def last_created(key: str, id_field: str) -> Callable[[Any], str]:
    """The id of the newest entry of a dict attribute whose ids look like PREFIX-<n>."""

    def get(env: Any) -> str:
        table = getattr(env, key)
        return max(table, key=lambda k: int(k.rsplit("-", 1)[1]))

    return get


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    module: str  # module under lopd_core.envs.toolworld.envs
    class_name: str
    world: Callable[[random.Random], dict[str, Any]]
    goals: tuple[Callable[[random.Random, World], Goal | None], ...]
