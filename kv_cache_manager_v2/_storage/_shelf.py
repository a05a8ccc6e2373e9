"""Pages kept out of eviction for a while without a use (``Shelf``): the manager's own work on
pages no request uses, such as placing a prefetch's reads and fetched values while the pages the
same prefetch brought (or is bringing) must stay where they are.

A lock would keep them too, but its release is a use: the policy lists the page as just released
(LRU: the newest; frequency: a new value, the simulated LRU told), and a retention duration
restarts. A shelved page is out of its evictor (not evictable, not counted as room) and changes
nothing a policy counts; ``restore`` lists it back exactly where it was (``Evictor.unshelve``),
its retention's duration running on as if it had stayed, unless it changed priority meanwhile
(listed as ``set_priority`` lists it). A page moved to another level meanwhile is listed there as
any moved page is; one whose block left the tree is freed.

Only the manager's own work runs between ``put`` and ``restore``: no request takes or releases a
shelved page then (the shelf counts a lock on it, so a request's release meanwhile would neither
list it nor start its retention's duration, and ``restore`` would list it back in its old place).
"""

from __future__ import annotations

from collections.abc import Iterable

from .._common import BAD_PAGE_INDEX
from .._page import Page, PoolGroupStorage


class Shelf:
    """The pages one operation shelved (see the module), restored by ``restore`` (last first)."""

    __slots__ = ("_pages", "_places", "_storages")

    def __init__(self) -> None:
        self._pages: list[Page] = []
        #: each page's place (``Evictor.shelve``; -1: it was in no evictor) and storage when shelved
        self._places: list[int] = []
        self._storages: list[PoolGroupStorage] = []

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, pages: Iterable[Page]) -> None:
        """Shelve ``pages``, but those a running request owns (or shelved already: neither is
        evictable now) and those without a slot. Each counts one more lock meanwhile (not taken:
        no owner, no use), so nothing lists it while it is out (a pin running out, say)."""
        for page in pages:
            if page.num_locks or page.slot == BAD_PAGE_INDEX:
                continue
            storage = page.storage
            self._places.append(storage.evictor.shelve(page) if page.in_evictor else -1)
            page.num_locks += 1
            self._pages.append(page)
            self._storages.append(storage)

    def restore(self) -> None:
        """List every shelved page back, the last shelved first (so each goes back between the
        neighbours it had); one in no evictor before, moved meanwhile, or whose pins ended, is
        listed as ``Page.relist`` lists it; one lost or owned by a request now is not."""
        pages, places, storages = self._pages, self._places, self._storages
        self._pages, self._places, self._storages = [], [], []
        for k in range(len(pages) - 1, -1, -1):
            page = pages[k]
            page.num_locks -= 1
            if page.in_evictor:  # (listed again meanwhile: its links are its list's)
                continue
            storage = page.storage
            place = places[k]
            ownerless = page.num_locks == 0 and page.num_holds == 0
            if page.num_locks or page.lost or page.slot == BAD_PAGE_INDEX or (ownerless and page.node is None):
                page.lru_prev = page.lru_next = None  # (its old neighbours)
                if ownerless and (page.lost or page.slot != BAD_PAGE_INDEX):
                    page.free()  # as a last release frees it (lost, or its block left the tree)
            elif place < 0 or storage is not storages[k] or page.pin_held or (page.num_holds and storage.is_last):
                page.lru_prev = page.lru_next = None
                page.relist()  # (nothing for a page pinned now, or HELD at the last level)
            else:
                storage.evictor.unshelve(page, place)
