"""The storage manager: every cache level x pool group of one manager (pools built by each
level's tier object, slot allocator, evictor), the facade requests and the reuse tree use. It
builds the levels and plans against them (``fits``, ``levels_with_room``), allocates pages,
onboards them (moving pages up), copies pages, hands dropped ones to the remote tier
(``_tiers/_remote_tier.py``) and writes the persistent disk tier back; the parts it holds move
pages down and count the room that makes (the eviction cascade, ``_cascade.py``), resize tiers
(``_resize.py``) and count traffic (``_statistics.py``).

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
    PoolGroupIndex,
    Priority,
    SlotId,
    StorageStatistics,
    TierStatistics,
)
from .._config import LocalCacheTierConfig
from .._page import Evictor, Page, PoolGroupStorage
from .._typed import TypedList
from ._backend import MAX_GROWTH, MemoryBackend
from ._cascade import EvictionCascade, Excluded, PageDropListener
from ._copy_engine import CopyEngine
from ._expiry import ExpiryQueue
from ._layout import StorageLayout
from ._persist import PersistentDisk
from ._persistence import take_persisted
from ._pins import PinTable
from ._policies._make import pool_group_evictors
from ._remote._store import RemoteStore
from ._resize import TierResizer
from ._statistics import TrafficStatistics
from ._tier_costs import TierCosts
from ._tiers._base import Tier
from ._tiers._registry import local_tier
from ._tiers._remote_tier import RemoteTier

__all__ = ["PageDropListener", "StorageManager"]


class StorageManager:
    """Owns the memory of every cache level and pool group (see the module doc): level 0 is the
    GPU tier, then host, then disk, as configured."""

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
        self.expiries.storages = [group for level in self.levels for group in level]
        self.pins = PinTable(self.expiries.now, max_pinned_share)
        for groups in self.levels:
            for group in groups:
                group.pinned_share = max_pinned_share
                group.start_retention = self.expiries.start
                group.stop_retention = self.expiries.stop
        #: moves pages down the levels and drops them (``make_room``), and counts the room it can make
        # (``self.persist``, which _add_level set: read here, mypy takes it for the None assigned above)
        persist = self.tier_objects[self.persist_level].persistent() if self.persist_level >= 0 else None
        self.cascade = EvictionCascade(
            self.levels, self.copier, self.expiries, self.pins, persist, self.persist_level, tokens_per_block
        )
        gpu = self.gpu
        #: GPU storage of each layer group's pool group (the allocation hot path)
        self.lc_storage: TypedList[LayerGroupId, PoolGroupStorage] = TypedList(
            [gpu[g] for g in layout.pool_group_of_layer_group]
        )
        #: the remote store below the last level (``attach_remote``)
        self.remote: RemoteStore | None = None
        #: the remote tier's write-through queue (empty without one; the allocation path tests it)
        self._write_through: list[rawref.ref[Page]] = []
        self.resizer = TierResizer(self.cascade)
        self.stats = TrafficStatistics(self.cascade, self.tiers)
        #: read and write costs of the levels' links, refined by ``move_up``'s timed batches (``set_costs``)
        self.costs: TierCosts | None = None

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

    def set_costs(self, costs: TierCosts) -> None:
        """The levels' links (read costs, queued writes, write admission), shared with the cascade
        and the statistics."""
        self.costs = self.cascade.costs = self.stats.costs = costs

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
                available = self.cascade.available(0, g, excluded) + gain[g]
            if n > available:
                return False
            total = storage.num_slots
            used = total - available + n
            if max_util < 1.0 and used / total > max_util and (floor is None or used > floor[g]):
                return False
        return True

    def fits_at(self, level: int, need: list[int], excluded: Excluded) -> bool:
        """Whether every pool group at ``level`` can provide ``need[g]`` slots (prefetch)."""
        return all(n == 0 or n <= self.cascade.available(level, g, excluded) for g, n in enumerate(need))

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
                if n <= self.cascade.available(level, g):
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

    # ------------------------------------------------------------------ the cascade's (see ``EvictionCascade``)
    @property
    def drop_listener(self) -> PageDropListener | None:
        """Told of the pages dropped and moved (the reuse tree)."""
        return self.cascade.drop_listener

    @drop_listener.setter
    def drop_listener(self, listener: PageDropListener | None) -> None:
        self.cascade.drop_listener = listener

    @property
    def remote_tier(self) -> RemoteTier | None:
        """The remote tier below the last level (``attach_remote``), else None."""
        return self.cascade.remote_tier

    def available(self, level: int, pool_group: int, excluded: Excluded | None = None) -> int:
        """Slots of ``pool_group`` at ``level`` that are free or can be made free (``EvictionCascade.available``)."""
        return self.cascade.available(level, pool_group, excluded)

    def make_room(self, storage: PoolGroupStorage, count: int, reserve: int = 0) -> None:
        """Evict until ``count`` slots of ``storage`` are free (``EvictionCascade.make_room``)."""
        self.cascade.make_room(storage, count, reserve)

    def demote(self, pages: list[Page], level: int) -> None:
        """Move the reusable ``pages`` down to ``level`` now (``EvictionCascade.demote``)."""
        self.cascade.demote(pages, level)

    def discard(self, pages: list[Page]) -> None:
        """Drop the reusable ``pages`` now (``EvictionCascade.discard``)."""
        self.cascade.discard(pages)

    def lose(self, page: Page) -> None:
        """A page whose data a disk error destroyed (``EvictionCascade.lose``)."""
        self.cascade.lose(page)

    def drop(self, page: Page, spill: bool = True) -> None:
        """Free an evicted page for good (``EvictionCascade.drop``)."""
        self.cascade.drop(page, spill)

    def drop_all_evictable(self) -> None:
        """Drop every evictable page of every level (``EvictionCascade.drop_all_evictable``)."""
        self.cascade.drop_all_evictable()

    def persist_pages(self, pages: list[Page]) -> None:
        """Record the persistent disk tier's pages among ``pages`` (``EvictionCascade.persist_pages``)."""
        self.cascade.persist_pages(pages)

    # ------------------------------------------------------------------ the remote tier, the persistent disk tier
    def attach_remote(self, remote: RemoteStore, tokens_per_block: int) -> None:
        """Write dropped pages to ``remote``. A last level below the GPU gets headroom slots, so a
        dropped page's data is sent from its slot (no copy on the scheduler's thread); host-memory
        pools are registered with the store (zero-copy backends read and write there)."""
        self.remote = remote
        self.tokens_per_block = self.cascade.tokens_per_block = tokens_per_block
        tier = RemoteTier(remote, self.copier, tokens_per_block, self.num_pool_groups, self.expiries)
        self.cascade.remote_tier = self.stats.remote = tier
        self._write_through = tier.write_through
        level = self.num_levels - 1
        if level > 0:
            for group in self.levels.items[level]:
                tier.add_headroom(group, tier.headroom_for(group, group.num_slots))
        for groups in self.levels.items:
            for group in groups:
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
            self.cascade.make_room(disk, len(candidates))
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
                failed = self.cascade.relocate(batch, disk)
                lost = {id(p) for p in failed}
                for p in batch:
                    if id(p) not in lost:
                        p.relist()
                        moved += 1
                for p in failed:
                    self.cascade.lose(p)
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
        self.cascade.make_room(storage, len(priorities))
        after = prev.slot if prev is not None and prev.storage is storage else -1
        slots = storage.allocator.allocate(len(priorities), after, not storage.layout.holds_states)
        return [Page(storage, slot, layer_group, prio, locked) for slot, prio in zip(slots, priorities)]

    def new_page(self, layer_group: LayerGroupId, priority: Priority, locked: bool, prev: Page | None = None) -> Page:
        """``new_pages`` for one page."""
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.lc_storage[layer_group]
        self.cascade.make_room(storage, 1)
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
        self.cascade.make_room(storage, len(priorities))
        slots = storage.allocator.allocate(len(priorities))
        return [Page(storage, slot, layer_group, prio, False) for slot, prio in zip(slots, priorities)]

    def new_scratch_slots(self, layer_group: LayerGroupId, count: int) -> list[SlotId]:
        """``count`` GPU slots of ``layer_group``'s pool group owned by a request as scratch (no pages)."""
        storage = self.lc_storage[layer_group]
        self.cascade.make_room(storage, count)
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
                self.cascade.make_room(targets.items[g], n)
        lost: list[Page] = []
        costs = self.costs
        for key in sorted(batches):
            batch = batches[key]
            src = batch[0].storage
            t0 = time.perf_counter()
            failed = self.cascade.relocate(batch, targets.items[key[1]])
            if costs is not None and costs.refine and target == 0:  # (only what the CPU waits for counts)
                costs.observe(key[0], len(batch) * src.layout.slot_bytes, time.perf_counter() - t0)
            src.num_onboarded += len(batch) - len(failed)
            for p in failed:
                self.cascade.lose(p)
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
