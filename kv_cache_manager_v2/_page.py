"""Pages: one slot in some tier holding one block of one life cycle, and who owns it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import rawref

from ._common import BAD_PAGE_INDEX, LifeCycleId, PageStatus, Priority, SlotId
from ._exceptions import LogicError

if TYPE_CHECKING:
    from ._reuse._tree import Node
    from ._storage._storage_manager import PoolGroupStorage


class Page:
    """A block's memory for one life cycle.

    Owners count themselves: active requests lock (``num_locks``), suspended ones hold
    (``num_holds``). When the last owner lets go the slot is freed at once, so release is
    deterministic and never waits for the cycle collector. A page committed to the reuse
    tree (``node`` set) is not freed but becomes DROPPABLE: it waits in its pool group's
    evictor until reused or evicted. The tree refers to pages through ``rawref.ref(page)``,
    which is invalidated when the slot is freed.
    """

    __slots__ = (
        "_rawref",
        "level",
        "life_cycle",
        "lru_next",
        "lru_prev",
        "node",
        "num_holds",
        "num_locks",
        "priority",
        "slot",
        "storage",
    )

    _rawref: rawref.ref[Page] | None

    def __init__(
        self, storage: PoolGroupStorage, slot: SlotId, life_cycle: LifeCycleId, priority: Priority, locked: bool
    ) -> None:
        self.storage = storage
        self.slot = slot
        self.level = storage.level
        self.life_cycle = life_cycle
        self.priority = priority
        self.num_locks = 1 if locked else 0
        self.num_holds = 0 if locked else 1
        self._rawref = None
        self.node: Node | None = None
        # links of the evictor's LRU list while DROPPABLE
        self.lru_prev: Page | None = None
        self.lru_next: Page | None = None

    @property
    def status(self) -> PageStatus:
        if self.num_locks:
            return PageStatus.LOCKED
        if self.num_holds:
            return PageStatus.HELD
        return PageStatus.DROPPABLE

    def lock_from_hold(self) -> None:
        self.num_holds -= 1
        self.num_locks += 1

    def hold_from_lock(self) -> None:
        self.num_locks -= 1
        self.num_holds += 1

    def take(self, locked: bool) -> None:
        """A new owner (locking if ``locked``, else holding); a DROPPABLE page leaves the evictor."""
        if self.num_locks == 0 and self.num_holds == 0:
            self.storage.evictor.remove(self)
        if locked:
            self.num_locks += 1
        else:
            self.num_holds += 1

    def release(self, locked: bool) -> None:
        """One owner lets go; after the last, a committed page becomes DROPPABLE, others are freed."""
        if locked:
            self.num_locks -= 1
        else:
            self.num_holds -= 1
        if self.num_locks == 0 and self.num_holds == 0:
            if self.node is not None:
                self.storage.evictor.add(self)
            else:
                self.free()

    def __del__(self) -> None:
        # rawref's contract: a target invalidates its ref before it dies. Normally free() did.
        r = self._rawref
        if r is not None:
            r.invalidate()

    def free(self) -> None:
        """Give the slot back and invalidate refs to this page (owners must be gone)."""
        if self.slot == BAD_PAGE_INDEX:
            raise LogicError("page freed twice")
        self.storage.allocator.free(self.slot)
        self.slot = SlotId(BAD_PAGE_INDEX)
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None
