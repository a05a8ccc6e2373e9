"""Evictable pages of one (cache level, pool group): LRU lists per priority, O(1) add/remove.

Evictable are DROPPABLE pages (reusable cache, or garbage), and HELD pages (owned only by
suspended requests) when the level is not the last: those move down a level when evicted,
never get dropped. The evictor counts the two kinds apart, for the availability arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ._common import MAX_PRIORITY, Priority

if TYPE_CHECKING:
    from ._page import Page

#: Priority of pages that no longer belong to a reusable block (their subtree was removed):
#: they are evicted before everything else.
GARBAGE_PRIORITY: Final = Priority(-1)

#: ``Page.in_evictor`` values: not listed, listed as DROPPABLE, listed as HELD.
NOT_LISTED: Final = 0
LISTED_DROPPABLE: Final = 1
LISTED_HELD: Final = 2


class Evictor:
    """Lowest priority first, least recently released first within a priority.

    One intrusive doubly linked list per priority (``Page.lru_prev`` / ``lru_next``), plus one
    for garbage ahead of priority 0, and a bit mask of the non-empty lists, so add, remove and
    pick-victim allocate nothing.
    """

    __slots__ = ("_heads", "_nonempty", "_tails", "count", "num_held")

    def __init__(self) -> None:
        # list i holds priority i - 1: list 0 is garbage
        self._heads: list[Page | None] = [None] * (MAX_PRIORITY + 2)  # oldest
        self._tails: list[Page | None] = [None] * (MAX_PRIORITY + 2)  # newest
        self._nonempty = 0  # bit i set: list i has pages
        self.count = 0
        #: listed pages that are HELD (the rest are DROPPABLE)
        self.num_held = 0

    def add(self, page: Page) -> None:
        """List ``page`` as the newest of its priority (HELD if it has holders, else DROPPABLE)."""
        if page.num_holds:
            page.in_evictor = LISTED_HELD
            self.num_held += 1
        else:
            page.in_evictor = LISTED_DROPPABLE
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
        if page.in_evictor == LISTED_HELD:
            self.num_held -= 1
        page.in_evictor = NOT_LISTED
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
        """Move an evictable page to the front of the eviction order (it can no longer be reused).
        A page an eviction has already taken out is only marked."""
        if page.in_evictor == NOT_LISTED:
            page.priority = GARBAGE_PRIORITY
            return
        self.remove(page)
        page.priority = GARBAGE_PRIORITY
        self.add(page)

    def select(self, count: int, max_held: int) -> list[Page]:
        """Take out and return up to ``count`` pages in eviction order, at most ``max_held`` of them
        HELD (HELD pages beyond that are skipped: there is no room for them below)."""
        out: list[Page] = []
        held = 0
        mask = self._nonempty
        while mask and len(out) < count:
            page = self._heads[(mask & -mask).bit_length() - 1]
            while page is not None and len(out) < count:
                if page.in_evictor != LISTED_HELD:
                    out.append(page)
                elif held < max_held:
                    out.append(page)
                    held += 1
                page = page.lru_next
            mask &= mask - 1
        for p in out:
            self.remove(p)
        return out

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
