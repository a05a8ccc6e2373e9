"""Where a request's pages live: adopting matched pages, bringing them to GPU memory on resume
(and ahead of it on prefetch), letting them go on suspend and close, and shrinking to what is
intact after a disk error (docs/design.md, "Cache levels")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .._common import DEFAULT_PRIORITY, GPU_LEVEL, CacheLevel, KVCacheStatus, LayerGroupId, SlotId, TokenIdExt
from .._page import NO_HINT, Page
from .._retention import Retention
from .._reuse._node import Node
from .._storage._page_reads import on_disk
from ._commit import publish_final
from ._request_state import RequestState
from ._retention import end_hint, last_published, retain_history


def _take_reused(node: Node, layer_group: LayerGroupId, state: RequestState, match_end: int) -> Page:
    """Take ``node``'s page of ``layer_group`` for a request that matched it (a hit), its match
    ending at block ``match_end``."""
    page = node.page(layer_group)
    assert page is not None
    page.take(False)
    page.used(state._serial, True)
    if page.hint_end != NO_HINT:
        end_hint(page, state, match_end)
    return page


def adopt(
    state: RequestState, nodes: list[Node], part: Node | None, part_len: int, tokens: Sequence[TokenIdExt]
) -> None:
    """Take holds on matched pages (called once, right after construction)."""
    tokens_per_block = state._tokens_per_block
    length = len(nodes) * tokens_per_block + part_len
    num_blocks = (length + tokens_per_block - 1) // tokens_per_block
    table = state._table
    taken = 0
    match_end = num_blocks - 1
    for i, policy in enumerate(state._ctx.layer_groups):
        layer_group = LayerGroupId(i)
        beg, end = policy.stale_range(length)
        pages: list[Page | None] = [None] * num_blocks
        for ordinal in range(num_blocks):
            if beg <= ordinal < end:
                continue
            if ordinal < len(nodes):
                pages[ordinal] = _take_reused(nodes[ordinal], layer_group, state, match_end)
                taken += 1
            else:
                assert part is not None
                table.pending_copy[layer_group] = _take_reused(part, layer_group, state, match_end)
        table.adopt(layer_group, pages, policy.stale_end(length))
        for other in state._tables[1:]:
            for page_or_none in pages:
                if page_or_none is not None:
                    page_or_none.take(False)
            other.adopt(layer_group, list(pages), policy.stale_end(length))
    if nodes:  # a hybrid match ends at a block holding a snapshot of each state group
        for layer_group in table.state_groups:
            table.pending_copy[layer_group] = _take_reused(nodes[-1], layer_group, state, match_end)
            state._ctx.tree.snapshot_used(nodes[-1], layer_group)
            taken += 1
            if state._ctx.enable_stats:
                state._ctx.stats.snapshots_reused += 1
    state._committed_blocks = [node.tokens for node in nodes]  # equal keys: equal tokens
    state._tail = list(tokens[len(nodes) * tokens_per_block : length])
    state._capacity = state._history = length
    state._num_blocks = num_blocks
    state._num_published = state._num_matched_blocks = len(nodes)
    state._extend_from(nodes[-1] if nodes else None)
    if state._ctx.enable_stats:
        stats = state._ctx.stats
        stats.reused_blocks += num_blocks
        stats.missed_blocks += (len(tokens) + tokens_per_block - 1) // tokens_per_block - num_blocks
        stats.reused_pages += taken
        stats.queried_tokens += len(tokens)
        stats.reused_tokens += length


def _missing_states(state: RequestState) -> list[tuple[int, int]]:
    """``(beam, index in state_groups)`` of every live state the request has no page for yet."""
    return [
        (beam, k)
        for beam, table in enumerate(state._tables)
        for k, state_page in enumerate(table.state_pages)
        if state_page is None
    ]


def settle_loads(state: RequestState) -> None:
    """Install the background reads that finished, and stop wanting the request's others (a
    resume reads what is still on disk itself; a close needs nothing)."""
    if state._loads:
        state._ctx.poll_loads()
    cancel_loads(state)


def cancel_loads(state: RequestState) -> None:
    """Stop wanting the request's background reads not installed yet (``KVCache.cancel_prefetch``)."""
    if state._loads:
        reads = state._ctx.reads
        assert reads is not None
        reads.cancel(state._loads, state._load_group)
        state._loads = []
    state._load_group.pages = []


def loads_in_flight(state: RequestState) -> bool:
    """Whether a background read of the request's pages is still running (after installing the finished ones)."""
    if not state._loads:
        return False
    state._ctx.poll_loads()
    state._loads = [job for job in state._loads if not job.settled]
    return len(state._loads) > 0


