"""KVCache: one request's lengths, state and committed tokens; it orchestrates its block table,
the storage manager (allocation) and the reuse tree (publishing) (SPEC 4.3)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import rawref

from .._common import (
    BAD_PAGE_INDEX,
    DEFAULT_PRIORITY,
    GPU_LEVEL,
    MAX_CAPACITY,
    MAX_PRIORITY,
    MAX_TOKEN_ID,
    BeamIndex,
    BlockOrdinal,
    BlockTokens,
    CacheLevel,
    HalfOpenRange,
    KVCacheStatus,
    LayerGroupId,
    PageIndexMode,
    Priority,
    RequestSerial,
    ReuseScope,
    ScratchDesc,
    SlotId,
    TokenIdExt,
)
from .._exceptions import LogicError, OutOfPagesError
from .._page import Page
from .._reuse._keys import chain_token_keys, check_token, check_token_sequence, validate_tokens
from .._reuse._tree import Node, same_tokens
from .._utils import as_list, check_int, check_type
from ._block_table import BlockTable
from ._context import CacheContext

PriorityCallback = Callable[[BlockOrdinal, LayerGroupId], Priority]


def default_priority(block_ordinal: BlockOrdinal, layer_group: LayerGroupId) -> Priority:
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
        ctx: CacheContext,
        reuse_scope: ReuseScope,
        id: object,
        priority_callback: PriorityCallback,
        beam_width: int = 1,
    ) -> None:
        self._rawref = None
        self._ctx = ctx
        ctx.num_requests += 1
        #: this request in use counting (frequency eviction policy)
        self._serial = RequestSerial(ctx.num_requests)
        self._tokens_per_block = ctx.tokens_per_block
        self._reuse_scope = reuse_scope
        self._id = id
        self._priority_cb = priority_callback
        self._status = KVCacheStatus.SUSPENDED
        self._capacity = 0
        self._history = 0
        self._num_blocks = 0
        # Committed tokens: full blocks as tuples (ints-only tuples leave the cycle collector's
        # view, so long prompts cost no GC traversal), then the partial tail.
        self._committed_blocks: list[BlockTokens] = []
        self._tail: list[TokenIdExt] = []
        self._committing = True
        self._cuda_stream = 0
        self._table = BlockTable(ctx.initial_stale_ends)
        # Beam search: one block table per beam (beam 0's is ``_table``). Until the first commit
        # with beam_search_indices every beam's table holds the same pages (one owner per table);
        # from then on ("forked") each beam has its own committed tokens and tail pages.
        self._beam_width = beam_width
        self._tables = [self._table] + [BlockTable(ctx.initial_stale_ends) for _ in range(beam_width - 1)]
        self._forked = False
        #: committed full blocks and tail of beams 1.. once forked (beam 0's are the fields above)
        self._beam_seqs: list[tuple[list[BlockTokens], list[TokenIdExt]]] = []
        #: (beam, layer group, block) whose page other beams share but this beam will write: the
        #: next resize gives it a private page (a copy, for the block holding committed tokens)
        self._cow: list[tuple[int, LayerGroupId, int]] = []
        self._final_beam = 0
        self._scratch_enabled = ctx.max_rewind_len >= 0 and ctx.has_releasing_groups and beam_width == 1
        # Reuse: the tree node of the last published full block, and how many full blocks are published.
        self._last_node: Node | None = None
        self._num_published = 0
        #: the last batch call that listed this cache (a cache listed twice is refused)
        self._batch_serial = 0
        #: no sliding window moves below this history (see ``_window_moves``; 0: check)
        self._window_next = 0

    def _adopt(self, nodes: list[Node], part: Node | None, part_len: int, tokens: Sequence[TokenIdExt]) -> None:
        """Take holds on matched pages (called once, right after construction)."""
        t = self._tokens_per_block
        length = len(nodes) * t + part_len
        nb = (length + t - 1) // t
        table = self._table
        taken = 0
        for i, lc in enumerate(self._ctx.layer_groups):
            lc_id = LayerGroupId(i)
            beg, end = lc.stale_range(length)
            pages: list[Page | None] = [None] * nb
            for o in range(nb):
                if beg <= o < end:
                    continue
                if o < len(nodes):
                    p = nodes[o].page(lc_id)
                    assert p is not None
                    p.take(False)
                    history = p.storage.history
                    if history is not None:
                        history.use(p, self._serial)
                    pages[o] = p
                    taken += 1
                else:
                    assert part is not None
                    src = part.page(lc_id)
                    assert src is not None
                    src.take(False)
                    history = src.storage.history
                    if history is not None:
                        history.use(src, self._serial)
                    table.pending_copy[lc_id] = src
            table.adopt(lc_id, pages, lc.stale_end(length))
            for other in self._tables[1:]:
                for p in pages:
                    if p is not None:
                        p.take(False)
                other.adopt(lc_id, list(pages), lc.stale_end(length))
        self._committed_blocks = [node.tokens for node in nodes]  # equal keys: equal tokens
        self._tail = list(tokens[len(nodes) * t : length])
        self._capacity = self._history = length
        self._num_blocks = nb
        self._num_published = len(nodes)
        self._extend_from(nodes[-1] if nodes else None)
        if self._ctx.enable_stats:
            stats = self._ctx.stats
            stats.reused_blocks += nb
            stats.missed_blocks += (len(tokens) + t - 1) // t - nb
            stats.reused_pages += taken
            stats.queried_tokens += len(tokens)
            stats.reused_tokens += length

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
        """Tokens the request has pages for (allocated or stale).

        Setting it is ``resize(value)`` that raises ``OutOfPagesError`` (changing nothing)
        where ``resize`` would return False.
        """
        return self._capacity

    @capacity.setter
    def capacity(self, value: object) -> None:  # object: compiled code would turn a bool into an int first
        if not self.resize(check_int("capacity", value)):
            raise OutOfPagesError(
                f"not enough GPU memory to grow this cache to capacity {value}; nothing changed "
                "(resize() returns False instead of raising)"
            )

    @property
    def history_length(self) -> int:
        """Tokens whose KV is already computed (the step's input starts here).

        Setting it is ``resize(None, value)``: capacity stays; history never shrinks.
        """
        return self._history

    @history_length.setter
    def history_length(self, value: object) -> None:
        if not self.resize(None, check_int("history_length", value)):
            raise OutOfPagesError(f"not enough GPU memory to raise history to {value}; nothing changed")

    @property
    def num_committed_tokens(self) -> int:
        return len(self._committed_blocks) * self._tokens_per_block + len(self._tail)

    @property
    def committed_tokens(self) -> list[TokenIdExt]:
        """A copy of the committed token sequence (beam 0's; see ``get_committed_tokens``)."""
        return [tok for block in self._committed_blocks for tok in block] + self._tail

    def get_committed_tokens(self, beam: BeamIndex = BeamIndex(0)) -> list[TokenIdExt]:
        """A copy of one beam's committed token sequence."""
        self._check_beam(beam)
        blocks, tail = self._seq(beam)
        return [tok for block in blocks for tok in block] + tail

    def _seq(self, beam: int) -> tuple[list[BlockTokens], list[TokenIdExt]]:
        if beam == 0 or not self._forked:
            return self._committed_blocks, self._tail
        return self._beam_seqs[beam - 1]

    @property
    def reuse_scope(self) -> ReuseScope:
        return self._reuse_scope

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def beam_width(self) -> int:
        """Beams of this request (set by ``create_kv_cache``; fixed for its life)."""
        return self._beam_width

    @property
    def id(self) -> object:
        return self._id

    @property
    def cuda_stream(self) -> int:
        """The stream (``CUstream`` handle) the request's kernels run on; 0 until set here or by ``resume``."""
        return self._cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: object) -> None:
        self._cuda_stream = check_int("cuda_stream (a CUstream handle)", value)

    @property
    def num_blocks(self) -> int:
        """Blocks covered by ``capacity``: ``ceil(capacity / tokens_per_block)``."""
        return self._num_blocks

    @property
    def block_table(self) -> BlockTable:
        """This request's pages and indices, beam 0's (for introspection)."""
        return self._table

    @property
    def block_tables(self) -> list[BlockTable]:
        """Every beam's block table (for introspection)."""
        return list(self._tables)

    @property
    def has_scratch_slots(self) -> bool:
        """Whether this step has scratch blocks (then only ``PageIndexMode.PER_LAYER`` addresses them)."""
        return self._table.has_scratch_slots

    def get_scratch_desc(self, layer_group_id: LayerGroupId) -> ScratchDesc | None:
        """Scratch blocks of this step for the layer group and the slots they share (None: none).

        Pass it to the ``PageIndexConverter`` (with ``PageIndexMode.PER_LAYER``) to address them.
        """
        self._check_lc(layer_group_id)
        slots = self._table.scratch_slots[layer_group_id]
        if not slots:
            return None
        beg, end = self._table.scratch[layer_group_id]
        return ScratchDesc(HalfOpenRange(beg, end), tuple(slots))

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER addresses every block; SHARED every block except scratch ones."""
        check_type("mode", mode, PageIndexMode)
        return mode is PageIndexMode.PER_LAYER or not self._table.has_scratch_slots

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether this request's prefill steps use scratch slots (SPEC 5.7; on by default when the
        manager has ``swa_scratch_reuse``). Settable while the current step has no scratch blocks."""
        return self._scratch_enabled

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, value: bool) -> None:
        check_type("enable_swa_scratch_reuse", value, bool)
        if value and self._ctx.max_rewind_len < 0:
            raise LogicError(
                "enable_swa_scratch_reuse needs a manager configured with swa_scratch_reuse=SwaScratchReuseConfig(...)"
            )
        table = self._table
        ctx = self._ctx
        done = True  # every scratch block is out of the window at the current history: the step is over
        for i, (beg, end) in enumerate(table.scratch):
            if beg < end and ctx.layer_groups[LayerGroupId(i)].stale_end(self._history) < end:
                done = False
        if not done:
            raise LogicError(
                "enable_swa_scratch_reuse cannot change while the current step has scratch blocks; "
                "commit the step (or resize to one without scratch blocks) first"
            )
        ctx.enter("enable_swa_scratch_reuse")
        try:
            self._free_scratch_slots()  # the committed step's scratch slots: nothing needs them now
            for i in range(len(table.scratch)):
                table.scratch[LayerGroupId(i)] = (0, 0)
        finally:
            ctx.leave()
        self._scratch_enabled = value and ctx.has_releasing_groups

    # ------------------------------------------------------------------ state machine
    def resume(self, cuda_stream: int | None = None) -> bool:
        """SUSPENDED -> ACTIVE: bring every page to GPU memory and lock it there.

        Pages in lower cache levels (matched there, or spilled while suspended) come up in one
        batch per (source level, pool group); a partially matched block gets its private copy.
        Returns False (staying SUSPENDED, nothing changed) when there is no room for them, or
        when GPU utilisation with them placed would exceed ``max_util_for_resume``. If a disk
        read fails, the blocks from the first lost one on are dropped: ``history_length`` (and
        capacity, committed tokens) shrink to what is still intact; read it again after resume.
        """
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(f"resume() needs a SUSPENDED cache; this one is {self._status.name}")
        if cuda_stream is not None:
            check_int("cuda_stream (a CUstream handle)", cuda_stream)
        ctx = self._ctx
        ctx.enter("resume()")
        try:
            if not self._resume():
                return False
        finally:
            ctx.leave()
        if cuda_stream is not None:
            self._cuda_stream = cuda_stream
        return True

    def _resume(self) -> bool:
        ctx = self._ctx
        table = self._table
        storage = ctx.storage
        scratch_needs = [
            (LayerGroupId(i), self._scratch_slots_for(beg, end, LayerGroupId(i)))
            for i, (beg, end) in enumerate(table.scratch)
            if end > beg
        ]
        max_util = ctx.config.max_util_for_resume
        if storage.num_levels == 1 and not table.has_pending() and not scratch_needs:
            # GPU only: every page is in GPU memory and nothing new is taken; the admission gate
            # still applies (its pages already count as used)
            if max_util < 1.0 and not storage.fits(ctx.no_gain, ctx.no_gain, max_util):
                return False
            self._lock_all()
            self._show_indices()
            self._status = KVCacheStatus.ACTIVE
            return True
        if storage.any_lost():
            self._drop_lost_blocks(False, -1)
        pending = [(LayerGroupId(i), src) for i, src in enumerate(table.pending_copy) if src is not None]
        need, excluded, up = self._plan_move_up(GPU_LEVEL, False)
        for lc, _ in pending:
            need[ctx.lc_group[lc]] += 1
        for lc, n in scratch_needs:
            need[ctx.lc_group[lc]] += n
        if not storage.fits(need, ctx.no_gain, max_util, excluded):
            return False
        if not up and not pending and not scratch_needs and not any(excluded[GPU_LEVEL]):
            self._lock_all()  # everything is in GPU memory already and takes nothing from others
            self._show_indices()
            self._status = KVCacheStatus.ACTIVE
            return True
        storage.reserve(need)
        o = self._num_published
        priorities = [self._priorities(lc, [o])[0] for lc, _ in pending]  # may raise: nothing changed yet
        # Lock first: the pages leave the evictors, so making room cannot push any of them down.
        self._lock_all()
        table.lock_pending()
        copies: list[tuple[Page, Page]] = []
        scratch: list[tuple[LayerGroupId, list[SlotId]]] = []
        try:
            lost = storage.move_up(up, GPU_LEVEL) if up else []
            for (lc, src), prio in zip(pending, priorities):
                copies.append((src, storage.new_pages(lc, [prio], True)[0]))
            bad = storage.copy_pages(copies) if copies else set()
            for lc, n in scratch_needs:  # the current step's scratch slots come back too
                scratch.append((lc, storage.new_scratch_slots(lc, n)))
        except BaseException:
            for _, dst in copies:
                dst.release(True)  # private and unpublished: its slot is freed
            for lc, slots in scratch:
                storage.free_scratch_slots(lc, slots)
            table.hold_pending()
            self._hold_all()
            raise
        for lc, slots in scratch:
            table.scratch_slots[lc].extend(slots)
        bad_block = -1
        for i, ((lc, src), (_, dst)) in enumerate(zip(pending, copies)):
            table.pending_copy[lc] = None
            if i in bad:  # the partially matched block could not be read back
                storage.lose(src)
                dst.release(True)
                bad_block = o
            else:
                table.set_page(lc, o, dst)
                for other in self._tables[1:]:  # every beam shares the copy (one owner each)
                    dst.take(True)
                    other.set_page(lc, o, dst)
            src.release(True)
        if ctx.enable_stats:
            ctx.stats.allocated_pages += len(copies) - len(bad)
        if lost or bad_block >= 0:
            self._drop_lost_blocks(True, bad_block)
        self._show_indices()
        self._status = KVCacheStatus.ACTIVE
        return True

    def _scratch_slots_for(self, beg: int, end: int, lc: LayerGroupId) -> int:
        num, den = self._ctx.scratch_util[lc]
        return ((end - beg) * num + den - 1) // den

    def prefetch(self, target_level: CacheLevel) -> bool:
        """Move this SUSPENDED cache's pages that sit below ``target_level`` up to it, ahead of
        ``resume`` (one batch per source level and pool group). Returns False, changing nothing,
        when ``target_level`` has no room for them. The pages stay HELD, so they may spill down
        again. A failed disk read drops the blocks from the first lost one on (as ``resume``)."""
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(f"prefetch() needs a SUSPENDED cache; this one is {self._status.name}")
        storage = self._ctx.storage
        check_int("target_level", target_level)
        if target_level >= storage.num_levels:
            raise ValueError(
                f"target_level must be in [0, {storage.num_levels}) ({storage.num_levels} tiers configured), "
                f"got {target_level}"
            )
        if storage.any_lost():
            self._drop_lost_blocks(False, -1)
        need, excluded, up = self._plan_move_up(target_level, True)
        if not up:
            return True
        if not storage.fits_at(target_level, need, excluded):
            return False
        if target_level == GPU_LEVEL:
            storage.reserve(need)
        table = self._table
        self._lock_all()  # pinned while pages move
        table.lock_pending()
        try:
            lost = storage.move_up(up, target_level)
        finally:
            table.hold_pending()
            self._hold_all()
        if lost:
            self._drop_lost_blocks(False, -1)
        return True

    def _plan_move_up(self, target: int, sources_too: bool) -> tuple[list[int], list[list[int]], list[Page]]:
        """Slots per pool group that bringing this cache's pages to ``target`` takes, how many of
        its pages each (level, pool group) evictor lists, and the pages below ``target`` (the
        copy-on-partial sources only with ``sources_too``: resume copies them from where they are)."""
        ctx = self._ctx
        n_groups = ctx.num_pool_groups
        need = [0] * n_groups
        excluded = [[0] * n_groups for _ in range(ctx.storage.num_levels)]
        up: list[Page] = []
        pending = self._table.pending_copy
        seen: set[int] = set()
        for p in self._all_pages():
            if id(p) in seen:  # a page beams share is moved once
                continue
            seen.add(id(p))
            g = p.storage.index
            if p.in_evictor:
                excluded[p.level][g] += 1
            if p.level > target and (sources_too or p is not pending[p.layer_group]):
                need[g] += 1
                up.append(p)
        return need, excluded, up

    def _drop_lost_blocks(self, locked: bool, bad_block: int) -> None:
        """Shrink to the longest prefix whose needed pages are all intact, after a disk error lost
        the data of some page (or of the block ``bad_block``). Lengths and committed tokens follow
        (every beam's); the blocks dropped are recomputed by the engine like any other new tokens."""
        first = bad_block
        for table in self._tables:
            f = table.first_lost_block()
            if f >= 0 and (first < 0 or f < first):
                first = f
        if first < 0:
            return
        b = first
        while b > 0 and not self._intact(b):
            b -= 1
        t = self._tokens_per_block
        n = b * t
        self._table.release_pending(locked)
        for table in self._tables:
            table.truncate(b, locked)
        self._free_scratch_slots()  # the step they served is gone with the blocks
        for i in range(len(self._table)):
            self._table.scratch[LayerGroupId(i)] = (0, 0)
        self._cow = [c for c in self._cow if c[2] < b]
        ctx = self._ctx
        for i, layer_group in enumerate(ctx.layer_groups):
            lc = LayerGroupId(i)
            end = layer_group.stale_end(n)
            for table in self._tables:
                table.release_range(lc, table.stale_end[lc], end, locked)
                table.stale_end[lc] = end
        self._window_next = 0
        self._capacity = self._history = n
        self._num_blocks = b
        if self.num_committed_tokens > n:
            for beam in range(self._beam_width):
                blocks, tail = self._seq(beam)
                del blocks[b:]
                tail.clear()
        if self._committing and self._num_published > len(self._committed_blocks):
            node = self._published_node(len(self._committed_blocks))
            self._num_published = node.ordinal + 1 if node is not None else 0
            self._extend_from(node)

    def _intact(self, nb: int) -> bool:
        """Whether every page needed at ``nb`` full blocks of history exists and holds its data (every beam)."""
        n = nb * self._tokens_per_block
        for i, layer_group in enumerate(self._ctx.layer_groups):
            beg, end = layer_group.stale_range(n)
            for table in self._tables:
                pages = table.pages[LayerGroupId(i)]
                for o in range(nb):
                    if beg <= o < end:
                        continue
                    p = pages[o]
                    if p is None or p.lost:
                        return False
        return True

    def _published_node(self, nb: int) -> Node | None:
        """The tree node of the last of the first ``nb`` blocks that is still in the tree, via its pages."""
        table = self._table
        for o in range(nb - 1, -1, -1):
            for pages in table.pages:
                p = pages[o]
                node = p.node if p is not None else None
                if node is not None and node.ordinal == o and node.parent is not None:
                    return node
        return None

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: locks become holds. The pages stay where they are, but with lower
        cache levels configured other requests may push them down (never drop them); the indices
        read ``BAD_PAGE_INDEX`` until ``resume``."""
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"suspend() needs an ACTIVE cache; this one is {self._status.name}")
        ctx = self._ctx
        ctx.enter("suspend()")
        try:
            self._hold_all()
            for table in self._tables:
                table.hide_indices()
            self._free_scratch_slots()  # scratch keeps nothing between steps; resume allocates it again
            self._status = KVCacheStatus.SUSPENDED
        finally:
            ctx.leave()

    def _lock_all(self) -> None:
        """Every beam's holds become locks (each table owns its pages once)."""
        for table in self._tables:
            table.lock_all()

    def _hold_all(self) -> None:
        for table in self._tables:
            table.hold_all()

    def _show_indices(self) -> None:
        for table in self._tables:
            table.show_indices()

    def _all_pages(self) -> list[Page]:
        """Every page of every beam (a page beams share appears once per beam)."""
        if len(self._tables) == 1:
            return self._table.all_pages()
        return [p for table in self._tables for p in table.all_pages()]

    def _free_scratch_slots(self) -> None:
        table = self._table
        for i, slots in enumerate(table.scratch_slots):
            if slots:
                self._ctx.storage.free_scratch_slots(LayerGroupId(i), slots)
                slots.clear()

    def close(self) -> None:
        """Publish the partial last block (unless ``stop_committing()`` came first) and release
        every page; committed pages stay reusable. Idempotent; also runs on garbage collection."""
        if self._status is KVCacheStatus.CLOSED:
            return
        ctx = self._ctx
        ctx.enter("close()")
        try:
            self._close()
        finally:
            ctx.leave()

    def _close(self) -> None:
        if self._status is KVCacheStatus.SUSPENDED and self._ctx.storage.any_lost():
            self._drop_lost_blocks(False, -1)  # never publish a block whose data is gone
        self._publish_final()
        locked = self._status is KVCacheStatus.ACTIVE
        for table in self._tables:
            table.release_all(locked)
            table.detach_user_bufs()
        self._cow = []
        self._free_scratch_slots()
        for i in range(len(self._table)):
            self._table.scratch[LayerGroupId(i)] = (0, 0)
        self._extend_from(None)
        self._status = KVCacheStatus.CLOSED
        self._capacity = self._history = self._num_blocks = 0
        r = self._rawref
        if r is not None:
            self._ctx.cache_closed(r)
            r.invalidate()
            self._rawref = None

    def __del__(self) -> None:
        if self._status is not KVCacheStatus.CLOSED:
            ctx = self._ctx
            if ctx.busy:  # collected in the middle of a call: close when it ends
                ctx.deferred_closes.append(self)
            else:
                self.close()

    # ------------------------------------------------------------------ allocation
    def resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Set capacity (and raise history); allocate/release pages. All or nothing.

        Returns False, changing nothing, when GPU memory is short. Misuse raises.
        """
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"resize() needs an ACTIVE cache; this one is {self._status.name} (call resume() first)")
        # refuse bools while they are still objects (compiled, an int local would make them 0 / 1)
        if type(capacity) is bool:
            check_int("capacity", capacity)
        if type(history_length) is bool:
            check_int("history_length", history_length)
        cap = self._capacity if capacity is None else capacity
        h = self._history if history_length is None else history_length
        if type(cap) is not int or type(h) is not int or cap < 0 or h < 0 or cap > MAX_CAPACITY:
            check_int("capacity", cap)  # raises with the reason
            check_int("history_length", h)
            if cap > MAX_CAPACITY:
                raise ValueError(f"capacity must be at most {MAX_CAPACITY} tokens (int32 positions), got {cap}")
        if h < self._history:
            raise LogicError(f"history_length never shrinks: {self._history} -> {h}")
        if cap < h:
            raise LogicError(f"capacity {cap} is below history_length {h}")
        t = self._tokens_per_block
        nb = (cap + t - 1) // t
        if (
            nb == self._num_blocks
            and (not self._ctx.has_releasing_groups or not self._window_moves(cap, h))
            and not self._cow
        ):
            self._capacity = cap
            self._history = h
            return True
        ctx = self._ctx
        ctx.enter("resize()")
        try:
            return self._resize(cap, h, nb)
        finally:
            ctx.leave()

    def _resize(self, cap: int, h: int, nb: int) -> bool:
        """resize() past its checks and its no-op case (the caller entered the context)."""
        if (
            nb == self._num_blocks + 1
            and len(self._tables) == 1
            and not self._cow
            and not self._scratch_enabled
            and (not self._ctx.has_releasing_groups or not self._window_moves(cap, h))
        ):
            return self._grow_one_block(cap, h)
        return self._resize_blocks(cap, h, nb)

    def _grow_one_block(self, cap: int, h: int) -> bool:
        """The decode step's growth, which ``_resize_blocks`` would plan the long way: one more
        block with a new page in every layer group, nothing released (one table, no scratch, no
        copy-on-write, no window movement; a block at the end is never out of window)."""
        ctx = self._ctx
        storage = ctx.storage
        table = self._table
        o = self._num_blocks
        table.check_user_buf_room(o + 1)
        need = ctx.pages_per_block
        if not storage.fits(need, ctx.no_gain):
            return False
        cb = self._priority_cb
        if cb is default_priority:
            priorities = ctx.default_priorities
        else:
            priorities = [_checked_priority(cb(BlockOrdinal(o), LayerGroupId(i))) for i in range(ctx.num_layer_groups)]
        storage.reserve(need)
        for i, prio in enumerate(priorities):
            lc = LayerGroupId(i)
            table.append(lc, storage.new_page(lc, prio, True))
        if ctx.enable_stats:
            ctx.stats.allocated_pages += ctx.num_layer_groups
        self._capacity = cap
        self._history = h
        self._num_blocks = o + 1
        return True

    def _window_moves(self, cap: int, h: int) -> bool:
        """Whether some SWA layer group has blocks to release at history ``h``, or a different
        scratch range for the step ``h -> cap``.

        Without scratch, the answer stays False until history reaches ``_window_next`` (kept
        from the last call), so a decode step usually costs one comparison."""
        if h < self._window_next:
            return False
        ctx = self._ctx
        table = self._table
        scratch = self._scratch_enabled
        nxt = MAX_CAPACITY + 1
        for lc in ctx.releasing_layer_groups:
            layer_group = ctx.layer_groups.items[lc]
            done = table.stale_end.items[lc]
            if layer_group.stale_end(h) > done:
                return True
            if scratch and layer_group.scratch_range(cap, h, ctx.max_rewind_len) != table.scratch.items[lc]:
                return True
            nxt = min(nxt, layer_group.history_releasing_after(done))
        if not scratch:
            self._window_next = nxt
        return False

    def _scratch_plan(self, lc: LayerGroupId, cap: int, h: int) -> tuple[int, int, int]:
        """Scratch range ``(beg, end)`` of layer group ``lc`` for the step ``h -> cap`` and the
        scratch slots it needs: ``ceil(blocks * slot_util_frac_max)`` (several blocks share a slot)."""
        ctx = self._ctx
        if not self._scratch_enabled:
            return (0, 0, 0)
        beg, end = ctx.layer_groups[lc].scratch_range(cap, h, ctx.max_rewind_len)
        return (beg, end, self._scratch_slots_for(beg, end, lc))

    def _resize_blocks(self, cap: int, h: int, nb: int) -> bool:
        ctx = self._ctx
        table = self._table
        tables = self._tables
        storage = ctx.storage
        old_nb = self._num_blocks
        for tb in tables:
            tb.check_user_buf_room(nb)
        # beams that forked get a page each per new block; before that they share one
        per_block = len(tables) if self._forked else 1
        # Plan without touching anything: which blocks get pages, with which priorities, and
        # whether every pool group has enough slots once this request's releases are counted.
        need = [0] * ctx.num_pool_groups
        gain = [0] * ctx.num_pool_groups
        stale_ends: list[int] = []
        stale_ranges: list[tuple[int, int]] = []
        scratch: list[tuple[int, int, int]] = []
        wanted: list[list[int]] = []
        priorities: list[list[Priority]] = []
        for i, layer_group in enumerate(ctx.layer_groups):
            lc = LayerGroupId(i)
            end = layer_group.stale_end(h)
            stale_ends.append(end)
            stale_beg, stale_stop = layer_group.stale_range(h)
            stale_ranges.append((stale_beg, stale_stop))
            g = ctx.lc_group[lc]
            sb, se, num_slots = self._scratch_plan(lc, cap, h)  # (0, 0, 0) without scratch
            # released: blocks leaving the window, blocks past the new end, and blocks of this
            # step's scratch range that got pages in an earlier resize
            released = (
                (table.stale_end[lc], min(end, old_nb)),
                (max(nb, end), old_nb),
                (sb, min(se, old_nb)),
            )
            if len(tables) == 1:
                for beg, stop in released:
                    gain[g] += table.sole_owned(lc, beg, stop)
            else:
                gain[g] += self._beams_release_gain(lc, released)
            held = len(table.scratch_slots[lc])
            need[g] += max(0, num_slots - held)
            gain[g] += max(0, held - num_slots)
            # new blocks, and blocks that were scratch and now need a page, except stale and scratch
            # ones; counted first, so a huge capacity is refused before any per-block work
            old_sb, old_se = table.scratch[lc]
            need[g] += per_block * _count_outside(old_sb, min(old_se, nb), stale_beg, stale_stop, sb, se)
            need[g] += per_block * _count_outside(old_nb, nb, stale_beg, stale_stop, sb, se)
            scratch.append((sb, se, num_slots))
        cow = [c for c in self._cow if c[2] < nb and not ctx.layer_groups[c[1]].is_stale(c[2], h)]
        for _, lc, _ in cow:
            need[ctx.lc_group[lc]] += 1
        if not storage.fits(need, gain):
            return False
        for i, (sb, se, _) in enumerate(scratch):
            lc = LayerGroupId(i)
            stale_beg, stale_stop = stale_ranges[i]
            old_sb, old_se = table.scratch[lc]
            # (two ranges, not one list of both: compiled, a range loop stays on unboxed ints)
            want = [o for o in range(old_sb, min(old_se, nb)) if not stale_beg <= o < stale_stop and not sb <= o < se]
            want += [o for o in range(old_nb, nb) if not stale_beg <= o < stale_stop and not sb <= o < se]
            wanted.append(want)
            priorities.append(self._priorities(lc, want))  # may raise: nothing changed yet
        cow_priorities = [self._priorities(lc, [o])[0] for _, lc, o in cow]
        storage.reserve(need)  # a driver failure here changes nothing
        # Release everything first: layer groups sharing a pool group use each other's releases.
        for i in range(ctx.num_layer_groups):
            lc = LayerGroupId(i)
            self._release_stale(lc, stale_ends[i])
            sb, se, num_slots = scratch[i]
            table.release_range(lc, sb, se, True)
            slots = table.scratch_slots[lc]
            if len(slots) > num_slots:
                storage.free_scratch_slots(lc, slots[num_slots:])
                del slots[num_slots:]
        if nb < old_nb:
            for tb in tables:
                tb.truncate(nb, True)
        for i in range(ctx.num_layer_groups):
            lc = LayerGroupId(i)
            if wanted[i] or nb > old_nb:
                self._extend(lc, nb, wanted[i], priorities[i])
            sb, se, num_slots = scratch[i]
            slots = table.scratch_slots[lc]
            if len(slots) < num_slots:
                slots.extend(storage.new_scratch_slots(lc, num_slots - len(slots)))
            table.scratch[lc] = (sb, se)
        if cow:
            self._copy_on_write(cow, cow_priorities)
        self._cow = []
        self._capacity = cap
        self._history = h
        self._num_blocks = nb
        return True

    def _extend(self, lc: LayerGroupId, nb: int, want: list[int], priorities: list[Priority]) -> None:
        """New pages for blocks ``want`` of every beam (one shared page a block before beams fork)."""
        ctx = self._ctx
        storage = ctx.storage
        tables = self._tables
        if len(tables) == 1 or self._forked:
            for tb in tables:
                tb.extend(lc, nb, want, storage.new_pages(lc, priorities, True))
        else:
            pages = storage.new_pages(lc, priorities, True)
            self._table.extend(lc, nb, want, pages)
            for tb in tables[1:]:
                for p in pages:
                    p.take(True)
                tb.extend(lc, nb, want, pages)
        if ctx.enable_stats:
            ctx.stats.allocated_pages += len(want) * (len(tables) if self._forked else 1)

    def _beams_release_gain(self, lc: LayerGroupId, ranges: tuple[tuple[int, int], ...]) -> int:
        """Slots that releasing blocks ``ranges`` in every beam frees: pages whose every owner is
        one of this request's beams (a page beams share is freed once, by its last beam)."""
        refs: dict[int, int] = {}
        pages: dict[int, Page] = {}
        for table in self._tables:
            lst = table.pages[lc]
            for beg, end in ranges:
                for o in range(beg, min(end, len(lst))):
                    p = lst[o]
                    if p is not None:
                        refs[id(p)] = refs.get(id(p), 0) + 1
                        pages[id(p)] = p
        return sum(1 for k, p in pages.items() if p.num_holds == 0 and p.num_locks == refs[k])

    def _copy_on_write(self, cow: list[tuple[int, LayerGroupId, int]], priorities: list[Priority]) -> None:
        """Give each listed beam a private page for a block it shares with another beam; the data
        is copied where the block holds committed tokens (the partial last block)."""
        storage = self._ctx.storage
        committed_blocks = (self.num_committed_tokens + self._tokens_per_block - 1) // self._tokens_per_block
        copies: list[tuple[Page, Page]] = []
        for (b, lc, o), prio in zip(cow, priorities):
            table = self._tables[b]
            src = table.pages[lc][o]
            if src is None:
                continue
            dst = storage.new_pages(lc, [prio], True)[0]
            if o < committed_blocks:
                copies.append((src, dst))
            table.set_page(lc, o, dst)
            src.release(True)
        if copies:
            storage.copy_pages(copies)
        if self._ctx.enable_stats:
            self._ctx.stats.allocated_pages += len(cow)

    def _release_stale(self, lc: LayerGroupId, end: int) -> None:
        """Release pages of blocks below ``end`` that left the window (sinks never do), in every beam."""
        done = self._table.stale_end[lc]
        if end <= done:
            return
        locked = self._status is KVCacheStatus.ACTIVE
        for table in self._tables:
            table.release_range(lc, done, end, locked)
            table.stale_end[lc] = end

    # ------------------------------------------------------------------ tokens
    def commit(
        self,
        accepted_input_tokens: Sequence[TokenIdExt] | Sequence[Sequence[TokenIdExt]],
        beam_search_indices: Sequence[int] | None = None,
    ) -> None:
        """Append tokens whose KV has been computed; history rises to at least the committed length.

        Beam search (``beam_width > 1``): without ``beam_search_indices`` every beam commits the
        same tokens (the prompt; allowed until beams fork). With them, ``accepted_input_tokens[b]``
        are beam ``b``'s tokens (the same count for every beam) and ``beam_search_indices[b]`` the
        beam it continues: its history is that beam's, and so are its pages (full blocks shared,
        the partial last block copied on the next ``resize``). The first such commit forks the
        beams; commit the last prompt chunk that way (``[chunk] * B``, indices ``[0] * B``) so every
        beam has its own tail before the first generation step writes it.
        """
        check_token_sequence(accepted_input_tokens, "accepted_input_tokens")
        if beam_search_indices is not None:
            self._check_committing()
            self._commit_beams(cast(Sequence[Sequence[TokenIdExt]], accepted_input_tokens), beam_search_indices)
            return
        accepted_input_tokens = cast(Sequence[TokenIdExt], accepted_input_tokens)
        if len(accepted_input_tokens) == 1:
            # the decode step: one token (read as an object: compiled code would type-check it first)
            tok = cast(Sequence[object], accepted_input_tokens)[0]
            self._check_commit()
            check_token(tok, "accepted_input_tokens")
            self._check_room(1)
            ctx = self._ctx
            ctx.check_idle("commit()")  # before the token goes in: all or nothing
            if not self._commit_token(cast(TokenIdExt, tok)):
                try:
                    ctx.enter("commit()")
                except LogicError:
                    # another thread entered since check_idle: take the token out again (only
                    # the tail changed: _commit_token returns False before touching history)
                    self._tail.pop()
                    raise
                try:
                    self._committed()
                finally:
                    ctx.leave()
            return
        self._check_commit()
        validate_tokens(accepted_input_tokens, "accepted_input_tokens")
        self._check_room(len(accepted_input_tokens))
        ctx = self._ctx
        ctx.enter("commit()")
        try:
            self._committed(accepted_input_tokens)
        finally:
            ctx.leave()

    def _check_committing(self) -> None:
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"commit() needs an ACTIVE cache; this one is {self._status.name}")
        if not self._committing:
            raise LogicError("commit() after stop_committing(): this request no longer commits tokens")

    def _check_commit(self) -> None:
        """Raise unless tokens can be committed without beam_search_indices."""
        self._check_committing()
        if self._forked:
            raise LogicError(
                "commit() without beam_search_indices after the beams forked: pass each beam's tokens and "
                "the beam it continues"
            )

    def _check_room(self, num_tokens: int) -> None:
        n = len(self._committed_blocks) * self._tokens_per_block + len(self._tail) + num_tokens
        if n > self._capacity:
            raise LogicError(
                f"commit() of {num_tokens} tokens would reach {n} committed tokens, beyond capacity "
                f"{self._capacity}; resize() first"
            )

    def _commit_token(self, tok: TokenIdExt) -> bool:
        """Append one checked token: the decode step. False when it completed a block or moved
        a sliding window: then ``_committed`` must follow (in the entered context)."""
        tail = self._tail
        tail.append(tok)
        t = self._tokens_per_block
        n = len(self._committed_blocks) * t + len(tail)
        if len(tail) == t:
            return False
        if n > self._history:
            if self._ctx.has_releasing_groups and self._window_moves(n, n):
                return False
            self._history = n
        return True

    def _committed(self, more: Sequence[TokenIdExt] | None = None) -> None:
        """After tokens were appended to the tail, or with validated tokens ``more`` to append:
        publish the blocks they completed, raise history to the committed length and release
        what left the sliding windows."""
        t = self._tokens_per_block
        tail = self._tail
        if more is not None and (tail or not isinstance(more, (list, tuple, array))):
            tail.extend(more)  # the tail's block first (or a sequence without slices): cut from the tail
            more = None
        src: Sequence[TokenIdExt] = tail if more is None else more
        full = len(src) // t
        if full:
            first = len(self._committed_blocks)
            completed = src[: full * t] if first == self._num_published else None
            if isinstance(src, array) and src.typecode == "I":
                # an array('I') block is one object, no int objects; it refers to nothing but its
                # type, so it is untracked by the GC like the tuples below
                self._committed_blocks.extend([rawref.untrack(src[i * t : (i + 1) * t]) for i in range(full)])
                tail.extend(src[full * t :])
            else:
                items = rawref.untrack(src.tolist()) if isinstance(src, array) else src  # ints made in one pass
                # a block's tokens (ints, digests) can be in no reference cycle: untracked by the GC
                self._committed_blocks.extend([rawref.untrack(tuple(items[i * t : (i + 1) * t])) for i in range(full)])
                if more is None:
                    del tail[: full * t]
                else:
                    tail.extend(items[full * t :])
            self._publish(first + full, 0, completed)
        elif more is not None:
            tail.extend(more)
        n = len(self._committed_blocks) * t + len(tail)
        if n > self._history:
            self._history = n
            ctx = self._ctx
            if ctx.has_releasing_groups:
                for lc in ctx.releasing_layer_groups:
                    self._release_stale(lc, ctx.layer_groups[lc].stale_end(n))

    def _commit_beams(self, tokens: Sequence[Sequence[TokenIdExt]], parents: Sequence[int]) -> None:
        """Beam search's commit: rebuild each beam from the beam it continues, then append its tokens."""
        width = self._beam_width
        if width == 1:
            raise ValueError("beam_search_indices: this cache has beam_width 1; pass None")
        if len(parents) != width or len(tokens) != width:
            raise ValueError(
                f"beam_search_indices and accepted_input_tokens need one entry per beam ({width}), got "
                f"{len(parents)} and {len(tokens)}"
            )
        for b in range(width):
            check_int(f"beam_search_indices[{b}]", parents[b])
            if parents[b] >= width:
                raise ValueError(f"beam_search_indices[{b}] must be in [0, {width}), got {parents[b]}")
            validate_tokens(tokens[b], f"accepted_input_tokens[{b}]")
        n_new = len(tokens[0])
        if any(len(toks) != n_new for toks in tokens):
            raise ValueError("accepted_input_tokens: every beam commits the same number of tokens")
        n = self.num_committed_tokens + n_new
        if n > self._capacity:
            raise LogicError(
                f"commit() would reach {n} committed tokens, beyond capacity {self._capacity}; resize() first"
            )
        ctx = self._ctx
        ctx.enter("commit()")
        try:
            if not self._forked:
                self._forked = True
                self._beam_seqs = [(list(self._committed_blocks), list(self._tail)) for _ in range(width - 1)]
            old_tables = self._tables
            old_seqs = [self._seq(b) for b in range(width)]
            bufs = [table.take_user_bufs() for table in old_tables]
            new_tables: list[BlockTable] = list(old_tables)
            new_seqs: list[tuple[list[BlockTokens], list[TokenIdExt]]] = list(old_seqs)
            used = [False] * width
            extra: list[int] = []
            for b in range(width):
                p = parents[b]
                if used[p]:
                    extra.append(b)
                else:  # the first beam continuing p takes p's table as it is
                    used[p] = True
                    new_tables[b] = old_tables[p]
                    new_seqs[b] = old_seqs[p]
            # each further beam continuing a parent takes the table of a beam nobody continues:
            # it becomes a copy of the parent's (beams share most pages, so few change hands)
            dropped = [p for p in range(width) if not used[p]]
            for b, d in zip(extra, dropped):
                p = parents[b]
                old_tables[d].become(old_tables[p], True)
                new_tables[b] = old_tables[d]
                new_seqs[b] = (list(old_seqs[p][0]), list(old_seqs[p][1]))
            t = self._tokens_per_block
            for b in range(width):
                new_tables[b].give_user_bufs(bufs[b])
                blocks, tail = new_seqs[b]
                tail.extend(tokens[b])
                if len(tail) >= t:
                    full = len(tail) // t
                    blocks.extend([tuple(tail[i * t : (i + 1) * t]) for i in range(full)])
                    del tail[: full * t]
            self._tables = new_tables
            self._table = new_tables[0]
            self._committed_blocks, self._tail = new_seqs[0]
            self._beam_seqs = new_seqs[1:]
            if n > self._history:
                self._history = n
                for lc in ctx.releasing_layer_groups:
                    self._release_stale(lc, ctx.layer_groups[lc].stale_end(n))
            self._cow = self._shared_tails(n)
            self._publish(self._num_published + self._common_full_blocks())
        finally:
            ctx.leave()

    def _common_full_blocks(self) -> int:
        """Full blocks after the published ones that every beam holds alike (same tokens, same
        pages): reusable by others already, like a prompt."""
        n = 0
        o = self._num_published
        seqs = [self._seq(b)[0] for b in range(self._beam_width)]
        while all(len(blocks) > o for blocks in seqs) and all(same_tokens(blocks[o], seqs[0][o]) for blocks in seqs):
            for i in range(len(self._table)):
                page = self._table.pages[LayerGroupId(i)][o]
                if any(table.pages[LayerGroupId(i)][o] is not page for table in self._tables):
                    return n
            n += 1
            o += 1
        return n

    def _shared_tails(self, committed: int) -> list[tuple[int, LayerGroupId, int]]:
        """Blocks from the one holding position ``committed`` on whose page several beams share:
        every beam after the first needs its own before it writes there."""
        out: list[tuple[int, LayerGroupId, int]] = []
        first = committed // self._tokens_per_block
        for i in range(len(self._table)):
            lc = LayerGroupId(i)
            for o in range(first, self._num_blocks):
                seen: set[int] = set()
                for b, table in enumerate(self._tables):
                    p = table.pages[lc][o]
                    if p is None:
                        continue
                    if id(p) in seen:
                        out.append((b, lc, o))
                    else:
                        seen.add(id(p))
        return out

    def stop_committing(self, final_beam: BeamIndex | None = None) -> None:
        """No more commits for this request (its further output must not be reused); publishes
        what was committed, the partial last block included. With beams, that is the sequence of
        ``final_beam`` (default: the one ``close`` would publish, beam 0)."""
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("stop_committing() on a CLOSED cache")
        if final_beam is not None:
            self._check_beam(final_beam)
        ctx = self._ctx
        ctx.enter("stop_committing()")
        try:
            if self._status is KVCacheStatus.SUSPENDED and ctx.storage.any_lost():
                self._drop_lost_blocks(False, -1)
            if final_beam is not None:
                self._final_beam = final_beam
            self._publish_final()
            self._committing = False
            self._extend_from(None)
        finally:
            ctx.leave()

    def _publish_final(self) -> None:
        """Publish the rest of the committed sequence (the final beam's, once beams forked)."""
        if not self._committing:
            return
        blocks, tail = self._seq(self._final_beam)
        upto = len(blocks) + (1 if tail else 0)
        if upto > self._num_published:
            self._publish(upto, self._final_beam)

    def _publish(self, upto: int, beam: int = 0, tokens: Sequence[TokenIdExt] | None = None) -> None:
        """Insert committed blocks ``[num_published, upto)`` of ``beam`` into the reuse tree (the
        last may be partial); ``tokens``: those blocks' tokens (full blocks), so their keys are
        hashed in one call. Before beams fork every beam's table holds the same pages: a block
        deduplicated onto the tree's page switches in all of them."""
        tree = self._ctx.tree
        t = self._tokens_per_block
        parent = self._last_node
        if parent is None:
            parent = tree.root(self._reuse_scope, True)
            assert parent is not None
        if parent.ordinal >= 0 and parent.parent is None:
            return  # our last block was evicted and pruned: nothing after it can be reached
        locked = self._status is KVCacheStatus.ACTIVE
        table = self._tables[beam]
        blocks, tail = self._seq(beam)
        shared = len(self._tables) > 1
        first = self._num_published
        keys = chain_token_keys(parent.key, tokens, t) if tokens is not None else None
        for o in range(first, upto):
            toks = blocks[o] if o < len(blocks) else rawref.untrack(tuple(tail))
            mine = table.block_pages(o)
            pages = list(mine)
            node = tree.publish(
                parent, toks, pages, locked, self._serial, keys[o - first] if keys is not None else None
            )
            if node is None:
                return
            for i in range(len(pages)):
                theirs = pages[i]
                old = mine[i]
                if theirs is not old:  # deduplicated: the tree's page replaced ours
                    lc = LayerGroupId(i)
                    table.set_page(lc, o, theirs)
                    if shared and theirs is not None and old is not None:
                        for other in self._tables:  # other beams holding the same page switch too
                            if other is not table and other.pages[lc][o] is old:
                                theirs.take(locked)
                                other.set_page(lc, o, theirs)
                                old.release(locked)
            if len(toks) < t:
                return
            parent = node
            self._num_published = o + 1
            self._extend_from(node)

    def _extend_from(self, node: Node | None) -> None:
        """Publish the next block under ``node`` (None: publish no more). The node the request
        extends stays in the tree even without pages, so the key chain never breaks."""
        old = self._last_node
        if old is node:
            return
        if node is not None:
            node.num_extenders += 1
        self._last_node = node
        if old is not None:
            old.num_extenders -= 1
            self._ctx.tree.prune(old)

    # ------------------------------------------------------------------ indices
    def get_base_page_indices(self, layer_group_id: LayerGroupId, beam_id: BeamIndex = BeamIndex(0)) -> memoryview:
        """Slot id per block (``BAD_PAGE_INDEX`` for none): an int32 ``memoryview`` the manager keeps
        up to date in place (wrap it with numpy at will; do not write to it). Its length is the
        block count when fetched: fetch it again after a ``resize`` that changes ``num_blocks``."""
        indices = self._table.views.items
        if type(layer_group_id) is int and 0 <= layer_group_id < len(indices) and beam_id == 0:
            return indices[layer_group_id]  # the per-step path: no helper calls
        self._check_lc(layer_group_id)
        self._check_beam(beam_id)
        return self._tables[beam_id].views[layer_group_id]

    def set_base_page_index_buf(self, beam: BeamIndex, layer_group_id: LayerGroupId, buf: memoryview | None) -> None:
        """Have the manager write this layer group's indices into ``buf`` (1-D int32, writable).

        Entries past the cache's blocks are set to ``BAD_PAGE_INDEX``; ``None`` detaches.
        """
        self._check_beam(beam)
        self._check_lc(layer_group_id)
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("set_base_page_index_buf() on a CLOSED cache")
        table = self._tables[beam]
        if buf is None:
            table.attach_user_buf(layer_group_id, None)
            return
        if not isinstance(buf, memoryview):
            raise TypeError(f"buf must be a memoryview (or None), got {type(buf).__name__}")
        if (
            buf.readonly
            or buf.ndim != 1
            or buf.itemsize != 4
            or buf.format not in ("i", "=i", "<i", "@i")
            or not buf.c_contiguous
        ):
            raise ValueError(
                "buf must be a writable, C-contiguous, 1-D memoryview of int32 (format 'i'); got "
                f"format={buf.format!r} itemsize={buf.itemsize} ndim={buf.ndim} readonly={buf.readonly}"
            )
        if len(buf) < self._num_blocks:
            raise ValueError(f"buf holds {len(buf)} entries but the cache has {self._num_blocks} blocks")
        table.attach_user_buf(layer_group_id, buf.cast("B").cast("i"))

    def get_aggregated_page_indices(
        self, layer_group_id: LayerGroupId, beam_id: BeamIndex = BeamIndex(0), valid_only: bool = False
    ) -> Iterator[int]:
        """Slot ids of the blocks: one slot aggregates every buffer of the layer group."""
        for idx in self.get_base_page_indices(layer_group_id, beam_id):
            if not valid_only or idx != BAD_PAGE_INDEX:
                yield idx

    # ------------------------------------------------------------------ helpers
    def _priorities(self, lc: LayerGroupId, ordinals: list[int]) -> list[Priority]:
        """Eviction priorities of new pages for these blocks (the callback is validated)."""
        cb = self._priority_cb
        if cb is default_priority:
            return [DEFAULT_PRIORITY] * len(ordinals)
        return [_checked_priority(cb(BlockOrdinal(o), lc)) for o in ordinals]

    def _check_lc(self, layer_group_id: int) -> None:
        n = self._ctx.num_layer_groups
        check_int("layer_group_id", layer_group_id)
        if layer_group_id >= n:
            raise ValueError(f"layer_group_id must be in [0, {n}), got {layer_group_id}")

    def _check_beam(self, beam: int) -> None:
        check_int("beam index", beam)
        if beam >= self._beam_width:
            raise ValueError(f"beam index must be in [0, {self._beam_width}) (the beam width), got {beam}")


