"""The ``"frequency"`` eviction policy (issue #18; the study is docs/eviction_proposal.md):
use-rate GreedyDual, with its own priority classes (:class:`FrequencyEvictor`).

Evictable are DROPPABLE pages (reusable cache, or garbage), and HELD pages (owned only by
suspended requests) when the level is not the last: those move down a level when evicted,
never get dropped. Lowest priority first, garbage before everything. Within a priority the page
with the lowest value goes first, value = the class's clock (the value of its last victim) + the
block's use rate ``(uses - 1) / (now - first_use + tau)``; blocks used by one request only have
rate 0 and go first. Use counts survive eviction in a ghost table (:class:`UseHistory`). At the
last level a full-attention / sink page whose tree node has children waits (is *parked*) until
its last child leaves the tree, so descendants go first. Adaptive aging (issue #31): each victim
also raises its class clock by ``aging / slots**2``; ``aging`` learns from the disagreements
with an LRU cache of the same size, simulated beside the policy over the block keys (a miss that
LRU would have hit ages faster, a hit that LRU would have missed ages slower), so the policy
drifts to recency order where recency wins (long multi-turn chats at large capacity) and stays
frequency-driven where popularity wins. O(log n) per operation, O(1) for pages of rate 0 (most
of them).

Pages the reuse tree marks ``low_value`` go first within a priority, as under the list policies
(``_lru.py``), but inside the class (a value below every other, ``LOW_VALUE_KEY``): their victims
age the class's clock like any other. A page's values are its :class:`FrequencyState`.
"""

from __future__ import annotations

from typing import Final

from ..._common import MAX_PRIORITY, Priority, RequestSerial
from ..._page import NOT_LISTED, Evictor, Page
from ._use_history import AGING_ON, NOT_IN_HEAP, FrequencyState, UseHistory, frequency_state, state_of

#: ``FrequencyState.pos``: a heap index, ``NOT_IN_HEAP``, or one of these
PARKED: Final = -2
IN_FIFO: Final = -3

#: Frequency policy: the value of a low-value page (``Page.low_value``): below every other
#: (values are >= 0), so it goes first of its class, the earliest listed first
LOW_VALUE_KEY: Final = -1.0

#: Frequency policy: the rate's damping ``tau``, in cache sizes of block uses (15 x the level's slots).
TAU_SLOTS: Final = 15

#: ``FrequencyEvictor.shelve``'s place of a parked page: its class plus this
_PARKED_PLACE: Final = MAX_PRIORITY + 2


