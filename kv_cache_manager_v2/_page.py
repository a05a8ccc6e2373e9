"""Pages and where they live: one slot of some cache level holding one block of one layer group
(``Page``), the storage of one pool group at one level (``PoolGroupStorage``: pools, slot
allocator, evictor, traffic counters), and the interface pages use there: the evictor
(``Evictor``: the eviction policy's interface; the policies are in ``_storage/_policies/``) and a
policy's per-page state (``PolicyState``, one handle on the page).

Storage never names the reuse tree: what a page needs of its tree node is ``PageNode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol, final

import rawref

from ._common import (
    BAD_PAGE_INDEX,
    CacheLevel,
    LayerGroupId,
    MemAddress,
    PageStatus,
    PoolGroupIndex,
    Priority,
    RequestSerial,
    SlotId,
    TokenIdExt,
)
from ._exceptions import LogicError
from ._storage._backend import MemoryPool, Pool
from ._storage._layout import PoolGroupLayout
from ._storage._slot_allocator import SlotAllocator
from ._storage._tiers._base import MediumAccess, Tier, memory

#: Priority of pages that no longer belong to a reusable block (their subtree was removed):
#: they are evicted before everything else.
GARBAGE_PRIORITY: Final = Priority(-1)

#: ``Page.in_evictor`` values: not listed, listed as DROPPABLE, listed as HELD.
NOT_LISTED: Final = 0
LISTED_DROPPABLE: Final = 1
LISTED_HELD: Final = 2

#: ``Page.expires`` of a page without retention
NO_EXPIRY: Final = float("inf")

#: ``Page.hint_end`` of a page without a close-time hint
NO_HINT: Final = -1

#: ``FrequencyState.use_serial`` of a page no request has been counted for
NO_SERIAL: Final = RequestSerial(-1)
#: bound once: mypyc looks a module's attribute up at every call (hot: once per page)
_untrack: Final = rawref.untrack
_fresh_ref: Final = rawref.fresh
_invalidate: Final = rawref.invalidate


class PageNode(Protocol):
    """What storage needs of the reuse-tree node a published page belongs to."""

    @property
    def key(self) -> bytes: ...

    @property
    def parent(self) -> PageNode | None: ...

    @property
    def tokens(self) -> Sequence[TokenIdExt]: ...

    @property
    def ordinal(self) -> int:
        """The block's index in its sequence."""

    @property
    def scope(self) -> tuple[int | None, int | None] | None:
        """The scope's ``(lora_id, salt)``."""

    @property
    def has_children(self) -> bool: ...


class PolicyState:
    """A page's state under its eviction policy (``Page.policy_state``: None until the policy
    gives it one): a policy that keeps values per page (use counts, a segment) subclasses it. It
    holds no references (a page's list links are ``Page.lru_prev`` / ``lru_next``, shared by the
    policies that keep lists)."""

    __slots__ = ()


