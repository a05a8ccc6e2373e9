"""The eviction policies, one line each: the name (``KVCacheManagerConfig.eviction_policy``), the
module in ``_storage/_policies/`` that defines it (imported when a manager uses it), the function there that
makes one pool group's evictors (``slots`` per cache level, top first -> one ``Evictor`` per
level; levels may share state, as frequency's use counting), and what it keeps first, in a few
words. Adding a policy is one module and one line here."""

from __future__ import annotations

from typing import Final

#: (name, module, function, what it keeps)
POLICIES: Final[tuple[tuple[str, str, str, str], ...]] = (
    ("lru", "_lru", "lru_evictors", "least recently released first"),
    ("frequency", "_frequency", "frequency_evictors", "lowest use rate first: use-rate GreedyDual, adaptive aging"),
    ("slru", "_slru", "slru_evictors", "segmented LRU: blocks reused since cached outlive one-off blocks"),
)

#: every policy's name, in the registry's order
EVICTION_POLICIES: Final[tuple[str, ...]] = tuple(entry[0] for entry in POLICIES)


def policy_of(name: str) -> tuple[str, str]:
    """The (module, function) of eviction policy ``name`` (ValueError: no policy has that name)."""
    for policy, module, function, _ in POLICIES:
        if policy == name:
            return module, function
    raise ValueError(f"no eviction policy {name!r}; the policies are {', '.join(EVICTION_POLICIES)}")
