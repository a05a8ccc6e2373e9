"""The storage manager: every cache level x pool group (pools, slot allocator, evictor), the
availability arithmetic requests plan against, page allocation, eviction and page copies.

Requests never touch allocators or evictors directly: they ask ``fits`` (plan), ``reserve``
(map memory; may raise, changes nothing), then ``new_pages`` (evicts as needed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .._common import (
    GPU_LEVEL,
    CacheLevel,
    LifeCycleId,
    MemAddress,
    PoolGroupIndex,
    Priority,
    SlotId,
    StorageStatistics,
)
from .._eviction import Evictor
from .._page import Page
from .._typed import TypedList
from ._backend import DevicePool, MemoryBackend
from ._layout import PoolGroupLayout, StorageLayout
from ._slot_allocator import SlotAllocator


class PoolGroupStorage:
    """The pools of one pool group at one cache level, the allocator of their shared slots, and
    the evictor of the level's evictable pages of that group."""

    __slots__ = ("allocator", "evictor", "layout", "level", "num_dropped", "pools")

    def __init__(self, level: CacheLevel, layout: PoolGroupLayout, num_slots: int, backend: MemoryBackend) -> None:
        self.level = level
        self.layout = layout
        self.pools: list[DevicePool] = [backend.reserve_pool(num_slots * size) for size in layout.slot_sizes]
        self.allocator = SlotAllocator(num_slots, self.pools, layout.slot_sizes)
        self.evictor = Evictor()
        #: pages eviction dropped for good (cumulative)
        self.num_dropped = 0

    @property
    def index(self) -> PoolGroupIndex:
        return self.layout.index

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def num_available(self) -> int:
        """Slots free now plus slots eviction can free."""
        return self.allocator.num_free + self.evictor.count

    def slot_address(self, pool: int, slot: SlotId) -> MemAddress:
        return MemAddress(self.pools[pool].base_address + slot * self.layout.slot_sizes[pool])

    def statistics(self) -> StorageStatistics:
        a = self.allocator
        return StorageStatistics(self.layout.index, self.layout.slot_sizes, a.num_slots, a.num_free, self.evictor.count)

    def release(self) -> None:
        for pool in self.pools:
            pool.release()


class PageDropListener(ABC):
    """Told when eviction drops a page for good (the reuse tree forgets it), and when a page
    moves between tiers (the tree reports it to KV-cache event subscribers)."""

    @abstractmethod
    def page_dropped(self, page: Page) -> None:
        """``page`` is about to be freed: forget every reference to it."""

    def page_moved(self, page: Page, source_level: CacheLevel) -> None:
        """``page`` now lives at ``page.level`` (it was at ``source_level``). Tier moves call this
        after the copy; the default does nothing."""


class StorageManager:
    """Owns the memory of every cache level and pool group.

    Level 0 is the GPU tier. Eviction is an operation of its own (``make_room``): it takes
    the evictor's victims lowest priority first and drops them (the listener is told first).
    """

    def __init__(self, layout: StorageLayout, gpu_slots: list[int], backend: MemoryBackend) -> None:
        self.layout = layout
        self.backend = backend
        gpu: TypedList[PoolGroupIndex, PoolGroupStorage] = TypedList(
            [PoolGroupStorage(GPU_LEVEL, g, n, backend) for g, n in zip(layout.pool_groups, gpu_slots)]
        )
        self.levels: TypedList[CacheLevel, TypedList[PoolGroupIndex, PoolGroupStorage]] = TypedList([gpu])
        #: GPU storage of each life cycle's pool group (the allocation hot path)
        self.lc_storage: TypedList[LifeCycleId, PoolGroupStorage] = TypedList(
            [gpu[g] for g in layout.life_cycle_pool_group]
        )
        self.drop_listener: PageDropListener | None = None

    @property
    def num_pool_groups(self) -> int:
        return len(self.layout.pool_groups)

    @property
    def gpu(self) -> TypedList[PoolGroupIndex, PoolGroupStorage]:
        return self.levels[GPU_LEVEL]

    # ------------------------------------------------------------------ planning
    def fits(self, need: list[int], gain: list[int], max_util: float = 1.0) -> bool:
        """Whether every GPU pool group can provide ``need[g]`` slots, counting ``gain[g]`` slots
        the asking request releases first, without GPU utilisation exceeding ``max_util``."""
        for g, n in enumerate(need):
            if n == 0:
                continue
            storage = self.gpu.items[g]
            available = storage.num_available + gain[g]
            if n > available:
                return False
            total = storage.num_slots
            if max_util < 1.0 and (total - available + n) / total > max_util:
                return False
        return True

    def reserve(self, need: list[int]) -> None:
        """Map the memory ``need[g]`` allocations may take, so they cannot fail later.

        May raise (e.g. ``CuError``); changes no allocation state.
        """
        for g, n in enumerate(need):
            if n:
                self.gpu.items[g].allocator.prepare(n)

    # ------------------------------------------------------------------ allocation
    def make_room(self, storage: PoolGroupStorage, count: int) -> None:
        """Evict (lowest priority, least recently used first) until ``count`` slots are free."""
        allocator = storage.allocator
        while allocator.num_free < count:
            self.drop(storage.evictor.pop_victim())

    def drop_all_evictable(self) -> None:
        """Drop every evictable page of every level (clearing the reusable cache)."""
        for level in self.levels:
            for storage in level:
                while storage.evictor.count:
                    self.drop(storage.evictor.pop_victim())

    def drop(self, page: Page) -> None:
        """Free an evicted page for good; the listener forgets it first."""
        listener = self.drop_listener
        if listener is not None:
            listener.page_dropped(page)
        page.storage.num_dropped += 1
        page.free()

    def new_pages(self, lc: LifeCycleId, priorities: list[Priority], locked: bool) -> list[Page]:
        """One new GPU page of life cycle ``lc`` per priority, evicting as needed (callers planned)."""
        storage = self.lc_storage[lc]
        self.make_room(storage, len(priorities))
        slots = storage.allocator.allocate(len(priorities))
        return [Page(storage, slot, lc, prio, locked) for slot, prio in zip(slots, priorities)]

    def new_scratch_slots(self, lc: LifeCycleId, count: int) -> list[SlotId]:
        """``count`` GPU slots of ``lc``'s pool group owned by a request as scratch (no pages)."""
        storage = self.lc_storage[lc]
        self.make_room(storage, count)
        return storage.allocator.allocate(count)

    def free_scratch_slots(self, lc: LifeCycleId, slots: list[SlotId]) -> None:
        allocator = self.lc_storage[lc].allocator
        for slot in slots:
            allocator.free(slot)

    def copy_pages(self, pairs: list[tuple[Page, Page]]) -> None:
        """Copy every pool's slot data of each ``(src, dst)`` pair (GPU pages of one group each).

        Waits for the whole device first (the sources may have been written by any request's
        kernels) and for the copies after, so the data is in place on return.
        """
        backend = self.backend
        backend.synchronize_device()
        for src, dst in pairs:
            storage = src.storage
            for p, size in enumerate(storage.layout.slot_sizes):
                backend.copy(storage.slot_address(p, dst.slot), storage.slot_address(p, src.slot), size, 0)
        backend.synchronize()

    # ------------------------------------------------------------------ accounting
    def statistics(self, level: CacheLevel) -> list[StorageStatistics]:
        return [g.statistics() for g in self.levels[level]]

    def utilization(self) -> float:
        """Max over GPU pool groups of unavailable / total slots."""
        return max(1.0 - g.num_available / g.num_slots for g in self.gpu)

    def release(self) -> None:
        for level in self.levels:
            for g in level:
                g.release()
