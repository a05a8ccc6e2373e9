"""Beam search: the commit that rebuilds each beam from the beam it continues, and what beams
share afterwards (docs/design.md, "Beam search")."""

from __future__ import annotations

from collections.abc import Sequence

from .._common import BlockTokens, LayerGroupId, TokenIdExt
from .._exceptions import LogicError
from .._page import Page
from .._reuse._keys import validate_tokens
from .._reuse._node import same_tokens
from .._utils import check_int
from ._block_table import BlockTable
from ._commit import publish, snapshot_priorities_at, take_snapshot
from ._request_state import RequestState


def commit_beams(state: RequestState, tokens: Sequence[Sequence[TokenIdExt]], parents: Sequence[object]) -> None:
    """Beam search's commit: rebuild each beam from the beam it continues, then append its tokens."""
    width = state._beam_width
    if width == 1:
        raise ValueError("beam_search_indices: this cache has beam_width 1; pass None")
    if len(parents) != width or len(tokens) != width:
        raise ValueError(
            f"beam_search_indices and accepted_input_tokens need one entry per beam ({width}), got "
            f"{len(parents)} and {len(tokens)}"
        )
    indices: list[int] = []  # checked as objects: a bool is refused
    for beam in range(width):
        parent = check_int(f"beam_search_indices[{beam}]", parents[beam])
        indices.append(parent)
        if parent >= width:
            raise ValueError(f"beam_search_indices[{beam}] must be in [0, {width}), got {parent}")
        validate_tokens(tokens[beam], f"accepted_input_tokens[{beam}]")
    num_new = len(tokens[0])
    if any(len(beam_tokens) != num_new for beam_tokens in tokens):
        raise ValueError("accepted_input_tokens: every beam commits the same number of tokens")
    committed = state.num_committed_tokens + num_new
    if committed > state._capacity:
        raise LogicError(
            f"commit() would reach {committed} committed tokens, beyond capacity {state._capacity}; resize() first"
        )
    ctx = state._ctx
    ctx.enter("commit()")
    try:
        # (asked of the callback before anything changes: it may raise)
        snapshot_priorities = snapshot_priorities_at(state, committed) if ctx.state_layer_groups else None
        if not state._forked:
            state._forked = True
            state._beam_seqs = [(list(state._committed_blocks), list(state._tail)) for _ in range(width - 1)]
        old_tables = state._tables
        old_seqs = [state._seq(beam) for beam in range(width)]
        bufs = [table.take_user_bufs() for table in old_tables]
        new_tables: list[BlockTable] = list(old_tables)
        new_seqs: list[tuple[list[BlockTokens], list[TokenIdExt]]] = list(old_seqs)
        used = [False] * width
        extra: list[int] = []
        for beam in range(width):
            parent = indices[beam]
            if used[parent]:
                extra.append(beam)
            else:  # the first beam continuing the parent takes its table as it is
                used[parent] = True
                new_tables[beam] = old_tables[parent]
                new_seqs[beam] = old_seqs[parent]
        # each further beam continuing a parent takes the table of a beam nobody continues:
        # it becomes a copy of the parent's (beams share most pages, so few change hands)
        dropped = [parent for parent in range(width) if not used[parent]]
        state_copies: list[tuple[Page, Page]] = []
        for beam, free in zip(extra, dropped):
            parent = indices[beam]
            old_tables[free].become(old_tables[parent], True)
            new_tables[beam] = old_tables[free]
            new_seqs[beam] = (list(old_seqs[parent][0]), list(old_seqs[parent][1]))
            # its live state continues the parent's: a copy (the free beam's own is nobody's parent)
            for source, destination in zip(old_tables[parent].state_pages, old_tables[free].state_pages):
                if source is not None and destination is not None:
                    state_copies.append((source, destination))
        if state_copies:
            ctx.storage.copy_pages(state_copies)
        tokens_per_block = state._tokens_per_block
        for beam in range(width):
            new_tables[beam].give_user_bufs(bufs[beam])
            blocks, tail = new_seqs[beam]
            tail.extend(tokens[beam])
            if len(tail) >= tokens_per_block:
                num_full = len(tail) // tokens_per_block
                blocks.extend([tuple(tail[i * tokens_per_block : (i + 1) * tokens_per_block]) for i in range(num_full)])
                del tail[: num_full * tokens_per_block]
        state._tables = new_tables
        state._table = new_tables[0]
        state._committed_blocks, state._tail = new_seqs[0]
        state._beam_seqs = new_seqs[1:]
        if committed > state._history:
            state._history = committed
            for layer_group in ctx.releasing_layer_groups:
                state._release_stale(layer_group, ctx.layer_groups[layer_group].stale_end(committed))
        state._cow = shared_tails(state, committed)
        publish(state, state._num_published + common_full_blocks(state))
        if snapshot_priorities is not None:
            take_snapshot(state, snapshot_priorities)
    finally:
        ctx.leave()


def common_full_blocks(state: RequestState) -> int:
    """Full blocks after the published ones that every beam holds alike (same tokens, same
    pages): reusable by others already, like a prompt."""
    count = 0
    ordinal = state._num_published
    seqs = [state._seq(beam)[0] for beam in range(state._beam_width)]
    while all(len(blocks) > ordinal for blocks in seqs) and all(
        same_tokens(blocks[ordinal], seqs[0][ordinal]) for blocks in seqs
    ):
        for i in range(len(state._table)):
            page = state._table.pages[LayerGroupId(i)][ordinal]
            if any(table.pages[LayerGroupId(i)][ordinal] is not page for table in state._tables):
                return count
        count += 1
        ordinal += 1
    return count


def shared_tails(state: RequestState, committed: int) -> list[tuple[int, LayerGroupId, int]]:
    """Blocks from the one holding position ``committed`` on whose page several beams share:
    every beam after the first needs its own before it writes there."""
    out: list[tuple[int, LayerGroupId, int]] = []
    first = committed // state._tokens_per_block
    for i in range(len(state._table)):
        layer_group = LayerGroupId(i)
        for ordinal in range(first, state._num_blocks):
            seen: set[int] = set()
            for beam, table in enumerate(state._tables):
                page = table.pages[layer_group][ordinal]
                if page is None:
                    continue
                if id(page) in seen:
                    out.append((beam, layer_group, ordinal))
                else:
                    seen.add(id(page))
    return out