class Evictor:
    """The eviction policy's interface: the pages one (cache level, pool group) may evict, in
    eviction order, what a use, a release and a drop of a tree page tell the policy, and a hold
    that is no use (``shelve``: back in its place after).

    ``count`` pages are listed, ``num_held`` of them HELD. Subclasses keep the order (one
    module per policy in ``_storage/_policies/``, named in its registry); the listing state
    (``Page.in_evictor``) and the counts are kept here. Priorities (lowest first, garbage before
    all), the tree's value (``Page.low_value``: first within a priority), retention (a priority
    kept for a while, ``_expiry.py``) and pins (a pinned page is in no evictor, ``_pins.py``)
    are the same layer around every policy.
    """

    __slots__ = ("count", "hears_uses", "num_held")

    def __init__(self) -> None:
        self.count = 0
        #: listed pages that are HELD (the rest are DROPPABLE)
        self.num_held = 0
        #: whether ``used``, ``released`` and ``dropped`` are called (a policy that needs them
        #: sets it): policies without cost one test per event there, not a call
        self.hears_uses = False

    @final
    def _listed(self, page: Page) -> None:
        """Bookkeeping of a page that enters the evictor (HELD if it has holders, else DROPPABLE)."""
        if page.num_holds:
            page.in_evictor = LISTED_HELD
            self.num_held += 1
        else:
            page.in_evictor = LISTED_DROPPABLE
        self.count += 1

    @final
    def _unlisted(self, page: Page) -> None:
        if page.in_evictor == LISTED_HELD:
            self.num_held -= 1
        page.in_evictor = NOT_LISTED
        self.count -= 1

    def add(self, page: Page) -> None:
        """List ``page`` (released by its last active owner, moved here, or re-prioritized)."""
        raise NotImplementedError

    def remove(self, page: Page) -> None:
        """Unlist a listed page (taken by a request, moved, or freed)."""
        raise NotImplementedError

    def taken(self, page: Page) -> None:
        """Unlist a listed page a new owner takes (a request reuses it)."""
        self.remove(page)

    def pop_victim(self) -> Page:
        """Remove and return the page to evict next (callers check ``count`` first)."""
        raise NotImplementedError

    def select(self, count: int, max_held: int) -> list[Page]:
        """Take out and return up to ``count`` pages in eviction order, at most ``max_held`` of them
        HELD (HELD pages beyond that are skipped: there is no room for them below)."""
        raise NotImplementedError

    def pages(self) -> list[Page]:
        """Every evictable page, in eviction order (for checks and statistics)."""
        raise NotImplementedError

    def structure_error(self) -> str | None:
        """The first inconsistency of the internal structure, or None (for the invariant checker)."""
        raise NotImplementedError

    def to_garbage(self, page: Page) -> None:
        """Move an evictable page to the front of the eviction order (it can no longer be reused).
        A page an eviction has already taken out is only marked."""
        if page.in_evictor == NOT_LISTED:
            page.priority = GARBAGE_PRIORITY
            return
        self.remove(page)
        page.priority = GARBAGE_PRIORITY
        self.add(page)

    def shelve(self, page: Page) -> int:
        """Take listed ``page`` out of the eviction order without a use (``_storage/_shelf.py``):
        nothing a policy counts changes. Returns its place, for ``unshelve``."""
        raise NotImplementedError

    def unshelve(self, page: Page, place: int) -> None:
        """List ``page`` (shelved, DROPPABLE or HELD again) where ``shelve`` found it, as if it had stayed
        (where its priority or value changed meanwhile: as ``set_priority`` lists it)."""
        raise NotImplementedError

    def became_leaf(self, page: Page) -> None:
        """``page``'s tree node lost its last child (the tree tells policies that park pages)."""

    def resize(self, num_slots: int) -> None:
        """The level now has ``num_slots`` slots of this pool group."""

    def used(self, page: Page, serial: RequestSerial, cached: bool) -> None:
        """(``hears_uses``) Request ``serial`` uses tree page ``page``: ``cached``, it was there
        before (a hit: a match, a partial match's source, a dedup); else the request publishes it."""

    def released(self, page: Page) -> None:
        """(``hears_uses``) Tree page ``page`` became DROPPABLE: its last owner let go."""

    def dropped(self, page: Page) -> None:
        """(``hears_uses``) Tree page ``page`` is dropped for good (its block leaves the cache)."""