# ---------------------------------------------------------------------- batched decode steps
def commit_batch(ctx: CacheContext, serial: int, caches: Sequence[KVCache], tokens: Sequence[TokenIdExt]) -> None:
    """``caches[i].commit([tokens[i]])`` for every i, every cache and token checked first."""
    kvs = _batch_members(ctx, serial, caches)
    toks: list[object] = as_list(tokens)
    if len(kvs) != len(toks):
        raise ValueError(f"commit_batch: {len(kvs)} caches but {len(toks)} tokens (one token per cache)")
    for i in range(len(kvs)):
        kv = kvs[i]
        tok = toks[i]
        try:
            kv._check_commit()
            if type(tok) is int:
                if not 0 <= tok <= MAX_TOKEN_ID:
                    check_token(tok, "token")  # raises with the reason
            else:
                check_token(tok, "token")
            kv._check_room(1)
        except (LogicError, ValueError, TypeError) as e:
            raise type(e)(f"commit_batch: caches[{i}]: {e}") from None
    ctx.enter("commit_batch()")
    try:
        for i in range(len(kvs)):
            kv = kvs[i]
            if not kv._commit_token(cast(TokenIdExt, toks[i])):
                kv._committed()
    finally:
        ctx.leave()


def resize_batch(ctx: CacheContext, caches: Sequence[KVCache], num_new_tokens: int) -> list[int]:
    """Capacity of each cache at least its committed length + ``num_new_tokens``; the positions
    of the caches that did not get it (each unchanged)."""
    check_int("num_new_tokens", num_new_tokens)
    kvs = _batch_members(ctx, 0, caches)
    caps: list[int] = []  # each cache's capacity to reach
    for i in range(len(kvs)):
        kv = kvs[i]
        if kv._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"resize_batch: caches[{i}] is {kv._status.name}; only ACTIVE caches grow")
        cap = kv.num_committed_tokens + num_new_tokens
        caps.append(cap)
        if cap > MAX_CAPACITY:
            raise ValueError(f"resize_batch: caches[{i}]: capacity must be at most {MAX_CAPACITY} tokens")
        nb = (cap + kv._tokens_per_block - 1) // kv._tokens_per_block
        if nb > kv._num_blocks:
            try:
                for table in kv._tables:
                    table.check_user_buf_room(nb)
            except LogicError as e:
                raise LogicError(f"resize_batch: caches[{i}]: {e}") from None
    failed: list[int] = []
    ctx.enter("resize_batch()")
    i = 0
    try:
        for i in range(len(kvs)):
            kv = kvs[i]
            cap = caps[i]
            if cap <= kv._capacity:
                continue
            t = kv._tokens_per_block
            nb = (cap + t - 1) // t
            h = kv._history
            if nb == kv._num_blocks and not kv._cow and (not ctx.has_releasing_groups or not kv._window_moves(cap, h)):
                kv._capacity = cap
            elif not kv._resize(cap, h, nb):
                failed.append(i)
    except BaseException as e:  # e.g. a custom_priority_callback raised: say what already happened
        e.add_note(
            f"resize_batch: raised at caches[{i}] (unchanged); caches before it got their room, except "
            f"positions {failed}"
        )
        raise
    finally:
        ctx.leave()
    return failed


