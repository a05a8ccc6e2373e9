"""The remote tier's side of local storage: what a dropped or published page sends to the remote
store (``RemoteStore``, below the last local level), and the slots the store reads into.

A reusable full block dropped for good at a last level whose slots the writer thread can read as
they are (host memory, disk: ``MediumAccess.can_detach``) is *handed off*: its slot goes to the
writer, which sends the data from there, and a parked *headroom* slot takes its place (no copy on the
scheduler's thread). Otherwise the data is copied into the store's write ring (``spill``).
Write-through queues the pages published since the last flush and copies them out in one batch.

Fetched pages are read straight into new slots of a host-memory level (``read_into_slots``: the
slots registered with a zero-copy backend), verified there before any page holds them. Headroom
slots, and slots a read past its deadline may still write (*held* until the backend says it
returned), are the storage's ``set_aside`` slots: allocated, not capacity.
"""

from __future__ import annotations

from typing import Final

import rawref

from ..._common import LayerGroupId, SlotId
from ..._page import Page, PoolGroupStorage
from .._backend import HOST_MEMORY
from .._copy_engine import CopyEngine
from .._expiry import ExpiryQueue
from .._remote._store import RemoteStore
from .._remote._value import HEADER_BYTES, Carried, carried_priority, value_retention, verify_parts

#: most headroom slots one pool group gets for the remote tier's writes
MAX_HEADROOM: Final = 4096

#: the retention of a span given back unused (never written)
NOTHING_CARRIED: Final = (0, 0, 0.0, 0.0, 0)