class PoolGroupStorage:
    """The pools of one pool group at one cache level, the allocator of their shared slots, and
    the evictor of the level's evictable pages of that group, with its traffic counters."""

    __slots__ = (
        "allocator",
        "evictor",
        "is_last",
        "layout",
        "level",
        "media",
        "num_dropped",
        "num_evicted",
        "num_io_errors",
        "num_lost",
        "num_offloaded",
        "num_onboarded",
        "num_pinned",
        "num_retained",
        "pinned_share",
        "pools",
        "set_aside",
        "start_retention",
        "stop_retention",
        "tier",
    )

    def __init__(
        self,
        level: CacheLevel,
        tier: Tier,
        is_last: bool,
        layout: PoolGroupLayout,
        num_slots: int,
        pools: list[Pool],
        evictor: Evictor,
        media: list[MediumAccess],
    ) -> None:
        self.level = level
        #: the medium's tier object (builds and grows the pools)
        self.tier = tier
        #: each pool's access object (see ``_tiers``)
        self.media = [media[pool.medium] for pool in pools]
        #: the last level drops what it evicts; levels above move it down
        self.is_last = is_last
        self.layout = layout
        self.pools = pools
        self.allocator = SlotAllocator(num_slots, pools, layout.slot_sizes)
        #: the level's evictable pages of this group, in eviction order
        self.evictor = evictor
        # traffic (cumulative): pages dropped for good here (evicted reusable pages, pages lost to disk
        # errors), taken out of this level by eviction (moved down or dropped), evicted into it from
        # the level above, copied from it to a higher one; pages a disk read or write failed for
        self.num_dropped = self.num_evicted = self.num_offloaded = self.num_onboarded = self.num_io_errors = 0
        #: lost pages whose owners have not let go yet
        self.num_lost = 0
        #: pinned pages here (``_pins.py``: those whose pin this storage holds), and pages under
        #: retention (``_expiry.py``)
        self.num_pinned = 0
        #: ``max_pinned_share``: at most this share of the slots may hold pins
        self.pinned_share = 1.0
        self.num_retained = 0
        #: start the duration of a retained page's retention when it becomes reusable (``ExpiryQueue.start``),
        #: stop it when a request takes the page (``ExpiryQueue.stop``: a retention whose time is up ends)
        self.start_retention: Callable[[Page], None] | None = None
        self.stop_retention: Callable[[Page], None] | None = None
        #: slots beyond ``num_slots`` that hold no page, lent to the store below the levels; the
        #: allocator counts them as used
        self.set_aside = 0

    @property
    def index(self) -> PoolGroupIndex:
        return self.layout.index

    @property
    def pin_limit(self) -> int:
        """The most pinned pages this storage holds (``max_pinned_share`` of its slots)."""
        return int(self.pinned_share * self.num_slots)

    @property
    def num_slots(self) -> int:
        """Slots for pages (those set aside not counted)."""
        return self.allocator.num_slots - self.set_aside

    @property
    def num_used(self) -> int:
        return self.allocator.num_used - self.set_aside

    def memory_pool(self, pool: int) -> MemoryPool:
        """Pool ``pool`` of a memory level (GPU or host)."""
        return memory(self.pools[pool])

    def slot_address(self, pool: int, slot: SlotId) -> MemAddress:
        return MemAddress(self.memory_pool(pool).base_address + slot * self.layout.slot_sizes[pool])

    def release(self) -> None:
        for pool in self.pools:
            pool.release()


