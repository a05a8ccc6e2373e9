"""The ``"lru"`` eviction policy: least recently released first, within the priority layer every
list-ordered policy shares (:class:`LruEvictor`).

The layer: lowest priority first, garbage before everything; within a priority, pages the reuse
tree marks ``low_value`` first (hybrid models: KV past the deepest snapshot on its path, which no
match can use, and incomplete snapshots). A policy that orders pages in lists subclasses
:class:`LruEvictor` and changes only where a page enters its list (``_slru.py``).
"""

from __future__ import annotations

from typing import Final

from ..._common import MAX_PRIORITY
from ..._page import LISTED_HELD, NOT_LISTED, Evictor, Page

#: LRU lists of low-value pages start here (lists below: the other pages, by priority)
_LOW_LISTS: Final = MAX_PRIORITY + 2


def _lru_bit(page: Page) -> int:
    """The bit of ``page``'s LRU list in its mask (one per priority, garbage's first)."""
    return page.priority + 1


def lru_list(page: Page) -> int:
    """The LRU list of ``page``: its priority's, among the low-value lists if it is low value."""
    return page.priority + 1 + (_LOW_LISTS if page.low_value else 0)


def first_list(normal: int, low: int) -> int:
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
        # (``_link`` at the tail, written out: every release lists its pages here; the call cost the
        # free phase 0.5 % of its instructions)
        self._listed(page)
        i = lru_list(page)
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
        i = lru_list(page)
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

    def shelve(self, page: Page) -> int:
        """Its list; its links keep its neighbours while it is out (``unshelve`` goes back between them)."""
        i = lru_list(page)
        prev, nxt = page.lru_prev, page.lru_next
        self.remove(page)
        page.lru_prev, page.lru_next = prev, nxt
        return i

    def unshelve(self, page: Page, place: int) -> None:
        """Back after its older neighbour while that is in its list, else before its newer one,
        else first (both left: evictions take the oldest first, so it is the oldest of those that
        were there; pages listed since are newer)."""
        prev, nxt = page.lru_prev, page.lru_next
        page.lru_prev = page.lru_next = None
        if lru_list(page) != place:  # its priority or value changed meanwhile
            self.add(page)
        elif prev is not None and self.in_list(prev, place):
            self._link(page, place, prev, prev.lru_next)
        elif nxt is not None and self.in_list(nxt, place):
            self._link(page, place, nxt.lru_prev, nxt)
        else:
            self._link(page, place, None, self._heads[place])

    def in_list(self, page: Page, i: int) -> bool:
        """Whether ``page`` is listed in this evictor's list ``i``."""
        return page.in_evictor != NOT_LISTED and page.storage.evictor is self and lru_list(page) == i

    def _link(self, page: Page, i: int, prev: Page | None, nxt: Page | None) -> None:
        """List ``page`` in list ``i`` between ``prev`` and ``nxt`` (adjacent there; None: an end)."""
        self._listed(page)
        page.lru_prev = prev
        page.lru_next = nxt
        if prev is None:
            self._heads[i] = page
            if page.low_value:
                self._nonempty_low |= 1 << _lru_bit(page)
            else:
                self._nonempty |= 1 << _lru_bit(page)
        else:
            prev.lru_next = page
        if nxt is None:
            self._tails[i] = page
        else:
            nxt.lru_prev = page

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
            i = first_list(normal, low)
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
        i = first_list(self._nonempty, self._nonempty_low)
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
            i = first_list(normal, low)
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
                if page.lru_prev is not prev or lru_list(page) != i:
                    return f"LRU list {i}: broken back link or a page of priority {page.priority} (low value: {page.low_value})"
                prev = page
                page = page.lru_next
            mask = self._nonempty_low if i >= _LOW_LISTS else self._nonempty
            if self._tails[i] is not prev or bool(mask >> (i % _LOW_LISTS) & 1) != (prev is not None):
                return f"LRU list {i}: tail or non-empty bit out of date"
        return None


def lru_evictors(slots: list[int]) -> list[Evictor]:
    """A pool group's evictors under ``"lru"``, one per cache level (``slots[level]`` slots each)."""
    return [LruEvictor() for _ in slots]
