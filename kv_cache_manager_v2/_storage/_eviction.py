"""Evictable pages of one (cache level, pool group), in eviction order, under one of two policies.

Evictable are DROPPABLE pages (reusable cache, or garbage), and HELD pages (owned only by
suspended requests) when the level is not the last: those move down a level when evicted,
never get dropped. The evictor counts the two kinds apart, for the availability arithmetic.

Policies (``KVCacheManagerConfig.eviction_policy``), both lowest priority first, garbage before
everything:

* ``"lru"`` (:class:`LruEvictor`): least recently released first within a priority. O(1).
* ``"frequency"`` (:class:`FrequencyEvictor`, issue #18; the study is docs/eviction_proposal.md):
  use-rate GreedyDual. Within a priority the page with the lowest value goes first, value =
  the class's clock (the value of its last victim) + the block's use rate
  ``(uses - 1) / (now - first_use + tau)``; blocks used by one request only have rate 0 and go
  first. Use counts survive eviction in a ghost table (:class:`UseHistory`). At the last level a
  full-attention / sink page whose tree node has children waits (is *parked*) until its last
  child leaves the tree, so descendants go first. Adaptive aging (issue #31): each victim also
  raises its class clock by ``aging / slots**2``; ``aging`` learns from the disagreements with
  an LRU cache of the same size, simulated beside the policy over the block keys (a miss that
  LRU would have hit ages faster, a hit that LRU would have missed ages slower), so the policy
  drifts to recency order where recency wins (long multi-turn chats at large capacity) and
  stays frequency-driven where popularity wins. O(log n) per operation, O(1) for pages of
  rate 0 (most of them).

Within a priority, under both, pages the reuse tree marks ``low_value`` go first (hybrid models:
KV past the deepest snapshot on its path, which no match can use, and incomplete snapshots).
"""

from __future__ import annotations

from typing import Final

from .._common import MAX_PRIORITY, Priority
from .._page import LISTED_HELD, NOT_IN_HEAP, NOT_LISTED, Evictor, Page
from ._use_history import AGING_ON, UseHistory

#: ``Page.ev_pos`` (frequency policy): a heap index, ``NOT_IN_HEAP``, or one of these
PARKED: Final = -2
IN_FIFO: Final = -3

#: Frequency policy: the value of a low-value page (``Page.low_value``): below every other
#: (values are >= 0), so it goes first of its class, the earliest listed first
LOW_VALUE_KEY: Final = -1.0

#: Frequency policy: the rate's damping ``tau``, in cache sizes of block uses (15 x the level's slots).
TAU_SLOTS: Final = 15


#: LRU lists of low-value pages start here (lists below: the other pages, by priority)
_LOW_LISTS: Final = MAX_PRIORITY + 2


def _lru_bit(page: Page) -> int:
    """The bit of ``page``'s LRU list in its mask (one per priority, garbage's first)."""
    return page.priority + 1


def _lru_list(page: Page) -> int:
    """The LRU list of ``page``: its priority's, among the low-value lists if it is low value."""
    return page.priority + 1 + (_LOW_LISTS if page.low_value else 0)


def _first_list(normal: int, low: int) -> int:
    """The list to take pages from first, given the masks of non-empty lists (not both 0): the
    lowest priority's, its low-value pages first."""
    if low:
        low_bit = (low & -low).bit_length() - 1
        if not normal or low_bit <= (normal & -normal).bit_length() - 1:
            return low_bit + _LOW_LISTS
    return (normal & -normal).bit_length() - 1