class Page:
    """A block's memory for one layer group.

    Owners count themselves: active requests lock (``num_locks``), suspended ones hold (``num_holds``).
    When the last owner lets go the slot is freed at once, so release is deterministic and never waits
    for the cycle collector. A page committed to the reuse tree (``node`` set) is not freed but becomes
    DROPPABLE: it waits in its pool group's evictor until reused or evicted. The tree refers to pages
    through ``page.ref()`` (a ``rawref.ref``), which is invalidated when the slot is freed.

    A page keeps its identity when it moves between cache levels (``storage``, ``slot`` and ``level``
    change; owners and the tree keep their references). Its level's evictor lists it while it is
    DROPPABLE, or HELD at a level above the last (``in_evictor`` says how). A page whose data was lost
    to a disk error is ``lost``: no slot, out of the tree, still counted by its owners until they let go.

    Pages are untracked by the cyclic garbage collector, like tree nodes: the evictor unlinks
    a page it stops listing, and the manager empties the evictors when it goes away.
    """

    __slots__ = (
        "_rawref",
        "anchor",
        "base_priority",
        "expires",
        "hint_end",
        "in_evictor",
        "level",
        "layer_group",
        "lost",
        "low_value",
        "lru_next",
        "lru_prev",
        "node",
        "num_holds",
        "num_locks",
        "num_pins",
        "pin_held",
        "policy_state",
        "priority",
        "retain_s",
        "slot",
        "storage",
        "stored_below",
    )

    _rawref: rawref.ref[Page] | None

    def __init__(
        self, storage: PoolGroupStorage, slot: SlotId, layer_group: LayerGroupId, priority: Priority, locked: bool
    ) -> None:
        self.storage = storage
        self.slot = slot
        self.level = storage.level
        self.layer_group = layer_group
        self.priority = priority
        self.num_locks = 1 if locked else 0
        self.num_holds = 0 if locked else 1
        self._rawref = None
        self.node: PageNode | None = None
        # links of the evictor's list while listed in one (LRU's lists, frequency's FIFO and parked pages)
        self.lru_prev: Page | None = None
        self.lru_next: Page | None = None
        self.in_evictor = NOT_LISTED
        self.lost = False
        #: the store below the levels has (or was sent) this page's data: dropping it writes nothing there
        self.stored_below = False
        #: set when published: a full-attention or sink block, whose loss removes the blocks after it
        self.anchor = False
        #: the tree's valuation (hybrid models): evicted before the other pages of its priority:
        #: KV no match can use (past the deepest snapshot on its path), or a block's incomplete
        #: snapshot; changed only through ``set_low_value`` (it places a listed page)
        self.low_value = False
        #: the eviction policy's own state of this page (``_storage/_policies/``), if it keeps any
        self.policy_state: PolicyState | None = None
        # Retention (``_storage/_expiry.py``): the priority is kept for ``retain_s`` seconds (0.0:
        # no duration) from the page's release, until ``expires`` (clock seconds; inf: not running),
        # then ``base_priority`` again; ``hint_end``: under a close-time hint, the last block
        # (ordinal) of the hinted history, whose reuse (the conversation continues) ends the hint
        self.retain_s = 0.0
        self.expires = NO_EXPIRY
        self.base_priority = priority
        self.hint_end = NO_HINT
        #: pins on this page (``_storage/_pins.py``), and whether its storage holds them (counted
        #: in ``num_pinned``, within the share): a page whose pins are held is in no evictor
        self.num_pins = 0
        self.pin_held = False
        _untrack(self)  # see the class docstring

    @property
    def status(self) -> PageStatus:
        if self.num_locks:
            return PageStatus.LOCKED
        if self.num_holds:
            return PageStatus.HELD
        return PageStatus.DROPPABLE

    def _list_if_held(self) -> None:
        """List a page that only suspended requests own, above the last level (it may spill down)."""
        if self.num_locks == 0 and not self.storage.is_last and not self.lost and not self.pin_held:
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

    def _droppable(self) -> None:
        """The last owner of a tree page let go: list it DROPPABLE (the policy hears of it)."""
        storage = self.storage
        evictor = storage.evictor
        if not self.pin_held:
            evictor.add(self)
        if self.retain_s != 0.0 and storage.start_retention is not None:
            storage.start_retention(self)  # its retention's duration runs from now
        if evictor.hears_uses:
            evictor.released(self)

    def used(self, serial: RequestSerial, cached: bool) -> None:
        """Request ``serial`` uses this tree page (``cached``: a hit, else it publishes it): its policy hears of it."""
        evictor = self.storage.evictor
        if evictor.hears_uses:
            evictor.used(self, serial, cached)

    def dropped(self) -> None:
        """This tree page is dropped for good (its block leaves the cache): its policy hears of it."""
        evictor = self.storage.evictor
        if evictor.hears_uses:
            evictor.dropped(self)

    def take(self, locked: bool) -> None:
        """A new owner (locking if ``locked``, else holding); a listed page leaves the evictor
        (a HELD page comes back as the newest); a retention's duration stops running (ends if its time is up)."""
        storage = self.storage
        if self.expires != NO_EXPIRY and storage.stop_retention is not None:
            storage.stop_retention(self)
        if self.in_evictor:
            storage.evictor.taken(self)
        if locked:
            self.num_locks += 1
        else:
            self.num_holds += 1
            if self.num_locks == 0 and not storage.is_last and not self.lost and not self.pin_held:
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
                self._droppable()
            else:
                self.free()
            return
        self.num_holds -= 1
        if self.num_locks == 0:
            if self.num_holds == 0:
                if self.in_evictor:
                    self.storage.evictor.remove(self)
                if self.node is not None:
                    self._droppable()
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

    def set_low_value(self, low: bool) -> None:
        """Evict before (``low``) or with the other pages of its priority (a listed page moves)."""
        if self.low_value == low:
            return
        if self.in_evictor:
            self.storage.evictor.remove(self)
            self.low_value = low
            self.storage.evictor.add(self)
        else:
            self.low_value = low

    def ref(self) -> rawref.ref[Page]:
        """The page's one non-owning reference (``rawref.ref(page)`` finds the same; made on first use)."""
        r = self._rawref
        if r is None:
            r = _fresh_ref(self)
            self._rawref = r
        return r

    def relocate(self, storage: PoolGroupStorage, slot: SlotId) -> None:
        """Now at ``slot`` of ``storage`` (the caller copied the data and frees the old slot). A
        pinned page's pins are held there within its share only (beyond it, e.g. pulled up to a
        tier whose share is taken, it is evicted like any page until it moves again)."""
        self.unhold_pins()
        if self.num_pins and storage.num_pinned < storage.pin_limit:
            storage.num_pinned += 1
            self.pin_held = True
        if self.retained:
            self.storage.num_retained -= 1
            storage.num_retained += 1
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

    def unhold_pins(self) -> None:
        """Its storage no longer holds its pins (the caller lists it where it should be)."""
        if self.pin_held:
            self.pin_held = False
            self.storage.num_pinned -= 1

    def relist(self) -> None:
        """List a page its level's evictor should hold (after a move): DROPPABLE, or HELD above the last level."""
        if (
            self.num_locks == 0
            and not self.lost
            and not self.pin_held
            and (self.num_holds == 0 or not self.storage.is_last)
        ):
            self.storage.evictor.add(self)

    def mark_lost(self) -> None:
        """The data is gone (disk error): free the slot, keep the owners' counts (they drop the page)."""
        if self.in_evictor:
            self.storage.evictor.remove(self)
        self.storage.allocator.free(self._vacate())
        self.lost = True
        self.storage.num_lost += 1

    @property
    def retained(self) -> bool:
        """Whether the page is under retention (a priority until an expiry time, or a close-time hint)."""
        return self.retain_s != 0.0 or self.hint_end != NO_HINT

    def _vacate(self) -> SlotId:
        """The page leaves its slot (freed, lost, handed off): its pins and retention go with it, refs
        to it read None from now on. Returns the slot."""
        self.num_pins = 0
        if self.pin_held:
            self.unhold_pins()
        if self.retain_s != 0.0 or self.hint_end != NO_HINT:  # (``retained``, without a call per freed page)
            self.expires, self.retain_s, self.hint_end = NO_EXPIRY, 0.0, NO_HINT
            self.storage.num_retained -= 1
        slot = self.slot
        self.slot = SlotId(BAD_PAGE_INDEX)
        r = self._rawref
        if r is not None:
            _invalidate(r)
            self._rawref = None
        return slot

    def __del__(self) -> None:
        # rawref's contract: a target invalidates its ref before it dies. Normally free() did. (The
        # method, not the module global: interpreted, globals may be gone at interpreter exit.)
        r = self._rawref
        if r is not None:
            r.invalidate()

    def leave_slot(self) -> SlotId:
        """Forget the slot without freeing it (whoever takes it frees it) and invalidate refs to this
        page (owners must be gone). Returns the slot."""
        return self._vacate()

    def free(self) -> None:
        """Give the slot back and invalidate refs to this page (owners must be gone)."""
        if self.slot == BAD_PAGE_INDEX:
            if not self.lost:
                raise LogicError("page freed twice")
            self.lost = False  # the last owner let go of a lost page: nothing to free
            self.storage.num_lost -= 1
            return
        self.storage.allocator.free(self._vacate())