class _Class:
    """One priority class of a :class:`FrequencyEvictor`: its GreedyDual clock; pages listed with
    rate 0 in release order (a FIFO: their value is the clock when listed, which only rises, so
    the FIFO is in eviction order); the rest in a binary min-heap by ``(key, seq)`` (each
    page's state knows its index, ``pos``); and the parked pages. The two lists are intrusive
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


def _before(a: FrequencyState, b: FrequencyState) -> bool:
    """Whether a page with state ``a`` is evicted before one with ``b`` (same class): lower value,
    then listed earlier."""
    return a.key < b.key or (a.key == b.key and a.seq < b.seq)


def _first(a: Page, b: Page) -> bool:
    """Whether page ``a`` is evicted before page ``b`` (same class)."""
    return _before(state_of(a), state_of(b))


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
        self.hears_uses = True
        self._classes = [_Class() for _ in range(MAX_PRIORITY + 2)]  # class i: priority i - 1
        self._nonempty = 0  # bit i set: class i has pages
        self._history = history
        self._parks = parks
        self._seq = 0
        self._tau = 1.0
        self._age_unit = 1.0
        self._slots = 0
        self._size(num_slots)

    @property
    def history(self) -> UseHistory:
        """The use counting of the evictor's pool group (shared by its levels)."""
        return self._history

    def resize(self, num_slots: int) -> None:
        self._size(num_slots)
        if self._parks:  # the last level: the ghost is sized by its slots
            self._history.resize(num_slots)

    def _size(self, num_slots: int) -> None:
        self._history.lru_slots += num_slots - self._slots  # the simulated LRU spans every level
        self._slots = num_slots
        slots = float(max(1, num_slots))
        self._tau = TAU_SLOTS * slots
        self._age_unit = 1.0 / (slots * slots)

    # ------------------------------------------------------------------ the interface
    def used(self, page: Page, serial: RequestSerial, cached: bool) -> None:
        self._history.use(page, serial, cached)

    def released(self, page: Page) -> None:
        self._history.released(page)

    def dropped(self, page: Page) -> None:
        self._history.record(page)

    def add(self, page: Page) -> None:
        """List ``page`` with its value now: parked (last level, an anchor with children), in the
        FIFO (rate 0) or in the heap."""
        self._listed(page)
        i = page.priority + 1
        cls = self._classes[i]
        self._seq += 1
        st = frequency_state(page)
        st.seq = self._seq
        history = self._history
        node = page.node
        uses = st.uses
        if page.low_value:
            st.key = LOW_VALUE_KEY
        elif uses > 1:
            st.key = cls.clock + (uses - 1) / (history.now - st.first_use + self._tau)
        else:
            st.key = cls.clock
        if self._parks and page.anchor and node is not None and node.has_children:
            st.pos = PARKED
            cls.parked_head, cls.parked_tail = _append(cls.parked_head, cls.parked_tail, page)
        elif uses > 1 or page.low_value:
            self._push(cls, page)
        else:
            st.pos = IN_FIFO
            cls.fifo_head, cls.fifo_tail = _append(cls.fifo_head, cls.fifo_tail, page)
        self._nonempty |= 1 << i

    def shelve(self, page: Page) -> int:
        """Its class (a parked page's: plus ``_PARKED_PLACE``); its value and sequence number stay
        in its state (a parked page's links keep its neighbours while it is out)."""
        i = page.priority + 1
        if state_of(page).pos != PARKED:
            self.remove(page)
            return i
        prev, nxt = page.lru_prev, page.lru_next
        self.remove(page)
        page.lru_prev, page.lru_next = prev, nxt
        return i + _PARKED_PLACE

    def unshelve(self, page: Page, place: int) -> None:
        """Back with the value and sequence number it had: in the heap, which orders any value (a
        parked page: after its older parked neighbour while that is parked in its class, else
        before its newer one, else first; one whose node gained children meanwhile, a remote
        fill's chain, as the newest, as ``add`` parks it)."""
        st = state_of(page)
        was_parked = place >= _PARKED_PLACE
        if was_parked:
            place -= _PARKED_PLACE
        prev, nxt = page.lru_prev, page.lru_next
        page.lru_prev = page.lru_next = None
        if page.priority + 1 != place or (st.key == LOW_VALUE_KEY) != page.low_value:
            self.add(page)  # its priority or value changed meanwhile
            return
        self._listed(page)
        cls = self._classes[place]
        node = page.node
        if self._parks and page.anchor and node is not None and node.has_children:
            st.pos = PARKED
            if not was_parked:
                prev, nxt = cls.parked_tail, None
            elif prev is not None and self._parked_in(prev, place):
                nxt = prev.lru_next
            elif nxt is not None and self._parked_in(nxt, place):
                prev = nxt.lru_prev
            else:
                prev, nxt = None, cls.parked_head
            cls.parked_head, cls.parked_tail = _insert(cls.parked_head, cls.parked_tail, page, prev, nxt)
        else:
            self._push(cls, page)
        self._nonempty |= 1 << place

    def _parked_in(self, page: Page, i: int) -> bool:
        return (
            page.in_evictor != NOT_LISTED
            and page.storage.evictor is self
            and page.priority + 1 == i
            and (state_of(page).pos == PARKED)
        )

    def remove(self, page: Page) -> None:
        self._unlisted(page)
        i = page.priority + 1
        cls = self._classes[i]
        st = state_of(page)
        pos = st.pos
        if pos >= 0:
            self._delete(cls.heap, page)
        elif pos == IN_FIFO:
            cls.fifo_head, cls.fifo_tail = _unlink(cls.fifo_head, cls.fifo_tail, page)
        else:
            cls.parked_head, cls.parked_tail = _unlink(cls.parked_head, cls.parked_tail, page)
        st.pos = NOT_IN_HEAP
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
        if page.in_evictor != NOT_LISTED and state_of(page).pos == PARKED:
            cls = self._classes[page.priority + 1]
            cls.parked_head, cls.parked_tail = _unlink(cls.parked_head, cls.parked_tail, page)
            self._seq += 1
            state_of(page).seq = self._seq
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
        return page.in_evictor != NOT_LISTED and state_of(page).pos == PARKED

    def structure_error(self) -> str | None:
        n = 0
        for i, cls in enumerate(self._classes):
            where = f"frequency class {i - 1}"
            heap = cls.heap
            for k, page in enumerate(heap):
                pos = state_of(page).pos
                if pos != k:
                    return f"{where}: heap entry {k} records position {pos}"
                if k and _first(page, heap[(k - 1) >> 1]):
                    return f"{where}: heap order broken at {k}"
                error = self._entry_error(page, i)
                if error is not None:
                    return f"{where}: {error}"
            n += len(heap)
            prev: Page | None = None
            page_ = cls.fifo_head
            while page_ is not None:
                if state_of(page_).pos != IN_FIFO or page_.lru_prev is not prev:
                    return f"{where}: FIFO list broken"
                if prev is not None and not _first(prev, page_):
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
                if state_of(page_).pos != PARKED or page_.lru_prev is not prev or page_.priority + 1 != i:
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
        if state_of(page).seq > self._seq:
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
        if heap and (page is None or _first(heap[0], page)):
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
        key = state_of(victim).key
        if key > clock:
            clock = key
        aging = self._history.aging
        if aging > AGING_ON:
            clock += aging * self._age_unit
        cls.clock = clock

    def _push(self, cls: _Class, page: Page) -> None:
        heap = cls.heap
        heap.append(page)
        self._sift_up(heap, len(heap) - 1, page)

    def _delete(self, heap: list[Page], page: Page) -> None:
        i = state_of(page).pos
        last = heap.pop()
        if last is page:
            return
        if i > 0 and _first(last, heap[(i - 1) >> 1]):
            self._sift_up(heap, i, last)
        else:
            self._sift_down(heap, i, last)

    def _sift_up(self, heap: list[Page], i: int, page: Page) -> None:
        """Place ``page`` at hole ``i`` or above."""
        st = state_of(page)
        while i > 0:
            j = (i - 1) >> 1
            parent = heap[j]
            parent_st = state_of(parent)
            if not _before(st, parent_st):
                break
            heap[i] = parent
            parent_st.pos = i
            i = j
        heap[i] = page
        st.pos = i

    def _sift_down(self, heap: list[Page], i: int, page: Page) -> None:
        """Place ``page`` at hole ``i`` or below."""
        st = state_of(page)
        n = len(heap)
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            child = heap[c]
            child_st = state_of(child)
            if c + 1 < n:
                right = heap[c + 1]
                right_st = state_of(right)
                if _before(right_st, child_st):
                    c += 1
                    child = right
                    child_st = right_st
            if not _before(child_st, st):
                break
            heap[i] = child
            child_st.pos = i
            i = c
        heap[i] = page
        st.pos = i