class RemoteTier:
    """Writes to ``remote`` the reusable full-block pages local storage lets go of."""

    def __init__(
        self,
        remote: RemoteStore,
        copier: CopyEngine,
        tokens_per_block: int,
        num_pool_groups: int,
        expiries: ExpiryQueue,
    ) -> None:
        self.remote = remote
        #: a written block's retention goes into its value's header (``ExpiryQueue.carried``)
        self.expiries = expiries
        self.copier = copier
        self.tokens_per_block = tokens_per_block
        self.num_pool_groups = num_pool_groups
        #: write-through pages published since the last ``flush_write_through`` (emptied in place:
        #: the storage manager tests this very list on its allocation path)
        self.write_through: list[rawref.ref[Page]] = []
        #: per pool group (``id``): its headroom, and its headroom slots not being written from (the
        #: writer appends, the scheduler's thread pops)
        self.headroom: dict[int, int] = {}
        self.parked: dict[int, list[SlotId]] = {}
        #: slots a read past its deadline may still write, until the backend is no longer ``busy``
        self.held: list[tuple[PoolGroupStorage, SlotId]] = []

    # ------------------------------------------------------------------ headroom
    @staticmethod
    def can_hand_off(storage: PoolGroupStorage) -> bool:
        """Whether a dropped page's slot can go to the writer as it is (host memory or disk)."""
        return all(access.can_detach() for access in storage.media)

    def headroom_for(self, storage: PoolGroupStorage, num_slots: int) -> int:
        """Headroom of a last-level pool group with ``num_slots`` slots: the write queue's budget
        (``max_pending_bytes``, split among pool groups), at most as many slots as it has and what
        its reserved address space takes; 0 where slots cannot be handed off."""
        if not self.can_hand_off(storage):
            return 0
        headroom = max(1, self.remote.cfg.max_pending_bytes // (self.num_pool_groups * storage.layout.slot_bytes))
        headroom = min(headroom, num_slots, MAX_HEADROOM)
        for pool, size in zip(storage.pools, storage.layout.slot_sizes):
            headroom = min(headroom, pool.reserved_bytes // size - num_slots)
        return max(headroom, 0)

    def headroom_of(self, storage: PoolGroupStorage) -> int:
        """The headroom slots ``storage`` has (0: none)."""
        return self.headroom.get(id(storage), 0)

    def parked_of(self, storage: PoolGroupStorage) -> list[SlotId]:
        """The headroom slots of ``storage`` not being written from."""
        return self.parked.get(id(storage), [])

    def add_headroom(self, storage: PoolGroupStorage, headroom: int) -> None:
        """Give ``storage`` (which has none) ``headroom`` slots past its slots, all parked."""
        num_slots = storage.allocator.num_slots
        if headroom <= 0:
            return
        for pool, size in zip(storage.pools, storage.layout.slot_sizes):
            pool.ensure_mapped((num_slots + headroom) * size)
        storage.allocator.resize(num_slots + headroom)
        self.parked[id(storage)] = storage.allocator.allocate(headroom)
        self.headroom[id(storage)] = headroom
        storage.set_aside += headroom

    def register_slots(self, storage: PoolGroupStorage) -> None:
        """Tell the store where the slots of ``storage`` lie in host memory (a zero-copy backend
        registers them: handed-off slots are sent from there, fetched pages read into them)."""
        for medium, pool in zip(storage.media, storage.pools):
            view = medium.host_bytes(pool, 0, pool.reserved_bytes) if pool.medium == HOST_MEMORY else None
            if view is not None:
                self.remote.backend.register(view)

    def drop_headroom(self, storage: PoolGroupStorage) -> None:
        """Turn the headroom of ``storage`` (none in flight) into ordinary free slots."""
        for slot in self.parked.pop(id(storage), []):
            storage.allocator.free(slot)
        storage.set_aside -= self.headroom.pop(id(storage), 0)

    # ------------------------------------------------------------------ reads into slots
    @staticmethod
    def reads_into(storage: PoolGroupStorage) -> bool:
        """Whether fetched values can be read straight into slots of ``storage`` (host memory)."""
        return all(pool.medium == HOST_MEMORY for pool in storage.pools)

    def read_into_slots(
        self, keys: list[bytes], checks: list[tuple[int, bytes]], targets: list[tuple[PoolGroupStorage, SlotId]]
    ) -> list[Carried | None] | None:
        """Read the value of ``keys[i]`` (layer group and block key ``checks[i]``) into the allocated
        slot ``targets[i]`` (``reads_into`` storages) in one call and verify it there: the retention the
        value carries where the slot now holds that page intact, else None; None: the call failed. Every other slot is freed, or held
        while a call past its deadline may still write it."""
        self.settle()
        remote = self.remote
        headers = memoryview(bytearray(HEADER_BYTES * len(keys)))
        parts: list[list[memoryview]] = []
        for i, (storage, slot) in enumerate(targets):
            views = [headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]]
            for access, pool, size in zip(storage.media, storage.pools, storage.layout.slot_sizes):
                view = access.host_bytes(pool, slot, size)  # (after the copies still touching it)
                assert view is not None
                views.append(view)
            parts.append(views)
        got = remote.fetch_into(keys, parts)
        ok: list[Carried | None] = [None] * len(keys)
        if got is not None:
            fp = remote.fingerprint
            for i, (storage, _) in enumerate(targets):
                if not got[i]:
                    continue
                layer_group, block_key = checks[i]
                if verify_parts(parts[i][0], parts[i][1:], layer_group, fp, block_key, storage.layout.slot_bytes):
                    ok[i] = value_retention(parts[i][0])
                else:
                    remote.corrupt_pages += 1
        parts.clear()  # (views of the pools' memory)
        hold = got is None and remote.backend.busy()
        for i, (storage, slot) in enumerate(targets):
            if ok[i] is not None:
                continue
            if hold:
                storage.set_aside += 1
                self.held.append((storage, slot))
            else:
                storage.allocator.free(slot)
        return ok if got is not None else None

    @staticmethod
    def adopt(
        needed: list[tuple[int, int]],
        slots: dict[tuple[int, int], tuple[PoolGroupStorage, SlotId]],
        carried: dict[tuple[int, int], Carried],
    ) -> dict[tuple[int, int], Page]:
        """New locked pages in the slots read (``read_into_slots``) for the (block, layer group) items
        ``needed``, at the base priority their values kept; the other slots are given back."""
        placed: dict[tuple[int, int], Page] = {}
        for item in needed:
            dst, slot = slots.pop(item)
            placed[item] = fetched_page(dst, slot, item[1], carried[item])
        for dst, slot in slots.values():
            dst.allocator.free(slot)
        return placed

    def settle(self) -> bool:
        """Free the held slots once no late call may write them; whether none is held now."""
        if self.held and not self.remote.backend.busy():
            for storage, slot in self.held:
                storage.set_aside -= 1
                storage.allocator.free(slot)
            self.held.clear()
        return not self.held

    def held_of(self, storage: PoolGroupStorage) -> list[SlotId]:
        """The slots of ``storage`` held while a late read may still write them."""
        return [slot for s, slot in self.held if s is storage]

    # ------------------------------------------------------------------ dropped pages
    def takes_slot(self, page: Page) -> bool:
        """Whether dropping ``page`` (a reusable page the store lacks) hands its slot off."""
        node = page.node
        return (
            bool(self.parked.get(id(page.storage)))
            and not page.lost
            and node is not None
            and len(node.tokens) == self.tokens_per_block
            and self.remote.accepts_slot()
        )

    def hand_off(self, page: Page, key: bytes) -> None:
        """Give the slot of ``page`` (block ``key``; its listener told, its counters kept) to the
        writer, which sends the data from there; a parked headroom slot becomes free in its place."""
        storage = page.storage
        parked = self.parked[id(storage)]
        layer_group = page.layer_group
        carried = self.expiries.carried(page)  # (before the hand-off frees the page)
        slot = page.leave_slot()
        storage.allocator.free(parked.pop())
        parts = [
            access.detach(pool, slot, size)
            for access, pool, size in zip(storage.media, storage.pools, storage.layout.slot_sizes)
        ]
        self.remote.enqueue_slot(key, layer_group, parts, storage.layout.slot_bytes, parked, slot, carried)

    def spill(self, pages: list[Page]) -> None:
        """Queue the data of ``pages`` (reusable full blocks whose data the remote tier lacks) for
        writing to the remote tier: copied out now (their slots may be reused at once), sent by the
        writer thread. Pages beyond the write queue's room are skipped and counted as dropped."""
        remote = self.remote
        groups: dict[int, list[Page]] = {}
        for page in pages:
            node = page.node
            if node is None or page.stored_below or page.lost or len(node.tokens) != self.tokens_per_block:
                continue
            found = groups.get(id(page.storage))
            if found is None:
                groups[id(page.storage)] = [page]
            else:
                found.append(page)
        for batch in groups.values():
            source = batch[0].storage
            nbytes = source.layout.slot_bytes
            spans: list[int] = []
            taken: list[Page] = []
            for page in batch:
                pos = remote.reserve(nbytes)
                if pos >= 0:
                    spans.append(pos)
                    taken.append(page)
            if not taken:
                continue
            views = [remote.span(pos, nbytes) for pos in spans]
            failed = self.copier.read_slots(
                source.pools, source.layout.slot_sizes, [page.slot for page in taken], views, 0
            )
            for i, (page, pos) in enumerate(zip(taken, spans)):
                node = page.node
                assert node is not None
                if i in failed:  # a disk read failed: the page keeps its (possibly bad) data locally
                    source.num_io_errors += 1
                    remote.enqueue(pos, nbytes, b"", 0, NOTHING_CARRIED)
                    continue
                remote.enqueue(pos, nbytes, node.key, page.layer_group, self.expiries.carried(page))
                page.stored_below = True

    def spill_one(self, page: Page) -> None:
        """``spill`` of one page being dropped (the eviction path: kept lean, one memory copy)."""
        node = page.node
        assert node is not None
        if page.lost or len(node.tokens) != self.tokens_per_block:
            return
        storage = page.storage
        size = storage.layout.slot_sizes[0]
        data = storage.media[0].host_bytes(storage.pools[0], page.slot, size) if len(storage.pools) == 1 else None
        if data is None:
            self.spill([page])
            return
        remote = self.remote
        pos = remote.reserve(size)
        if pos >= 0:  # host memory (or the emulated GPU): one copy into the write ring
            remote.span(pos, size)[:] = data
            remote.enqueue(pos, size, node.key, page.layer_group, self.expiries.carried(page))
            page.stored_below = True

    # ------------------------------------------------------------------ write-through
    def queue_write_through(self, page: Page) -> None:
        """``page`` was just published; its data goes to the remote tier at the next
        ``flush_write_through`` (batched: one copy-out per flush, not per block)."""
        self.write_through.append(page.ref())
        if len(self.write_through) >= 64:
            self.flush_write_through()

    def flush_write_through(self) -> None:
        """Copy out the published pages queued by ``queue_write_through`` that still exist."""
        refs = self.write_through
        if not refs:
            return
        pages: list[Page] = []
        for ref in refs:
            page = ref()
            if page is not None:
                pages.append(page)
        refs.clear()
        self.spill(pages)


def fetched_page(dst: PoolGroupStorage, slot: SlotId, layer_group: int, retention: Carried) -> Page:
    """A new locked page in ``slot`` of ``dst`` holding a value fetched from the remote tier (so
    stored below), at the base priority the value kept."""
    page = Page(dst, slot, LayerGroupId(layer_group), carried_priority(retention), True)
    page.stored_below = True
    return page
