"""Retention with durations: pages kept at a priority until an expiry time, then back to their
base priority (``Page.expires``, ``base_priority``, ``hint_end``), on every tier (a page keeps
these fields when it moves).

Expiry costs nothing per decode step: the manager's one ``ExpiryQueue`` (a heap of the next
expiry times) is consulted when the evictor runs (``EvictionCascade.make_room``) and before
statistics, so an expired page is treated at its base priority even while the heap still had it
in a higher class. Entries of pages that were freed, or re-retained since, are skipped when they
come up, and swept when they are most of the heap (checked every ``_SWEEP_SLACK`` entries pushed,
against the pages under retention now: a burst's entries do not outlive it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Final

from .._common import BAD_PAGE_INDEX, Priority
from .._page import GARBAGE_PRIORITY, NO_EXPIRY, NO_HINT, Page, PoolGroupStorage

#: the heap is swept of dead entries when it holds more than this many plus twice the pages under
#: retention (checked each time it grew by this many)
_SWEEP_SLACK: Final = 1024


class ExpiryQueue:
    """The manager's clock and the expiry times of retained pages (see the module)."""

    __slots__ = ("_heap", "_limit", "_seq", "clock", "num_expired", "num_retained", "storages")

    def __init__(self, clock: Callable[[], float]) -> None:
        #: seconds (``KVCacheManagerConfig.clock``)
        self.clock = clock
        #: (expiry time, -block ordinal, sequence, page): of pages expiring together the later
        #: blocks go back first, so the earlier ones are listed after them (tails evicted first)
        self._heap: list[tuple[float, int, int, Page]] = []
        self._seq = 0
        self._limit = _SWEEP_SLACK
        #: every pool group storage (their ``num_retained`` bound the live entries; set by the owner)
        self.storages: list[PoolGroupStorage] = []
        #: pages given retention so far, and retention that ran out (statistics)
        self.num_retained = 0
        self.num_expired = 0

    def now(self) -> float:
        return float(self.clock())

    def retain(
        self, page: Page, ordinal: int, priority: Priority, duration_s: float | None, hint_end: int, now: float
    ) -> None:
        """Keep ``page`` (of block ``ordinal``) at ``priority`` until ``now + duration_s`` (None: no
        expiry), then at its base priority (what it had before any retention). ``hint_end``: for
        a close-time hint, the last block of the hinted history (a request reusing the page
        that far ends the hint), else ``NO_HINT``."""
        was = page.retained
        if not was:
            page.base_priority = page.priority
        if page.priority != GARBAGE_PRIORITY and page.priority != priority:
            page.set_priority(priority)
        page.hint_end = hint_end
        page.expires = NO_EXPIRY if duration_s is None else now + duration_s
        self.num_retained += 1
        page.storage.num_retained += int(page.retained) - int(was)  # (a range without duration: a plain priority)
        if duration_s is not None:
            self._seq += 1
            heapq.heappush(self._heap, (page.expires, -ordinal, self._seq, page))
            if len(self._heap) > self._limit:
                self._sweep()

    def end(self, page: Page) -> None:
        """``page``'s retention ends now: back to its base priority."""
        if page.retained:
            page.storage.num_retained -= 1
        page.expires = NO_EXPIRY
        page.hint_end = NO_HINT
        if page.priority != GARBAGE_PRIORITY and page.priority != page.base_priority:
            page.set_priority(page.base_priority)

    def expire(self) -> None:
        """End the retention of every page whose expiry time has come (cheap when none has)."""
        heap = self._heap
        if not heap or heap[0][0] > self.clock():
            return
        now = self.now()
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            until, page = entry[0], entry[3]
            if page.expires == until and page.slot != BAD_PAGE_INDEX:
                self.end(page)
                self.num_expired += 1

    def _sweep(self) -> None:
        """Drop the entries of freed or re-retained pages if they may be most of the heap (each
        live entry is a page under retention); again after ``_SWEEP_SLACK`` more entries."""
        heap = self._heap
        live = 0
        for storage in self.storages:
            live += storage.num_retained
        if len(heap) > 2 * live + _SWEEP_SLACK:
            heap = [e for e in heap if e[3].expires == e[0] and e[3].slot != BAD_PAGE_INDEX]
            heapq.heapify(heap)
            self._heap = heap
        self._limit = len(heap) + _SWEEP_SLACK

    def pending(self) -> set[tuple[int, float]]:
        """``(id(page), expiry time)`` of every entry (for the invariant checker)."""
        return {(id(e[3]), e[0]) for e in self._heap}

    def __len__(self) -> int:
        return len(self._heap)