def needs_disk_reads(state: RequestState) -> bool:
    """Whether a page of the request lies on a disk level (resume would read it)."""
    return any(on_disk(page) for page in state._all_pages())


def resume_pages(state: RequestState) -> bool:
    """``KVCache.resume`` past its checks (the caller entered the context)."""
    ctx = state._ctx
    settle_loads(state)
    table = state._table
    storage = ctx.storage
    scratch_needs = [
        (LayerGroupId(i), state._scratch_slots_for(beg, end, LayerGroupId(i)))
        for i, (beg, end) in enumerate(table.scratch)
        if end > beg
    ]
    max_util = ctx.config.max_util_for_resume
    # live states: one new page per beam and state group at the first resume (or after a
    # disk error lost one), a copy of the matched snapshot when there is one
    state_news = _missing_states(state)
    if storage.num_levels == 1 and not table.has_pending() and not scratch_needs and not state_news:
        # GPU only: every page is in GPU memory and nothing new is taken; the admission gate
        # still applies (its pages already count as used)
        if max_util < 1.0 and not storage.fits(ctx.no_gain, ctx.no_gain, max_util, None, ctx.resume_floor):
            return False
        _activate(state)
        return True
    if storage.any_lost():
        drop_lost_blocks(state, False, -1)
        state_news = _missing_states(state)  # a live state it lost was let go of: a new one is taken below
    state_groups = table.state_groups
    pending = [
        (LayerGroupId(i), source)
        for i, source in enumerate(table.pending_copy)
        if source is not None and LayerGroupId(i) not in state_groups
    ]
    need, excluded, up = plan_move_up(state, GPU_LEVEL, False)
    for layer_group, _ in pending:
        need[ctx.pool_group_of[layer_group]] += 1
    for _, k in state_news:
        need[ctx.pool_group_of[state_groups[k]]] += 1
    for layer_group, num_slots in scratch_needs:
        need[ctx.pool_group_of[layer_group]] += num_slots
    promote = _snapshots_below_gpu(state)
    if promote:  # a matched snapshot below the GPU is brought up too (promoted), when that fits
        more = list(need)
        for below in promote:
            more[ctx.pool_group_of[below.layer_group]] += 1
        if storage.fits(more, ctx.no_gain, max_util, excluded, ctx.resume_floor):
            need = more
            up.extend(promote)
    if not storage.fits(need, ctx.no_gain, max_util, excluded, ctx.resume_floor):
        return False
    if not up and not pending and not scratch_needs and not state_news and not any(excluded[GPU_LEVEL]):
        _activate(state)  # everything is in GPU memory already and takes nothing from others
        return True
    storage.reserve(need)
    ordinal = state._num_published
    priorities = [state._priorities(layer_group, [ordinal])[0] for layer_group, _ in pending]  # may raise
    # Lock first: the pages leave the evictors, so making room cannot push any of them down.
    state._lock_all()
    table.lock_pending()
    copies: list[tuple[Page, Page]] = []
    scratch: list[tuple[LayerGroupId, list[SlotId]]] = []
    made_states: list[Page] = []
    state_copies: list[tuple[Page, Page]] = []
    try:
        lost = storage.move_up(up, GPU_LEVEL) if up else []
        for (layer_group, source), priority in zip(pending, priorities):
            copies.append((source, storage.new_pages(layer_group, [priority], True)[0]))
        bad = storage.copy_pages(copies) if copies else set()
        for _, k in state_news:
            layer_group = state_groups[k]
            made_states.append(storage.new_pages(layer_group, [DEFAULT_PRIORITY], True)[0])
            snapshot = table.pending_copy[layer_group]
            if snapshot is not None and not snapshot.lost:  # (lost: a disk read failed bringing it up)
                state_copies.append((snapshot, made_states[-1]))
        bad_states = storage.copy_pages(state_copies) if state_copies else set()
        for layer_group, num_slots in scratch_needs:  # the current step's scratch slots come back too
            scratch.append((layer_group, storage.new_scratch_slots(layer_group, num_slots)))
    except BaseException:
        for destination in made_states:
            destination.release(True)
        for _, destination in copies:
            destination.release(True)  # private and unpublished: its slot is freed
        for layer_group, slots in scratch:
            storage.free_scratch_slots(layer_group, slots)
        table.hold_pending()
        state._hold_all()
        raise
    for layer_group, slots in scratch:
        table.scratch_slots[layer_group].extend(slots)
    bad_block = -1
    for i, ((layer_group, source), (_, destination)) in enumerate(zip(pending, copies)):
        table.pending_copy[layer_group] = None
        if i in bad:  # the partially matched block could not be read back
            storage.lose(source)
            destination.release(True)
            bad_block = ordinal
        else:
            table.set_page(layer_group, ordinal, destination)
            for other in state._tables[1:]:  # every beam shares the copy (one owner each)
                destination.take(True)
                other.set_page(layer_group, ordinal, destination)
        source.release(True)
    for (beam, k), made in zip(state_news, made_states):
        state._tables[beam].state_pages[k] = made
    for layer_group in state_groups:
        snapshot = table.pending_copy[layer_group]
        if snapshot is not None:  # copied into every beam's live state: copy-on-write done
            table.pending_copy[layer_group] = None
            if bad_states or snapshot.lost:  # the snapshot could not be read back: the request starts over
                if not snapshot.lost:
                    storage.lose(snapshot)
                bad_block = 0
            snapshot.release(True)
    if ctx.enable_stats:
        ctx.stats.allocated_pages += len(copies) - len(bad) + len(made_states)
    if lost or bad_block >= 0:
        drop_lost_blocks(state, True, bad_block)
    state._show_indices()
    state._status = KVCacheStatus.ACTIVE
    return True


