"""The ``"slru"`` eviction policy: segmented LRU (Karedla, Love and Wherry, 1994), in the
priority layer of the list policies (``_lru.py``).

A block reused since it entered the cache (a request took its page: a hit) is *protected*; the
others are *probationary*. Probationary pages go first, least recently released first, then
protected ones in the same order; the protected pages of a level are at most ``PROTECTED_SHARE``
of its slots: one more demotes the oldest protected page of its list to the newest probationary
one. A scan of one-off prompts thus passes through the probationary pages and leaves the reused
prefixes alone, where LRU would let it flush them.

Each LRU list (a priority, low value or not) keeps both segments, probationary then protected::

    head -> P1 P2 P3 | Q1 Q2 <- tail        ``_first_protected[i]`` = Q1
    add(P4):  P1 P2 P3 P4 | Q1 Q2           (before the boundary)
    add(Q3):  P1 P2 P3 P4 | Q1 Q2 Q3        (at the tail; over the share, Q1 is demoted:
              P1 P2 P3 P4 Q1 | Q2 Q3         the boundary moves one page, nothing is relinked)

so the victim is always a list's head, as under LRU. O(1) per operation; a page's state
(:class:`SlruState`) is made at its first hit only.
"""

from __future__ import annotations

from typing import Final, cast, final

from ..._common import RequestSerial
from ..._page import Evictor, Page, PolicyState
from ._lru import LruEvictor, first_list, lru_list

#: at most this share of a level's slots holds protected pages (the paper's 80 %)
PROTECTED_SHARE: Final = 0.8


@final
class SlruState(PolicyState):
    """A page's state under SLRU: a request took it since it was last listed (``hit``), and
    whether it is in its list's protected segment."""

    __slots__ = ("hit", "protected")

    def __init__(self) -> None:
        self.hit = False
        self.protected = False


def _protected(page: Page) -> bool:
    st = page.policy_state
    return st is not None and cast(SlruState, st).protected


@final
class SlruEvictor(LruEvictor):
    """Segmented LRU (see the module). Deeper because: it is :class:`LruEvictor` (the same lists
    and priority layer), only where a page enters its list differs."""

    __slots__ = ("_first_protected", "_limit", "_num_protected")

    def __init__(self, num_slots: int) -> None:
        super().__init__()
        self.hears_uses = True
        #: per LRU list, its oldest protected page (None: it has none)
        self._first_protected: list[Page | None] = [None] * len(self._heads)
        self._num_protected = 0
        self._limit = 0
        self.resize(num_slots)

    def resize(self, num_slots: int) -> None:
        """The share applies from the next protected page on (a shrink demotes nothing at once)."""
        self._limit = int(PROTECTED_SHARE * num_slots)

    def used(self, page: Page, serial: RequestSerial, cached: bool) -> None:
        if cached:
            st = page.policy_state
            if st is None:
                fresh = SlruState()
                fresh.hit = True
                page.policy_state = fresh
            else:
                cast(SlruState, st).hit = True

    def add(self, page: Page) -> None:
        """A page hit since it was last listed (or protected then) enters the protected segment,
        any other the probationary one, as the newest of its segment."""
        st = page.policy_state
        if st is None:
            self._add_probationary(page)
            return
        state = cast(SlruState, st)
        if state.hit:
            state.hit = False
            state.protected = True
        if not state.protected:
            self._add_probationary(page)
            return
        super().add(page)  # the tail: the newest protected page
        self._protected_listed(page, lru_list(page))

    def _protected_listed(self, page: Page, i: int) -> None:
        """Protected ``page`` was linked into list ``i``: the boundary and the count follow; over the
        share, the list's oldest protected page is demoted."""
        first = self._first_protected[i]
        if first is None or first is page.lru_next:
            self._first_protected[i] = page
        self._num_protected += 1
        if self._num_protected > self._limit:
            first = self._first_protected[i]
            assert first is not None
            cast(SlruState, first.policy_state).protected = False
            self._first_protected[i] = first.lru_next
            self._num_protected -= 1

    def _add_probationary(self, page: Page) -> None:
        """List ``page`` as the newest probationary page of its list (before its protected ones)."""
        i = lru_list(page)
        boundary = self._first_protected[i]
        if boundary is None:
            super().add(page)
        else:
            self._link(page, i, boundary.lru_prev, boundary)

    def unshelve(self, page: Page, place: int) -> None:
        """As under LRU, within its segment: next to a neighbour still in its list and segment,
        else first in its segment."""
        prev, nxt = page.lru_prev, page.lru_next
        page.lru_prev = page.lru_next = None
        if lru_list(page) != place:  # its priority or value changed meanwhile
            self.add(page)
            return
        protected = _protected(page)
        if prev is not None and self.in_list(prev, place) and _protected(prev) == protected:
            self._link(page, place, prev, prev.lru_next)
        elif nxt is not None and self.in_list(nxt, place) and _protected(nxt) == protected:
            self._link(page, place, nxt.lru_prev, nxt)
        elif protected:  # the oldest protected page
            first = self._first_protected[place]
            self._link(page, place, self._tails[place] if first is None else first.lru_prev, first)
        else:
            self._link(page, place, None, self._heads[place])
        if protected:
            self._protected_listed(page, place)

    def remove(self, page: Page) -> None:
        if _protected(page):
            i = lru_list(page)
            if self._first_protected[i] is page:
                self._first_protected[i] = page.lru_next
            self._num_protected -= 1
        super().remove(page)

    def pop_victim(self) -> Page:
        if not (self._nonempty or self._nonempty_low):
            raise IndexError("no evictable page")
        page = self._heads[first_list(self._nonempty, self._nonempty_low)]
        assert page is not None
        self.remove(page)
        return page

    def structure_error(self) -> str | None:
        error = super().structure_error()
        if error is not None:
            return error
        n = 0
        for i, first in enumerate(self._first_protected):
            page = self._heads[i]
            while page is not None and page is not first:
                if _protected(page):
                    return f"SLRU list {i}: a protected page before the boundary"
                page = page.lru_next
            if page is not first:
                return f"SLRU list {i}: the boundary is not in its list"
            while page is not None:
                if not _protected(page):
                    return f"SLRU list {i}: a probationary page after the boundary"
                n += 1
                page = page.lru_next
        if n != self._num_protected:
            return f"SLRU counts {self._num_protected} protected pages but lists {n}"
        return None


def slru_evictors(slots: list[int]) -> list[Evictor]:
    """A pool group's evictors under ``"slru"``, one per cache level (``slots[level]`` slots each)."""
    return [SlruEvictor(n) for n in slots]
