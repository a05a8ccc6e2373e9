"""Background reads of pages from the disk tier (docs/design.md, "Background loads").

``PageReads.read`` plans a read of each page (its level, slot and the checksum of every pool's
slot, taken on the scheduler's thread) and hands it to the ``BackgroundLoader``: a worker preads
the slot bytes into a buffer of its own and verifies them against those checksums, and nothing
else. ``PageReads.install`` (the scheduler's thread, from the manager's poll) places the finished
reads that are still current: the page is still at the slot read and the slot was not written
since (not moved, dropped or lost meanwhile, nor moved away and back: then the result is
discarded, and the page is wherever the manager put it), and the
target level has room. It then does what a synchronous move up does (room first, new slots
written, the old ones freed, the tree told of the move), so a page's bytes are the ones a
synchronous read gives. A read that failed, or whose bytes do not match the checksum, makes the
page lost exactly like a failed synchronous read (a reusable page is dropped: a miss; a held one
is lost: its owner recomputes from there).
"""

from __future__ import annotations

import time

from .._common import BAD_PAGE_INDEX, GPU_LEVEL, CacheLevel
from .._page import Page, PoolGroupStorage
from ._backend import FILE
from ._disk import READ_OK, DiskPool
from ._loader import BackgroundLoader, LoadJob
from ._shelf import Shelf
from ._slot_allocator import pair_sorted
from ._storage_manager import StorageManager
from ._tiers._base import file


class ReadGroup:
    """The pages one owner's reads (a prefetch by tokens, a suspended cache's ``prefetch``) have
    installed (or a prefetch's fetch placed), and its reads: placing another of its reads (or a
    prefetch's fetched values) never evicts what it brought or is bringing (they are shelved
    meanwhile: ``Shelf``, no use of them; where the target level is full of them, the read is
    discarded and its page stays below)."""

    def __init__(self) -> None:
        self.pages: list[Page] = []
        #: pages its reads installed so far
        self.num_installed = 0
        #: its reads (those settled, or no longer its own, are pruned by ``owned``)
        self.reads: list[PageRead] = []

    def owned(self) -> list[Page]:
        """The pages it brought that are still in a slot, and those its reads in flight are bringing."""
        self.pages = [page for page in self.pages if page.slot != BAD_PAGE_INDEX]
        self.reads = [job for job in self.reads if not job.settled and not job.cancelled and self in job.groups]
        return self.pages + [job.page for job in self.reads]


class PageRead(LoadJob):
    """One page's slot bytes (every pool of its group, in pool order) read from a disk level."""

    def __init__(self, page: Page, target: CacheLevel) -> None:
        super().__init__()
        src = page.storage
        self.page = page
        self.src = src
        self.slot = page.slot
        #: the level the bytes are placed in
        self.target = target
        self.files: list[DiskPool] = [file(pool) for pool in src.pools]
        self.sizes: list[int] = list(src.layout.slot_sizes)
        self.sums: list[int] = [disk.sums[page.slot] for disk in self.files]
        #: the slot's write generation in each pool (the scheduler's thread only: a write since
        #: the read was planned makes it stale, even with the page back at the same slot)
        self.generations: list[int] = [disk.generations[page.slot] for disk in self.files]
        #: owners that want it (caches, prefetches): at 0 it is cancelled
        self.wanted = 0
        #: the bytes read (None until read, or when the read failed)
        self.data: memoryview | None = None
        self.outcome = READ_OK
        self.bad_pool = -1
        #: set when installed (or discarded) on the scheduler's thread
        self.settled = False
        #: seconds the read took on its worker (it refines the level's cost: ``TierCosts``)
        self.seconds = 0.0
        #: the owners' groups: the page joins them when installed
        self.groups: list[ReadGroup] = []

    def run(self) -> None:
        t0 = time.perf_counter()
        buf = memoryview(bytearray(sum(self.sizes)))
        at = 0
        slot = self.slot
        for p, disk in enumerate(self.files):
            size = self.sizes[p]
            outcome = disk.read_checked(buf[at : at + size], slot * size, self.sums[p])
            if outcome != READ_OK:
                self.outcome = outcome
                self.bad_pool = p
                return
            at += size
        self.data = buf
        self.seconds = time.perf_counter() - t0

    def current(self) -> bool:
        """Whether the page is still at the slot read, intact and owned or reusable, and the slot
        not written since the read was planned (a page moved up and back into the same slot while
        a worker read it: the bytes read may be torn)."""
        page = self.page
        if not (
            page.storage is self.src
            and page.slot == self.slot
            and not page.lost
            and (page.num_locks > 0 or page.num_holds > 0 or page.node is not None)
        ):
            return False
        slot = self.slot
        return all(disk.generations[slot] == generation for disk, generation in zip(self.files, self.generations))


