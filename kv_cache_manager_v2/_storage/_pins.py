"""Pins: prefixes kept cached whatever the eviction policy (``KVCacheManager.pin`` / ``unpin``).

A pinned page (``Page.num_pins`` > 0) whose storage holds its pins (``Page.pin_held``) is in no
evictor: it is never evicted (nor moved down) while pinned, wherever it is. Each (cache level,
pool group) holds at most ``max_pinned_share`` of its slots pinned (``PoolGroupStorage.num_pinned``,
``pin_limit``): a pin beyond that is refused before anything changes, and a pinned page that
moves (a request pulls it up to the GPU tier) holds its pins at the new place only within that
share; beyond it, it is an ordinary page there (evicted, moved down as usual) until it moves to a
place with room in its share, where its pins hold again (or is pinned afresh, or its tier grows). A pin with a duration ends by itself: its expiry time is
consulted when the evictor runs, like retention's (``_expiry.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable

from .._common import BAD_PAGE_INDEX
from .._page import Page, PoolGroupStorage


class Pin:
    """The pages of one pinned prefix, and when the pin ends (inf: when unpinned)."""

    __slots__ = ("pages", "until")

    def __init__(self, pages: list[Page], until: float) -> None:
        self.pages = pages
        self.until = until


def _hold(page: Page) -> None:
    """``page``'s storage holds its pins: out of the evictor, counted (the caller checked the share)."""
    storage = page.storage
    if page.in_evictor:
        storage.evictor.remove(page)
    storage.num_pinned += 1
    page.pin_held = True


class PinTable:
    """The manager's pins by key (scope and tokens), bounded per (level, pool group)."""

    __slots__ = ("_heap", "_seq", "clock", "pins", "share")

    def __init__(self, clock: Callable[[], float], share: float) -> None:
        self.clock = clock
        #: at most this share of each (level, pool group)'s slots may be pinned
        self.share = share
        self.pins: dict[Hashable, Pin] = {}
        self._heap: list[tuple[float, int, Hashable, Pin]] = []
        self._seq = 0

    def pin(self, key: Hashable, pages: list[Page], duration_s: float | None) -> None:
        """Pin ``pages`` (tree pages, distinct) under ``key`` (a key pinned again: its pages
        and duration are replaced; no pages: no pin). Raises ``ValueError`` beyond a storage's share,
        changing nothing."""
        if not pages:
            self.unpin(key)
            return
        until = float("inf") if duration_s is None else self.clock() + duration_s  # (the clock first)
        old = self.pins.get(key)
        new: dict[int, tuple[PoolGroupStorage, int]] = {}  # pages pinned now for the first time
        for page in pages:
            if page.num_pins == 0:
                s = page.storage
                entry = new.get(id(s))
                new[id(s)] = (s, (entry[1] if entry is not None else 0) + 1)
        for storage, count in new.values():
            limit = storage.pin_limit
            if storage.num_pinned + count > limit:
                raise ValueError(
                    f"pin refused: {count} more pinned pages would make {storage.num_pinned + count} of the "
                    f"{storage.num_slots} slots of pool group {storage.index} at cache level {storage.level} "
                    f"pinned, beyond max_pinned_share {self.share:g} ({limit} slots); unpin something first"
                )
        for page in pages:
            if page.num_pins == 0:
                _hold(page)
            page.num_pins += 1
        self.hold_again(pages)  # pinned already, not held (a shrink, a pull beyond the share): held where room is
        if old is not None:
            del self.pins[key]  # (the pins stay in the order pinned: a pin renewed is the newest)
            self._release(old)
        pin = Pin(pages, until)
        self.pins[key] = pin
        if duration_s is not None:
            self._seq += 1
            heapq.heappush(self._heap, (until, self._seq, key, pin))

    def unpin(self, key: Hashable) -> bool:
        """End the pin of ``key``; False if there is none."""
        pin = self.pins.pop(key, None)
        if pin is None:
            return False
        self._release(pin)
        return True

    def expire(self) -> None:
        """End the pins whose duration ran out."""
        heap = self._heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            key, pin = entry[2], entry[3]
            if self.pins.get(key) is pin:
                del self.pins[key]
                self._release(pin)

    def fit_share(self, storage: PoolGroupStorage, num_slots: int) -> list[Page]:
        """``storage`` is about to have ``num_slots`` slots (a tier shrink): the pages whose pins
        it holds beyond ``max_pinned_share`` of them are ordinary pages there from now on, still
        pinned (as if pulled up beyond the share: their pins hold again where they move to room
        in a share), the oldest pins' first, each pin's last blocks first. Returns those pages
        (``hold_again`` undoes it)."""
        excess = storage.num_pinned - int(storage.pinned_share * num_slots)
        released: list[Page] = []
        for pin in self.pins.values():
            if excess <= 0:
                break
            for page in reversed(pin.pages):
                if excess > 0 and page.pin_held and page.storage is storage:
                    page.unhold_pins()
                    page.relist()
                    released.append(page)
                    excess -= 1
        return released

    def grown(self, storage: PoolGroupStorage) -> None:
        """``storage`` grew (a tier resize): its pinned pages whose pins it does not hold (let go by
        a shrink, pulled up beyond the share) hold them again within the share, the oldest pins' first."""
        for pin in self.pins.values():
            if storage.num_pinned >= storage.pin_limit:
                break
            self.hold_again([page for page in pin.pages if page.storage is storage])

    @staticmethod
    def hold_again(pages: list[Page]) -> None:
        """The pages still pinned whose pins are not held hold them again where they are, within the
        share there, in order (undoes ``fit_share``: a shrink refused before anything else changed)."""
        for page in pages:
            ok = page.num_pins and not page.pin_held and page.slot != BAD_PAGE_INDEX
            if ok and page.storage.num_pinned < page.storage.pin_limit:
                _hold(page)

    def clear(self) -> None:
        """Forget every pin (their pages were dropped with the reusable blocks)."""
        for pin in self.pins.values():
            self._release(pin)
        self.pins.clear()
        self._heap.clear()

    @staticmethod
    def _release(pin: Pin) -> None:
        for page in pin.pages:
            if page.num_pins == 0:
                continue  # freed meanwhile (its pins went with it)
            page.num_pins -= 1
            if page.num_pins == 0 and page.pin_held and page.slot != BAD_PAGE_INDEX:
                page.unhold_pins()
                if page.node is not None:
                    page.relist()  # (a page whose pins were not held is listed already, or owned)
        pin.pages = []
