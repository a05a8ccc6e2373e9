"""Evictable (DROPPABLE) pages of one pool group: LRU lists per priority, O(1) add/remove."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._page import Page


class Evictor:
    """Lowest priority first, least recently released first within a priority."""

    def __init__(self) -> None:
        self._lists: dict[int, dict[Page, None]] = {}
        self.count = 0

    def add(self, page: Page) -> None:
        lst = self._lists.get(page.priority)
        if lst is None:
            lst = self._lists[page.priority] = {}
        lst[page] = None
        self.count += 1

    def remove(self, page: Page) -> None:
        del self._lists[page.priority][page]
        self.count -= 1

    def pop_victim(self) -> Page:
        """Remove and return the page to evict next (callers check ``count`` first)."""
        for prio in sorted(self._lists):
            lst = self._lists[prio]
            if lst:
                page = next(iter(lst))
                del lst[page]
                self.count -= 1
                return page
        raise IndexError("no evictable page")