def _snapshots_below_gpu(state: RequestState) -> list[Page]:
    """The matched snapshots (copied into the live states at the first resume) below the GPU."""
    table = state._table
    out: list[Page] = []
    for layer_group in table.state_groups:
        snapshot = table.pending_copy[layer_group]
        if snapshot is not None and snapshot.level > GPU_LEVEL:
            out.append(snapshot)
    return out


def _activate(state: RequestState) -> None:
    """Every page is in GPU memory: lock them and show the indices."""
    state._lock_all()
    state._show_indices()
    state._status = KVCacheStatus.ACTIVE


def prefetch_pages(state: RequestState, target_level: CacheLevel) -> bool:
    """``KVCache.prefetch`` past its checks. With background reads, the pages on disk are read in
    the background (``PageReads``; installed by the manager's poll) and the others move now."""
    ctx = state._ctx
    storage = ctx.storage
    ctx.poll_loads()
    if storage.any_lost():
        drop_lost_blocks(state, False, -1)
    need, excluded, up = plan_move_up(state, target_level, True)
    if not up:
        return True
    if not storage.fits_at(target_level, need, excluded):
        return False
    reads = ctx.reads
    if reads is not None and any(on_disk(page) for page in up):
        wanted = {id(job.page) for job in state._loads if not job.settled}
        slow = [page for page in up if on_disk(page) and id(page) not in wanted]
        state._loads = [job for job in state._loads if not job.settled]
        state._loads.extend(reads.read(slow, reads.background_target(target_level), state._load_group))
        up = [page for page in up if not on_disk(page)]
        need = [0] * ctx.num_pool_groups
        for page in up:
            need[page.storage.index] += 1
        if not up:
            return True
    if target_level == GPU_LEVEL:
        storage.reserve(need)
    table = state._table
    state._lock_all()  # pinned while pages move
    table.lock_pending()
    try:
        lost = storage.move_up(up, target_level)
    finally:
        table.hold_pending()
        state._hold_all()
    if lost:
        drop_lost_blocks(state, False, -1)
    return True


def plan_move_up(state: RequestState, target: int, sources_too: bool) -> tuple[list[int], list[list[int]], list[Page]]:
    """Slots per pool group that bringing the request's pages to ``target`` takes, how many of
    its pages each (level, pool group) evictor lists, and the pages below ``target`` (the
    copy-on-partial sources only with ``sources_too``: resume copies them from where they are).
    Pins that ran out end first: their pages are listed again before they are counted (planning
    with these counts expires no more pins: ``fits``, ``available``)."""
    ctx = state._ctx
    ctx.storage.pins.expire()
    num_pool_groups = ctx.num_pool_groups
    need = [0] * num_pool_groups
    excluded = [[0] * num_pool_groups for _ in range(ctx.storage.num_levels)]
    up: list[Page] = []
    pending = state._table.pending_copy
    seen: set[int] = set()
    for page in state._all_pages():
        if id(page) in seen:  # a page beams share is moved once
            continue
        seen.add(id(page))
        pool_group = page.storage.index
        if page.in_evictor:
            excluded[page.level][pool_group] += 1
        if page.level > target and (sources_too or page is not pending[page.layer_group]):
            need[pool_group] += 1
            up.append(page)
    return need, excluded, up


