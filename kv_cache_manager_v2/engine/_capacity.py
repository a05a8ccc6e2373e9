"""Block accounting for capacity scheduling: how many slots a request's remaining steps need.

Per layer group the manager keeps a page for every block of ``[0, ceil(capacity/T))``
except the blocks stale at the current history (SPEC 5.1): a request's slot count in a pool
group at a step is the sum of those counts over the group's layer groups.
"""

from __future__ import annotations

from .._common import PoolGroupIndex


class LayerGroupShape:
    """Attention shape of one layer group: window (None: full attention) and sink blocks."""

    def __init__(self, window: int | None, num_sink_blocks: int, pool_group: PoolGroupIndex) -> None:
        self.window = window
        self.num_sink_blocks = num_sink_blocks
        self.pool_group = pool_group


def live_blocks(shape: LayerGroupShape, tokens_per_block: int, history: int, capacity: int) -> int:
    """Blocks holding a page at ``(history, capacity)``: all blocks but the stale ones."""
    t = tokens_per_block
    nb = (capacity + t - 1) // t
    w = shape.window
    if w is None:
        return nb
    beg = min((history + t - 1) // t, shape.num_sink_blocks)
    end = max(beg, (history + 1 - w) // t)
    return nb - max(0, min(end, nb) - min(beg, nb))


class StepPlan:
    """The steps a request still runs: chunks of its uncomputed tokens, then one token a step.

    ``history``/``capacity``: the current state (``capacity > history`` while a step is
    prepared); ``num_tokens``: tokens known now; ``final_capacity``: capacity of the last step
    (prompt + max_new_tokens - 1: the last sampled token is never computed); ``chunk``: tokens
    per step while more than one is uncomputed (0: all at once).
    """

    def __init__(self, history: int, capacity: int, num_tokens: int, final_capacity: int, chunk: int) -> None:
        self.history = history
        self.capacity = capacity
        self.num_tokens = num_tokens
        self.final_capacity = final_capacity
        self.chunk = chunk

    def states(self, tokens_per_block: int, need_all_steps: bool) -> list[tuple[int, int]]:
        """``(history, capacity)`` of the remaining steps where a slot count may peak.

        Chunk steps are all listed. Over one-token steps a layer group's count only rises
        where a new block starts (``h % T == 0``; the sink boundary cannot raise it: while
        sinks are still growing nothing is stale), so the first step and those are enough;
        with ``need_all_steps`` False (full attention only: counts never fall) the last one is.
        """
        t = tokens_per_block
        out: list[tuple[int, int]] = []
        h = self.history
        if self.capacity > h:
            out.append((h, self.capacity))
            h = self.capacity
        n = self.num_tokens
        c = self.chunk
        while h < n:
            cap = n if c == 0 else min(h + c, n)
            out.append((h, cap))
            h = cap
        last = self.final_capacity - 1  # history of the last one-token step
        if h > last:
            return out
        if not need_all_steps:
            out.append((last, last + 1))
            return out
        out.append((h, h + 1))
        for b in range((h // t + 1) * t, last + 1, t):
            out.append((b, b + 1))
        return out


def peak_slots(
    shapes: list[LayerGroupShape], num_pool_groups: int, tokens_per_block: int, plan: StepPlan, has_swa: bool
) -> list[int]:
    """Max over the plan's steps of the request's slots per pool group (max of sums, per group)."""
    peak = [0] * num_pool_groups
    for h, cap in plan.states(tokens_per_block, has_swa):
        counts = [0] * num_pool_groups
        for shape in shapes:
            counts[shape.pool_group] += live_blocks(shape, tokens_per_block, h, cap)
        for g in range(num_pool_groups):
            if counts[g] > peak[g]:
                peak[g] = counts[g]
    return peak


def admission_bound(
    shapes: list[LayerGroupShape], num_pool_groups: int, tokens_per_block: int, final_capacity: int, chunk: int
) -> list[int]:
    """Slots per pool group a request not yet admitted may need at most.

    Prefix reuse shifts where its chunks start, and with a window the blocks a chunk spans
    depend on that alignment, so each sliding-window layer group is bounded over every
    alignment: ``sinks + (c + W + 2T - 3) // T`` blocks for chunks of ``c`` tokens (never more
    than the blocks of the whole sequence). Full-attention groups need every block.
    """
    t = tokens_per_block
    nb = (final_capacity + t - 1) // t
    c = final_capacity if chunk == 0 else min(chunk, final_capacity)
    out = [0] * num_pool_groups
    for shape in shapes:
        w = shape.window
        if w is None:
            out[shape.pool_group] += nb
        else:
            out[shape.pool_group] += min(nb, shape.num_sink_blocks + (c + w + 2 * t - 3) // t)
    return out
