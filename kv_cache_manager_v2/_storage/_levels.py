"""Every cache level x pool group of one manager (pools built by each level's tier object, slot
allocator, evictor) and the availability arithmetic requests plan against.

Requests never touch allocators or evictors directly: they ask ``fits`` (plan), ``reserve``
(map memory; may raise, changes nothing), then allocate (which evicts as needed).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._common import GPU_LEVEL, CacheLevel, CacheTier, PoolGroupIndex
from .._config import LocalCacheTierConfig
from .._page import Evictor, PoolGroupStorage
from .._typed import TypedList
from ._backend import MAX_GROWTH, MemoryBackend
from ._copy_engine import CopyEngine
from ._layout import StorageLayout
from ._persist import PersistentDisk
from ._persistence import take_persisted
from ._pins import PinTable
from ._policies._make import pool_group_evictors
from ._tiers._base import Tier
from ._tiers._registry import local_tier

#: Per level and pool group, how many of the asking request's own pages its evictor lists
#: (they are about to be used, so they do not count as evictable).
Excluded = list[list[int]]


class StorageLevels:
    """The storage of every cache level and pool group: level 0 is the GPU tier, then host, then
    disk, as configured; the planning arithmetic over their free and evictable slots."""

    #: pinned prefixes, whose pages are in no evictor (set by the subclass's constructor)
    pins: PinTable

    def __init__(
        self,
        layout: StorageLayout,
        slots: list[list[int]],
        backend: MemoryBackend,
        tiers: Sequence[LocalCacheTierConfig],
        eviction_policy: str,
        disk_fingerprint: bytes,
        tokens_per_block: int,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.copier = CopyEngine(backend)
        self.tiers: list[CacheTier] = [t.tier for t in tiers]
        #: the tier object of each level (``_tiers``)
        self.tier_objects: list[Tier] = []
        self.levels: TypedList[CacheLevel, TypedList[PoolGroupIndex, PoolGroupStorage]] = TypedList([])
        self.tokens_per_block = tokens_per_block
        #: the persistent disk tier's files (``DiskCacheTierConfig.persistent``), and its level
        self.persist: PersistentDisk | None = None
        self.persist_level = -1
        #: per pool group, its evictor of each level (``eviction_policy``'s; levels may share state)
        evictors = [
            pool_group_evictors(eviction_policy, [slots[level][g] for level in range(len(tiers))])
            for g in range(len(layout.pool_groups))
        ]
        try:
            for cfg in tiers:
                self._add_level(cfg, slots, evictors, disk_fingerprint)
            for level, tier in enumerate(self.tier_objects):
                persist = tier.persistent()
                if persist is not None:  # its slots with valid records are taken
                    take_persisted(persist, self.levels.items[level])
        except BaseException:
            self.release()
            raise

    def _add_level(
        self,
        cfg: LocalCacheTierConfig,
        slots: list[list[int]],
        evictors: list[list[Evictor]],
        disk_fingerprint: bytes,
    ) -> None:
        """Build the next level's tier and pool groups (``slots[level][g]`` slots each)."""
        level = len(self.levels)
        last = len(self.tiers) - 1
        tier = local_tier(cfg, self.backend, self.layout, slots[level], disk_fingerprint, self.tokens_per_block)
        self.tier_objects.append(tier)
        persist = tier.persistent()
        if persist is not None:
            self.persist = persist
            self.persist_level = level
        groups: TypedList[PoolGroupIndex, PoolGroupStorage] = TypedList([])
        self.levels.items.append(groups)
        is_last = level == last
        for group, num_slots, group_evictors in zip(self.layout.pool_groups, slots[level], evictors):
            # address space for MAX_GROWTH x the tier's quota, as if this group got all of it, so any
            # later split of a grown quota fits without moving
            pools = tier.make_pools(group, num_slots, max(num_slots, MAX_GROWTH * cfg.quota // group.slot_bytes))
            groups.items.append(
                PoolGroupStorage(
                    CacheLevel(level), tier, is_last, group, num_slots, pools, group_evictors[level], self.copier.media
                )
            )

    @property
    def num_pool_groups(self) -> int:
        return len(self.layout.pool_groups)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def gpu(self) -> TypedList[PoolGroupIndex, PoolGroupStorage]:
        return self.levels[GPU_LEVEL]

    # ------------------------------------------------------------------ planning
    def available(self, level: int, pool_group: int, excluded: Excluded | None = None) -> int:
        """Slots of pool group ``pool_group`` at ``level`` that are free or can be made free: free slots,
        DROPPABLE pages (moved down or dropped), and HELD pages as far as the levels below can take
        them. ``excluded`` pages (listed per level and group) are not counted as evictable. Pins that
        ran out end first (their pages are evictable again), but with ``excluded``: its counter
        expired them before counting (a pin ending now could list a page it did not count)."""
        if excluded is None:
            self.pins.expire()
        storage = self.levels.items[level].items[pool_group]
        evictor = storage.evictor
        count = storage.allocator.num_free + evictor.count - evictor.num_held
        held = evictor.num_held
        if excluded is not None:
            held -= excluded[level][pool_group]
        if held > 0:
            count += min(held, self.capacity(level + 1, pool_group))
        return count

    def capacity(self, level: int, pool_group: int) -> int:
        """How many pages of pool group ``pool_group`` levels ``level`` and below can take in (0 past the
        last): their free slots and DROPPABLE pages. Each level keeps the newest pages it can hold
        and passes the older rest further down (the eviction cascade), so a small level does not
        limit how much the levels below it take, and HELD pages already there may stay where they are."""
        count = 0
        for storages in self.levels.items[level:]:
            storage = storages.items[pool_group]
            evictor = storage.evictor
            count += storage.allocator.num_free + evictor.count - evictor.num_held
        return count

    def fits(
        self,
        need: list[int],
        gain: list[int],
        max_util: float = 1.0,
        excluded: Excluded | None = None,
        floor: list[int] | None = None,
    ) -> bool:
        """Whether every GPU pool group can provide ``need[g]`` slots, counting ``gain[g]`` slots
        the asking request releases first, without GPU utilisation exceeding ``max_util``.
        ``excluded``: the asker's own listed pages, which stop being evictable (resume). A
        utilisation limit below 1 applies to every group, even with no new slot (the resume gate),
        except while the group's unavailable slots stay within ``floor[g]`` (what the
        constraints guarantee). Pins that ran out end first, but with ``excluded`` (see ``available``)."""
        if excluded is None:
            self.pins.expire()
        for g, n in enumerate(need):
            if n == 0 and max_util >= 1.0 and (excluded is None or excluded[0][g] == 0):
                continue
            storage = self.gpu.items[g]
            if excluded is None and storage.is_last:
                available = storage.allocator.num_free + storage.evictor.count + gain[g]
            else:
                available = self.available(0, g, excluded) + gain[g]
            if n > available:
                return False
            total = storage.num_slots
            used = total - available + n
            if max_util < 1.0 and used / total > max_util and (floor is None or used > floor[g]):
                return False
        return True

    def fits_at(self, level: int, need: list[int], excluded: Excluded) -> bool:
        """Whether every pool group at ``level`` can provide ``need[g]`` slots (prefetch)."""
        return all(n == 0 or n <= self.available(level, g, excluded) for g, n in enumerate(need))

    def levels_with_room(self, need: list[int], first: CacheLevel = GPU_LEVEL) -> list[CacheLevel] | None:
        """Per pool group, the first level from ``first`` down that can provide ``need[g]`` new
        slots (``available``: the cascade makes that room without dropping a HELD page), else the
        first above ``first`` that can; None when some group has no room at any level. Groups
        needing nothing get the GPU level."""
        out = [GPU_LEVEL] * len(need)
        order = list(range(first, self.num_levels)) + list(range(min(first, self.num_levels)))
        for g, n in enumerate(need):
            if n == 0:
                continue
            for level in order:
                if n <= self.available(level, g):
                    out[g] = CacheLevel(level)
                    break
            else:
                return None
        return out

    def reserve(self, need: list[int], levels: list[CacheLevel] | None = None) -> None:
        """Map the memory ``need[g]`` allocations may take (at GPU level, or at ``levels[g]``), so
        they cannot fail later.

        May raise (e.g. ``CuError``); changes no allocation state.
        """
        for g, n in enumerate(need):
            if n:
                level = GPU_LEVEL if levels is None else levels[g]
                self.levels.items[level].items[g].allocator.prepare(n)

    def any_lost(self) -> bool:
        """Whether some page lost to a disk error still has owners (suspended requests)."""
        for level in self.levels:
            for storage in level:
                if storage.num_lost:
                    return True
        return False

    def release(self) -> None:
        self.copier.streams.close()
        for level in self.levels:
            for g in level:
                g.release()
        if self.persist is not None:
            self.persist.release()
