"""Retention with durations: pages kept at a priority until an expiry time, then back to their
base priority (``Page.retain_s``, ``expires``, ``base_priority``, ``hint_end``), on every tier (a
page keeps these fields when it moves). A duration counts from the page's release: it runs while
the page is reusable (no request owns it: DROPPABLE), from the moment its last owner lets go
(``start``); a request taking the page again stops it (``stop``; it ends there if its time is
up), and its next release starts it afresh.

Expiry costs nothing per decode step: the manager's one ``ExpiryQueue`` (a heap of the next
expiry times) is consulted when the evictor runs (``EvictionCascade.make_room``) and before
statistics, so an expired page is treated at its base priority even while the heap still had it
in a higher class. Entries of pages that were freed, taken again, or re-retained since, are
skipped when they come up (of several entries of one page at its expiry time, the first ends
it), and swept when they are most of the heap (checked every ``_SWEEP_SLACK`` entries pushed,
against the pages under retention now: a burst's entries do not outlive it; one entry a page).

Retention travels with a block beyond the process (``carried``, ``restore``): a persistent disk
tier's records and the remote tier's values keep its priority, base priority, close-time hint and
duration, and the expiry of a running duration as wall-clock time (``time.time``: the manager's
clock may be monotonic, a restart or another replica does not share it); the block's next manager
gives its page the same retention with the time left. Pins stay with the process.

The clock (``KVCacheManagerConfig.clock``) is read checked (``read``): a finite number of seconds
(any real number: an int or a numpy scalar will do, a bool will not), never more than
``CLOCK_TOLERANCE_S`` below the last reading (a smaller step back reads as the last reading: the
manager's time never goes back). The manager's construction (one reading: only a non-number
there) and ``pin`` with a duration raise on a bad reading before changing anything; where
failing is no option (a release, eviction, statistics) a bad reading reads as the last good one
(``now``, logged), so a clock that fails never leaves an operation half done, nor puts a NaN in
an expiry time.
"""

from __future__ import annotations

import heapq
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Final

from .._common import BAD_PAGE_INDEX, MAX_PRIORITY, Priority
from .._page import GARBAGE_PRIORITY, NO_EXPIRY, NO_HINT, Page, PoolGroupStorage

#: the heap is swept of dead entries when it holds more than this many plus twice the pages under
#: retention (checked each time it grew by this many)
_SWEEP_SLACK: Final = 1024

#: seconds the clock may go back before a reading is refused (a smaller step reads as no time passing)
CLOCK_TOLERANCE_S: Final = 1.0

#: an expiry time beyond any reading (a duration whose sum with the time overflows)
_LATEST: Final = 1.7976931348623157e308

_LOG: Final = logging.getLogger("kv_cache_manager_v2")


def clock_seconds(value: object) -> float:
    """A clock reading ``value`` as seconds: ``TypeError`` unless a real number (``numbers.Real``:
    a float, an int, a numpy scalar; a bool refused), ``ValueError`` unless finite."""
    if type(value) is not float and (type(value) is bool or not isinstance(value, numbers.Real)):
        raise TypeError(
            f"config.clock must return seconds as a float (like time.monotonic; any real number but a bool), "
            f"got {type(value).__name__} {value!r}"
        )
    try:
        t = float(value)
    except OverflowError:  # an int beyond any float
        t = math.inf
    if not math.isfinite(t):
        raise ValueError(f"config.clock must return a finite number of seconds, got {value!r}")
    return t


