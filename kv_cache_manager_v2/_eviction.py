"""Evictable (DROPPABLE) pages of one pool group: LRU lists per priority, O(1) add/remove."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import MAX_PRIORITY

if TYPE_CHECKING:
    from ._page import Page


class Evictor:
    """Lowest priority first, least recently released first within a priority.

    One intrusive doubly linked list per priority (``Page.lru_prev`` / ``lru_next``), and a
    bit mask of the non-empty priorities, so add, remove and pick-victim allocate nothing.
    """

    __slots__ = ("_heads", "_nonempty", "_tails", "count")

    def __init__(self) -> None:
        self._heads: list[Page | None] = [None] * (MAX_PRIORITY + 1)  # oldest
        self._tails: list[Page | None] = [None] * (MAX_PRIORITY + 1)  # newest
        self._nonempty = 0  # bit p set: priority p has pages
        self.count = 0

    def add(self, page: Page) -> None:
        p = page.priority
        tail = self._tails[p]
        page.lru_prev = tail
        page.lru_next = None
        if tail is None:
            self._heads[p] = page
            self._nonempty |= 1 << p
        else:
            tail.lru_next = page
        self._tails[p] = page
        self.count += 1

    def remove(self, page: Page) -> None:
        p = page.priority
        prev = page.lru_prev
        nxt = page.lru_next
        if prev is None:
            self._heads[p] = nxt
        else:
            prev.lru_next = nxt
        if nxt is None:
            self._tails[p] = prev
        else:
            nxt.lru_prev = prev
        page.lru_prev = page.lru_next = None
        if self._heads[p] is None:
            self._nonempty &= ~(1 << p)
        self.count -= 1

    def pop_victim(self) -> Page:
        """Remove and return the page to evict next (callers check ``count`` first)."""
        mask = self._nonempty
        if mask == 0:
            raise IndexError("no evictable page")
        page = self._heads[(mask & -mask).bit_length() - 1]
        assert page is not None
        self.remove(page)
        return page

    def pages(self) -> list[Page]:
        """Every evictable page, in eviction order (for checks and statistics)."""
        out: list[Page] = []
        mask = self._nonempty
        while mask:
            page = self._heads[(mask & -mask).bit_length() - 1]
            while page is not None:
                out.append(page)
                page = page.lru_next
            mask &= mask - 1
        return out