class LruEvictor(Evictor):
    """Lowest priority first, low-value pages first within a priority (``Page.low_value``), least
    recently released first within those.

    One intrusive doubly linked list per priority and value (``Page.lru_prev`` / ``lru_next``),
    the garbage's ahead of priority 0, and a bit mask of the non-empty lists per value (one bit
    per priority: a machine word compiled for the usual priorities), so add, remove and
    pick-victim allocate nothing.
    """

    __slots__ = ("_heads", "_nonempty", "_nonempty_low", "_tails")

    def __init__(self) -> None:
        super().__init__()
        # list i < _LOW_LISTS holds priority i - 1, list _LOW_LISTS + i its low-value pages: lists 0
        # and _LOW_LISTS are garbage
        self._heads: list[Page | None] = [None] * (2 * _LOW_LISTS)  # oldest
        self._tails: list[Page | None] = [None] * (2 * _LOW_LISTS)  # newest
        self._nonempty = 0  # bit i set: list i has pages
        self._nonempty_low = 0  # bit i set: list _LOW_LISTS + i has pages

    def add(self, page: Page) -> None:
        """List ``page`` as the newest of its priority and value (HELD if it has holders, else DROPPABLE)."""
        self._listed(page)
        i = _lru_list(page)
        tail = self._tails[i]
        page.lru_prev = tail
        page.lru_next = None
        if tail is None:
            self._heads[i] = page
            if page.low_value:
                self._nonempty_low |= 1 << _lru_bit(page)
            else:
                self._nonempty |= 1 << _lru_bit(page)
        else:
            tail.lru_next = page
        self._tails[i] = page

    def remove(self, page: Page) -> None:
        self._unlisted(page)
        i = _lru_list(page)
        prev = page.lru_prev
        nxt = page.lru_next
        if prev is None:
            self._heads[i] = nxt
        else:
            prev.lru_next = nxt
        if nxt is None:
            self._tails[i] = prev
        else:
            nxt.lru_prev = prev
        page.lru_prev = page.lru_next = None
        if self._heads[i] is None:
            self._emptied(i)

    def _emptied(self, i: int) -> None:
        """List ``i`` lost its last page: its bit in the masks of non-empty lists goes."""
        if i >= _LOW_LISTS:
            self._nonempty_low &= ~(1 << (i - _LOW_LISTS))
        else:
            self._nonempty &= ~(1 << i)

    def select(self, count: int, max_held: int) -> list[Page]:
        out: list[Page] = []
        held = 0
        normal, low = self._nonempty, self._nonempty_low
        while (normal or low) and len(out) < count:
            i = _first_list(normal, low)
            page = self._heads[i]
            while page is not None and len(out) < count:
                if page.in_evictor != LISTED_HELD:
                    out.append(page)
                elif held < max_held:
                    out.append(page)
                    held += 1
                page = page.lru_next
            if i >= _LOW_LISTS:
                low &= low - 1
            else:
                normal &= normal - 1
        for p in out:
            self.remove(p)
        return out

    def pop_victim(self) -> Page:
        if not (self._nonempty or self._nonempty_low):
            raise IndexError("no evictable page")
        i = _first_list(self._nonempty, self._nonempty_low)
        page = self._heads[i]
        assert page is not None
        self._unlisted(page)  # (``remove`` of a list's head, whose list is known: one eviction each)
        nxt = page.lru_next
        self._heads[i] = nxt
        if nxt is None:
            self._tails[i] = None
            self._emptied(i)
        else:
            nxt.lru_prev = None
            page.lru_next = None
        return page

    def pages(self) -> list[Page]:
        out: list[Page] = []
        normal, low = self._nonempty, self._nonempty_low
        while normal or low:
            i = _first_list(normal, low)
            page = self._heads[i]
            while page is not None:
                out.append(page)
                page = page.lru_next
            if i >= _LOW_LISTS:
                low &= low - 1
            else:
                normal &= normal - 1
        return out

    def structure_error(self) -> str | None:
        for i in range(len(self._heads)):
            prev: Page | None = None
            page = self._heads[i]
            while page is not None:
                if page.lru_prev is not prev or _lru_list(page) != i:
                    return f"LRU list {i}: broken back link or a page of priority {page.priority} (low value: {page.low_value})"
                prev = page
                page = page.lru_next
            mask = self._nonempty_low if i >= _LOW_LISTS else self._nonempty
            if self._tails[i] is not prev or bool(mask >> (i % _LOW_LISTS) & 1) != (prev is not None):
                return f"LRU list {i}: tail or non-empty bit out of date"
        return None