class ExpiryQueue:
    """The manager's clock and the expiry times of retained pages (see the module)."""

    __slots__ = ("_failing", "_heap", "_limit", "_seq", "clock", "num_expired", "num_retained", "storages", "time")

    def __init__(self, clock: Callable[[], object]) -> None:
        #: seconds (``KVCacheManagerConfig.clock``; any object: ``read`` checks it, compiled too)
        self.clock = clock
        #: the last good reading; the clock is read once here, so a bad one is refused at once
        self.time = -math.inf
        self._failing = False  # (the last reading failed: logged once until a good one)
        self.time = self.read()
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

    def read(self) -> float:
        """The clock's time, checked (see the module): raises, changing nothing but the time, on a
        reading that is no finite number of seconds or goes back more than ``CLOCK_TOLERANCE_S``
        (the clock's own exception passes through)."""
        t = clock_seconds(self.clock())
        last = self.time
        if t < last:
            if t < last - CLOCK_TOLERANCE_S:
                raise ValueError(
                    f"config.clock went back {last - t:g} s (from {last!r} to {t!r}); "
                    f"at most {CLOCK_TOLERANCE_S:g} s is allowed"
                )
            return last
        self.time = t
        self._failing = False
        return t

    def now(self) -> float:
        """The clock's time where failing is no option: a bad reading (or a clock that raises)
        reads as the last good one, logged once until the clock recovers."""
        try:
            return self.read()
        except Exception as e:
            if not self._failing:
                self._failing = True
                _LOG.warning("config.clock failed (%s); using its last good reading, %r s", e, self.time)
            return self.time

    def retain(self, page: Page, ordinal: int, priority: Priority, duration_s: float | None, hint_end: int) -> None:
        """Keep ``page`` (of block ``ordinal``) at ``priority`` for ``duration_s`` seconds (None: no
        expiry) from its release (at once if no request owns it), then at its base priority (what it
        had before any retention). ``hint_end``: for a close-time hint, the last block of the
        hinted history (a request reusing the page that far ends the hint), else ``NO_HINT``."""
        was = page.retained
        if not was:
            page.base_priority = page.priority
        if page.priority != GARBAGE_PRIORITY and page.priority != priority:
            page.set_priority(priority)
        page.hint_end = hint_end
        page.retain_s = 0.0 if duration_s is None else duration_s
        page.expires = NO_EXPIRY
        self.num_retained += 1
        page.storage.num_retained += int(page.retained) - int(was)  # (a range without duration: a plain priority)
        if duration_s is not None and page.num_locks == 0 and page.num_holds == 0:
            self._start(page, ordinal)

    def start(self, page: Page) -> None:
        """``page`` (in the tree, retained with a duration) became reusable: its duration runs from now."""
        node = page.node
        assert node is not None
        self._start(page, node.ordinal)

    def _start(self, page: Page, ordinal: int) -> None:
        expires = self.now() + page.retain_s
        page.expires = expires if expires != NO_EXPIRY else _LATEST  # (a sum beyond any float)
        self._seq += 1
        heapq.heappush(self._heap, (page.expires, -ordinal, self._seq, page))
        if len(self._heap) > self._limit:
            self._sweep()

    def stop(self, page: Page) -> None:
        """A request takes ``page``, whose duration was running: its retention ends if the expiry
        time has come (by the manager's time: whether the evictor or statistics ran since makes no
        difference), else the duration stops (``start`` runs it afresh at the next release)."""
        if page.expires <= self.now():
            self.end(page)
            self.num_expired += 1
        else:
            page.expires = NO_EXPIRY

    def end(self, page: Page) -> None:
        """``page``'s retention ends now: back to its base priority."""
        if page.retained:
            page.storage.num_retained -= 1
        page.expires = NO_EXPIRY
        page.retain_s = 0.0
        page.hint_end = NO_HINT
        if page.priority != GARBAGE_PRIORITY and page.priority != page.base_priority:
            page.set_priority(page.base_priority)

    def expire(self) -> None:
        """End the retention of every page whose expiry time has come (cheap when none has)."""
        heap = self._heap
        if not heap:
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
        live entry is a page under retention); again after ``_SWEEP_SLACK`` more entries. A page
        released again and again while the clock stands still has entries that all match its
        expiry time: one of them is kept (they are the same entry)."""
        heap = self._heap
        live = 0
        for storage in self.storages:
            live += storage.num_retained
        if len(heap) > 2 * live + _SWEEP_SLACK:
            kept: dict[int, tuple[float, int, int, Page]] = {}
            for e in heap:
                page = e[3]
                if page.expires == e[0] and page.slot != BAD_PAGE_INDEX:
                    kept[id(page)] = e
            heap = list(kept.values())
            heapq.heapify(heap)
            self._heap = heap
        self._limit = len(heap) + _SWEEP_SLACK

    def carried(self, page: Page) -> tuple[int, int, float, float, int]:
        """What a record of ``page`` keeps of its retention (``restore`` gives it back): its base
        priority (what it has without retention), its priority, the wall-clock expiry of its running
        duration (``NO_EXPIRY``: none running), its duration (0.0: none) and its hint's last block."""
        if not page.retained:
            return page.priority, page.priority, NO_EXPIRY, 0.0, NO_HINT
        expires = page.expires
        if expires != NO_EXPIRY:
            expires = time.time() + (expires - self.now())
        return page.base_priority, page.priority, expires, page.retain_s, page.hint_end

    def restore(self, page: Page, ordinal: int, priority: int, expires: float, retain_s: float, hint_end: int) -> bool:
        """Give ``page`` (of block ``ordinal``, reusable, at its base priority) the retention a
        record kept (``carried``): ``priority`` until ``expires`` (wall-clock seconds: the time left
        runs now; ``NO_EXPIRY``: the whole ``retain_s`` from now) and then for ``retain_s`` from each
        release, or until the hint ends (``hint_end``). Nothing when it has run out or there was
        none, or for values no record of ours holds; returns whether the page is retained now."""
        if not (0 <= priority <= MAX_PRIORITY) or not (retain_s == 0.0 or 0.0 < retain_s < math.inf):
            return False
        if retain_s == 0.0 and hint_end == NO_HINT:
            return False
        left = retain_s
        if retain_s != 0.0 and expires != NO_EXPIRY:
            left = expires - time.time()
            if not left > 0.0:  # (a NaN too)
                return False
        self.retain(page, ordinal, Priority(priority), retain_s if retain_s != 0.0 else None, hint_end)
        if left < retain_s and page.num_locks == 0 and page.num_holds == 0:  # the time left runs, not the whole
            self._run_until(page, ordinal, self.now() + left)
        return True

    def _run_until(self, page: Page, ordinal: int, expires: float) -> None:
        page.expires = expires
        self._seq += 1
        heapq.heappush(self._heap, (expires, -ordinal, self._seq, page))

    def pending(self) -> set[tuple[int, float]]:
        """``(id(page), expiry time)`` of every entry (for the invariant checker)."""
        return {(id(e[3]), e[0]) for e in self._heap}

    def __len__(self) -> int:
        return len(self._heap)