def drop_lost_blocks(state: RequestState, locked: bool, bad_block: int) -> None:
    """Shrink to the longest prefix whose needed pages are all intact, after a disk error lost
    the data of some page (or of the block ``bad_block``). Lengths and committed tokens follow
    (every beam's); the blocks dropped are recomputed by the engine like any other new tokens."""
    first = bad_block
    for table in state._tables:
        first_lost = table.first_lost_block()
        if first_lost >= 0 and (first < 0 or first_lost < first):
            first = first_lost
    if first < 0:
        return
    num_blocks = first
    while num_blocks > 0 and not _intact(state, num_blocks):
        num_blocks -= 1
    if state._ctx.state_layer_groups:
        # a live state holds the whole history: a shorter one cannot be recovered from it
        num_blocks = 0
        replace_lost_states(state, locked)
    length = num_blocks * state._tokens_per_block
    state._table.release_pending(locked)
    for table in state._tables:
        table.truncate(num_blocks, locked)
    state._clear_scratch()  # the step the scratch served is gone with the blocks
    state._cow = [entry for entry in state._cow if entry[2] < num_blocks]
    for i, policy in enumerate(state._ctx.layer_groups):
        layer_group = LayerGroupId(i)
        end = policy.stale_end(length)
        for table in state._tables:
            table.release_range(layer_group, table.stale_end[layer_group], end, locked)
            table.stale_end[layer_group] = end
    state._window_next = 0
    state._capacity = state._history = length
    state._num_blocks = num_blocks
    if state.num_committed_tokens > length:
        for beam in range(state._beam_width):
            blocks, tail = state._seq(beam)
            del blocks[num_blocks:]
            tail.clear()
    if state._committing and state._num_published > len(state._committed_blocks):
        node = _published_node(state, len(state._committed_blocks))
        state._num_published = node.ordinal + 1 if node is not None else 0
        state._extend_from(node)


def replace_lost_states(state: RequestState, locked: bool) -> None:
    """Let go of live-state pages a disk error lost; an ACTIVE request gets new ones at once (the
    GPU slot its move up reserved), a suspended one at its next resume."""
    storage = state._ctx.storage
    for table in state._tables:
        for k, state_page in enumerate(table.state_pages):
            if state_page is not None and state_page.lost:
                table.state_pages[k] = None
                state_page.release(locked)
                if locked:
                    table.state_pages[k] = storage.new_pages(table.state_groups[k], [DEFAULT_PRIORITY], True)[0]


def _intact(state: RequestState, num_blocks: int) -> bool:
    """Whether every page needed at ``num_blocks`` full blocks of history exists and holds its
    data (every beam)."""
    length = num_blocks * state._tokens_per_block
    for i, policy in enumerate(state._ctx.layer_groups):
        beg, end = policy.stale_range(length)
        for table in state._tables:
            pages = table.pages[LayerGroupId(i)]
            for ordinal in range(num_blocks):
                if beg <= ordinal < end:
                    continue
                page = pages[ordinal]
                if page is None or page.lost:
                    return False
    return True


def _published_node(state: RequestState, num_blocks: int) -> Node | None:
    """The tree node of the last of the first ``num_blocks`` blocks that is still in the tree,
    via its pages."""
    table = state._table
    for ordinal in range(num_blocks - 1, -1, -1):
        for pages in table.pages:
            page = pages[ordinal]
            node = page.node if page is not None else None
            if node is not None and node.ordinal == ordinal and node.parent is not None:
                return cast(Node, node)
    return None


def suspend_pages(state: RequestState) -> None:
    """``KVCache.suspend`` past its checks: locks become holds, indices are hidden."""
    state._hold_all()
    for table in state._tables:
        table.hide_indices()
    state._free_scratch_slots()  # scratch keeps nothing between steps; resume allocates it again
    state._status = KVCacheStatus.SUSPENDED


def close_pages(state: RequestState, retain: Sequence[Retention] | None) -> None:
    """``KVCache.close`` past its checks: publish the rest, give the published history the
    close-time hints ``retain`` (each over its token range), release every page."""
    settle_loads(state)  # its reads in flight are cancelled (nothing was allocated for them)
    if state._status is KVCacheStatus.SUSPENDED and state._ctx.storage.any_lost():
        drop_lost_blocks(state, False, -1)  # never publish a block whose data is gone
    publish_final(state)
    if state._session is not None:
        state._ctx.sessions.record(state._session, last_published(state))
    if retain is not None:
        for hint in retain:
            retain_history(state, hint)
    locked = state._status is KVCacheStatus.ACTIVE
    for table in state._tables:
        table.release_all(locked)
        table.detach_user_bufs()
    state._cow = []
    state._clear_scratch()
    state._extend_from(None)
    state._status = KVCacheStatus.CLOSED
    state._capacity = state._history = state._num_blocks = 0
