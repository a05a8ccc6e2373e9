"""The block table of one request: per layer group, the page of every block and the live index
array kernels read (one beam's view; a beam-search request keeps one table per beam).

Index storage never changes size: each layer group's slot ids live in an ``array('i')`` with
spare capacity (-1 past the blocks), and callers get a cached ``memoryview`` of its first
``num_blocks`` entries. A caller may wrap that view (numpy, torch) for as long as it likes: the
manager writes into it in place, and when the blocks outgrow the capacity it moves to a new
array instead of resizing the exported one (so an export can never make an operation fail
half-way). A view's length is the block count when it was taken; fetch it again after a
``resize`` that changes ``num_blocks``.
"""

from __future__ import annotations

import struct
from array import array
from typing import Final

from .._common import BAD_PAGE_INDEX, LayerGroupId, SlotId
from .._exceptions import LogicError
from .._page import Page
from .._typed import TypedList

#: bound once: mypyc looks a module's attribute up at every call
_pack: Final = struct.pack

#: Shared by new tables until their first block: never written (writes go to grown arrays).
_EMPTY_STORE: array[int] = array("i")
_EMPTY_VIEW = memoryview(_EMPTY_STORE)
#: copied from by ``_bad_indices`` (no array built per call when blocks leave)
_BAD_RUN: Final = array("i", [BAD_PAGE_INDEX]) * 256


