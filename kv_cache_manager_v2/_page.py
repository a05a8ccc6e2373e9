"""Pages: one slot in some tier holding one block of one life cycle, and who owns it."""

from __future__ import annotations

import rawref

from ._common import BAD_PAGE_INDEX, CacheLevel, LifeCycleId, PageStatus, Priority, SlotId
from ._exceptions import LogicError
from ._storage._storage import PoolGroupStorage


class Page:
    """A block's memory for one life cycle.

    Owners count themselves: active requests lock (``num_locks``), suspended ones hold
    (``num_holds``). When the last owner lets go the slot is freed at once, so release is
    deterministic and never waits for the cycle collector. Others refer to a page through
    ``rawref.ref(page)``, which is invalidated when the slot is freed.
    """

    _rawref: rawref.ref[Page] | None

    def __init__(
        self, storage: PoolGroupStorage, slot: SlotId, life_cycle: LifeCycleId, priority: Priority, locked: bool
    ) -> None:
        self.storage = storage
        self.slot = slot
        self.level = CacheLevel(0)
        self.life_cycle = life_cycle
        self.priority = priority
        self.num_locks = 1 if locked else 0
        self.num_holds = 0 if locked else 1
        self._rawref = None

    @property
    def status(self) -> PageStatus:
        if self.num_locks:
            return PageStatus.LOCKED
        if self.num_holds:
            return PageStatus.HELD
        return PageStatus.DROPPABLE

    @property
    def is_freed(self) -> bool:
        return self.slot == BAD_PAGE_INDEX

    def lock_from_hold(self) -> None:
        self.num_holds -= 1
        self.num_locks += 1

    def hold_from_lock(self) -> None:
        self.num_locks -= 1
        self.num_holds += 1

    def release(self, locked: bool) -> None:
        """One owner (locking if ``locked``, else holding) lets go; frees the slot after the last."""
        if locked:
            self.num_locks -= 1
        else:
            self.num_holds -= 1
        if self.num_locks == 0 and self.num_holds == 0:
            self._free()

    def _free(self) -> None:
        if self.slot == BAD_PAGE_INDEX:
            raise LogicError("page freed twice")
        self.storage.allocator.free(self.slot)
        self.slot = SlotId(BAD_PAGE_INDEX)
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None
