"""The storage manager: every cache level x pool group (pools, slot allocator, evictor), the
availability arithmetic requests plan against, page allocation, eviction (the cascade down the
levels), onboarding (moving pages up), page copies, tier resizing and statistics.

Requests never touch allocators or evictors directly: they ask ``fits`` (plan), ``reserve``
(map memory; may raise, changes nothing), then ``new_pages`` / ``move_up`` (which evict as needed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from typing import cast

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
from .._config import DiskCacheTierConfig, LocalCacheTierConfig
from .._exceptions import OutOfPagesError
from .._typed import TypedList
from ._backend import MAX_GROWTH, MemoryBackend
from ._copy_engine import CopyEngine
from ._eviction import FrequencyEvictor, LruEvictor, UseHistory
from ._layout import StorageLayout
from ._page import Evictor, Page, PoolGroupStorage
from ._persist import PersistentDisk
from ._remote import RemoteStore
from ._tiers._base import Tier
from ._tiers._disk_tier import arm_sums, check_disk_space, slot_sums
from ._tiers._registry import local_tier

#: Per level and pool group, how many of the asking request's own pages its evictor lists
#: (they are about to be used, so they do not count as evictable).
Excluded = list[list[int]]
#: most headroom slots one pool group gets for the remote tier's writes
_MAX_HEADROOM = 4096
#: how long a tier resize waits for the remote tier's writer to finish with handed-off slots
_RESIZE_FLUSH_S = 30.0


class PageDropListener(ABC):
    """Told when eviction drops a page for good (the reuse tree forgets it), and when a page
    moves between tiers (the tree reports it to KV-cache event subscribers)."""

    @abstractmethod
    def page_dropped(self, page: Page) -> None:
        """``page`` is about to be freed (or was lost): forget every reference to it."""

    def page_moved(self, page: Page, source_level: CacheLevel) -> None:
        """``page`` now lives at ``page.level`` (it was at ``source_level``). Tier moves call this
        after the copy; the default does nothing."""


class StorageManager:
    """Owns the memory of every cache level and pool group.

    Level 0 is the GPU tier, then host, then disk, as configured. Eviction (``make_room``)
    takes the evictor's victims lowest priority first; above the last level they move one level
    down (which may push that level's victims further), at the last level reusable pages are
    dropped (the listener is told first). HELD pages only ever move, so an allocation that would
    need to drop one is refused by the planning arithmetic (``available``) before anything moves.
    """

    def __init__(
        self,
        layout: StorageLayout,
        slots: list[list[int]],
        backend: MemoryBackend,
        tiers: Sequence[LocalCacheTierConfig],
        eviction_policy: str = "lru",
        disk_fingerprint: bytes = b"",
        tokens_per_block: int = 0,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.copier = CopyEngine(backend)
        self.tiers: list[CacheTier] = [t.tier for t in tiers]
        #: the tier object of each level (``_tiers``)
        self.tier_objects: list[Tier] = []
        self.levels: TypedList[CacheLevel, TypedList[PoolGroupIndex, PoolGroupStorage]] = TypedList([])
        last = len(tiers) - 1
        #: per pool group, the use counting the frequency policy shares among the group's levels
        histories: list[UseHistory | None] = [
            UseHistory(n) if eviction_policy == "frequency" else None for n in slots[last]
        ]
        #: the persistent disk tier's files (``DiskCacheTierConfig.persistent``), and its level
        self.persist: PersistentDisk | None = None
        self.persist_level = -1
        try:
            for level, cfg in enumerate(tiers):
                if isinstance(cfg, DiskCacheTierConfig):
                    check_disk_space(cfg, layout, slots[level])
                    if cfg.persistent:
                        groups_at = [(g.slot_sizes, n) for g, n in zip(layout.pool_groups, slots[level])]
                        self.persist = PersistentDisk(cfg, disk_fingerprint, groups_at, tokens_per_block)
                        self.persist_level = level
                tier = local_tier(cfg, backend, self.persist if self.persist_level == level else None)
                self.tier_objects.append(tier)
                groups: TypedList[PoolGroupIndex, PoolGroupStorage] = TypedList([])
                self.levels.items.append(groups)
                is_last = level == last
                for g, n, history in zip(layout.pool_groups, slots[level], histories):
                    # address space for MAX_GROWTH x the tier's quota, as if this group got all of it,
                    # so any later split of a grown quota fits without moving
                    pools = tier.make_pools(g, n, max(n, MAX_GROWTH * cfg.quota // g.slot_bytes))
                    evictor: Evictor = LruEvictor() if history is None else FrequencyEvictor(history, n, parks=is_last)
                    groups.items.append(
                        PoolGroupStorage(
                            CacheLevel(level), tier, is_last, g, n, pools, evictor, history, self.copier.media
                        )
                    )
            if self.persist is not None:
                self._take_persisted()
        except BaseException:
            self.release()
            raise
        gpu = self.levels[GPU_LEVEL]
        #: GPU storage of each layer group's pool group (the allocation hot path)
        self.lc_storage: TypedList[LayerGroupId, PoolGroupStorage] = TypedList(
            [gpu[g] for g in layout.pool_group_of_layer_group]
        )
        self.drop_listener: PageDropListener | None = None
        #: the remote tier below the last level (``attach_remote``): reusable full-block pages dropped
        #: for good are written there
        self.remote: RemoteStore | None = None
        self.tokens_per_block = tokens_per_block
        #: write-through pages published since the last ``flush_write_through``
        self._write_through: list[rawref.ref[Page]] = []
        #: cumulative counters at the last ``take_iteration_stats``, per level (the remote tier last)
        self._iteration_base: list[list[int]] = [[0] * 7 for _ in range(len(tiers) + 1)]

    def attach_remote(self, remote: RemoteStore, tokens_per_block: int) -> None:
        """Write dropped pages to ``remote``. A last level below the GPU gets headroom slots, so a
        dropped page's data is sent from its slot (no copy on the scheduler's thread)."""
        self.remote = remote
        self.tokens_per_block = tokens_per_block
        level = self.num_levels - 1
        if level > 0:
            for s in self.levels.items[level]:
                self._add_headroom(s, self._headroom_for(s, s.num_slots))

    def _headroom_for(self, s: PoolGroupStorage, num_slots: int) -> int:
        """Headroom of a last-level pool group with ``num_slots`` slots: the write queue's budget
        (``max_pending_bytes``, split among pool groups), at most as many slots as it has and what
        its reserved address space takes; 0 where slots cannot be handed off."""
        remote = self.remote
        if remote is None or not s.can_hand_off():
            return 0
        h = max(1, remote.cfg.max_pending_bytes // (self.num_pool_groups * s.layout.slot_bytes))
        h = min(h, num_slots, _MAX_HEADROOM)
        for pool, size in zip(s.pools, s.layout.slot_sizes):
            h = min(h, pool.reserved_bytes // size - num_slots)
        return max(h, 0)

    def _add_headroom(self, s: PoolGroupStorage, h: int) -> None:
        """Give ``s`` (which has none) ``h`` headroom slots past its slots, all parked."""
        n = s.allocator.num_slots
        if h <= 0:
            return
        for pool, size in zip(s.pools, s.layout.slot_sizes):
            pool.ensure_mapped((n + h) * size)
        s.allocator.resize(n + h)
        s.parked = s.allocator.allocate(h)
        s.headroom = h

    def _drop_headroom(self, s: PoolGroupStorage) -> None:
        """Turn the headroom of ``s`` (none in flight) into ordinary free slots."""
        for x in s.parked:
            s.allocator.free(x)
        s.parked = []
        s.headroom = 0

    def _take_persisted(self) -> None:
        """Mark the slots of the persistent disk tier's valid records used (their pages are made by
        the manager's ``adopt_persisted``, which frees what it cannot place) and arm their checksums."""
        persist = self.persist
        assert persist is not None
        for g, found in enumerate(persist.records):
            s = self.levels.items[self.persist_level].items[g]
            s.allocator.take([SlotId(r.slot) for r in found])
            arm_sums(s.pools, [r.slot for r in found], [r.sums for r in found])

    def persist_pages(self, pages: list[Page]) -> None:
        """Record the persistent disk tier's reusable full-block pages among ``pages`` (their bytes
        are in place): a manager opening the directory after this one adopts them."""
        persist = self.persist
        assert persist is not None
        t = self.tokens_per_block
        for p in pages:
            node = p.node
            if node is None or p.level != self.persist_level or len(node.tokens) != t:
                continue  # a suspended request's private page, a partial tail, a failed copy: not persisted
            parent = node.parent
            scope = node.scope
            if parent is None or scope is None:
                continue
            raw = node.tokens
            if type(raw) is array:
                tokens = cast("array[int]", raw)
            else:
                try:
                    tokens = array("I", cast(Sequence[int], raw))
                except (TypeError, OverflowError):
                    continue  # a block of digests (bytes tokens): not persisted
            st = p.storage
            sums = slot_sums(st.pools, p.slot)
            persist.write(int(st.index), p.slot, p.layer_group, p.priority, scope, parent.key, node.key, tokens, sums)

    def write_back(self) -> int:
        """Shutdown of a manager with a persistent disk tier: move the reusable full blocks of the
        levels above it down to it (ancestors first; the tier's oldest pages make way), so they
        survive the restart too. No request may be open. Returns the pages moved."""
        level = self.persist_level
        t = self.tokens_per_block
        moved = 0
        for g in range(self.num_pool_groups):
            disk = self.levels.items[level].items[g]
            candidates: list[Page] = []
            for upper in range(level):
                for p in self.levels.items[upper].items[g].evictor.pages():
                    node = p.node
                    if node is not None and len(node.tokens) == t and p.num_holds == 0:
                        candidates.append(p)
            if not candidates:
                continue
            candidates.sort(key=lambda p: p.node.ordinal if p.node is not None else 0)
            room = disk.allocator.num_free + disk.evictor.count - disk.evictor.num_held
            candidates = candidates[:room]
            self.make_room(disk, len(candidates))
            by_level: dict[int, list[Page]] = {}
            for p in candidates:
                if p.node is not None and p.in_evictor:  # (not made garbage while room was made)
                    p.storage.evictor.remove(p)
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
    def available(self, level: int, g: int, excluded: Excluded | None = None) -> int:
        """Slots of pool group ``g`` at ``level`` that are free or can be made free: free slots,
        DROPPABLE pages (moved down or dropped), and HELD pages as far as the levels below can take
        them. ``excluded`` pages (listed per level and group) are not counted as evictable."""
        storage = self.levels.items[level].items[g]
        ev = storage.evictor
        n = storage.allocator.num_free + ev.count - ev.num_held
        held = ev.num_held
        if excluded is not None:
            held -= excluded[level][g]
        if held > 0:
            n += min(held, self.capacity(level + 1, g))
        return n

    def capacity(self, level: int, g: int) -> int:
        """How many pages of pool group ``g`` levels ``level`` and below can take in (0 past the
        last): their free slots and DROPPABLE pages. Each level keeps the newest pages it can hold
        and passes the older rest further down (``_place``), so a small level does not limit how
        much the levels below it take, and HELD pages already there may stay where they are."""
        n = 0
        for storages in self.levels.items[level:]:
            storage = storages.items[g]
            ev = storage.evictor
            n += storage.allocator.num_free + ev.count - ev.num_held
        return n

    def fits(self, need: list[int], gain: list[int], max_util: float = 1.0, excluded: Excluded | None = None) -> bool:
        """Whether every GPU pool group can provide ``need[g]`` slots, counting ``gain[g]`` slots
        the asking request releases first, without GPU utilisation exceeding ``max_util``.
        ``excluded``: the asker's own listed pages, which stop being evictable (resume). A
        utilisation limit below 1 applies to every group, even with no new slot (the resume gate)."""
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
            if max_util < 1.0 and (total - available + n) / total > max_util:
                return False
        return True

    def fits_at(self, level: int, need: list[int], excluded: Excluded) -> bool:
        """Whether every pool group at ``level`` can provide ``need[g]`` slots (prefetch)."""
        return all(n == 0 or n <= self.available(level, g, excluded) for g, n in enumerate(need))

    def reserve(self, need: list[int]) -> None:
        """Map the memory ``need[g]`` allocations may take, so they cannot fail later.

        May raise (e.g. ``CuError``); changes no allocation state.
        """
        for g, n in enumerate(need):
            if n:
                self.gpu.items[g].allocator.prepare(n)

    # ------------------------------------------------------------------ eviction
    def make_room(self, storage: PoolGroupStorage, count: int, reserve: int = 0) -> None:
        """Evict (lowest priority, least recently used first) until ``count`` slots are free.
        ``reserve``: pages the caller places in the levels below afterwards (room kept for them)."""
        allocator = storage.allocator
        if allocator.num_free >= count:
            return
        if storage.is_last:
            while allocator.num_free < count:
                storage.num_evicted += 1
                self.drop(storage.evictor.pop_victim())
            return
        self._evict(storage, count - allocator.num_free, reserve)

    def _evict(self, storage: PoolGroupStorage, n: int, reserve: int) -> None:
        """Take ``n`` pages out of a level above the last: HELD ones and the newest reusable ones
        move down as far as the levels below have room (``capacity``, less ``reserve``), garbage
        and the oldest reusable ones beyond that are dropped. One batch of copies per level."""
        level, g = storage.level, storage.index
        room = self.capacity(level + 1, g) - reserve
        victims = storage.evictor.select(n, room)
        if len(victims) < n:
            for v in victims:
                v.relist()
            raise OutOfPagesError(
                f"cache level {level}, pool group {g}: {n} pages must be evicted but only {len(victims)} can be "
                "(the caller's planning and the evictor disagree)"
            )
        storage.num_evicted += n
        spare = room - sum(1 for v in victims if v.num_holds)
        reusable = [v for v in victims if not v.num_holds and v.node is not None]
        keep = {id(v) for v in reusable[max(0, len(reusable) - spare) :]}  # the newest ones move down
        for v in victims:
            if not v.num_holds and id(v) not in keep:
                self.drop(v)
        movers = [v for v in victims if v.num_holds or (id(v) in keep and v.node is not None)]
        for v in victims:  # dropping an anchor above may have made a kept page garbage
            if id(v) in keep and v.node is None and v.slot >= 0:
                self.drop(v)
        self._place(movers, level + 1, g)

    def _place(self, movers: list[Page], level: int, g: int) -> None:
        """Move ``movers`` (one source storage, in no evictor, in eviction order; at most
        ``capacity(level, g)`` of them) into ``level`` and below: the newest as many as ``level``
        can hold (it evicts its own victims further down first), the older rest one level
        further down. A GPU victim thus makes room in a small host tier by pushing the host's
        own victims to disk, and only the last level drops."""
        dst = self.levels.items[level].items[g]
        take = len(movers)
        if not dst.is_last:
            take = min(take, dst.allocator.num_free + dst.evictor.count)
        rest = movers[: len(movers) - take]
        here = movers[len(movers) - take :]
        try:
            self.make_room(dst, take, len(rest))
        except BaseException:
            for v in movers:  # e.g. a driver error below: they stay where they are, listed again
                v.relist()
            raise
        still = [v for v in here if v.num_holds or v.node is not None]
        for v in here:
            if not v.num_holds and v.node is None:
                self.drop(v)  # became garbage while the levels below made room: not worth moving
        try:
            failed = self._relocate(still, dst)
        except BaseException:
            for v in still + rest:
                v.relist()
            raise
        dst.num_offloaded += len(still) - len(failed)
        lost = {id(p) for p in failed}
        for p in still:
            if id(p) not in lost:
                p.relist()
        for p in failed:
            self.lose(p)
        if rest:
            for v in rest:
                if not v.num_holds and v.node is None:
                    self.drop(v)  # became garbage meanwhile
            self._place([v for v in rest if v.num_holds or v.node is not None], level + 1, g)

    def _relocate(self, pages: list[Page], dst: PoolGroupStorage) -> list[Page]:
        """Copy ``pages`` (one source storage, in no evictor) into new slots of ``dst`` (room made)
        and free their old slots. Returns the pages whose copy failed; they stay where they were."""
        if not pages:
            return []
        src = pages[0].storage
        slots = dst.allocator.allocate(len(pages))
        try:
            failed_idx = self.copier.copy(
                src.pools, dst.pools, src.layout.slot_sizes, [(p.slot, s) for p, s in zip(pages, slots)]
            )
        except BaseException:  # a driver error: the pages stay where they were
            for s in slots:
                dst.allocator.free(s)
            raise
        failed: list[Page] = []
        for i, (p, s) in enumerate(zip(pages, slots)):
            if i in failed_idx:
                dst.allocator.free(s)
                failed.append(p)
                continue
            src.allocator.free(p.slot)
            p.relocate(dst, s)
            if p.node is not None and self.drop_listener is not None:
                self.drop_listener.page_moved(p, src.level)
        if dst.level == self.persist_level:
            self.persist_pages(pages)
        if failed:
            disk = dst if dst.tier.tier is CacheTier.DISK else src
            disk.num_io_errors += len(failed)
        return failed

    def lose(self, page: Page) -> None:
        """A page whose data a disk error destroyed: reusable ones are dropped (a miss), owned ones
        are marked lost (their owners drop the blocks from there on when they next resume)."""
        if page.num_locks == 0 and page.num_holds == 0:
            self.drop(page, False)  # its data is gone: nothing to write to the remote tier
            return
        listener = self.drop_listener
        if listener is not None:
            listener.page_dropped(page)
        page.storage.num_dropped += 1
        page.mark_lost()

    def any_lost(self) -> bool:
        """Whether some page lost to a disk error still has owners (suspended requests)."""
        for level in self.levels:
            for storage in level:
                if storage.num_lost:
                    return True
        return False

    def drop_all_evictable(self) -> None:
        """Drop every evictable page of every level (clearing the reusable cache; no request is open)."""
        for level in self.levels:
            for storage in level:
                ev = storage.evictor
                while ev.count > ev.num_held:
                    victims = ev.select(ev.count - ev.num_held, 0)
                    for v in victims:
                        self.drop(v)

    def drop(self, page: Page, spill: bool = True) -> None:
        """Free an evicted page for good; the listener forgets it first (and the use history
        remembers a reusable block's uses). With a remote tier, a reusable full block's data is
        queued for writing there first (unless ``spill`` is False)."""
        history = page.storage.history
        if history is not None:
            history.record(page)
        if spill and self.remote is not None and page.node is not None and not page.remote_copy:
            st = page.storage
            if (
                st.parked
                and not page.lost
                and len(page.node.tokens) == self.tokens_per_block
                and self.remote.accepts_slot()
            ):
                self._hand_off(page)
                return
            self._spill_one(page)
        listener = self.drop_listener
        if listener is not None:
            listener.page_dropped(page)
        page.storage.num_dropped += 1
        page.free()

    def _hand_off(self, page: Page) -> None:
        """Drop ``page`` and give its slot to the remote tier's writer, which sends the data from
        there (no copy here); a parked headroom slot becomes free in its place."""
        node = page.node
        remote = self.remote
        assert node is not None and remote is not None
        key = node.key
        lc = page.layer_group
        listener = self.drop_listener
        if listener is not None:
            listener.page_dropped(page)
        st = page.storage
        st.num_dropped += 1
        slot = page.hand_off()
        st.allocator.free(st.parked.pop())
        parts = st.hand_off_parts(slot)
        remote.enqueue_slot(key, lc, parts, st.layout.slot_bytes, st.parked, slot)

    # ------------------------------------------------------------------ the remote tier's writes
    def spill(self, pages: list[Page]) -> None:
        """Queue the data of ``pages`` (reusable full blocks whose data the remote tier lacks) for
        writing to the remote tier: copied out now (their slots may be reused at once), sent by the
        writer thread. Pages beyond the write queue's room are skipped and counted as dropped."""
        remote = self.remote
        if remote is None:
            return
        t = self.tokens_per_block
        groups: dict[int, list[Page]] = {}
        for p in pages:
            node = p.node
            if node is None or p.remote_copy or p.lost or len(node.tokens) != t:
                continue
            found = groups.get(id(p.storage))
            if found is None:
                groups[id(p.storage)] = [p]
            else:
                found.append(p)
        for batch in groups.values():
            src = batch[0].storage
            n = src.layout.slot_bytes
            spans: list[int] = []
            taken: list[Page] = []
            for p in batch:
                pos = remote.reserve(n)
                if pos >= 0:
                    spans.append(pos)
                    taken.append(p)
            if not taken:
                continue
            views = [remote.span(pos, n) for pos in spans]
            failed = self.copier.read_slots(src.pools, src.layout.slot_sizes, [p.slot for p in taken], views, 0)
            for i, (p, pos) in enumerate(zip(taken, spans)):
                node = p.node
                assert node is not None
                if i in failed:  # a disk read failed: the page keeps its (possibly bad) data locally
                    src.num_io_errors += 1
                    remote.enqueue(pos, n, b"", 0)
                    continue
                remote.enqueue(pos, n, node.key, p.layer_group)
                p.remote_copy = True

    def _spill_one(self, p: Page) -> None:
        """``spill`` of one page being dropped (the eviction path: kept lean, one memory copy)."""
        node = p.node
        remote = self.remote
        assert node is not None and remote is not None
        if p.lost or len(node.tokens) != self.tokens_per_block:
            return
        st = p.storage
        size = st.layout.slot_sizes[0]
        data = st.media[0].host_bytes(st.pools[0], p.slot, size) if len(st.pools) == 1 else None
        if data is None:
            self.spill([p])
            return
        pos = remote.reserve(size)
        if pos >= 0:  # host memory (or the emulated GPU): one copy into the write ring
            remote.span(pos, size)[:] = data
            remote.enqueue(pos, size, node.key, p.layer_group)
            p.remote_copy = True

    def queue_write_through(self, page: Page) -> None:
        """Write-through: ``page`` was just published; its data goes to the remote tier at the next
        ``flush_write_through`` (batched: one copy-out per flush, not per block)."""
        self._write_through.append(rawref.ref(page))
        if len(self._write_through) >= 64:
            self.flush_write_through()

    def flush_write_through(self) -> None:
        """Copy out the published pages queued by ``queue_write_through`` that still exist."""
        refs = self._write_through
        if not refs:
            return
        self._write_through = []
        pages: list[Page] = []
        for r in refs:
            p = r()
            if p is not None:
                pages.append(p)
        self.spill(pages)

    # ------------------------------------------------------------------ allocation and moves
    def new_pages(self, lc: LayerGroupId, priorities: list[Priority], locked: bool) -> list[Page]:
        """One new GPU page of layer group ``lc`` per priority, evicting as needed (callers planned)."""
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.lc_storage[lc]
        self.make_room(storage, len(priorities))
        slots = storage.allocator.allocate(len(priorities))
        return [Page(storage, slot, lc, prio, locked) for slot, prio in zip(slots, priorities)]

    def new_page(self, lc: LayerGroupId, priority: Priority, locked: bool) -> Page:
        """``new_pages`` for one page."""
        if self._write_through:
            self.flush_write_through()  # before any slot is reused
        storage = self.lc_storage[lc]
        self.make_room(storage, 1)
        return Page(storage, storage.allocator.allocate_one(), lc, priority, locked)

    def new_scratch_slots(self, lc: LayerGroupId, count: int) -> list[SlotId]:
        """``count`` GPU slots of ``lc``'s pool group owned by a request as scratch (no pages)."""
        storage = self.lc_storage[lc]
        self.make_room(storage, count)
        return storage.allocator.allocate(count)

    def free_scratch_slots(self, lc: LayerGroupId, slots: list[SlotId]) -> None:
        allocator = self.lc_storage[lc].allocator
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
        for key in sorted(batches):
            batch = batches[key]
            src = batch[0].storage
            failed = self._relocate(batch, targets.items[key[1]])
            src.num_onboarded += len(batch) - len(failed)
            for p in failed:
                self.lose(p)
                lost.append(p)
        return lost

    def copy_pages(self, pairs: list[tuple[Page, Page]]) -> set[int]:
        """Copy every pool's slot data of each ``(src, dst)`` pair (same pool group; sources on
        any level), batched per source level. Returns the indices of pairs whose source could not
        be read (disk errors); the data is in place on return."""
        by_src: dict[int, list[int]] = {}
        for i, (src, _) in enumerate(pairs):
            key = id(src.storage)
            lst = by_src.get(key)
            if lst is None:
                by_src[key] = [i]
            else:
                lst.append(i)
        failed: set[int] = set()
        for idxs in by_src.values():
            src_storage = pairs[idxs[0]][0].storage
            dst_storage = pairs[idxs[0]][1].storage
            bad = self.copier.copy(
                src_storage.pools,
                dst_storage.pools,
                src_storage.layout.slot_sizes,
                [(pairs[i][0].slot, pairs[i][1].slot) for i in idxs],
            )
            if src_storage.level != dst_storage.level:
                src_storage.num_onboarded += len(idxs) - len(bad)
            src_storage.num_io_errors += len(bad)
            failed.update(idxs[k] for k in bad)
        return failed

    # ------------------------------------------------------------------ tier sizes
    def check_resize(self, level: CacheLevel, slots: list[int]) -> None:
        """Raise ``ValueError`` if a memory pool cannot grow to ``slots`` in its reserved address space."""
        for g, n in enumerate(slots):
            storage = self.levels[level].items[g]
            for pool, size in zip(storage.pools, storage.layout.slot_sizes):
                if n * size > pool.reserved_bytes:
                    raise ValueError(
                        f"cache level {level}: pool group {g} would need {n * size} bytes in a pool whose "
                        f"reserved address space holds {pool.reserved_bytes}; a memory tier grows to at most "
                        f"{MAX_GROWTH}x its configured quota"
                    )

    def resize_level(self, level: CacheLevel, slots: list[int], live: list[Page]) -> bool:
        """Give ``level`` ``slots[g]`` slots per pool group. Shrinking evicts what no longer fits
        (cascading down; HELD pages only move) and moves pages out of the cut range. Returns False,
        changing nothing, when what must be kept cannot be placed. ``live`` lists every page
        (callers collect them; no request may be ACTIVE).
        """
        storages = self.levels[level]
        for g, n in enumerate(slots):
            s = storages.items[g]
            must_leave = s.num_used - n
            if must_leave > 0 and must_leave > self.available(level, g) - s.allocator.num_free:
                return False
        self.check_resize(level, slots)
        remote = self.remote
        headroom = [s.headroom for s in storages]
        if any(headroom):
            # the writer may still read handed-off slots: wait for it, then work without headroom
            assert remote is not None
            if not remote.flush(_RESIZE_FLUSH_S):
                return False
            for s in storages:
                self._drop_headroom(s)  # its slots are ordinary ones now: the resize moves pages out of them
        try:
            self._resize_slots(storages, slots, live)
        finally:
            for s in storages:
                if headroom[s.index]:
                    self._add_headroom(s, self._headroom_for(s, s.num_slots))
        return True

    def _resize_slots(
        self, storages: TypedList[PoolGroupIndex, PoolGroupStorage], slots: list[int], live: list[Page]
    ) -> None:
        for g, n in enumerate(slots):  # may raise (driver, disk space): nothing logical changed yet
            s = storages.items[g]
            if n > s.num_slots:
                s.tier.grow(s.pools, s.layout.slot_sizes, n)
        for g, n in enumerate(slots):
            s = storages.items[g]
            shrinking = n < s.num_slots
            if shrinking:
                self.make_room(s, s.num_slots - n)
                self._compact(s, n, live)
            s.allocator.resize(n)
            s.evictor.resize(n)
            if s.is_last and s.history is not None:
                s.history.resize(n)
            if shrinking:
                for pool, size in zip(s.pools, s.layout.slot_sizes):
                    pool.shrink(n * size)

    def _compact(self, storage: PoolGroupStorage, n: int, live: list[Page]) -> None:
        """Move the pages of ``storage`` in slots ``>= n`` to free slots below ``n``."""
        movers = [p for p in live if p.storage is storage and p.slot >= n]
        if not movers:
            return
        slots = storage.allocator.allocate_below(n, len(movers))
        try:
            failed = self.copier.copy(
                storage.pools, storage.pools, storage.layout.slot_sizes, [(p.slot, s) for p, s in zip(movers, slots)]
            )
        except BaseException:
            for s in slots:
                storage.allocator.free(s)
            raise
        for i, (p, s) in enumerate(zip(movers, slots)):
            if i in failed:
                storage.allocator.free(s)
                storage.num_io_errors += 1
                listed = p.in_evictor
                if listed:
                    storage.evictor.remove(p)
                self.lose(p)
                continue
            storage.allocator.free(p.slot)
            p.slot = s  # same storage: the evictor listing is unaffected
        if storage.level == self.persist_level:
            self.persist_pages(movers)

    # ------------------------------------------------------------------ accounting
    def statistics(self, level: CacheLevel) -> list[StorageStatistics]:
        out: list[StorageStatistics] = []
        for s in self.levels[level]:
            free = s.allocator.num_free
            avail = self.available(level, s.index)
            out.append(StorageStatistics(s.index, s.layout.slot_sizes, s.num_slots, free, avail - free))
        return out

    def utilization(self) -> float:
        """Max over GPU pool groups of unavailable / total slots."""
        return max(1.0 - self.available(0, g.index) / g.num_slots for g in self.gpu)

    def _counters(self, level: int) -> list[int]:
        """Cumulative (offloaded, onboarded, dropped) pages then bytes, and io errors, of ``level``."""
        if level == self.num_levels:
            assert self.remote is not None
            return self.remote.counters()
        out = [0] * 7
        for s in self.levels.items[level]:
            b = s.layout.slot_bytes
            for i, n in enumerate((s.num_offloaded, s.num_onboarded, s.num_dropped)):
                out[i] += n
                out[3 + i] += n * b
            out[6] += s.num_io_errors
            for access, pool in zip(s.media, s.pools):  # handed-off slots the remote writer found damaged
                out[6] += access.num_unsent(pool)
        return out

    def _bytes(self, level: int, per_group: list[int]) -> int:
        return sum(n * s.layout.slot_bytes for n, s in zip(per_group, self.levels.items[level]))

    def tier_statistics(self, level: CacheLevel) -> TierStatistics:
        """Usage and traffic of ``level`` since the manager was created."""
        if level == self.num_levels:
            return self._remote_stats(level, [0] * 7)
        return self._tier_stats(level, [0] * 7, [s.allocator.peak_used - s.headroom for s in self.levels[level]])

    def _remote_stats(self, level: CacheLevel, base: list[int]) -> TierStatistics:
        """The remote level: written (offloaded), fetched (onboarded), dropped writes, errors; usage
        is the server's business (it is shared), so it reads 0."""
        remote = self.remote
        assert remote is not None
        quota = remote.cfg.quota
        return _statistics(level, CacheTier.REMOTE, quota if quota is not None else 0, 0, 0, remote.counters(), base)

    def take_iteration_stats(self) -> list[TierStatistics]:
        """Per level, the traffic since the previous call (peaks: highest usage since then); resets."""
        out: list[TierStatistics] = []
        if self.remote is not None:
            self.flush_write_through()
        for level in range(self.num_levels):
            storages = self.levels.items[level]
            peaks = [s.allocator.iteration_peak - s.headroom for s in storages]
            out.append(self._tier_stats(CacheLevel(level), self._iteration_base[level], peaks))
            self._iteration_base[level] = self._counters(level)
            for s in storages:
                s.allocator.iteration_peak = s.allocator.num_used
        if self.remote is not None:
            level = self.num_levels
            out.append(self._remote_stats(CacheLevel(level), self._iteration_base[level]))
            self._iteration_base[level] = self.remote.counters()
        return out

    def _tier_stats(self, level: CacheLevel, base: list[int], peaks: list[int]) -> TierStatistics:
        storages = self.levels[level]
        return _statistics(
            level,
            self.tiers[level],
            self._bytes(level, [s.num_slots for s in storages]),
            self._bytes(level, [s.num_used for s in storages]),
            self._bytes(level, peaks),
            self._counters(level),
            base,
        )

    def release(self) -> None:
        for level in self.levels:
            for g in level:
                g.release()
        if self.persist is not None:
            self.persist.release()


def _statistics(
    level: CacheLevel, tier: CacheTier, total: int, used: int, peak: int, now: list[int], base: list[int]
) -> TierStatistics:
    """A level's statistics; traffic is the counters ``now`` minus ``base`` (offloaded, onboarded and
    dropped pages, the same in bytes, I/O errors)."""
    d = [now[i] - base[i] for i in range(7)]
    return TierStatistics(
        level=level,
        tier=tier,
        total_bytes=total,
        used_bytes=used,
        peak_used_bytes=peak,
        offloaded_pages=d[0],
        onboarded_pages=d[1],
        dropped_pages=d[2],
        offloaded_bytes=d[3],
        onboarded_bytes=d[4],
        dropped_bytes=d[5],
        io_errors=d[6],
    )