class _Class:
    """One priority class of a :class:`FrequencyEvictor`: its GreedyDual clock; pages listed with
    rate 0 in release order (a FIFO: their value is the clock when listed, which only rises, so
    the FIFO is in eviction order); the rest in a binary min-heap by ``(ev_key, ev_seq)`` (each
    page knows its index, ``ev_pos``); and the parked pages. The two lists are intrusive
    (``lru_prev`` / ``lru_next``), oldest first."""

    __slots__ = ("clock", "fifo_head", "fifo_tail", "heap", "parked_head", "parked_tail")

    def __init__(self) -> None:
        #: the value of the class's last victim (rises only): pages listed now start above it
        self.clock = 0.0
        self.heap: list[Page] = []
        self.fifo_head: Page | None = None
        self.fifo_tail: Page | None = None
        self.parked_head: Page | None = None
        self.parked_tail: Page | None = None


def _before(a: Page, b: Page) -> bool:
    """Whether ``a`` is evicted before ``b`` (same class): lower value, then listed earlier."""
    return a.ev_key < b.ev_key or (a.ev_key == b.ev_key and a.ev_seq < b.ev_seq)


class FrequencyEvictor(Evictor):
    """Lowest priority first; within a priority, low-value pages (``Page.low_value``) first, then
    lowest use-rate value first (see the module).

    Per priority (and garbage) a :class:`_Class`; a bit mask of the non-empty ones. A page's
    value is fixed when it is listed: ``clock + (uses - 1) / (now - first_use + tau)`` (rate 0
    for a block one request used), ``tau = TAU_SLOTS x`` the level's slots. The next victim of
    a class is the earlier of its FIFO's head and its heap's top. ``parks`` (the last level): an
    anchor page (full attention, sinks) whose node has children is parked instead, and enters
    the heap (same value) when the tree reports ``became_leaf``; a class with nothing else gives
    its oldest parked page (whose drop removes the subtree, as under LRU). Heap operations sift
    comparing unboxed fields; nothing is allocated besides amortized list growth.
    """

    __slots__ = ("_age_unit", "_classes", "_history", "_nonempty", "_parks", "_seq", "_slots", "_tau")

    def __init__(self, history: UseHistory, num_slots: int, parks: bool) -> None:
        super().__init__()
        self._classes = [_Class() for _ in range(MAX_PRIORITY + 2)]  # class i: priority i - 1
        self._nonempty = 0  # bit i set: class i has pages
        self._history = history
        self._parks = parks
        self._seq = 0
        self._tau = 1.0
        self._age_unit = 1.0
        self._slots = 0
        self.resize(num_slots)

    def resize(self, num_slots: int) -> None:
        self._history.lru_slots += num_slots - self._slots  # the simulated LRU spans every level
        self._slots = num_slots
        slots = float(max(1, num_slots))
        self._tau = TAU_SLOTS * slots
        self._age_unit = 1.0 / (slots * slots)

    # ------------------------------------------------------------------ the interface
    def add(self, page: Page) -> None:
        """List ``page`` with its value now: parked (last level, an anchor with children), in the
        FIFO (rate 0) or in the heap."""
        self._listed(page)
        i = page.priority + 1
        cls = self._classes[i]
        self._seq += 1
        page.ev_seq = self._seq
        history = self._history
        node = page.node
        uses = page.uses
        if page.low_value:
            page.ev_key = LOW_VALUE_KEY
        elif uses > 1:
            page.ev_key = cls.clock + (uses - 1) / (history.now - page.first_use + self._tau)
        else:
            page.ev_key = cls.clock
        if self._parks and page.anchor and node is not None and node.has_children:
            page.ev_pos = PARKED
            cls.parked_head, cls.parked_tail = _append(cls.parked_head, cls.parked_tail, page)
        elif uses > 1 or page.low_value:
            self._push(cls, page)
        else:
            page.ev_pos = IN_FIFO
            cls.fifo_head, cls.fifo_tail = _append(cls.fifo_head, cls.fifo_tail, page)
        self._nonempty |= 1 << i

    def remove(self, page: Page) -> None:
        self._unlisted(page)
        i = page.priority + 1
        cls = self._classes[i]
        pos = page.ev_pos
        if pos >= 0:
            self._delete(cls.heap, page)
        elif pos == IN_FIFO:
            cls.fifo_head, cls.fifo_tail = _unlink(cls.fifo_head, cls.fifo_tail, page)
        else:
            cls.parked_head, cls.parked_tail = _unlink(cls.parked_head, cls.parked_tail, page)
        page.ev_pos = NOT_IN_HEAP
        if not cls.heap and cls.fifo_head is None and cls.parked_head is None:
            self._nonempty &= ~(1 << i)

    def pop_victim(self) -> Page:
        if self._nonempty == 0:
            raise IndexError("no evictable page")
        page = self._next()
        self._advance_clock(page)
        return page

    def select(self, count: int, max_held: int) -> list[Page]:
        out: list[Page] = []
        skipped: list[Page] = []
        held = 0
        while len(out) < count and self._nonempty:
            page = self._next()
            if page.num_holds:
                if held >= max_held:
                    skipped.append(page)
                    continue
                held += 1
            self._advance_clock(page)
            out.append(page)
        for p in skipped:  # back in order: same value, same sequence number (in the heap)
            self._listed(p)
            i = p.priority + 1
            self._push(self._classes[i], p)
            self._nonempty |= 1 << i
        return out

    def became_leaf(self, page: Page) -> None:
        """A parked page's node lost its last child: it becomes a candidate, with its value."""
        if page.in_evictor != NOT_LISTED and page.ev_pos == PARKED:
            cls = self._classes[page.priority + 1]
            cls.parked_head, cls.parked_tail = _unlink(cls.parked_head, cls.parked_tail, page)
            self._seq += 1
            page.ev_seq = self._seq
            self._push(cls, page)  # its value may be below the FIFO's: the heap orders any value

    def pages(self) -> list[Page]:
        out: list[Page] = []
        for cls in self._classes:
            candidates = list(cls.heap)
            page = cls.fifo_head
            while page is not None:
                candidates.append(page)
                page = page.lru_next
            out.extend(sorted(candidates, key=_order))
            page = cls.parked_head
            while page is not None:
                out.append(page)
                page = page.lru_next
        return out

    def class_clock(self, priority: Priority) -> float:
        """The GreedyDual clock of ``priority``'s class (for tests and statistics)."""
        return self._classes[priority + 1].clock

    def is_parked(self, page: Page) -> bool:
        return page.in_evictor != NOT_LISTED and page.ev_pos == PARKED

    def structure_error(self) -> str | None:
        n = 0
        for i, cls in enumerate(self._classes):
            where = f"frequency class {i - 1}"
            heap = cls.heap
            for k, page in enumerate(heap):
                if page.ev_pos != k:
                    return f"{where}: heap entry {k} records position {page.ev_pos}"
                if k and _before(page, heap[(k - 1) >> 1]):
                    return f"{where}: heap order broken at {k}"
                error = self._entry_error(page, i)
                if error is not None:
                    return f"{where}: {error}"
            n += len(heap)
            prev: Page | None = None
            page_ = cls.fifo_head
            while page_ is not None:
                if page_.ev_pos != IN_FIFO or page_.lru_prev is not prev:
                    return f"{where}: FIFO list broken"
                if prev is not None and not _before(prev, page_):
                    return f"{where}: FIFO out of eviction order"
                error = self._entry_error(page_, i)
                if error is not None:
                    return f"{where}: {error}"
                n += 1
                prev = page_
                page_ = page_.lru_next
            if cls.fifo_tail is not prev:
                return f"{where}: FIFO tail out of date"
            prev = None
            page_ = cls.parked_head
            while page_ is not None:
                node = page_.node
                if page_.ev_pos != PARKED or page_.lru_prev is not prev or page_.priority + 1 != i:
                    return f"{where}: parked list broken"
                if not self._parks or not page_.anchor or node is None or not node.has_children:
                    return f"{where}: a parked page that should be a candidate"
                n += 1
                prev = page_
                page_ = page_.lru_next
            if cls.parked_tail is not prev:
                return f"{where}: parked tail out of date"
            nonempty = bool(heap) or cls.fifo_head is not None or prev is not None
            if bool(self._nonempty >> i & 1) != nonempty:
                return f"{where}: non-empty bit out of date"
        if n != self.count:
            return f"frequency evictor counts {self.count} pages but holds {n}"
        return None

    def _entry_error(self, page: Page, i: int) -> str | None:
        """What is wrong with a candidate (heap or FIFO) page of class ``i``, or None."""
        if page.priority + 1 != i:
            return f"holds a page of priority {page.priority}"
        if page.ev_seq > self._seq:
            return "a sequence number from the future"
        node = page.node
        if self._parks and page.anchor and node is not None and node.has_children:
            return "an anchor page with cached descendants is a candidate"
        return None

    # ------------------------------------------------------------------ internals
    def _next(self) -> Page:
        """Take out the next page in eviction order (some class is non-empty)."""
        mask = self._nonempty
        cls = self._classes[(mask & -mask).bit_length() - 1]
        page = cls.fifo_head
        heap = cls.heap
        if heap and (page is None or _before(heap[0], page)):
            page = heap[0]
        if page is None:
            page = cls.parked_head
        assert page is not None
        self.remove(page)
        return page

    def _advance_clock(self, victim: Page) -> None:
        """GreedyDual aging: the class's clock rises to its victim's value (a page listed long
        ago may hold a value below it: the clock never falls), plus the adaptive aging (none up to
        ``AGING_ON``: there the order is exactly use-rate GreedyDual's)."""
        cls = self._classes[victim.priority + 1]
        clock = cls.clock
        if victim.ev_key > clock:
            clock = victim.ev_key
        aging = self._history.aging
        if aging > AGING_ON:
            clock += aging * self._age_unit
        cls.clock = clock

    def _push(self, cls: _Class, page: Page) -> None:
        heap = cls.heap
        heap.append(page)
        self._sift_up(heap, len(heap) - 1, page)

    def _delete(self, heap: list[Page], page: Page) -> None:
        i = page.ev_pos
        last = heap.pop()
        if last is page:
            return
        if i > 0 and _before(last, heap[(i - 1) >> 1]):
            self._sift_up(heap, i, last)
        else:
            self._sift_down(heap, i, last)

    def _sift_up(self, heap: list[Page], i: int, page: Page) -> None:
        """Place ``page`` at hole ``i`` or above."""
        while i > 0:
            j = (i - 1) >> 1
            parent = heap[j]
            if not _before(page, parent):
                break
            heap[i] = parent
            parent.ev_pos = i
            i = j
        heap[i] = page
        page.ev_pos = i

    def _sift_down(self, heap: list[Page], i: int, page: Page) -> None:
        """Place ``page`` at hole ``i`` or below."""
        n = len(heap)
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            child = heap[c]
            if c + 1 < n:
                right = heap[c + 1]
                if _before(right, child):
                    c += 1
                    child = right
            if not _before(child, page):
                break
            heap[i] = child
            child.ev_pos = i
            i = c
        heap[i] = page
        page.ev_pos = i


def _append(head: Page | None, tail: Page | None, page: Page) -> tuple[Page | None, Page | None]:
    """Append ``page`` to the intrusive list ``head .. tail``; returns the new (head, tail)."""
    page.lru_prev = tail
    page.lru_next = None
    if tail is None:
        return page, page
    tail.lru_next = page
    return head, page


def _unlink(head: Page | None, tail: Page | None, page: Page) -> tuple[Page | None, Page | None]:
    """Unlink ``page`` from the intrusive list ``head .. tail``; returns the new (head, tail)."""
    prev = page.lru_prev
    nxt = page.lru_next
    if prev is None:
        head = nxt
    else:
        prev.lru_next = nxt
    if nxt is None:
        tail = prev
    else:
        nxt.lru_prev = prev
    page.lru_prev = page.lru_next = None
    return head, tail


def _order(page: Page) -> tuple[float, int]:
    return (page.ev_key, page.ev_seq)