class BlockTable:
    """Pages and page indices of one request's blocks, per layer group.

    ``pages[layer_group][ordinal]`` is block ``ordinal``'s page (None: stale, not allocated, or awaiting its
    copy-on-partial), ``views[layer_group]`` the matching slot ids (``BAD_PAGE_INDEX`` where there is
    no page), mirrored into ``user_bufs[layer_group]`` when the caller gave a buffer. Blocks
    ``[initial, stale_end[layer_group])`` were released as stale, ``initial`` being the layer group's
    stale end at history 0 (its sink blocks), where ``stale_end[layer_group]`` starts.
    ``pending_copy[layer_group]`` is the held source page of a partially matched block.
    Blocks ``scratch[layer_group]`` (a ``(beg, end)`` range) of the current step have no page: they
    share the request's ``scratch_slots[layer_group]`` (docs/design.md, "SWA prefill scratch slots").

    Indices are ``live`` only while the request is ACTIVE (every page then sits in GPU memory);
    while it is SUSPENDED its pages may move between cache levels, so every index (and the
    caller's buffer) reads ``BAD_PAGE_INDEX`` until ``resume`` shows them again.
    """

    __slots__ = (
        "pages",
        "_store",
        "views",
        "user_bufs",
        "stale_end",
        "initial_stale_end",
        "pending_copy",
        "scratch",
        "scratch_slots",
        "state_groups",
        "state_pages",
        "live",
    )

    def __init__(self, initial_stale_ends: list[int], state_groups: list[LayerGroupId]) -> None:
        num_layer_groups = len(initial_stale_ends)
        self.pages: TypedList[LayerGroupId, list[Page | None]] = TypedList([[] for _ in range(num_layer_groups)])
        # slot ids with spare capacity (never resized), and a view of the blocks' part
        self._store: TypedList[LayerGroupId, array[int]] = TypedList([_EMPTY_STORE] * num_layer_groups)
        self.views: TypedList[LayerGroupId, memoryview] = TypedList([_EMPTY_VIEW] * num_layer_groups)
        self.user_bufs: TypedList[LayerGroupId, memoryview | None] = TypedList([None] * num_layer_groups)
        self.stale_end: TypedList[LayerGroupId, int] = TypedList(list(initial_stale_ends))
        self.initial_stale_end = initial_stale_ends  # (shared by every table of the manager, never changed)
        self.pending_copy: TypedList[LayerGroupId, Page | None] = TypedList([None] * num_layer_groups)
        self.scratch: TypedList[LayerGroupId, tuple[int, int]] = TypedList([(0, 0)] * num_layer_groups)
        self.scratch_slots: TypedList[LayerGroupId, list[SlotId]] = TypedList([[] for _ in range(num_layer_groups)])
        #: the layer groups keeping a live state (recurrent layers), and this beam's state page of
        #: each (None until the first resume); a matched snapshot waits in ``pending_copy`` (of
        #: beam 0's table) until that resume copies it into every beam's state page
        self.state_groups = state_groups
        self.state_pages: list[Page | None] = [None] * len(state_groups)
        self.live = False

    def __len__(self) -> int:
        return len(self.pages)

    # ------------------------------------------------------------------ pages
    def _set_len(self, layer_group: LayerGroupId, old_num_blocks: int, num_blocks: int) -> None:
        """Resize the block count of the index view: -1 past the blocks, more capacity if needed."""
        store = self._store.items[layer_group]
        if num_blocks > len(store):
            grown = _bad_indices(max(num_blocks, 2 * len(store), 16))
            if old_num_blocks:
                grown[:old_num_blocks] = store[:old_num_blocks]
            self._store.items[layer_group] = store = grown
        elif num_blocks < old_num_blocks:
            store[num_blocks:old_num_blocks] = _bad_indices(old_num_blocks - num_blocks)
        self.views.items[layer_group] = memoryview(store)[:num_blocks] if num_blocks else _EMPTY_VIEW

    def adopt(self, layer_group: LayerGroupId, pages: list[Page | None], stale_end: int) -> None:
        """Install the pages of a matched prefix (the table is empty)."""
        self.pages[layer_group] = pages
        self.stale_end[layer_group] = stale_end
        if pages:  # (an empty slice assignment counts as a resize for an exported array)
            self._set_len(layer_group, 0, len(pages))  # new entries read BAD_PAGE_INDEX
            if self.live:
                # filled as a list, then stored at once: array item calls are slow compiled
                self._store[layer_group][: len(pages)] = array(
                    "i", [BAD_PAGE_INDEX if p is None else p.slot for p in pages]
                )

    def become(self, other: BlockTable, locked: bool) -> None:
        """Turn into a copy of ``other``, another beam's table of the same request (same block
        count): pages it does not share with ``other`` are released, ``other``'s taken. Cheap
        when the beams share most blocks, as beams do."""
        for i, pages in enumerate(self.pages):
            layer_group = LayerGroupId(i)
            src = other.pages[layer_group]
            for ordinal in range(len(src)):
                p = src[ordinal]
                q = pages[ordinal]
                if p is not q:
                    if p is not None:
                        p.take(locked)
                    pages[ordinal] = p
                    if q is not None:
                        q.release(locked)
            n = len(src)
            if n:
                self._store[layer_group][:n] = other._store[layer_group][:n]
            self.stale_end[layer_group] = other.stale_end[layer_group]

    def block_pages(self, ordinal: int) -> list[Page | None]:
        """Block ``ordinal``'s page in every layer group."""
        return [pages[ordinal] for pages in self.pages.items]

    def set_page(self, layer_group: LayerGroupId, ordinal: int, page: Page | None) -> None:
        """Point block ``ordinal`` at ``page`` (or at nothing) in the pages, the indices and the caller's buffer."""
        self.pages[layer_group][ordinal] = page
        slot = BAD_PAGE_INDEX if page is None or not self.live else page.slot
        self._store[layer_group][ordinal] = slot
        buf = self.user_bufs[layer_group]
        if buf is not None:
            buf[ordinal] = slot

    def extend(self, layer_group: LayerGroupId, num_blocks: int, ordinals: list[int], new_pages: list[Page]) -> None:
        """Grow to ``num_blocks`` blocks (or keep the count); block ``ordinals[i]`` gets ``new_pages[i]``,
        the other new blocks none. Ordinals below the old count fill blocks that had no page."""
        pages = self.pages[layer_group]
        old_num_blocks = len(pages)
        slots = [BAD_PAGE_INDEX] * max(0, num_blocks - old_num_blocks)
        pages.extend([None] * (num_blocks - old_num_blocks))
        for ordinal, page in zip(ordinals, new_pages):
            if ordinal < old_num_blocks:
                self.set_page(layer_group, ordinal, page)
                continue
            pages[ordinal] = page
            slots[ordinal - old_num_blocks] = page.slot
        if num_blocks <= old_num_blocks:
            return
        self._set_len(layer_group, old_num_blocks, num_blocks)
        # packed in one call: ``array("i", slots)`` parses each int apart (a block's costliest step)
        self._store[layer_group][old_num_blocks:num_blocks] = array("i", _pack(f"{len(slots)}i", *slots))
        buf = self.user_bufs[layer_group]
        if buf is not None:
            buf[old_num_blocks:num_blocks] = memoryview(self._store[layer_group])[old_num_blocks:num_blocks]

    def append(self, layer_group: LayerGroupId, page: Page) -> None:
        """One more block, with ``page`` (the decode step's growth; ``extend`` in general)."""
        pages = self.pages.items[layer_group]
        ordinal = len(pages)
        pages.append(page)
        self._set_len(layer_group, ordinal, ordinal + 1)
        self._store.items[layer_group][ordinal] = page.slot
        buf = self.user_bufs.items[layer_group]
        if buf is not None:
            buf[ordinal] = page.slot

    def truncate(self, num_blocks: int, locked: bool) -> None:
        """Drop blocks from ``num_blocks`` on, releasing their pages last block first: the tail becomes
        the least recently used, so eviction takes tails before the prefixes others share."""
        all_pages = self.pages.items
        # blocks released as stale in every layer group hold no page: skipped (most blocks of a
        # sliding-window request); plain loops, not max()/min() (a generic call compiled)
        initial, stale = self.initial_stale_end, self.stale_end.items
        top, none_beg, none_end = 0, 0, stale[0]
        for i in range(len(all_pages)):
            if len(all_pages[i]) > top:
                top = len(all_pages[i])
            if initial[i] > none_beg:
                none_beg = initial[i]
            if stale[i] < none_end:
                none_end = stale[i]
        if none_beg < none_end:
            _release_blocks(all_pages, none_end if none_end > num_blocks else num_blocks, top, locked)
            _release_blocks(all_pages, num_blocks, none_beg if none_beg < top else top, locked)
        else:
            _release_blocks(all_pages, num_blocks, top, locked)
        for i, pages in enumerate(all_pages):
            layer_group = LayerGroupId(i)
            old_num_blocks = len(pages)
            del pages[num_blocks:]
            self._set_len(layer_group, old_num_blocks, num_blocks)
            self.write_user_tail(layer_group, num_blocks)

    def release_range(self, layer_group: LayerGroupId, beg: int, end: int, locked: bool) -> None:
        """Release the pages of blocks ``[beg, end)`` (they keep their place, with no page), last
        block first like ``truncate``: blocks leaving a sliding window together are evicted
        newest first, so the prefix others may share stays longest."""
        pages = self.pages[layer_group]
        for ordinal in range(min(end, len(pages)) - 1, beg - 1, -1):
            p = pages[ordinal]
            if p is not None:
                self.set_page(layer_group, ordinal, None)
                p.release(locked)

    def sole_owned(self, layer_group: LayerGroupId, beg: int, end: int) -> int:
        """How many pages of blocks ``[beg, end)`` become available when this request lets go
        (not a page whose pins its storage holds: it stays out of the evictor)."""
        pages = self.pages[layer_group]
        n = 0
        for ordinal in range(beg, end):
            p = pages[ordinal]
            if p is not None and p.num_locks == 1 and p.num_holds == 0 and not p.pin_held:
                n += 1
        return n

    @property
    def has_scratch_slots(self) -> bool:
        return any(self.scratch_slots.items)

    def lock_all(self) -> None:
        """Holds become locks (resume; also pins pages while they move)."""
        for pages in self.pages:
            for p in pages:
                if p is not None:
                    p.lock_from_hold()
        for state_page in self.state_pages:
            if state_page is not None:
                state_page.lock_from_hold()

    def hold_all(self) -> None:
        """Locks become holds (suspend)."""
        for pages in self.pages:
            for p in pages:
                if p is not None:
                    p.hold_from_lock()
        for state_page in self.state_pages:
            if state_page is not None:
                state_page.hold_from_lock()

    def state_page(self, layer_group: LayerGroupId) -> Page | None:
        """This beam's live-state page of ``layer_group`` (None: none yet, or not a state group)."""
        for i, state_group in enumerate(self.state_groups):
            if state_group == layer_group:
                return self.state_pages[i]
        return None

    def has_pending(self) -> bool:
        """Whether a copy-on-partial waits for the first resume."""
        for src in self.pending_copy.items:  # noqa: SIM110 - a plain loop on the resume path (no generator)
            if src is not None:
                return True
        return False

    def lock_pending(self) -> None:
        for src in self.pending_copy:
            if src is not None:
                src.lock_from_hold()

    def hold_pending(self) -> None:
        for src in self.pending_copy:
            if src is not None:
                src.hold_from_lock()

    def release_pending(self, locked: bool) -> None:
        """Let go of the sources of copy-on-partial."""
        for i, src in enumerate(self.pending_copy):
            if src is not None:
                self.pending_copy.items[i] = None
                src.release(locked)

    def all_pages(self) -> list[Page]:
        """Every page of the request, copy-on-partial sources and live states included (each once)."""
        out = [p for pages in self.pages for p in pages if p is not None]
        out.extend([src for src in self.pending_copy if src is not None])
        out.extend([p for p in self.state_pages if p is not None])
        return out

    def first_lost_block(self) -> int:
        """The first block with a page whose data was lost (disk error); -1 if none."""
        first = -1
        for pages in self.pages:
            for ordinal, p in enumerate(pages):
                if p is not None and p.lost:
                    if first < 0 or ordinal < first:
                        first = ordinal
                    break
        for i, src in enumerate(self.pending_copy):
            if src is not None and src.lost:
                # a lost snapshot: the state at every position after the start is gone
                ordinal = 0 if LayerGroupId(i) in self.state_groups else len(self.pages.items[i]) - 1
                if first < 0 or ordinal < first:
                    first = ordinal
        for state_page in self.state_pages:
            if state_page is not None and state_page.lost:
                first = 0
        return first

    def show_indices(self) -> None:
        """Indices become live (resume): the GPU slot of every page."""
        self.live = True
        self._write_indices()

    def hide_indices(self) -> None:
        """Indices read ``BAD_PAGE_INDEX`` (suspend: pages may move to other levels)."""
        self.live = False
        self._write_indices()

    def _write_indices(self) -> None:
        live = self.live
        for i, pages in enumerate(self.pages):
            layer_group = LayerGroupId(i)
            n = len(pages)
            if n == 0:
                continue
            self._store[layer_group][:n] = array(
                "i", [BAD_PAGE_INDEX if p is None or not live else p.slot for p in pages]
            )
            buf = self.user_bufs[layer_group]
            if buf is not None:
                buf[:n] = memoryview(self._store[layer_group])[:n]

    def release_all(self, locked: bool) -> None:
        """Let go of every page (close); the table ends empty. The request no longer grows: the free
        slot after its last block is no longer kept for it (``SlotAllocator.end_tail``)."""
        for pages in self.pages.items:
            last = pages[-1] if pages else None
            if last is not None and last.slot != BAD_PAGE_INDEX and last.num_locks + last.num_holds == 1:
                last.storage.allocator.end_tail(last.slot)  # (a page others use too may be their tail)
        self.release_pending(False)
        self.truncate(0, locked)
        self.release_state_pages(locked)

    def release_state_pages(self, locked: bool) -> None:
        """Let go of the live-state pages (close, or a state lost to a disk error)."""
        for i, state_page in enumerate(self.state_pages):
            if state_page is not None:
                self.state_pages[i] = None
                state_page.release(locked)

    # ------------------------------------------------------------------ caller buffers
    def check_user_buf_room(self, num_blocks: int) -> None:
        """Raise (before anything changes) if a caller's buffer cannot hold ``num_blocks`` blocks."""
        for layer_group, buf in enumerate(self.user_bufs):
            if buf is not None and num_blocks > len(buf):
                raise LogicError(
                    f"the index buffer of layer group {layer_group} holds {len(buf)} entries but the cache needs {num_blocks}; "
                    "give set_base_page_index_buf() a larger buffer"
                )

    def attach_user_buf(self, layer_group: LayerGroupId, view: memoryview | None) -> None:
        """Mirror the indices into ``view`` from now on (None: stop)."""
        old = self.user_bufs[layer_group]
        self.user_bufs[layer_group] = view
        if old is not None and old is not view:
            old.release()  # the caller's buffer is no longer exported by us
        if view is not None:
            n = len(self.pages[layer_group])
            view[:n] = memoryview(self._store[layer_group])[:n]
            self.write_user_tail(layer_group, n)

    def take_user_bufs(self) -> list[memoryview | None]:
        """Hand the callers' buffers over (to the table that takes this beam's place)."""
        bufs = list(self.user_bufs.items)
        for i in range(len(bufs)):
            self.user_bufs.items[i] = None
        return bufs

    def give_user_bufs(self, bufs: list[memoryview | None]) -> None:
        """Adopt callers' buffers and write this table's indices into them."""
        for i, view in enumerate(bufs):
            layer_group = LayerGroupId(i)
            self.user_bufs[layer_group] = view
            if view is not None:
                n = len(self.pages[layer_group])
                view[:n] = memoryview(self._store[layer_group])[:n]
                self.write_user_tail(layer_group, n)

    def detach_user_bufs(self) -> None:
        """Stop writing into callers' buffers (close)."""
        for i in range(len(self.user_bufs)):
            self.attach_user_buf(LayerGroupId(i), None)

    def write_user_tail(self, layer_group: LayerGroupId, n: int) -> None:
        buf = self.user_bufs[layer_group]
        if buf is not None and n < len(buf):
            buf[n:] = memoryview(_bad_indices(len(buf) - n))


def _release_blocks(all_pages: list[list[Page | None]], beg: int, end: int, locked: bool) -> None:
    """Release the pages of blocks ``[beg, end)`` in every layer group, last block first."""
    for ordinal in range(end - 1, beg - 1, -1):
        for pages in all_pages:
            p = pages[ordinal]
            if p is not None:
                p.release(locked)


def _bad_indices(n: int) -> array[int]:
    """A new array of ``n`` ``BAD_PAGE_INDEX`` entries."""
    return _BAD_RUN[:n] if n <= len(_BAD_RUN) else array("i", [BAD_PAGE_INDEX]) * n
