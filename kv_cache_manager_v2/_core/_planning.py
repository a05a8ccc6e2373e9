"""Resize planning: which blocks of a step get pages, which are released, which share scratch
slots, and whether memory suffices, all decided before anything changes (docs/design.md, "Allocation is all or nothing").
The decode step's one-block growth stays on ``KVCache``; this is every other resize."""

from __future__ import annotations

from .._common import LayerGroupId, Priority
from .._page import Page
from ._request_state import RequestState


def resize_blocks(state: RequestState, capacity: int, history_length: int, num_blocks: int) -> bool:
    """Set capacity and history, allocating and releasing pages; False (nothing changed) when
    memory is short. The caller entered the context and checked the arguments."""
    ctx = state._ctx
    table = state._table
    tables = state._tables
    storage = ctx.storage
    old_num_blocks = state._num_blocks
    for each_table in tables:
        each_table.check_user_buf_room(num_blocks)
    # beams that forked get a page each per new block; before that they share one
    per_block = len(tables) if state._forked else 1
    # Plan without touching anything: which blocks get pages, with which priorities, and
    # whether every pool group has enough slots once this request's releases are counted.
    need = [0] * ctx.num_pool_groups
    gain = [0] * ctx.num_pool_groups
    stale_ends: list[int] = []
    scratch: list[tuple[int, int, int]] = []
    wanted: list[list[int]] = []
    priorities: list[list[Priority]] = []
    for i, policy in enumerate(ctx.layer_groups):
        layer_group = LayerGroupId(i)
        end = policy.stale_end(history_length)
        stale_ends.append(end)
        stale_beg, stale_stop = policy.stale_range(history_length)
        pool_group = ctx.pool_group_of[layer_group]
        scratch_beg, scratch_end, num_slots = scratch_plan(state, layer_group, capacity, history_length)
        # released: blocks going stale, blocks past the new end, and blocks of this step's
        # scratch range that got pages in an earlier resize
        released = (
            (table.stale_end[layer_group], min(end, old_num_blocks)),
            (max(num_blocks, end), old_num_blocks),
            (scratch_beg, min(scratch_end, old_num_blocks)),
        )
        if len(tables) == 1:
            for beg, stop in released:
                gain[pool_group] += table.sole_owned(layer_group, beg, stop)
        else:
            gain[pool_group] += beams_release_gain(state, layer_group, released)
        held = len(table.scratch_slots[layer_group])
        need[pool_group] += max(0, num_slots - held)
        gain[pool_group] += max(0, held - num_slots)
        # new blocks, and blocks that were scratch and now need a page, except stale and scratch
        # ones; counted first, so a huge capacity is refused before any per-block work
        old_scratch_beg, old_scratch_end = table.scratch[layer_group]
        need[pool_group] += per_block * count_outside(
            old_scratch_beg, min(old_scratch_end, num_blocks), stale_beg, stale_stop, scratch_beg, scratch_end
        )
        need[pool_group] += per_block * count_outside(
            old_num_blocks, num_blocks, stale_beg, stale_stop, scratch_beg, scratch_end
        )
        scratch.append((scratch_beg, scratch_end, num_slots))
    cow = [
        entry
        for entry in state._cow
        if entry[2] < num_blocks and not ctx.layer_groups[entry[1]].is_stale(entry[2], history_length)
    ]
    for _, layer_group, _ in cow:
        need[ctx.pool_group_of[layer_group]] += 1
    if not storage.fits(need, gain):
        return False
    for i, (scratch_beg, scratch_end, _) in enumerate(scratch):
        layer_group = LayerGroupId(i)
        stale_beg, stale_stop = ctx.layer_groups[layer_group].stale_range(history_length)  # (no tuple kept)
        old_scratch_beg, old_scratch_end = table.scratch[layer_group]
        # (two ranges, not one list of both: compiled, a range loop stays on unboxed ints)
        want = [
            ordinal
            for ordinal in range(old_scratch_beg, min(old_scratch_end, num_blocks))
            if not stale_beg <= ordinal < stale_stop and not scratch_beg <= ordinal < scratch_end
        ]
        want += [
            ordinal
            for ordinal in range(old_num_blocks, num_blocks)
            if not stale_beg <= ordinal < stale_stop and not scratch_beg <= ordinal < scratch_end
        ]
        wanted.append(want)
        priorities.append(state._priorities(layer_group, want))  # may raise: nothing changed yet
    cow_priorities = [state._priorities(layer_group, [ordinal])[0] for _, layer_group, ordinal in cow]
    storage.reserve(need)  # a driver failure here changes nothing
    # Release everything first: layer groups sharing a pool group use each other's releases.
    for i in range(ctx.num_layer_groups):
        layer_group = LayerGroupId(i)
        state._release_stale(layer_group, stale_ends[i])
        scratch_beg, scratch_end, num_slots = scratch[i]
        table.release_range(layer_group, scratch_beg, scratch_end, True)
        slots = table.scratch_slots[layer_group]
        if len(slots) > num_slots:
            storage.free_scratch_slots(layer_group, slots[num_slots:])
            del slots[num_slots:]
    if num_blocks < old_num_blocks:
        for each_table in tables:
            each_table.truncate(num_blocks, True)
    for i in range(ctx.num_layer_groups):
        layer_group = LayerGroupId(i)
        if wanted[i] or num_blocks > old_num_blocks:
            extend_pages(state, layer_group, num_blocks, wanted[i], priorities[i])
        scratch_beg, scratch_end, num_slots = scratch[i]
        slots = table.scratch_slots[layer_group]
        if len(slots) < num_slots:
            slots.extend(storage.new_scratch_slots(layer_group, num_slots - len(slots)))
        table.scratch[layer_group] = (scratch_beg, scratch_end)
    if cow:
        copy_on_write(state, cow, cow_priorities)
    state._cow = []
    state._capacity = capacity
    state._history = history_length
    state._num_blocks = num_blocks
    return True


