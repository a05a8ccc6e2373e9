"""A list indexed by one kind of id: ``TypedList[LayerGroupId, X]`` refuses a ``PoolGroupIndex``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=int)
V = TypeVar("V")


class TypedList(Generic[K, V]):
    """Per-id storage (per layer group, pool group, cache level...) whose index type mypy checks.

    Ids are dense from 0, so this is a list underneath; ``items`` exposes it for loops that
    need raw speed.
    """

    __slots__ = ("items",)

    def __init__(self, items: list[V]) -> None:
        self.items = items  # adopted, not copied

    def __getitem__(self, key: K) -> V:
        return self.items[key]

    def __setitem__(self, key: K, value: V) -> None:
        self.items[key] = value

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[V]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"TypedList({self.items!r})"
