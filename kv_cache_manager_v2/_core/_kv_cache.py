"""KVCache: the pages of one request, its lengths and its page indices (SPEC 4.3)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import rawref

from .._common import (
    BAD_PAGE_INDEX,
    DEFAULT_PRIORITY,
    DEFAULT_REUSE_SCOPE,
    MAX_PRIORITY,
    BeamIndex,
    BlockOrdinal,
    KVCacheStatus,
    LayerGroupId,
    LifeCycleId,
    MemAddress,
    PageIndexMode,
    Priority,
    ReuseScope,
    ScratchDesc,
    TokenIdExt,
)
from .._exceptions import LogicError
from .._page import Page
from .._radix_tree import Node, block_key, check_token, validate_tokens
from .._utils import check_int

if TYPE_CHECKING:
    from ._kv_cache_manager import KVCacheManager

PriorityCallback = Callable[[BlockOrdinal, LifeCycleId], Priority]


def default_priority(block_ordinal: BlockOrdinal, life_cycle: LifeCycleId) -> Priority:
    """The priority pages get unless a request passes its own callback: 35."""
    return DEFAULT_PRIORITY


class KVCache:
    """The KV memory of one request.

    Created SUSPENDED by :meth:`KVCacheManager.create_kv_cache`; ``resume()`` makes it ACTIVE,
    ``resize()`` grows or shrinks its pages, ``commit()`` records the tokens whose KV was
    computed, ``close()`` releases everything. Lengths keep
    ``num_committed_tokens <= history_length <= capacity``.
    """

    _rawref: rawref.ref[KVCache] | None

    def __init__(
        self,
        manager: KVCacheManager,
        reuse_scope: ReuseScope | None,
        id: object,
        priority_callback: PriorityCallback,
    ) -> None:
        self._rawref = None
        self._mgr = manager
        self._tokens_per_block = manager.tokens_per_block
        self._reuse_scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
        self._id = id
        self._priority_cb = priority_callback
        self._status = KVCacheStatus.SUSPENDED
        self._capacity = 0
        self._history = 0
        self._num_blocks = 0
        # Committed tokens: full blocks as tuples (ints-only tuples leave the cycle collector's
        # view, so long prompts cost no GC traversal), then the partial tail.
        self._committed_blocks: list[tuple[TokenIdExt, ...]] = []
        self._tail: list[TokenIdExt] = []
        self._committing = True
        self._cuda_stream = 0
        n = manager.num_life_cycles
        self._pages: list[list[Page | None]] = [[] for _ in range(n)]
        self._indices: list[array[int]] = [array("i") for _ in range(n)]
        self._user_bufs: list[memoryview | None] = [None] * n
        # Per life cycle: blocks below this ordinal (and past the sinks) were released as stale.
        self._stale_end: list[int] = [0] * n
        # Reuse: the tree node of the last published full block, how many full blocks are
        # published, and per life cycle the held source page of a partial match, copied on resume.
        self._last_node: Node | None = None
        self._num_published = 0
        self._pending_copy: list[Page | None] = [None] * n

    def _adopt(self, nodes: list[Node], part: Node | None, part_len: int, tokens: Sequence[TokenIdExt]) -> None:
        """Take holds on matched pages (called once, right after construction)."""
        t = self._tokens_per_block
        length = len(nodes) * t + part_len
        nb = (length + t - 1) // t
        registry = self._mgr._registry
        for lc in range(len(self._pages)):
            beg, end = registry.stale_range(LifeCycleId(lc), length)
            pages: list[Page | None] = [None] * nb
            slots = [BAD_PAGE_INDEX] * nb  # filled as a list: array item calls are slow compiled
            for o in range(nb):
                if beg <= o < end:
                    continue
                if o < len(nodes):
                    p = nodes[o].page(lc)
                    assert p is not None
                    p.take(False)
                    pages[o] = p
                    slots[o] = p.slot
                else:
                    assert part is not None
                    src = part.page(lc)
                    assert src is not None
                    src.take(False)
                    self._pending_copy[lc] = src
            self._pages[lc] = pages
            self._indices[lc].extend(slots)
            self._stale_end[lc] = end
        self._committed_blocks = [node.tokens for node in nodes]  # equal keys: equal tokens
        self._tail = list(tokens[len(nodes) * t : length])
        self._capacity = self._history = length
        self._num_blocks = nb
        self._num_published = len(nodes)
        self._last_node = nodes[-1] if nodes else None

    def __repr__(self) -> str:
        return (
            f"KVCache(id={self._id!r}, status={self._status.name}, capacity={self._capacity}, "
            f"history_length={self._history}, committed={self.num_committed_tokens}, blocks={self._num_blocks})"
        )

    # ------------------------------------------------------------------ properties
    @property
    def status(self) -> KVCacheStatus:
        return self._status

    @property
    def capacity(self) -> int:
        """Tokens the request has pages for (allocated or stale)."""
        return self._capacity

    @property
    def history_length(self) -> int:
        """Tokens whose KV is already computed (the step's input starts here)."""
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return len(self._committed_blocks) * self._tokens_per_block + len(self._tail)

    @property
    def committed_tokens(self) -> list[TokenIdExt]:
        """A copy of the committed token sequence."""
        return [tok for block in self._committed_blocks for tok in block] + self._tail

    @property
    def reuse_scope(self) -> ReuseScope:
        return self._reuse_scope

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def beam_width(self) -> int:
        return 1

    @property
    def id(self) -> object:
        return self._id

    @property
    def cuda_stream(self) -> int:
        """The stream the request's kernels run on (0 until given to ``resume``)."""
        return self._cuda_stream

    @property
    def num_blocks(self) -> int:
        """Blocks covered by ``capacity``: ``ceil(capacity / tokens_per_block)``."""
        return self._num_blocks

    @property
    def has_scratch_slots(self) -> bool:
        return False

    def get_scratch_desc(self, layer_group_id: LayerGroupId) -> ScratchDesc | None:
        """Scratch blocks of this step for the layer group (None: this request uses none)."""
        self._check_lc(layer_group_id)
        return None

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """Both modes address every block of a request that has no scratch slots."""
        return isinstance(mode, PageIndexMode)

    # ------------------------------------------------------------------ state machine
    def resume(self, cuda_stream: int | None = None) -> bool:
        """SUSPENDED -> ACTIVE: lock this request's pages in GPU memory.

        Returns False (staying SUSPENDED) when pages must be placed (the private copy of a
        partially matched block) and GPU utilisation would exceed ``max_util_for_resume``.
        """
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(f"resume() needs a SUSPENDED cache; this one is {self._status.name}")
        if cuda_stream is not None:
            check_int("cuda_stream (a CUstream handle)", cuda_stream)
            self._cuda_stream = cuda_stream
        if not self._copy_partial_block():
            return False
        for pages in self._pages:
            for p in pages:
                if p is not None:
                    p.lock_from_hold()
        self._status = KVCacheStatus.ACTIVE
        return True

    def _copy_partial_block(self) -> bool:
        """Copy-on-partial: give the partially matched block private pages holding its data."""
        mgr = self._mgr
        need = [0] * len(mgr._gpu.groups)
        for lc, src in enumerate(self._pending_copy):
            if src is not None:
                need[mgr._lc_group_index[lc]] += 1
        if not any(need):
            return True
        max_util = mgr._config.max_util_for_resume
        for g, n in enumerate(need):
            group = mgr._gpu.groups[g]
            total = group.allocator.num_slots
            if n > group.num_available or (total - group.num_available + n) / total > max_util:
                return False
        for g, n in enumerate(need):
            if n:
                mgr._gpu.groups[g].allocator.prepare(n)
        o = self._num_published
        prios = [
            self._priorities(LifeCycleId(lc), [o])[0] if src is not None else DEFAULT_PRIORITY
            for lc, src in enumerate(self._pending_copy)
        ]
        mgr._backend.synchronize_device()  # the source was written by another request's kernels
        for lc, src in enumerate(self._pending_copy):
            if src is None:
                continue
            storage = mgr._lc_group[lc]
            mgr._make_room(storage, 1)
            slot = storage.allocator.allocate_one()
            prio = prios[lc]
            for pool, size in zip(storage.pools, storage.layout.slot_sizes):
                mgr._backend.copy(
                    MemAddress(pool.base_address + slot * size), MemAddress(pool.base_address + src.slot * size), size, 0
                )
            self._pages[lc][o] = Page(storage, slot, LifeCycleId(lc), prio, False)
            self._set_index(LifeCycleId(lc), o, slot)
            self._pending_copy[lc] = None
            src.release(False)
        mgr._backend.synchronize()
        return True

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: locks become holds; the pages stay valid."""
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"suspend() needs an ACTIVE cache; this one is {self._status.name}")
        for pages in self._pages:
            for p in pages:
                if p is not None:
                    p.hold_from_lock()
        self._status = KVCacheStatus.SUSPENDED

    def close(self) -> None:
        """Release every page; idempotent. Also runs when the cache is garbage collected."""
        if self._status is KVCacheStatus.CLOSED:
            return
        locked = self._status is KVCacheStatus.ACTIVE
        for lc, src in enumerate(self._pending_copy):
            if src is not None:
                self._pending_copy[lc] = None
                src.release(False)
        for lc, pages in enumerate(self._pages):
            for p in pages:
                if p is not None:
                    p.release(locked)
            pages.clear()
            del self._indices[lc][:]
            self._write_user_tail(LifeCycleId(lc), 0)
        self._status = KVCacheStatus.CLOSED
        self._capacity = self._history = self._num_blocks = 0
        self._mgr._unregister(self)
        r = self._rawref
        if r is not None:
            r.invalidate()
            self._rawref = None

    def __del__(self) -> None:
        if self._status is not KVCacheStatus.CLOSED:
            self.close()

    # ------------------------------------------------------------------ allocation
    def resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Set capacity (and raise history); allocate/release pages. All or nothing.

        Returns False, changing nothing, when GPU memory is short. Misuse raises.
        """
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"resize() needs an ACTIVE cache; this one is {self._status.name} (call resume() first)")
        cap = self._capacity if capacity is None else capacity
        h = self._history if history_length is None else history_length
        if type(cap) is not int or type(h) is not int or cap < 0 or h < 0:
            check_int("capacity", cap)  # raises with the reason
            check_int("history_length", h)
        if h < self._history:
            raise LogicError(f"history_length never shrinks: {self._history} -> {h}")
        if cap < h:
            raise LogicError(f"capacity {cap} is below history_length {h}")
        t = self._tokens_per_block
        nb = (cap + t - 1) // t
        if nb == self._num_blocks and (not self._mgr._has_swa or not self._window_moves(h)):
            self._capacity = cap
            self._history = h
            return True
        return self._resize_blocks(cap, h, nb)

    def _window_moves(self, h: int) -> bool:
        """Whether some SWA life cycle has blocks to release at history ``h``."""
        registry = self._mgr._registry
        for lc in self._mgr._swa_life_cycles:
            if registry.stale_range(lc, h)[1] > self._stale_end[lc]:
                return True
        return False

    def _resize_blocks(self, cap: int, h: int, nb: int) -> bool:
        mgr = self._mgr
        old_nb = self._num_blocks
        for lc, buf in enumerate(self._user_bufs):
            if buf is not None and nb > len(buf):
                raise LogicError(
                    f"the index buffer of layer group {lc} holds {len(buf)} entries but the cache needs {nb}; "
                    "give set_base_page_index_buf() a larger buffer"
                )
        # Plan without touching anything: which blocks get pages, with which priorities, and
        # whether every pool group has enough slots once this request's releases are counted.
        num_groups = len(mgr._gpu.groups)
        need = [0] * num_groups
        gain = [0] * num_groups
        stale_ends: list[int] = []
        wanted: list[list[int]] = []
        priorities: list[list[Priority]] = []
        for lc in range(mgr.num_life_cycles):
            beg, end = mgr._registry.stale_range(LifeCycleId(lc), h)
            stale_ends.append(end)
            g = mgr._lc_group_index[lc]
            pages = self._pages[lc]
            for o in range(max(beg, self._stale_end[lc]), min(end, old_nb)):
                gain[g] += _sole_owner(pages[o])
            for o in range(max(nb, end), old_nb):
                gain[g] += _sole_owner(pages[o])
            want = [o for o in range(old_nb, nb) if not beg <= o < end]
            need[g] += len(want)
            wanted.append(want)
            priorities.append(self._priorities(LifeCycleId(lc), want))
        for gi in range(num_groups):
            if need[gi] > gain[gi] + mgr._gpu.groups[gi].num_available:
                return False
        for gi in range(num_groups):
            if need[gi]:
                mgr._gpu.groups[gi].allocator.prepare(need[gi])  # a driver failure here changes nothing
        # Release everything first: life cycles sharing a pool group use each other's releases.
        for lc in range(mgr.num_life_cycles):
            self._release_stale(LifeCycleId(lc), stale_ends[lc])
            if nb < old_nb:
                self._truncate(LifeCycleId(lc), nb)
        if nb > old_nb:
            for lc in range(mgr.num_life_cycles):
                self._grow(LifeCycleId(lc), nb, wanted[lc], priorities[lc])
        self._capacity = cap
        self._history = h
        self._num_blocks = nb
        return True

    def _grow(self, lc: LifeCycleId, nb: int, want: list[int], priorities: list[Priority]) -> None:
        pages = self._pages[lc]
        indices = self._indices[lc]
        old_nb = len(pages)
        storage = self._mgr._lc_group[lc]
        self._mgr._make_room(storage, len(want))
        slots = storage.allocator.allocate(len(want))
        self._mgr._stats.allocated_blocks += len(want)
        new_slots = [BAD_PAGE_INDEX] * (nb - old_nb)
        pages.extend([None] * (nb - old_nb))
        for o, slot, prio in zip(want, slots, priorities):
            pages[o] = Page(storage, slot, lc, prio, True)
            new_slots[o - old_nb] = slot
        indices.extend(new_slots)
        buf = self._user_bufs[lc]
        if buf is not None:
            buf[old_nb:nb] = memoryview(indices)[old_nb:nb]

    def _truncate(self, lc: LifeCycleId, nb: int) -> None:
        pages = self._pages[lc]
        for o in range(nb, len(pages)):
            p = pages[o]
            if p is not None:
                p.release(True)
        del pages[nb:]
        del self._indices[lc][nb:]
        self._write_user_tail(lc, nb)

    def _release_stale(self, lc: LifeCycleId, end: int) -> None:
        """Release pages of blocks below ``end`` that left the window (sinks never do)."""
        done = self._stale_end[lc]
        if end <= done:
            return
        lc_obj = self._mgr._registry.life_cycles[lc]
        pages = self._pages[lc]
        locked = self._status is KVCacheStatus.ACTIVE
        for o in range(max(done, lc_obj.num_sink_blocks), min(end, len(pages))):
            p = pages[o]
            if p is not None:
                pages[o] = None
                self._set_index(lc, o, BAD_PAGE_INDEX)
                p.release(locked)
        self._stale_end[lc] = end

    # ------------------------------------------------------------------ tokens
    def commit(self, accepted_input_tokens: Sequence[TokenIdExt], beam_search_indices: object = None) -> None:
        """Append tokens whose KV has been computed; history rises to at least the committed length."""
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"commit() needs an ACTIVE cache; this one is {self._status.name}")
        if not self._committing:
            raise LogicError("commit() after stop_committing(): this request no longer commits tokens")
        if beam_search_indices is not None:
            raise ValueError("beam_search_indices: this cache has beam_width 1; pass None")
        t = self._tokens_per_block
        n = len(self._committed_blocks) * t + len(self._tail) + len(accepted_input_tokens)
        if n > self._capacity:
            raise LogicError(
                f"commit() of {len(accepted_input_tokens)} tokens would reach {n} committed tokens, "
                f"beyond capacity {self._capacity}; resize() first"
            )
        if len(accepted_input_tokens) == 1:
            check_token(accepted_input_tokens[0])  # the decode step: one token
        else:
            validate_tokens(accepted_input_tokens)
        tail = self._tail
        tail.extend(accepted_input_tokens)
        if len(tail) >= t:
            full = len(tail) // t
            self._committed_blocks.extend([tuple(tail[i * t : (i + 1) * t]) for i in range(full)])
            del tail[: full * t]
            self._publish(len(self._committed_blocks))
        if n > self._history:
            self._history = n
            if self._mgr._has_swa:
                for lc in self._mgr._swa_life_cycles:
                    self._release_stale(lc, self._mgr._registry.stale_range(lc, n)[1])

    def stop_committing(self) -> None:
        """No more commits for this request (its further output must not be reused)."""
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("stop_committing() on a CLOSED cache")
        if self._committing and self._tail:
            self._publish(self._num_published + 1)
        self._committing = False

    def _publish(self, upto: int) -> None:
        """Insert committed blocks ``[num_published, upto)`` into the reuse tree (the last may be partial).

        A block already in the tree with the same key is deduplicated: this request switches
        to the tree's pages and frees its own.
        """
        mgr = self._mgr
        t = self._tokens_per_block
        parent = self._last_node
        if parent is None:
            parent = mgr._tree.root(self._reuse_scope, True)
            assert parent is not None
        if parent.ordinal >= 0 and parent.parent is None:
            return  # our last block was evicted and pruned: nothing after it can be reached
        locked = self._status is KVCacheStatus.ACTIVE
        blocks = self._committed_blocks
        for o in range(self._num_published, upto):
            toks = blocks[o] if o < len(blocks) else tuple(self._tail)
            if len(toks) < t and any(c.tokens[: len(toks)] == toks for c in parent.children_starting_with(toks[0])):
                return  # a longer sibling already covers this partial tail
            key = block_key(parent.key, toks)
            node = parent.child(key)
            if node is None:
                node = Node(key, parent, toks, len(self._pages))
                parent.add_child(node)
            for lc in range(len(self._pages)):
                mine = self._pages[lc][o]
                theirs = node.page(lc)
                if theirs is None:
                    if mine is not None and mine.node is None:
                        mine.node = node
                        node.pages[lc] = rawref.ref(mine)
                elif mine is not None and theirs is not mine:
                    theirs.take(locked)
                    self._pages[lc][o] = theirs
                    self._set_index(LifeCycleId(lc), o, theirs.slot)
                    mine.release(locked)
            if len(toks) < t:
                return
            parent = node
            self._num_published = o + 1
            self._last_node = node

    # ------------------------------------------------------------------ indices
    def get_base_page_indices(self, layer_group_id: LayerGroupId, beam_id: BeamIndex = BeamIndex(0)) -> array[int]:
        """Slot id per block (``BAD_PAGE_INDEX`` for none); a live view kept up to date, do not modify."""
        indices = self._indices
        if type(layer_group_id) is int and 0 <= layer_group_id < len(indices) and beam_id == 0:
            return indices[layer_group_id]  # the per-step path: no helper calls
        self._check_lc(layer_group_id)
        self._check_beam(beam_id)
        return indices[layer_group_id]

    def set_base_page_index_buf(
        self, beam: BeamIndex, layer_group_id: LayerGroupId, buf: memoryview | None
    ) -> None:
        """Have the manager write this layer group's indices into ``buf`` (1-D int32, writable).

        Entries past the cache's blocks are set to ``BAD_PAGE_INDEX``; ``None`` detaches.
        """
        self._check_beam(beam)
        self._check_lc(layer_group_id)
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("set_base_page_index_buf() on a CLOSED cache")
        if buf is None:
            self._user_bufs[layer_group_id] = None
            return
        if not isinstance(buf, memoryview):
            raise TypeError(f"buf must be a memoryview (or None), got {type(buf).__name__}")
        if buf.readonly or buf.ndim != 1 or buf.itemsize != 4 or buf.format not in ("i", "=i", "<i", "@i") or not buf.c_contiguous:
            raise ValueError(
                "buf must be a writable, C-contiguous, 1-D memoryview of int32 (format 'i'); got "
                f"format={buf.format!r} itemsize={buf.itemsize} ndim={buf.ndim} readonly={buf.readonly}"
            )
        if len(buf) < self._num_blocks:
            raise ValueError(f"buf holds {len(buf)} entries but the cache has {self._num_blocks} blocks")
        view = buf.cast("B").cast("i")
        n = self._num_blocks
        view[:n] = memoryview(self._indices[layer_group_id])
        self._user_bufs[layer_group_id] = view
        self._write_user_tail(layer_group_id, n)

    def get_aggregated_page_indices(
        self, layer_group_id: LayerGroupId, beam_id: BeamIndex = BeamIndex(0), valid_only: bool = False
    ) -> Iterator[int]:
        """Slot ids of the blocks: one slot aggregates every buffer of the layer group."""
        for idx in self.get_base_page_indices(layer_group_id, beam_id):
            if not valid_only or idx != BAD_PAGE_INDEX:
                yield idx

    # ------------------------------------------------------------------ helpers
    def _priorities(self, lc: LifeCycleId, ordinals: list[int]) -> list[Priority]:
        """Eviction priorities of new pages for these blocks (the callback is validated)."""
        cb = self._priority_cb
        if cb is default_priority:
            return [DEFAULT_PRIORITY] * len(ordinals)
        return [_checked_priority(cb(BlockOrdinal(o), lc)) for o in ordinals]

    def _set_index(self, lc: LifeCycleId, o: int, slot: int) -> None:
        """Point block ``o`` at ``slot`` in the index array and the caller's buffer, if any."""
        self._indices[lc][o] = slot
        buf = self._user_bufs[lc]
        if buf is not None:
            buf[o] = slot

    def _write_user_tail(self, lc: LifeCycleId, n: int) -> None:
        buf = self._user_bufs[lc]
        if buf is not None and n < len(buf):
            buf[n:] = memoryview(array("i", [BAD_PAGE_INDEX]) * (len(buf) - n))

    def _check_lc(self, layer_group_id: int) -> None:
        n = self._mgr.num_life_cycles
        check_int("layer_group_id", layer_group_id)
        if layer_group_id >= n:
            raise ValueError(f"layer_group_id must be in [0, {n}), got {layer_group_id}")

    def _check_beam(self, beam: int) -> None:
        check_int("beam index", beam)
        if beam != 0:
            raise ValueError(f"beam index must be 0 (beam_width is 1), got {beam}")


def _sole_owner(page: Page | None) -> int:
    """1 if releasing this page's only lock makes its slot available, else 0."""
    return 1 if page is not None and page.num_locks == 1 and page.num_holds == 0 else 0


def _checked_priority(p: Priority) -> Priority:
    if type(p) is not int or not 0 <= p <= MAX_PRIORITY:
        raise ValueError(f"custom_priority_callback must return an int in [0, {MAX_PRIORITY}], got {p!r}")
    return p
