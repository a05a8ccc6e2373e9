"""What one request's KV memory is made of: its lengths, state, committed tokens and block
tables, and the small helpers every concern of a cache uses.

:class:`~._kv_cache.KVCache` is the public object built on it; the concerns (residency,
commit and publishing, beams, resize planning) are functions over a ``RequestState`` in their
own modules, so none of them needs the public class.
"""

from __future__ import annotations

from collections.abc import Callable

from .._common import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    BeamIndex,
    BlockOrdinal,
    BlockTokens,
    KVCacheStatus,
    LayerGroupId,
    Priority,
    RequestSerial,
    ReuseScope,
    SessionId,
    TokenIdExt,
)
from .._exceptions import LogicError
from .._page import Page
from .._retention import RequestRetention
from .._reuse._node import Node
from .._storage._page_reads import PageRead
from .._utils import check_int
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


class RequestState(OpenCache):
    """One request's lengths, state, committed tokens and block tables (see ``KVCache``).

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
