"""Block accounting for capacity scheduling: how many slots a request's remaining steps need.

Per layer group the manager keeps a page for every block of ``[0, ceil(capacity/T))``
except the blocks stale at the current history: a request's slot count in a pool
group at a step is the sum of those counts over the group's layer groups.
"""

from __future__ import annotations

from .._common import PoolGroupIndex
from .._layers._policy import LayerGroup


class LayerGroupShape:
    """One layer group as capacity planning sees it: its policy and the pool group of its slots."""

    def __init__(self, policy: LayerGroup, pool_group: PoolGroupIndex) -> None:
        self.policy = policy
        self.pool_group = pool_group


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
        out: list[tuple[int, int]] = []
        history = self.history
        if self.capacity > history:
            out.append((history, self.capacity))
            history = self.capacity
        num_tokens = self.num_tokens
        chunk = self.chunk
        while history < num_tokens:
            capacity = num_tokens if chunk == 0 else min(history + chunk, num_tokens)
            out.append((history, capacity))
            history = capacity
        last = self.final_capacity - 1  # history of the last one-token step
        if history > last:
            return out
        if not need_all_steps:
            out.append((last, last + 1))
            return out
        out.append((history, history + 1))
        for boundary in range((history // tokens_per_block + 1) * tokens_per_block, last + 1, tokens_per_block):
            out.append((boundary, boundary + 1))
        return out


def peak_slots(
    shapes: list[LayerGroupShape], num_pool_groups: int, tokens_per_block: int, plan: StepPlan, releases_blocks: bool
) -> list[int]:
    """Max over the plan's steps of the request's slots per pool group (max of sums, per group);
    ``releases_blocks``: some layer group's page count may fall as history grows."""
    peak = [0] * num_pool_groups
    for history_length, capacity in plan.states(tokens_per_block, releases_blocks):
        counts = [0] * num_pool_groups
        for shape in shapes:
            counts[shape.pool_group] += shape.policy.num_blocks_with_pages(capacity, history_length)
        for group in range(num_pool_groups):
            if counts[group] > peak[group]:
                peak[group] = counts[group]
    return peak


def admission_bound(shapes: list[LayerGroupShape], num_pool_groups: int, final_capacity: int, chunk: int) -> list[int]:
    """Slots per pool group a request not yet admitted may need at most.

    Prefix reuse shifts where its chunks start, and with a window the blocks a chunk spans
    depend on that alignment, so each layer group is bounded over every alignment
    (``LayerGroup.admission_blocks``).
    """
    out = [0] * num_pool_groups
    for shape in shapes:
        out[shape.pool_group] += shape.policy.admission_blocks(final_capacity, chunk)
    return out