def _append(head: Page | None, tail: Page | None, page: Page) -> tuple[Page | None, Page | None]:
    """Append ``page`` to the intrusive list ``head .. tail``; returns the new (head, tail)."""
    page.lru_prev = tail
    page.lru_next = None
    if tail is None:
        return page, page
    tail.lru_next = page
    return head, page


def _insert(
    head: Page | None, tail: Page | None, page: Page, prev: Page | None, nxt: Page | None
) -> tuple[Page | None, Page | None]:
    """Insert ``page`` between ``prev`` and ``nxt`` (adjacent; None: an end) of the intrusive list
    ``head .. tail``; returns the new (head, tail)."""
    page.lru_prev = prev
    page.lru_next = nxt
    if prev is None:
        head = page
    else:
        prev.lru_next = page
    if nxt is None:
        tail = page
    else:
        nxt.lru_prev = page
    return head, tail


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
    st = state_of(page)
    return (st.key, st.seq)


def frequency_evictors(slots: list[int]) -> list[Evictor]:
    """A pool group's evictors under ``"frequency"``, one per cache level (``slots[level]`` slots
    each, the last level last: it parks anchors), sharing one :class:`UseHistory`."""
    history = UseHistory(slots[-1])
    return [FrequencyEvictor(history, n, parks=level == len(slots) - 1) for level, n in enumerate(slots)]
