"""Where a hybrid request keeps snapshots of its recurrent state (``ssm_snapshot_policy``): the
positions planned at admission from its match, and the kind each taken snapshot counts as.

A match of a hybrid model ends at a block holding a snapshot, so reuse is bounded by where the
snapshots are, not by the attention layers' KV. Besides the multiples of the interval (policy
"interval" and "auto", where they have the lowest priority) a request keeps the state at its prompt's last full
block, and, when its attention match ends past its hybrid match, at the attention match's end:
a branch point when the tree goes on there (the prompt leaves a cached path: the next request
with that prefix reuses all of it, whatever its suffix), else on demand when the gap is at least
one interval (e.g. a conversation's previous output)."""

from __future__ import annotations

from typing import Final

from ._request_state import RequestState

#: kinds of snapshot positions (statistics): a multiple of the interval or a configured position
SNAPSHOT_INTERVAL: Final = 0
#: where the prompt leaves a cached path (the attention match's end, the tree going on there)
SNAPSHOT_BRANCH: Final = 1
#: the prompt's last full block, or the last full block of prompt + output (``plan_snapshot``)
SNAPSHOT_LAST: Final = 2
#: the attention match's end, at least one interval past the hybrid match
SNAPSHOT_DEMAND: Final = 3
#: a position the engine planned (``KVCache.plan_snapshot``: prompt + output, a conversation's
#: next turn starts there); counted as "last"
SNAPSHOT_HISTORY: Final = 4


def plan_snapshots(
    state: RequestState, num_input_tokens: int, reused_blocks: int, attention_blocks: int, branches: bool
) -> None:
    """A new request's snapshot positions besides the multiples of the interval, with their kinds:
    the configured ones, its prompt's last full block (and, under "auto" with a tier below the
    GPU, its last multiple of the interval), and (policies "branch" and "auto") the end
    of its attention match (``attention_blocks`` full blocks; ``branches``: the tree goes on past
    it) when that is past its hybrid match (``reused_blocks``)."""
    ctx = state._ctx
    config = ctx.config
    t = ctx.tokens_per_block
    kinds: dict[int, int] = dict.fromkeys(config.ssm_snapshots_from_start, SNAPSHOT_INTERVAL)
    prompt_end = num_input_tokens // t * t
    if prompt_end > 0:
        for offset in config.ssm_snapshots_from_end:
            if offset < prompt_end:
                kinds[prompt_end - offset] = SNAPSHOT_INTERVAL
        kinds[prompt_end] = SNAPSHOT_LAST
        interval = ctx.periodic_interval
        if ctx.periodic_level > 0 and prompt_end >= interval:
            # "auto" with a tier below the GPU (where the other periodic snapshots go, spaced by
            # bytes): the prompt's last multiple of that spacing is kept like its last block (the
            # GPU first, the callback's priority), for a request sharing the prompt up to a point
            # between the two (a changed last message; prefixes shared at multiples of the interval);
            # at the interval itself it would mostly double the prompt end's snapshot (measured)
            kinds.setdefault(prompt_end // interval * interval, SNAPSHOT_LAST)
    if ctx.plans_branches and attention_blocks > reused_blocks:
        end = attention_blocks * t
        if branches:
            kinds[end] = SNAPSHOT_BRANCH  # (also at the prompt's last block: a later request stops there)
        elif end - reused_blocks * t >= ctx.snapshot_interval:
            kinds[end] = SNAPSHOT_DEMAND
    state._snapshot_kinds = kinds
    state._snapshot_positions = sorted(kinds)


def add_snapshot_position(state: RequestState, position: int) -> None:
    """Keep the state at ``position`` too (``KVCache.plan_snapshot``; counted as "last")."""
    kinds = state._snapshot_kinds
    if kinds.get(position, SNAPSHOT_LAST) == SNAPSHOT_LAST:
        kinds[position] = SNAPSHOT_HISTORY
        state._snapshot_positions = sorted(kinds)


def count_snapshots(state: RequestState, position: int, count: int) -> None:
    """Statistics: ``count`` snapshots taken at ``position``, by the kind planned there."""
    stats = state._ctx.stats
    kind = state._snapshot_kinds.get(position, SNAPSHOT_INTERVAL)
    if kind == SNAPSHOT_BRANCH:
        stats.snapshots_branch += count
    elif kind in (SNAPSHOT_LAST, SNAPSHOT_HISTORY):
        stats.snapshots_last += count
    elif kind == SNAPSHOT_DEMAND:
        stats.snapshots_demand += count
    else:
        stats.snapshots_interval += count
