"""Committing tokens and publishing the blocks they complete into the reuse tree
(docs/design.md, "Reuse"). The one-token decode commit that completes nothing stays on ``KVCache``; this is the
rest: a block completed, several tokens, the final partial block."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final

import rawref

from .._common import GPU_LEVEL, MAX_CAPACITY, KVCacheStatus, LayerGroupId, Priority, TokenIdExt
from .._page import Page
from .._reuse._keys import chain_token_keys
from ._request_state import RequestState, default_priority
from ._retention import retain_new_pages
from ._snapshot_plan import SNAPSHOT_LAST, count_snapshots

#: bound once: mypyc looks a module's attribute up at every call (hot: once or twice per block)
_untrack: Final = rawref.untrack


def commit_tokens(state: RequestState, more: Sequence[TokenIdExt] | None = None) -> None:
    """After tokens were appended to the tail, or with validated tokens ``more`` to append:
    publish the blocks they completed, raise history to the committed length and release
    what went stale."""
    tokens_per_block = state._tokens_per_block
    tail = state._tail
    snapshot_priorities: list[Priority] | None = None
    if state._ctx.state_layer_groups:
        # a snapshot's priorities come from the callback: asked before anything changes (with
        # ``more`` None the caller appended one token to the tail: taken out again if it raises)
        try:
            snapshot_priorities = snapshot_priorities_at(
                state, state.num_committed_tokens + (len(more) if more is not None else 0)
            )
        except BaseException:
            if more is None:
                tail.pop()
            raise
    if more is None and len(tail) == tokens_per_block:
        # the decode step: one token completed the tail's block (one tuple; no slices, no type tests)
        block: tuple[TokenIdExt, ...] = _untrack(tuple(tail))
        tail.clear()
        first = len(state._committed_blocks)
        state._committed_blocks.append(block)
        publish(state, first + 1, 0, block if first == state._num_published else None)
    else:
        if more is not None and (tail or not isinstance(more, (list, tuple, array))):
            tail.extend(more)  # the tail's block first (or a sequence without slices): cut from the tail
            more = None
        source: Sequence[TokenIdExt] = tail if more is None else more
        num_full = len(source) // tokens_per_block
        if num_full:
            first = len(state._committed_blocks)
            completed = source[: num_full * tokens_per_block] if first == state._num_published else None
            if isinstance(source, array) and source.typecode == "I":
                # an array('I') block is one object, no int objects; it refers to nothing but its
                # type, so it is untracked by the GC like the tuples below
                state._committed_blocks.extend(
                    [_untrack(source[i * tokens_per_block : (i + 1) * tokens_per_block]) for i in range(num_full)]
                )
                tail.extend(source[num_full * tokens_per_block :])
            else:
                items = _untrack(source.tolist()) if isinstance(source, array) else source  # ints made in one pass
                # the tokens as one tuple first: each block is then one slice of it (one copy, not a list
                # slice and a tuple of it); a block's tokens (ints, digests) can be in no reference
                # cycle: untracked by the GC
                run = items if type(items) is tuple else tuple(items)
                state._committed_blocks.extend(
                    [_untrack(run[i * tokens_per_block : (i + 1) * tokens_per_block]) for i in range(num_full)]
                )
                if more is None:
                    del tail[: num_full * tokens_per_block]
                else:
                    tail.extend(items[num_full * tokens_per_block :])
            publish(state, first + num_full, 0, completed)
        elif more is not None:
            tail.extend(more)
    committed = len(state._committed_blocks) * tokens_per_block + len(tail)
    if committed > state._history:
        state._history = committed
        ctx = state._ctx
        if ctx.has_releasing_groups:
            for layer_group in ctx.releasing_layer_groups:
                state._release_stale(layer_group, ctx.layer_groups[layer_group].stale_end(committed))
    if snapshot_priorities is not None and not tail:
        take_snapshot(state, snapshot_priorities)


def snapshot_priorities_at(state: RequestState, end: int) -> list[Priority] | None:
    """When a commit ending at ``end`` committed tokens may take a snapshot: its priorities per
    state group, from the callback (may raise: ask before the commit changes anything); else None."""
    tokens_per_block = state._tokens_per_block
    # (history beyond the committed end: the state holds more than the block, no snapshot)
    if end % tokens_per_block != 0 or state._history > end or not is_snapshot_position(state, end):
        return None
    periodic = state._ctx.periodic_priority
    # "auto", for a request without its own priorities (the default callback): the interval
    # snapshots at the periodic priority; without a tier below the GPU (where they would go) the
    # prompt's last full block too, which usually lies in the prompt's own unique suffix; positions
    # planned from a match or by the engine keep the request's priority. A request's own callback
    # is asked for every snapshot: where the engine gives a priority, it wins.
    if periodic >= 0 and state._priority_cb is default_priority:
        kind = state._snapshot_kinds.get(end, -1)
        if kind == -1 or (kind == SNAPSHOT_LAST and state._ctx.periodic_level == 0):
            return [Priority(periodic)] * len(state._ctx.state_layer_groups)
    return [
        state._priorities(layer_group, [end // tokens_per_block - 1])[0]
        for layer_group in state._ctx.state_layer_groups
    ]


def is_snapshot_position(state: RequestState, position: int) -> bool:
    """Whether the live state at ``position`` tokens is kept as a snapshot: a positive multiple
    of the periodic interval (``ssm_snapshot_policy``), or a position planned at admission
    (``_snapshot_plan``)."""
    interval = state._ctx.periodic_interval
    return position > 0 and ((interval > 0 and position % interval == 0) or position in state._snapshot_positions)


def next_snapshot_position(state: RequestState, position: int) -> int:
    """The least snapshot position after ``position`` (none planned and no periodic interval:
    the largest capacity, which no request reaches)."""
    interval = state._ctx.periodic_interval
    nxt = (position // interval + 1) * interval if interval > 0 else MAX_CAPACITY + 1
    for extra in state._snapshot_positions:  # ascending
        if extra > position:
            return min(extra, nxt)
    return nxt


def take_snapshot(state: RequestState, priorities: list[Priority]) -> None:
    """The commit ended history at a snapshot position (``priorities``: the snapshots' per state
    group, asked of the callback before the commit changed anything): when the block is published
    as the request's last node, copy beam 0's live state into a new page that becomes the block's
    snapshot in the reuse tree, in GPU memory or, when the GPU has no room, at the first lower
    tier with room (the cascade's ``available``); a periodic snapshot under "auto" goes to the
    first tier below the GPU first (``periodic_level``), the live state staying where it is.
    (Once beams forked, a block is published only when every beam holds it alike: beam 0's
    state is then the state after exactly that block's chain.) No room at any level, or a failed write to a disk tier: skipped and counted (a
    snapshot never blocks, and never takes a page a request holds)."""
    committed = state.num_committed_tokens
    ordinal = committed // state._tokens_per_block - 1
    node = state._last_node
    if (
        state._history != committed
        or not is_snapshot_position(state, committed)
        or node is None
        or node.ordinal != ordinal
        or node.parent is None
    ):
        return
    ctx = state._ctx
    storage = ctx.storage
    table = state._table
    wanted: list[LayerGroupId] = []
    sources: list[Page] = []
    wanted_priorities: list[Priority] = []
    need = [0] * ctx.num_pool_groups
    for k, layer_group in enumerate(table.state_groups):
        live = table.state_pages[k]
        if live is not None and node.page(layer_group) is None:
            wanted.append(layer_group)
            sources.append(live)
            wanted_priorities.append(priorities[k])
            need[ctx.pool_group_of[layer_group]] += 1
    if not wanted:
        return
    # planned snapshots start at the GPU, periodic ones at ``periodic_level``; else the next tier with room
    first = ctx.periodic_level if committed not in state._snapshot_kinds else GPU_LEVEL
    levels = storage.levels_with_room(need, first)
    if levels is None:
        if ctx.enable_stats:
            ctx.stats.snapshots_skipped += len(wanted)
        return
    storage.reserve(need, levels)
    pool_group_of = ctx.pool_group_of
    snapshots: list[Page] = []  # HELD by us, in no evictor, until attached and released
    try:
        for layer_group, priority in zip(wanted, wanted_priorities):
            level = levels[pool_group_of[layer_group]]
            snapshots.append(storage.new_pages_at(level, layer_group, [priority])[0])
        failed = storage.copy_pages(list(zip(sources, snapshots)))  # a write to a disk tier may fail
    except BaseException:
        for snapshot in snapshots:
            snapshot.release(False)  # private: its slot is freed
        raise
    if failed:  # the block's snapshot is all of its state groups or none
        for snapshot in snapshots:
            snapshot.release(False)
        if ctx.enable_stats:
            ctx.stats.snapshots_skipped += len(wanted)
        return
    if state._retention is not None:
        retain_new_pages(state, ordinal, snapshots)
    tree = ctx.tree
    for layer_group, snapshot in zip(wanted, snapshots):
        tree.attach_snapshot(node, layer_group, snapshot, state._serial)
        snapshot.release(False)  # the tree's alone: reusable
    if storage.persist is not None:
        storage.persist_pages(snapshots)  # those placed on the persistent disk tier
    if ctx.enable_stats:
        ctx.stats.snapshots_taken += len(wanted)
        ctx.stats.allocated_pages += len(wanted)
        count_snapshots(state, committed, len(wanted))


def publish_final(state: RequestState) -> None:
    """Publish the rest of the committed sequence (the final beam's, once beams forked)."""
    if not state._committing:
        return
    blocks, tail = state._seq(state._final_beam)
    # (a hybrid match never ends inside a block: a partial tail would only take memory)
    upto = len(blocks) + (1 if tail and not state._ctx.state_layer_groups else 0)
    if upto > state._num_published:
        publish(state, upto, state._final_beam)


def publish(state: RequestState, upto: int, beam: int = 0, tokens: Sequence[TokenIdExt] | None = None) -> None:
    """Insert committed blocks ``[num_published, upto)`` of ``beam`` into the reuse tree (the
    last may be partial); ``tokens``: those blocks' tokens (full blocks), so their keys are
    hashed in one call. Before beams fork every beam's table holds the same pages: a block
    deduplicated onto the tree's page switches in all of them."""
    tree = state._ctx.tree
    tokens_per_block = state._tokens_per_block
    parent = state._last_node
    if parent is None:
        parent = tree.root(state._reuse_scope, True)
        assert parent is not None
    if parent.ordinal >= 0 and parent.parent is None:
        return  # our last block was evicted and pruned: nothing after it can be reached
    locked = state._status is KVCacheStatus.ACTIVE
    table = state._tables[beam]
    blocks, tail = state._seq(beam)
    shared = len(state._tables) > 1
    first = state._num_published
    keys = chain_token_keys(parent.key, tokens, tokens_per_block) if tokens is not None else None
    session = state._session
    table_pages = table.pages.items
    pages: list[Page | None] = [None] * len(table_pages)  # each block's, refilled (the tree may switch them)
    for ordinal in range(first, upto):
        block_tokens = blocks[ordinal] if ordinal < len(blocks) else _untrack(tuple(tail))
        for i in range(len(pages)):
            pages[i] = table_pages[i][ordinal]
        if state._retention is not None:
            retain_new_pages(state, ordinal, pages)
        node = tree.publish(
            parent,
            block_tokens,
            pages,
            locked,
            state._serial,
            keys[ordinal - first] if keys is not None else None,
            session,
        )
        if node is None:
            return
        for i in range(len(pages)):
            theirs = pages[i]
            old = table_pages[i][ordinal]  # the table still holds our page until set_page below
            if theirs is not old:  # deduplicated: the tree's page replaced ours
                layer_group = LayerGroupId(i)
                table.set_page(layer_group, ordinal, theirs)
                if shared and theirs is not None and old is not None:
                    for other in state._tables:  # other beams holding the same page switch too
                        if other is not table and other.pages[layer_group][ordinal] is old:
                            theirs.take(locked)
                            other.set_page(layer_group, ordinal, theirs)
                            old.release(locked)
        if len(block_tokens) < tokens_per_block:
            return
        parent = node
        state._num_published = ordinal + 1
        state._extend_from(node)