def _batch_members(ctx: CacheContext, serial: int, caches: Sequence[KVCache]) -> list[KVCache]:
    """``caches`` checked: KVCaches of this manager, each listed once (when ``serial`` is nonzero)."""
    items: list[object] = as_list(caches)
    for i in range(len(items)):
        kv = items[i]
        if not isinstance(kv, KVCache):
            raise TypeError(f"caches[{i}] must be a KVCache, got {type(kv).__name__}")
        if kv._ctx is not ctx:
            raise ValueError(f"caches[{i}] belongs to another KVCacheManager")
        if serial:
            if kv._batch_serial == serial:
                raise ValueError(f"caches[{i}] is listed twice")
            kv._batch_serial = serial
    return cast(list[KVCache], items)


def _count_outside(beg: int, end: int, a_beg: int, a_end: int, b_beg: int, b_end: int) -> int:
    """How many of ``[beg, end)`` lie outside the disjoint ranges ``[a_beg, a_end)`` and ``[b_beg, b_end)``."""
    if end <= beg:
        return 0
    n = end - beg
    n -= max(0, min(end, a_end) - max(beg, a_beg))
    n -= max(0, min(end, b_end) - max(beg, b_beg))
    return n


def _checked_priority(p: Priority) -> Priority:
    if type(p) is not int or not 0 <= p <= MAX_PRIORITY:
        raise ValueError(f"custom_priority_callback must return an int in [0, {MAX_PRIORITY}], got {p!r}")
    return p