def scratch_plan(
    state: RequestState, layer_group: LayerGroupId, capacity: int, history_length: int
) -> tuple[int, int, int]:
    """Scratch range ``(beg, end)`` of a layer group for the step ``history -> capacity`` and
    the scratch slots it needs (several blocks share a slot); ``(0, 0, 0)`` without scratch."""
    if not state._scratch_enabled:
        return (0, 0, 0)
    ctx = state._ctx
    beg, end = ctx.layer_groups[layer_group].scratch_range(capacity, history_length, ctx.max_rewind_len)
    return (beg, end, state._scratch_slots_for(beg, end, layer_group))


def extend_pages(
    state: RequestState, layer_group: LayerGroupId, num_blocks: int, want: list[int], priorities: list[Priority]
) -> None:
    """New pages for blocks ``want`` of every beam (one shared page a block before beams fork)."""
    ctx = state._ctx
    storage = ctx.storage
    tables = state._tables
    before = want[0] - 1 if want else -1
    if len(tables) == 1 or state._forked:
        for table in tables:
            held = table.pages[layer_group]
            prev = held[before] if 0 <= before < len(held) else None
            table.extend(layer_group, num_blocks, want, storage.new_pages(layer_group, priorities, True, prev))
    else:
        held = state._table.pages[layer_group]
        prev = held[before] if 0 <= before < len(held) else None
        pages = storage.new_pages(layer_group, priorities, True, prev)
        state._table.extend(layer_group, num_blocks, want, pages)
        for table in tables[1:]:
            for page in pages:
                page.take(True)
            table.extend(layer_group, num_blocks, want, pages)
    if ctx.enable_stats:
        ctx.stats.allocated_pages += len(want) * (len(tables) if state._forked else 1)


def beams_release_gain(state: RequestState, layer_group: LayerGroupId, ranges: tuple[tuple[int, int], ...]) -> int:
    """Slots that releasing blocks ``ranges`` in every beam frees: pages whose every owner is
    one of this request's beams (a page beams share is freed once, by its last beam) and whose
    pins its storage does not hold (such a page stays out of the evictor)."""
    refs: dict[int, int] = {}
    pages: dict[int, Page] = {}
    for table in state._tables:
        table_pages = table.pages[layer_group]
        for beg, end in ranges:
            for ordinal in range(beg, min(end, len(table_pages))):
                page = table_pages[ordinal]
                if page is not None:
                    refs[id(page)] = refs.get(id(page), 0) + 1
                    pages[id(page)] = page
    return sum(
        1 for key, page in pages.items() if page.num_holds == 0 and page.num_locks == refs[key] and not page.pin_held
    )


def copy_on_write(state: RequestState, cow: list[tuple[int, LayerGroupId, int]], priorities: list[Priority]) -> None:
    """Give each listed beam a private page for a block it shares with another beam; the data
    is copied where the block holds committed tokens (the partial last block)."""
    storage = state._ctx.storage
    tokens_per_block = state._tokens_per_block
    committed_blocks = (state.num_committed_tokens + tokens_per_block - 1) // tokens_per_block
    copies: list[tuple[Page, Page]] = []
    for (beam, layer_group, ordinal), priority in zip(cow, priorities):
        table = state._tables[beam]
        source = table.pages[layer_group][ordinal]
        if source is None:
            continue
        destination = storage.new_pages(layer_group, [priority], True)[0]
        if ordinal < committed_blocks:
            copies.append((source, destination))
        table.set_page(layer_group, ordinal, destination)
        source.release(True)
    if copies:
        storage.copy_pages(copies)
    if state._ctx.enable_stats:
        state._ctx.stats.allocated_pages += len(cow)


def count_outside(beg: int, end: int, a_beg: int, a_end: int, b_beg: int, b_end: int) -> int:
    """How many of ``[beg, end)`` lie outside the disjoint ranges ``[a_beg, a_end)`` and ``[b_beg, b_end)``."""
    if end <= beg:
        return 0
    count = end - beg
    count -= max(0, min(end, a_end) - max(beg, a_beg))
    count -= max(0, min(end, b_end) - max(beg, b_beg))
    return count