def on_disk(page: Page) -> bool:
    """Whether reading ``page`` takes a disk read (its level is a file)."""
    return page.storage.pools[0].medium == FILE


def is_disk(storage: PoolGroupStorage) -> bool:
    """Whether ``storage``'s level is a disk tier (its pools are files)."""
    return storage.pools[0].medium == FILE


class PageReads:
    """The page reads of one manager: at most one in flight per page (owners share it)."""

    def __init__(self, storage: StorageManager, loader: BackgroundLoader) -> None:
        self.storage = storage
        self.loader = loader
        #: id(page) -> its read in flight
        self.reads: dict[int, PageRead] = {}
        #: reads installed, discarded (no longer current, or no room) and failed, for tests and statistics
        self.num_installed = 0
        self.num_discarded = 0
        self.num_failed = 0

    def background_target(self, target: CacheLevel) -> CacheLevel:
        """Where a background read for ``target`` lands: the first memory level at or below
        ``target`` above the disk (a request not admitted yet takes no GPU memory when a host tier
        can hold its pages), else ``target``."""
        levels = self.storage.levels.items
        if target == GPU_LEVEL and len(levels) > 2 and levels[1].items[0].pools[0].medium != FILE:
            return CacheLevel(1)
        return target

    def read(self, pages: list[Page], target: CacheLevel, group: ReadGroup | None = None) -> list[PageRead]:
        """Start a background read of each of ``pages`` on a disk level below ``target`` (joining
        one in flight for the same page); returns the reads, each wanted once more (and by
        ``group``: the pages they install are never evicted to place another of its reads)."""
        out: list[PageRead] = []
        for page in pages:
            if page.level <= target or not on_disk(page):
                continue
            job = self.reads.get(id(page))
            if job is None or job.cancelled:
                job = PageRead(page, target)
                self.reads[id(page)] = job
                self.loader.submit(job)
            elif target < job.target:
                job.target = target
            job.wanted += 1
            if group is not None and group not in job.groups:
                job.groups.append(group)
                group.reads.append(job)
            out.append(job)
        return out

    def cancel(self, jobs: list[PageRead], group: ReadGroup | None = None) -> None:
        """The owner of ``jobs`` (and of ``group``) no longer wants them; a read nobody wants is
        cancelled (never installed). One another owner still wants is no longer the cancelled
        owner's: its page does not join ``group`` when installed, nor do ``group``'s pages stay
        where they are to make room for it."""
        for job in jobs:
            if job.settled:
                continue
            if group is not None and group in job.groups:
                job.groups.remove(group)
            job.wanted -= 1
            if job.wanted <= 0:
                job.cancelled = True
                if self.reads.get(id(job.page)) is job:
                    del self.reads[id(job.page)]

    def install(self, jobs: list[PageRead]) -> int:
        """Place the finished ``jobs`` (see the module doc); returns the pages installed."""
        storage = self.storage
        batches: dict[tuple[int, int], list[PageRead]] = {}
        costs = storage.costs
        for job in jobs:
            if self.reads.get(id(job.page)) is job:
                del self.reads[id(job.page)]
            if costs is not None and job.data is not None:  # a timed read, placed or not
                costs.observe(int(job.src.level), len(job.data), job.seconds)
            if job.cancelled or not job.current() or job.page.level <= job.target:
                job.settled = True
                self.num_discarded += 1
                continue
            if job.data is None:  # a failed or corrupt read: lost, as a failed synchronous read
                job.settled = True
                self.num_failed += 1
                job.files[job.bad_pool].count_failed_read(job.outcome)
                job.src.num_io_errors += 1
                page = job.page
                if page.num_locks == 0 and page.num_holds == 0:  # reusable: dropped (a miss)
                    if page.in_evictor:
                        page.storage.evictor.remove(page)
                    storage.lose(page)
                else:  # owned: lost, as a synchronous read that failed under its owner's lock
                    page.take(True)
                    storage.lose(page)
                    page.release(True)
                continue
            key = (int(job.target), int(job.src.index))
            batch = batches.get(key)
            if batch is None:
                batches[key] = [job]
            else:
                batch.append(job)
        placed = 0
        try:  # (settled once all are placed: placing a batch keeps the later batches' pages too, ``ReadGroup.owned``)
            for key in sorted(batches):
                placed += self._place(batches[key], storage.levels.items[key[0]].items[key[1]])
        finally:
            for batch in batches.values():
                for job in batch:
                    job.settled = True
        self.num_installed += placed
        self.num_discarded += sum(len(b) for b in batches.values()) - placed
        return placed

    def _place(self, jobs: list[PageRead], dst: PoolGroupStorage) -> int:
        """Move the pages of ``jobs`` (one pool group) into ``dst`` from their read bytes, as many
        as it has room for without evicting the pages read nor what their owners brought or are
        bringing (``ReadGroup``: shelved meanwhile, no use of them); the others stay where they are."""
        jobs = [job for job in jobs if job.current()]  # (placing an earlier batch may have dropped some)
        shelf = Shelf()
        try:
            shelf.put([job.page for job in jobs])  # out of the evictors: nothing pushes them away, no room below
            for group in _groups(jobs):
                shelf.put(group.owned())
            jobs = self._place_some(jobs, dst)
        finally:
            shelf.restore()  # (the pages placed: listed at ``dst`` as any move lists them, no use)
        for job in jobs:
            for group in job.groups:
                group.pages.append(job.page)
                group.num_installed += 1
        return len(jobs)

    def _place_some(self, jobs: list[PageRead], dst: PoolGroupStorage) -> list[PageRead]:
        """``_place`` with its pages shelved: returns the jobs placed."""
        storage = self.storage
        level, index = int(dst.level), int(dst.index)
        n = min(len(jobs), storage.available(level, index))
        if n <= 0:
            return []
        jobs = sorted(jobs, key=_slot_of)[:n]
        pages = [job.page for job in jobs]
        levels = [CacheLevel(0)] * storage.num_pool_groups
        need = [0] * storage.num_pool_groups
        levels[index] = CacheLevel(level)
        need[index] = n
        storage.reserve(need, levels)
        storage.make_room(dst, n)
        slots = pair_sorted([job.slot for job in jobs], dst.allocator.allocate(n))
        data: list[memoryview] = []
        for job in jobs:
            assert job.data is not None
            data.append(job.data)
        bad = storage.copier.write_slots(dst.pools, dst.layout.slot_sizes, slots, data)
        assert not bad, "background reads are placed in memory, where writes cannot fail"
        src_moved: dict[int, list[Page]] = {}
        for page, slot in zip(pages, slots):
            src = page.storage
            src.allocator.free(page.slot)
            src.num_onboarded += 1
            page.relocate(dst, slot)
            if page.node is not None:
                moved = src_moved.get(int(src.level))
                if moved is None:
                    src_moved[int(src.level)] = [page]
                else:
                    moved.append(page)
        listener = storage.drop_listener
        if listener is not None:
            for level, moved_pages in src_moved.items():
                listener.pages_moved(moved_pages, CacheLevel(level))
        return jobs


def _groups(jobs: list[PageRead]) -> list[ReadGroup]:
    """The owners' groups of ``jobs`` (once each)."""
    out: list[ReadGroup] = []
    for job in jobs:
        for group in job.groups:
            if group not in out:
                out.append(group)
    return out


def _slot_of(job: PageRead) -> int:
    return int(job.slot)
