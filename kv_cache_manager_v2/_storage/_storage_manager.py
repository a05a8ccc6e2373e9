"""The storage manager: the facade over every cache level x pool group that requests and the
reuse tree use. It is the eviction cascade (``_cascade.py``, on the levels of ``_levels.py``)
plus page allocation, onboarding (moving pages up), page copies, the remote tier's hand-off
(``_tiers/_remote_tier.py``), tier resizing (``_resize.py``), the persistent disk tier's
write-back and statistics (``_statistics.py``).

Requests never touch allocators or evictors directly: they ask ``fits`` (plan), ``reserve``
(map memory; may raise, changes nothing), then ``new_pages`` / ``move_up`` (which evict as needed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import rawref

from .._common import (
    GPU_LEVEL,
    CacheLevel,
    CacheTier,
    LayerGroupId,
    Priority,
    SlotId,
    StorageStatistics,
    TierStatistics,
)
from .._config import LocalCacheTierConfig
from .._page import Page, PoolGroupStorage
from .._typed import TypedList
from ._backend import MemoryBackend
from ._cascade import EvictionCascade, PageDropListener
from ._expiry import ExpiryQueue
from ._layout import StorageLayout
from ._pins import PinTable
from ._remote._store import RemoteStore
from ._resize import TierResizer
from ._statistics import TrafficStatistics
from ._tier_costs import TierCosts
from ._tiers._remote_tier import RemoteTier

__all__ = ["PageDropListener", "StorageManager"]


class StorageManager(EvictionCascade):
    """Owns the memory of every cache level and pool group (see the module doc)."""

    def __init__(
        self,
        layout: StorageLayout,
        slots: list[list[int]],
        backend: MemoryBackend,
        tiers: Sequence[LocalCacheTierConfig],
        eviction_policy: str = "lru",
        disk_fingerprint: bytes = b"",
        tokens_per_block: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_pinned_share: float = 0.5,
    ) -> None:
        self.expiries = ExpiryQueue(clock)  # first: a clock that returns no time is refused before any memory
        super().__init__(layout, slots, backend, tiers, eviction_policy, disk_fingerprint, tokens_per_block)
        self.drop_listener = None
        self.expiries.storages = [group for level in self.levels for group in level]
        self.pins = PinTable(self.expiries.now, max_pinned_share)
        for level in self.levels:
            for group in level:
                group.pinned_share = max_pinned_share
                group.start_retention = self.expiries.start
                group.stop_retention = self.expiries.stop
        self.remote_tier = None
        gpu = self.gpu
        #: GPU storage of each layer group's pool group (the allocation hot path)
        self.lc_storage: TypedList[LayerGroupId, PoolGroupStorage] = TypedList(
            [gpu[g] for g in layout.pool_group_of_layer_group]
        )
        #: the remote store below the last level (``attach_remote``)
        self.remote: RemoteStore | None = None
        #: the remote tier's write-through queue (empty without one; the allocation path tests it)
        self._write_through: list[rawref.ref[Page]] = []
        self.resizer = TierResizer(self)
        self.stats = TrafficStatistics(self)
        #: read costs of the levels, refined by ``move_up``'s timed batches (the manager sets them)
        self.costs: TierCosts | None = None

    def attach_remote(self, remote: RemoteStore, tokens_per_block: int) -> None:
        """Write dropped pages to ``remote``. A last level below the GPU gets headroom slots, so a
        dropped page's data is sent from its slot (no copy on the scheduler's thread)."""
        self.remote = remote
        self.tokens_per_block = tokens_per_block
        tier = RemoteTier(remote, self.copier, tokens_per_block, self.num_pool_groups)
        self.remote_tier = self.stats.remote = tier
        self._write_through = tier.write_through
        level = self.num_levels - 1
        if level > 0:
            for group in self.levels.items[level]:
                tier.add_headroom(group, tier.headroom_for(group, group.num_slots))
                tier.register_slots(group)

    def write_back(self) -> int:
        """Shutdown of a manager with a persistent disk tier: move the reusable full blocks of the
        levels above it down to it (pinned ones first, then ancestors first; the tier's oldest
        pages make way), so they survive the restart too. No request may be open. Returns the
        pages moved. Unlike steady-state copies these wait for the copy stream (the CPU writes the
        files from the staging buffer and from host memory)."""
        level = self.persist_level
        t = self.tokens_per_block
        held = [p for pin in self.pins.pins.values() for p in pin.pages if p.level < level]
        moved = 0
        for g in range(self.num_pool_groups):
            disk = self.levels.items[level].items[g]
            candidates: list[Page] = []
            seen: set[int] = set()
            for upper in range(level):
                storage = self.levels.items[upper].items[g]
                for p in [q for q in held if q.storage is storage and q.pin_held] + list(storage.evictor.pages()):
                    node = p.node
                    if node is not None and len(node.tokens) == t and p.num_holds == 0 and id(p) not in seen:
                        seen.add(id(p))  # (a page of several pins)
                        candidates.append(p)
            if not candidates:
                continue
            # a pin covers its blocks from the first on, so pinned pages first keeps ancestors first
            candidates.sort(key=lambda p: (p.num_pins == 0, p.node.ordinal if p.node is not None else 0))
            room = disk.allocator.num_free + disk.evictor.count - disk.evictor.num_held
            candidates = candidates[:room]
            self.make_room(disk, len(candidates))
            by_level: dict[int, list[Page]] = {}
            for p in candidates:
                if p.node is None:
                    continue  # made garbage while room was made
                if p.in_evictor:
                    p.storage.evictor.remove(p)
                elif not p.pin_held:
                    continue  # (likewise)
                by_level.setdefault(int(p.level), []).append(p)
            for batch in by_level.values():
                failed = self._relocate(batch, disk)
                lost = {id(p) for p in failed}
                for p in batch:
                    if id(p) not in lost:
                        p.relist()
                        moved += 1
                for p in failed:
                    self.lose(p)
        return moved

    # ------------------------------------------------------------------ the remote tier's writes
    def spill(self, pages: list[Page]) -> None:
        """Queue the data of ``pages`` (reusable full blocks whose data the remote tier lacks) for
        writing to the remote tier (see ``RemoteTier.spill``); nothing without a remote tier."""
        if self.remote_tier is not None:
            self.remote_tier.spill(pages)

    def queue_write_through(self, page: Page) -> None:
        """Write-through: ``page`` was just published; its data goes to the remote tier at the next
        ``flush_write_through`` (batched: one copy-out per flush, not per block)."""
        if self.remote_tier is not None:
            self.remote_tier.queue_write_through(page)

    def flush_write_through(self) -> None:
        """Copy out the published pages queued by ``queue_write_through`` that still exist."""
        if self.remote_tier is not None:
            self.remote_tier.flush_write_through()

    # ------------------------------------------------------------------ allocation and moves
    def new_pages(
        self, layer_group: LayerGroupId, priorities: list[Priority], locked: bool, prev: Page | None = None
    ) -> list[Page]:
        """One new GPU page of layer group ``layer_group`` per priority, evicting as needed (callers
        planned); in consecutive slots where there is room, right after ``prev``'s (the request's
        previous block) when that slot is free. The last one becomes the request's tail (the free
        slot after it goes to others last), but in a pool group of states (they do not grow)."""
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.lc_storage[layer_group]
        self.make_room(storage, len(priorities))
        after = prev.slot if prev is not None and prev.storage is storage else -1
        slots = storage.allocator.allocate(len(priorities), after, not storage.layout.holds_states)
        return [Page(storage, slot, layer_group, prio, locked) for slot, prio in zip(slots, priorities)]

    def new_page(self, layer_group: LayerGroupId, priority: Priority, locked: bool, prev: Page | None = None) -> Page:
        """``new_pages`` for one page."""
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.lc_storage[layer_group]
        self.make_room(storage, 1)
        after = prev.slot if prev is not None and prev.storage is storage else -1
        return Page(storage, storage.allocator.allocate_one(after), layer_group, priority, locked)

    def new_pages_at(self, level: CacheLevel, layer_group: LayerGroupId, priorities: list[Priority]) -> list[Page]:
        """One new page of layer group ``layer_group`` per priority at ``level``, evicting as needed
        (callers planned: ``levels_with_room``). The pages are HELD by the caller and in no evictor
        (a page below the GPU is never locked): ``release(False)`` lists them."""
        if level == GPU_LEVEL:
            return self.new_pages(layer_group, priorities, False)
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.levels[level][self.layout.pool_group_of_layer_group[layer_group]]
        self.make_room(storage, len(priorities))
        slots = storage.allocator.allocate(len(priorities))
        return [Page(storage, slot, layer_group, prio, False) for slot, prio in zip(slots, priorities)]

    def new_scratch_slots(self, layer_group: LayerGroupId, count: int) -> list[SlotId]:
        """``count`` GPU slots of ``layer_group``'s pool group owned by a request as scratch (no pages)."""
        storage = self.lc_storage[layer_group]
        self.make_room(storage, count)
        return storage.allocator.allocate(count)

    def free_scratch_slots(self, layer_group: LayerGroupId, slots: list[SlotId]) -> None:
        allocator = self.lc_storage[layer_group].allocator
        for slot in slots:
            allocator.free(slot)

    def move_up(self, pages: list[Page], target: CacheLevel) -> list[Page]:
        """Bring ``pages`` (each above ``target`` and in no evictor: their owner locked them) up to
        ``target``: room first, then one batch of copies per (source level, pool group).

        Returns the pages a disk read failed for: they are lost (see ``lose``). Callers planned
        (``fits``/``fits_at``) and reserved GPU memory.
        """
        counts = [0] * self.num_pool_groups
        batches: dict[tuple[int, int], list[Page]] = {}
        for p in pages:
            gi = int(p.storage.index)
            counts[gi] += 1
            where = (int(p.level), gi)
            found = batches.get(where)
            if found is None:
                batches[where] = [p]
            else:
                found.append(p)
        targets = self.levels[target]
        for g, n in enumerate(counts):
            if n:
                self.make_room(targets.items[g], n)
        lost: list[Page] = []
        costs = self.costs
        for key in sorted(batches):
            batch = batches[key]
            src = batch[0].storage
            t0 = time.perf_counter()
            failed = self._relocate(batch, targets.items[key[1]])
            if costs is not None and costs.refine and target == 0:  # (only what the CPU waits for counts)
                costs.observe(key[0], len(batch) * src.layout.slot_bytes, time.perf_counter() - t0)
            src.num_onboarded += len(batch) - len(failed)
            for p in failed:
                self.lose(p)
                lost.append(p)
        return lost

    def copy_pages(self, pairs: list[tuple[Page, Page]]) -> set[int]:
        """Copy every pool's slot data of each ``(src, dst)`` pair (same pool group; sources on
        any level), batched per (source, destination) storage. Returns the indices of pairs whose
        copy failed (a disk read or write); the data is in place on return."""
        batches: dict[tuple[int, int], list[int]] = {}
        for i, (src, dst) in enumerate(pairs):
            key = (id(src.storage), id(dst.storage))
            lst = batches.get(key)
            if lst is None:
                batches[key] = [i]
            else:
                lst.append(i)
        failed: set[int] = set()
        for idxs in batches.values():
            src_storage = pairs[idxs[0]][0].storage
            dst_storage = pairs[idxs[0]][1].storage
            bad = self.copier.copy(
                src_storage.pools,
                dst_storage.pools,
                src_storage.layout.slot_sizes,
                [(pairs[i][0].slot, pairs[i][1].slot) for i in idxs],
            )
            if src_storage.level > dst_storage.level:
                src_storage.num_onboarded += len(idxs) - len(bad)
            elif src_storage.level < dst_storage.level:  # (a snapshot placed below the GPU)
                dst_storage.num_offloaded += len(idxs) - len(bad)
                if self.costs is not None:
                    self.costs.note_write(
                        int(dst_storage.level), (len(idxs) - len(bad)) * src_storage.layout.slot_bytes
                    )
            disk = dst_storage if dst_storage.tier.tier is CacheTier.DISK else src_storage
            disk.num_io_errors += len(bad)
            failed.update(idxs[k] for k in bad)
        return failed

    # ------------------------------------------------------------------ tier sizes
    def check_resize(self, level: CacheLevel, slots: list[int]) -> None:
        """Raise ``ValueError`` if a memory pool cannot grow to ``slots`` in its reserved address space."""
        self.resizer.check_resize(level, slots)

    def resize_level(self, level: CacheLevel, slots: list[int], live: list[Page]) -> bool:
        """Give ``level`` ``slots[g]`` slots per pool group (see ``TierResizer.resize_level``)."""
        return self.resizer.resize_level(level, slots, live)

    # ------------------------------------------------------------------ accounting
    def statistics(self, level: CacheLevel) -> list[StorageStatistics]:
        self.expiries.expire()  # (retention that ran out is not counted)
        return self.stats.statistics(level)

    def utilization(self) -> float:
        """Max over GPU pool groups of unavailable / total slots."""
        return self.stats.utilization()

    def tier_statistics(self, level: CacheLevel) -> TierStatistics:
        """Usage and traffic of ``level`` since the manager was created."""
        return self.stats.tier_statistics(level)

    def take_iteration_stats(self) -> list[TierStatistics]:
        """Per level, the traffic since the previous call (peaks: highest usage since then); resets."""
        return self.stats.take_iteration_stats()
