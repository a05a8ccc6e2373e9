"""The eviction cascade: the room a level has or can make (``available``: free slots, DROPPABLE
pages, and HELD ones as far as the levels below take them), making it by moving its victims down
the levels (the newest as far as the levels below have room) and dropping what the last level
evicts, and the one place pages leave storage for good (``drop``, ``lose``).

Storage reports what it did in one direction: to the page-drop listener (the reuse tree, which
tells KV-cache event subscribers in plain values), once per dropped page and once per batch of
moved pages, after the move; the listener never calls back into storage while being told.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .._common import CacheLevel, CacheTier, PoolGroupIndex
from .._exceptions import OutOfPagesError
from .._page import Page, PoolGroupStorage
from .._typed import TypedList
from ._copy_engine import CopyEngine
from ._expiry import ExpiryQueue
from ._persist import PersistentDisk
from ._persistence import persist_pages
from ._pins import PinTable
from ._slot_allocator import pair_sorted
from ._tier_costs import TierCosts
from ._tiers._remote_tier import RemoteTier

#: Per level and pool group, how many of the asking request's own pages its evictor lists
#: (they are about to be used, so they do not count as evictable).
Excluded = list[list[int]]


class PageDropListener(ABC):
    """Told when eviction drops a page for good (the reuse tree forgets it), and when pages move
    between tiers (the tree reports them to KV-cache event subscribers)."""

    @abstractmethod
    def page_dropped(self, page: Page) -> None:
        """``page`` is about to be freed (or was lost): forget every reference to it."""

    def page_moved(self, page: Page, source_level: CacheLevel) -> None:
        """``page`` now lives at ``page.level`` (it was at ``source_level``); the default does nothing."""

    def pages_moved(self, pages: list[Page], source_level: CacheLevel) -> None:
        """Published ``pages`` moved from ``source_level`` to their ``level`` (after the copy), in order."""
        for page in pages:
            self.page_moved(page, source_level)


class EvictionCascade:
    """The room each level has or can make (``available``, ``capacity``) and making it:
    ``make_room`` takes the evictor's victims lowest priority first; above the last level they
    move one level down (which may push that level's victims further), at the last level reusable
    pages are dropped (the listener is told first). HELD pages only ever move, so an allocation
    that would need to drop one is refused by the planning arithmetic (``available``) before
    anything moves. The ``StorageManager`` holds it (``cascade``) and plans requests with it."""

    def __init__(
        self,
        levels: TypedList[CacheLevel, TypedList[PoolGroupIndex, PoolGroupStorage]],
        copier: CopyEngine,
        expiries: ExpiryQueue,
        pins: PinTable,
        persist: PersistentDisk | None,
        persist_level: int,
        tokens_per_block: int,
    ) -> None:
        #: the storage of every level and pool group (the manager's)
        self.levels = levels
        self.copier = copier
        #: retained pages' expiry times, consulted before each eviction
        self.expiries = expiries
        #: pinned prefixes, whose pages are in no evictor
        self.pins = pins
        #: the persistent disk tier's files and level (``persist_pages``), else None and -1
        self.persist = persist
        self.persist_level = persist_level
        self.tokens_per_block = tokens_per_block
        #: told of the pages dropped and moved (the reuse tree; ``StorageManager.drop_listener``)
        self.drop_listener: PageDropListener | None = None
        #: the remote tier below the last level (``attach_remote``): reusable full-block pages dropped
        #: for good are written there
        self.remote_tier: RemoteTier | None = None
        #: the levels' links (reads, queued writes, write admission); None until the manager sets them
        self.costs: TierCosts | None = None

    # ------------------------------------------------------------------ room
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

    def persist_pages(self, pages: list[Page]) -> None:
        """Record the persistent disk tier's reusable full-block pages among ``pages`` (their bytes
        are in place): a manager opening the directory after this one adopts them."""
        persist = self.persist
        assert persist is not None
        persist_pages(persist, self.persist_level, self.tokens_per_block, pages, self.expiries.carried)

    # ------------------------------------------------------------------ eviction
    def make_room(self, storage: PoolGroupStorage, count: int, reserve: int = 0) -> None:
        """Evict (lowest priority, least recently used first) until ``count`` slots are free.
        ``reserve``: pages the caller places in the levels below afterwards (room kept for them)."""
        allocator = storage.allocator
        if allocator.num_free >= count:
            return
        self.expiries.expire()  # expired retention first: those pages go at their base priority
        self.pins.expire()
        if storage.is_last:
            evictor = storage.evictor
            while allocator.num_free < count:
                for _ in range(count - allocator.num_free):  # each drop frees one slot (handed off: a parked one)
                    storage.num_evicted += 1
                    self.drop(evictor.pop_victim())
            return
        self._evict(storage, count - allocator.num_free, reserve)

    def _evict(self, storage: PoolGroupStorage, count: int, reserve: int) -> None:
        """Take ``count`` pages out of a level above the last: HELD ones and the newest reusable ones
        move down as far as the levels below have room (``capacity``, less ``reserve``), garbage
        and the oldest reusable ones beyond that are dropped. One batch of copies per level."""
        level, pool_group = storage.level, storage.index
        room = self.capacity(level + 1, pool_group) - reserve
        victims = storage.evictor.select(count, self._held_victims(storage, count, room))
        if len(victims) < count:
            for v in victims:
                v.relist()
            raise OutOfPagesError(
                f"cache level {level}, pool group {pool_group}: {count} pages must be evicted but only {len(victims)} can be "
                "(the caller's planning and the evictor disagree)"
            )
        storage.num_evicted += count
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
        self._place(movers, level + 1, pool_group)

    def _held_victims(self, storage: PoolGroupStorage, count: int, room: int) -> int:
        """How many HELD pages ``_evict`` may take out of ``storage`` (they must be written below):
        ``room``, but while the link below cannot absorb their writes (write admission) and
        ``count`` reusable victims are there to drop instead, only as many as it absorbs."""
        costs = self.costs
        evictor = storage.evictor
        if costs is None or evictor.num_held == 0 or evictor.count - evictor.num_held < count:
            return room
        absorbed = costs.admitted(int(storage.level) + 1, storage.layout.slot_bytes, count)
        return absorbed if absorbed < room else room

    def demote(self, pages: list[Page], level: int) -> None:
        """Move the reusable ``pages`` (tree pages listed in an evictor, above ``level``; distinct)
        down to ``level`` now, as eviction would (room made there by moving its victims further
        down; the oldest beyond its room one level further): per pool group, as many as the levels
        from ``level`` down can take in, in the order given (the rest stay where they are)."""
        groups: dict[int, list[Page]] = {}
        for page in pages:
            groups.setdefault(id(page.storage), []).append(page)
        for movers in groups.values():
            src = movers[0].storage
            movers = movers[: self.capacity(level, src.index)]
            for page in movers:
                src.evictor.remove(page)
            self._place(movers, level, src.index, False)

    def discard(self, pages: list[Page]) -> None:
        """Drop the reusable ``pages`` now (no request owns them; pinned ones too), as eviction
        at the last level would, without writing them to the remote tier (nobody will ask for them)."""
        for page in pages:
            if page.slot < 0:
                continue  # (freed with a page dropped before it)
            if page.pin_held:
                page.unhold_pins()
            elif page.in_evictor:
                page.storage.evictor.remove(page)
            self.drop(page, False)

    def _place(self, movers: list[Page], level: int, pool_group: int, admit: bool = True) -> None:
        """Move ``movers`` (one source storage, in no evictor, in eviction order; at most
        ``capacity(level, pool_group)`` of them) into ``level`` and below: the newest as many as ``level``
        can hold (it evicts its own victims further down first), the older rest one level
        further down. A GPU victim thus makes room in a small host tier by pushing the host's
        own victims to disk, and only the last level drops. With ``admit`` (eviction, not a
        demotion), reusable pages ``level``'s link cannot absorb are dropped (``_admit``)."""
        dst = self.levels.items[level].items[pool_group]
        take = len(movers)
        if not dst.is_last:
            take = min(take, dst.allocator.num_free + dst.evictor.count)
        rest = movers[: len(movers) - take]
        here = movers[len(movers) - take :]
        if admit and self.costs is not None:
            here = self._admit(here, dst, self.costs)
            take = len(here)
        try:
            self.make_room(dst, take, len(rest))
        except BaseException:
            for v in rest + here:  # e.g. a driver error below: they stay where they are, listed again
                v.relist()  # (not the pages ``_admit`` dropped: they are gone)
            raise
        still = [v for v in here if v.num_holds or v.node is not None]
        for v in here:
            if not v.num_holds and v.node is None:
                self.drop(v)  # became garbage while the levels below made room: not worth moving
        try:
            failed = self.relocate(still, dst)
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
            self._place([v for v in rest if v.num_holds or v.node is not None], level + 1, pool_group, admit)

    def _admit(self, pages: list[Page], dst: PoolGroupStorage, costs: TierCosts) -> list[Page]:
        """Write admission (``TierCosts.admitted``): ``pages`` (in eviction order) less the oldest
        reusable ones ``dst``'s link cannot absorb, which are dropped (counted at ``dst``); HELD
        pages always go."""
        held = sum(1 for p in pages if p.num_holds)
        ok = costs.admitted(int(dst.level), dst.layout.slot_bytes, len(pages)) - held
        declined = len(pages) - held - (ok if ok > 0 else 0)
        if declined <= 0:
            return pages
        costs.declined_pages[dst.level] += declined
        costs.declined_bytes[dst.level] += declined * dst.layout.slot_bytes
        kept: list[Page] = []
        for p in pages:
            if declined and not p.num_holds:
                declined -= 1
                self.drop(p)
            else:
                kept.append(p)
        return kept

    def relocate(self, pages: list[Page], dst: PoolGroupStorage) -> list[Page]:
        """Copy ``pages`` (one source storage, in no evictor) into new slots of ``dst`` (room made)
        and free their old slots. Returns the pages whose copy failed; they stay where they were."""
        if not pages:
            return []
        src = pages[0].storage
        slots = pair_sorted([p.slot for p in pages], dst.allocator.allocate(len(pages)))
        try:
            failed_idx = self.copier.copy(
                src.pools, dst.pools, src.layout.slot_sizes, [(p.slot, s) for p, s in zip(pages, slots)]
            )
        except BaseException:  # a driver error: the pages stay where they were
            for s in slots:
                dst.allocator.free(s)
            raise
        failed: list[Page] = []
        moved: list[Page] = []
        for i, (p, s) in enumerate(zip(pages, slots)):
            if i in failed_idx:
                dst.allocator.free(s)
                failed.append(p)
                continue
            src.allocator.free(p.slot)
            p.relocate(dst, s)
            if p.node is not None:
                moved.append(p)
        if dst.level > src.level and self.costs is not None:  # a write: queued on the link below
            self.costs.note_write(int(dst.level), (len(pages) - len(failed)) * src.layout.slot_bytes)
        listener = self.drop_listener
        if moved and listener is not None:
            listener.pages_moved(moved, src.level)
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
        """Free an evicted page for good; the listener forgets it first (and the eviction policy
        hears of it). With a remote tier, a reusable full block's data is
        queued for writing there first (unless ``spill`` is False)."""
        storage = page.storage
        page.dropped()
        remote = self.remote_tier
        listener = self.drop_listener
        node = page.node
        if spill and remote is not None and node is not None and not page.stored_below:
            if remote.takes_slot(page):
                key = node.key
                if listener is not None:
                    listener.page_dropped(page)
                storage.num_dropped += 1
                remote.hand_off(page, key)
                return
            remote.spill_one(page)
        if listener is not None:
            listener.page_dropped(page)
        storage.num_dropped += 1
        page.free()
