"""Pages: one slot in some tier holding one block of one life cycle, and who owns it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import rawref

from ._common import BAD_PAGE_INDEX, LifeCycleId, PageStatus, Priority, SlotId
from ._eviction import NO_SERIAL, NOT_IN_HEAP, NOT_LISTED
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

    A page keeps its identity when it moves between cache levels (``storage``, ``slot`` and
    ``level`` change; owners and the tree keep their references). Its level's evictor lists it
    while it is DROPPABLE, or HELD at a level above the last (``in_evictor`` says how).
    A page whose data was lost to a disk error is ``lost``: no slot, out of the tree, still
    counted by its owners until they let go.

    Pages are untracked by the cyclic garbage collector, like tree nodes: the evictor unlinks
    a page it stops listing, and the manager empties the evictors when it goes away.
    """

    __slots__ = (
        "_rawref",
        "anchor",
        "ev_deadline",
        "ev_key",
        "ev_pos",
        "ev_seq",
        "first_use",
        "in_evictor",
        "level",
        "life_cycle",
        "lost",
        "lru_next",
        "lru_prev",
        "node",
        "num_holds",
        "num_locks",
        "priority",
        "remote_copy",
        "slot",
        "storage",
        "use_serial",
        "uses",
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
        # links of the evictor's LRU list (frequency policy: of its parked list) while listed there
        self.lru_prev: Page | None = None
        self.lru_next: Page | None = None
        self.in_evictor = NOT_LISTED
        self.lost = False
        #: the remote tier has (or was sent) this page's data: dropping it locally writes nothing
        self.remote_copy = False
        #: set when published: a full-attention or sink block, whose loss removes the blocks after it
        self.anchor = False
        # Frequency policy (see _eviction.py): requests that used the block (history included),
        # the use clock at its first use, the last request counted; the value and sequence
        # number the page was listed with, its heap index (or NOT_IN_HEAP / PARKED), and its
        # LRU deadline (UseHistory: adaptive aging).
        self.uses = 0
        self.first_use = 0
        self.use_serial = NO_SERIAL
        self.ev_key = 0.0
        self.ev_seq = 0
        self.ev_pos = NOT_IN_HEAP
        self.ev_deadline = 0
        rawref.untrack(self)  # see the class docstring

    @property
    def status(self) -> PageStatus:
        if self.num_locks:
            return PageStatus.LOCKED
        if self.num_holds:
            return PageStatus.HELD
        return PageStatus.DROPPABLE

    def _list_if_held(self) -> None:
        """List a page that only suspended requests own, above the last level (it may spill down)."""
        if self.num_locks == 0 and not self.storage.is_last and not self.lost:
            self.storage.evictor.add(self)

    def lock_from_hold(self) -> None:
        if self.in_evictor:
            self.storage.evictor.remove(self)
        self.num_holds -= 1
        self.num_locks += 1

    def hold_from_lock(self) -> None:
        self.num_locks -= 1
        self.num_holds += 1
        self._list_if_held()

    def take(self, locked: bool) -> None:
        """A new owner (locking if ``locked``, else holding); a listed page leaves the evictor
        (a HELD page comes back as the newest)."""
        storage = self.storage
        if self.in_evictor:
            storage.evictor.taken(self)
        if locked:
            self.num_locks += 1
        else:
            self.num_holds += 1
            if self.num_locks == 0 and not storage.is_last and not self.lost:
                storage.evictor.add(self)

    def release(self, locked: bool) -> None:
        """One owner lets go; after the last, a committed page becomes DROPPABLE, others are freed."""
        if locked:  # a locked page is in no evictor
            self.num_locks -= 1
            if self.num_locks:
                return
            if self.num_holds:
                self._list_if_held()  # only suspended requests own it now
            elif self.node is not None:
                self.storage.evictor.add(self)
            else:
                self.free()
            return
        self.num_holds -= 1
        if self.num_locks == 0:
            if self.num_holds == 0:
                if self.in_evictor:
                    self.storage.evictor.remove(self)
                if self.node is not None:
                    self.storage.evictor.add(self)
                else:
                    self.free()
            elif not self.in_evictor:
                self._list_if_held()

    def set_priority(self, priority: Priority) -> None:
        """Change the eviction priority (a listed page moves to its new priority's list)."""
        if self.in_evictor:
            self.storage.evictor.remove(self)
            self.priority = priority
            self.storage.evictor.add(self)
        else:
            self.priority = priority

    def relocate(self, storage: PoolGroupStorage, slot: SlotId) -> None:
        """Now at ``slot`` of ``storage`` (the caller copied the data and frees the old slot)."""
        self.storage = storage
        self.slot = slot
        self.level = storage.level

    def exchange_location(self, other: Page) -> None:
        """Swap where this page and ``other`` (same pool group, same data) live; evictor listing follows."""
        a, b = self.in_evictor, other.in_evictor
        if a:
            self.storage.evictor.remove(self)
        if b:
            other.storage.evictor.remove(other)
        storage, slot = self.storage, self.slot
        self.relocate(other.storage, other.slot)
        other.relocate(storage, slot)
        if a:
            self.relist()
        if b:
            other.relist()

    def relist(self) -> None:
        """List a page its level's evictor should hold (after a move): DROPPABLE, or HELD above the last level."""
        if self.num_locks == 0 and not self.lost and (self.num_holds == 0 or not self.storage.is_last):
            self.storage.evictor.add(self)

    def mark_lost(self) -> None:
        """The data is gone (disk error): free the slot, keep the owners' counts (they drop the page)."""
        if self.in_evictor:
            self.storage.evictor.remove(self)
        self.storage.allocator.free(self.slot)
        self.slot = SlotId(BAD_PAGE_INDEX)
        self.lost = True
        self.storage.num_lost += 1
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None

    def __del__(self) -> None:
        # rawref's contract: a target invalidates its ref before it dies. Normally free() did.
        r = self._rawref
        if r is not None:
            r.invalidate()

    def hand_off(self) -> SlotId:
        """Forget the slot without freeing it (the remote tier's writer sends its data, then the
        storage manager reuses it) and invalidate refs to this page (owners must be gone)."""
        slot = self.slot
        self.slot = SlotId(BAD_PAGE_INDEX)
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None
        return slot

    def free(self) -> None:
        """Give the slot back and invalidate refs to this page (owners must be gone)."""
        if self.slot == BAD_PAGE_INDEX:
            if not self.lost:
                raise LogicError("page freed twice")
            self.lost = False  # the last owner let go of a lost page: nothing to free
            self.storage.num_lost -= 1
            return
        self.storage.allocator.free(self.slot)
        self.slot = SlotId(BAD_PAGE_INDEX)
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None
