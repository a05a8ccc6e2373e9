"""Evictable pages of one (cache level, pool group): LRU lists per priority, O(1) add/remove."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ._common import MAX_PRIORITY, Priority

if TYPE_CHECKING:
    from ._page import Page

#: Priority of pages that no longer belong to a reusable block (their subtree was removed):
#: they are evicted before everything else.
GARBAGE_PRIORITY: Final = Priority(-1)


class Evictor:
    """Lowest priority first, least recently released first within a priority.

    One intrusive doubly linked list per priority (``Page.lru_prev`` / ``lru_next``), plus one
    for garbage ahead of priority 0, and a bit mask of the non-empty lists, so add, remove and
    pick-victim allocate nothing.
    """

    __slots__ = ("_heads", "_nonempty", "_tails", "count")

    def __init__(self) -> None:
        # list i holds priority i - 1: list 0 is garbage
        self._heads: list[Page | None] = [None] * (MAX_PRIORITY + 2)  # oldest
        self._tails: list[Page | None] = [None] * (MAX_PRIORITY + 2)  # newest
        self._nonempty = 0  # bit i set: list i has pages
        self.count = 0

    def add(self, page: Page) -> None:
        i = page.priority + 1
        tail = self._tails[i]
        page.lru_prev = tail
        page.lru_next = None
        if tail is None:
            self._heads[i] = page
            self._nonempty |= 1 << i
        else:
            tail.lru_next = page
        self._tails[i] = page
        self.count += 1

    def remove(self, page: Page) -> None:
        i = page.priority + 1
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
            self._nonempty &= ~(1 << i)
        self.count -= 1

    def to_garbage(self, page: Page) -> None:
        """Move an evictable page to the front of the eviction order (it can no longer be reused)."""
        self.remove(page)
        page.priority = GARBAGE_PRIORITY
        self.add(page)

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
