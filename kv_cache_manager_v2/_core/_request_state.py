"""What one request's KV memory is made of and what it shows: its lengths, state, committed
tokens and block tables, the queries on them (status, tokens, tables, page indices: public as
``KVCache``'s), and the small helpers every concern of a cache uses.

:class:`~._kv_cache.KVCache` is the public object built on it (the state machine, resize,
commit); the concerns (residency, commit and publishing, beams, resize planning) are functions
over a ``RequestState`` in their own modules, so none of them needs the public class (which
imports them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import rawref

from .._common import (
    BAD_PAGE_INDEX,
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    BeamIndex,
    BlockOrdinal,
    BlockTokens,
    HalfOpenRange,
    KVCacheStatus,
    LayerGroupId,
    PageIndexMode,
    Priority,
    RequestSerial,
    ReuseScope,
    ScratchDesc,
    SessionId,
    TokenIdExt,
)
from .._exceptions import LogicError
from .._page import Page
from .._retention import RequestRetention
from .._reuse._node import Node
from .._storage._page_reads import PageRead, ReadGroup
from .._utils import check_int, check_type
from ._block_table import BlockTable
from ._context import CacheContext, OpenCache

PriorityCallback = Callable[[BlockOrdinal, LayerGroupId], Priority]


def default_priority(block_ordinal: BlockOrdinal, layer_group: LayerGroupId) -> Priority:
    """The priority pages get unless a request passes its own callback: 35."""
    return DEFAULT_PRIORITY


def checked_priority(priority: Priority) -> Priority:
    """A priority a ``custom_priority_callback`` returned, validated."""
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"custom_priority_callback must return an int in [0, {MAX_PRIORITY}], got {priority!r}")
    return priority


class RequestState:
    """One request's lengths, state, committed tokens and block tables, and the queries on them
    (see ``KVCache``, the public class: this is its one base, what the concern modules act on).

    Lengths keep ``num_committed_tokens <= history_length <= capacity``.
    """

    def __init__(
        self,
        ctx: CacheContext,
        reuse_scope: ReuseScope,
        id: object,
        priority_callback: PriorityCallback,
        beam_width: int = 1,
    ) -> None:
        #: the one non-owning reference to this cache (``rawref``), made when it opens
        self._rawref: rawref.ref[OpenCache] | None = None
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
        #: ``_cuda_stream`` is counted in ``StreamOrder`` (from the first resume to close)
        self._stream_counted = False
        self._table = BlockTable(ctx.initial_stale_ends, ctx.state_layer_groups)
        # Beam search: one block table per beam (beam 0's is ``_table``). Until the first commit
        # with beam_search_indices every beam's table holds the same pages (one owner per table);
        # from then on ("forked") each beam has its own committed tokens and tail pages.
        self._beam_width = beam_width
        self._tables = [self._table] + [
            BlockTable(ctx.initial_stale_ends, ctx.state_layer_groups) for _ in range(beam_width - 1)
        ]
        #: snapshot positions besides the multiples of the snapshot interval, ascending: the
        #: prompt end rounded down to a block (``input_tokens`` given at create) and the
        #: configured extra ones (``ssm_snapshots_from_start`` / ``_from_end``)
        self._snapshot_positions: list[int] = []
        #: the kind of each of them (``_snapshot_plan``: statistics)
        self._snapshot_kinds: dict[int, int] = {}
        self._forked = False
        #: committed full blocks and tail of beams 1.. once forked (beam 0's are the fields above)
        self._beam_seqs: list[tuple[list[BlockTokens], list[TokenIdExt]]] = []
        #: background reads of its pages (``KVCache.prefetch``) not installed yet when last looked at
        self._loads: list[PageRead] = []
        #: the pages they installed (placing another never evicts them)
        self._load_group = ReadGroup()
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
        #: no sliding window moves below this history (see ``KVCache._window_moves``; 0: check)
        self._window_next = 0
        #: retention of the blocks this request publishes (``create_kv_cache(retention=...)``)
        #: the session it belongs to (``create_kv_cache(session_id=...)``)
        self._session: SessionId | None = None
        self._retention: RequestRetention | None = None
        #: the prompt's length (where decode blocks start, for ``_retention``)
        self._prompt_length = 0
        #: full blocks reused at creation (the blocks after them this request published itself)
        self._num_matched_blocks = 0

    @property
    def num_committed_tokens(self) -> int:
        """Tokens committed so far (history whose KV the request computed or reused)."""
        return len(self._committed_blocks) * self._tokens_per_block + len(self._tail)

    def _seq(self, beam: int) -> tuple[list[BlockTokens], list[TokenIdExt]]:
        """One beam's committed full blocks and tail."""
        if beam == 0 or not self._forked:
            return self._committed_blocks, self._tail
        return self._beam_seqs[beam - 1]

    # ------------------------------------------------------------------ pages of every beam
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
        return [page for table in self._tables for page in table.all_pages()]

    def _free_scratch_slots(self) -> None:
        table = self._table
        for i, slots in enumerate(table.scratch_slots):
            if slots:
                self._ctx.storage.free_scratch_slots(LayerGroupId(i), slots)
                slots.clear()

    def _clear_scratch(self) -> None:
        """No scratch blocks and no scratch slots (the step they served is over or gone)."""
        self._free_scratch_slots()
        table = self._table
        for i in range(len(table)):
            table.scratch[LayerGroupId(i)] = (0, 0)

    def _scratch_slots_for(self, beg: int, end: int, layer_group: LayerGroupId) -> int:
        """Scratch slots blocks ``[beg, end)`` share: ``ceil(blocks * slot_util_frac_max)``."""
        numerator, denominator = self._ctx.scratch_util[layer_group]
        return ((end - beg) * numerator + denominator - 1) // denominator

    def _release_stale(self, layer_group: LayerGroupId, end: int) -> None:
        """Release pages of blocks below ``end`` that went stale (the policy never reports a
        kept block, e.g. a sink, as stale), in every beam."""
        done = self._table.stale_end[layer_group]
        if end <= done:
            return
        locked = self._status is KVCacheStatus.ACTIVE
        for table in self._tables:
            table.release_range(layer_group, done, end, locked)
            table.stale_end[layer_group] = end

    def _priorities(self, layer_group: LayerGroupId, ordinals: list[int]) -> list[Priority]:
        """Eviction priorities of new pages for these blocks (the callback is validated)."""
        callback = self._priority_cb
        if callback is default_priority:
            return [DEFAULT_PRIORITY] * len(ordinals)
        return [checked_priority(callback(BlockOrdinal(ordinal), layer_group)) for ordinal in ordinals]

    # ------------------------------------------------------------------ publishing
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
            if old.num_extenders == 0 and not old.has_children:  # (else prune removes nothing: skip its walk)
                self._ctx.tree.prune(old)

    # ------------------------------------------------------------------ checks
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
        total = len(self._committed_blocks) * self._tokens_per_block + len(self._tail) + num_tokens
        if total > self._capacity:
            raise LogicError(
                f"commit() of {num_tokens} tokens would reach {total} committed tokens, beyond capacity "
                f"{self._capacity}; resize() first"
            )

    # (public arguments arrive as ``object``: compiled code would turn a bool into an int first)
    def _check_layer_group(self, layer_group_id: object) -> LayerGroupId:
        num_layer_groups = self._ctx.num_layer_groups
        layer_group = check_int("layer_group_id", layer_group_id)
        if layer_group >= num_layer_groups:
            raise ValueError(f"layer_group_id must be in [0, {num_layer_groups}), got {layer_group}")
        return LayerGroupId(layer_group)

    def _check_beam(self, beam: object) -> BeamIndex:
        index = check_int("beam index", beam)
        if index >= self._beam_width:
            raise ValueError(f"beam index must be in [0, {self._beam_width}) (the beam width), got {index}")
        return BeamIndex(index)

    # ------------------------------------------------------------------ what the cache shows (public, via KVCache)
    @property
    def status(self) -> KVCacheStatus:
        """ACTIVE (pages locked in GPU memory), SUSPENDED or CLOSED."""
        return self._status

    @property
    def committed_tokens(self) -> list[TokenIdExt]:
        """A copy of the committed token sequence (beam 0's; see ``get_committed_tokens``)."""
        return [tok for block in self._committed_blocks for tok in block] + self._tail

    def get_committed_tokens(self, beam: object = BeamIndex(0)) -> list[TokenIdExt]:
        """A copy of one beam's committed token sequence (``beam``: a ``BeamIndex``)."""
        blocks, tail = self._seq(self._check_beam(beam))
        return [tok for block in blocks for tok in block] + tail

    @property
    def reuse_scope(self) -> ReuseScope:
        """The scope its blocks are reused in (only between requests of equal scope)."""
        return self._reuse_scope

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block (the manager's)."""
        return self._tokens_per_block

    @property
    def beam_width(self) -> int:
        """Beams of this request (set by ``create_kv_cache``; fixed for its life)."""
        return self._beam_width

    @property
    def id(self) -> object:
        """The ``id`` given to ``create_kv_cache`` (any object; None by default)."""
        return self._id

    @property
    def cuda_stream(self) -> int:
        """The stream (``CUstream`` handle) the request's kernels run on; 0 (the legacy default
        stream) until set here or by ``resume``. The manager's copies of the request's pages wait
        for the kernels queued there, and the kernels queued there after a copy wait for it; a
        stream replaced here (or left by ``close``) is still waited for by the next copy."""
        return self._cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: object) -> None:
        self._set_stream(check_int("cuda_stream (a CUstream handle)", value))

    def _set_stream(self, stream: int) -> None:
        """``cuda_stream = stream`` past its check (compiled, ``resume`` calling the property's
        setter on ``self`` crashed: a method instead)."""
        if self._stream_counted and stream != self._cuda_stream:
            streams = self._ctx.storage.copier.streams
            streams.acquire(stream)
            streams.release(self._cuda_stream)
        self._cuda_stream = stream

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

    def get_scratch_desc(self, layer_group_id: object) -> ScratchDesc | None:
        """Scratch blocks of this step for the layer group and the slots they share (None: none).

        Pass it to the ``PageIndexConverter`` (with ``PageIndexMode.PER_LAYER``) to address them.
        """
        layer_group = self._check_layer_group(layer_group_id)
        slots = self._table.scratch_slots[layer_group]
        if not slots:
            return None
        beg, end = self._table.scratch[layer_group]
        return ScratchDesc(HalfOpenRange(beg, end), tuple(slots))

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER addresses every block; SHARED every block except scratch ones."""
        check_type("mode", mode, PageIndexMode)
        return mode is PageIndexMode.PER_LAYER or not self._table.has_scratch_slots

    # ------------------------------------------------------------------ indices
    def get_base_page_indices(self, layer_group_id: object, beam_id: object = BeamIndex(0)) -> memoryview:
        """Slot id per block (``BAD_PAGE_INDEX`` for none): an int32 ``memoryview`` the manager keeps
        up to date in place (wrap it with numpy at will; do not write to it). Its length is the
        block count when fetched: fetch it again after a ``resize`` that changes ``num_blocks``.
        A recurrent group's blocks have no page (all ``BAD_PAGE_INDEX``): its live state is at
        ``get_ssm_state_index``."""
        if type(layer_group_id) is int and type(beam_id) is int and beam_id == 0:
            indices = self._table.views.items
            if 0 <= layer_group_id < len(indices):
                return indices[layer_group_id]  # the per-step path: no helper calls
        layer_group = self._check_layer_group(layer_group_id)
        return self._tables[self._check_beam(beam_id)].views[layer_group]

    def set_base_page_index_buf(self, beam: object, layer_group_id: object, buf: memoryview | None) -> None:
        """Have the manager write this layer group's indices into ``buf`` (1-D int32, writable).

        Entries past the cache's blocks are set to ``BAD_PAGE_INDEX``; ``None`` detaches.
        """
        beam_index = self._check_beam(beam)
        layer_group = self._check_layer_group(layer_group_id)
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("set_base_page_index_buf() on a CLOSED cache")
        table = self._tables[beam_index]
        if buf is None:
            table.attach_user_buf(layer_group, None)
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
        table.attach_user_buf(layer_group, buf.cast("B").cast("i"))

    def get_ssm_state_index(self, layer_group_id: object, beam: object = BeamIndex(0)) -> int:
        """The base page index of beam ``beam``'s live recurrent state in layer group
        ``layer_group_id`` (a ``"recurrent"`` group): one slot holds the state of every layer of
        the group; per layer and buffer, ``PageIndexConverter`` applies as for KV pages. The
        index stays the same across suspend/resume while the state stayed in GPU memory; fetch
        it again after each resume."""
        layer_group = self._check_layer_group(layer_group_id)
        beam_index = self._check_beam(beam)
        groups = self._ctx.state_layer_groups
        if layer_group not in groups:
            kind = self._ctx.layer_groups[layer_group].kind
            raise ValueError(
                f"get_ssm_state_index: layer group {layer_group} is a {kind!r} group; a recurrent "
                f"group is one of {[int(g) for g in groups]}"
            )
        page = self._tables[beam_index].state_page(layer_group)
        if self._status is not KVCacheStatus.ACTIVE or page is None:
            raise ValueError(
                f"get_ssm_state_index: the cache is {self._status.name}; its live state has an index only "
                "while it is ACTIVE (after resume())"
            )
        return int(page.slot)

    def get_aggregated_page_indices(
        self, layer_group_id: object, beam_id: object = BeamIndex(0), valid_only: bool = False
    ) -> Iterator[int]:
        """Slot ids of the blocks: one slot aggregates every buffer of the layer group."""
        for idx in self.get_base_page_indices(layer_group_id, beam_id):
            if not valid_only or idx != BAD_PAGE_INDEX:
                yield idx
