"""Sizing arithmetic: slots a request shape needs, and the split of a quota among pool groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .._common import LayerGroupId
from .._config import BatchDesc, KVCacheDesc
from .._life_cycle_registry import LayerGroupRegistry
from .._utils import div_up
from ._layout import StorageLayout

#: Request shape assumed for the default quota split when no typical_step is configured: a
#: 512-token prefill chunk at the end of a 4096-token prompt. Sliding-window groups then get
#: their window plus one chunk per request (a decode-only shape would starve prefill steps).
DEFAULT_TYPICAL_STEP = BatchDesc([KVCacheDesc(capacity=4096, history_length=3584)])

#: Snapshots of the recurrent state the quota split counts per request of the typical step, at
#: most: the latest one (what a follow-up turn or a request sharing the prefix resumes from).
#: Counting one per snapshot interval instead gives a 37.7 MiB state (Qwen3-Next) most of the GPU
#: at interval 512 and starves the KV pool of long requests; an engine that wants more snapshot
#: slots says so through ``initial_pool_ratio`` or a ``typical_step`` with more requests.
MAX_SNAPSHOTS_PER_REQUEST: Final = 1


def batch_needs(
    registry: LayerGroupRegistry,
    layout: StorageLayout,
    batch: BatchDesc,
    max_rewind_len: int = -1,
    with_snapshots: bool = False,
) -> list[int]:
    """Slots per pool group a whole batch needs; each full block of the shared system prompt
    takes one page however many requests hold it (and none where it is out of their window).
    With SWA scratch reuse (``max_rewind_len >= 0``) a step's out-of-window blocks take no page
    but their share of scratch slots, ``ceil(blocks * slot_util_frac_max)`` per request.
    ``with_snapshots``: also the recurrent-state snapshots each request leaves, at most
    ``MAX_SNAPSHOTS_PER_REQUEST`` (the live states, one per request and beam, are always counted)."""
    t = registry.tokens_per_block
    shared = batch.system_prompt_length // t
    out = [0] * len(layout.pool_groups)
    for i, layer_group in enumerate(registry.layer_groups):
        holders = [0] * shared
        pages = 0
        frac = layout.slot_util_frac_max[LayerGroupId(i)]
        for desc in batch.kv_caches:
            pages += layer_group.num_blocks_with_pages(desc.capacity, desc.history_length) * (
                desc.beam_width if layer_group.keeps_live_state else 1
            )
            if with_snapshots:
                pages += min(layer_group.snapshot_pages(desc.history_length), MAX_SNAPSHOTS_PER_REQUEST)
            sb = se = 0  # scratch blocks [sb, se)
            if max_rewind_len >= 0:
                sb, se = layer_group.scratch_range(desc.capacity, desc.history_length, max_rewind_len)
                n = se - sb  # scratch blocks: no page each, a share of the request's scratch slots
                pages += div_up(n * frac.numerator, frac.denominator) - n
            for ordinal in range(min(shared, (desc.capacity + t - 1) // t)):
                if not layer_group.is_stale(ordinal, desc.history_length) and not sb <= ordinal < se:
                    holders[ordinal] += 1
        out[layout.pool_group_of_layer_group[LayerGroupId(i)]] += pages - sum(max(0, n - 1) for n in holders)
    return out


def constraint_floors(
    registry: LayerGroupRegistry, layout: StorageLayout, constraints: Sequence[BatchDesc], max_rewind_len: int = -1
) -> list[int]:
    """Per pool group, the most slots one of the ``constraints`` batches needs (0 without any):
    the GPU split keeps at least that many, and the resume gate never refuses below it."""
    floors = [0] * len(layout.pool_groups)
    for batch in constraints:
        for g, n in enumerate(batch_needs(registry, layout, batch, max_rewind_len)):
            floors[g] = max(floors[g], n)
    return floors


def split_quota(
    quota: int,
    registry: LayerGroupRegistry,
    layout: StorageLayout,
    initial_pool_ratio: Sequence[float] | None,
    typical_step: BatchDesc | None,
    constraints: Sequence[BatchDesc],
    max_rewind_len: int = -1,
) -> list[int]:
    """Slots per pool group for ``quota`` bytes (docs/design.md, "Sizing").

    Byte shares come from ``initial_pool_ratio``, else from the slot needs of ``typical_step``
    (or a default request shape); ``constraints`` are floors every group must keep. Both count
    SWA scratch slots instead of pages when scratch reuse is on (``max_rewind_len >= 0``).
    """
    groups = layout.pool_groups
    slot_bytes = [g.slot_bytes for g in groups]
    n_groups = len(groups)
    floors = [max(1, n) for n in constraint_floors(registry, layout, constraints, max_rewind_len)]
    floor_bytes = sum(f * b for f, b in zip(floors, slot_bytes))
    if floor_bytes > quota:
        raise ValueError(
            f"GPU quota {quota} bytes is too small: one slot of every pool group and the constraints need "
            f"{floor_bytes} bytes (slot bytes per pool group: {slot_bytes}, slots needed: {floors})"
        )
    if initial_pool_ratio is not None:
        if len(initial_pool_ratio) != n_groups:
            raise ValueError(
                f"initial_pool_ratio has {len(initial_pool_ratio)} entries but the layout has {n_groups} pool groups"
            )
        weights = [float(r) for r in initial_pool_ratio]
    else:
        needs = batch_needs(registry, layout, typical_step or DEFAULT_TYPICAL_STEP, max_rewind_len, True)
        weights = [max(n, 1) * b for n, b in zip(needs, slot_bytes)]
    # Give each group its byte share; groups whose share is below their floor get the floor and
    # the rest is shared again among the others, until no group is below its floor.
    fixed: dict[int, int] = {}
    while True:
        free_bytes = quota - sum(fixed[g] * slot_bytes[g] for g in fixed)
        total_w = sum(weights[g] for g in range(n_groups) if g not in fixed)
        slots = [
            fixed[g] if g in fixed else int(free_bytes * weights[g] / total_w) // slot_bytes[g] for g in range(n_groups)
        ]
        below = [g for g in range(n_groups) if g not in fixed and slots[g] < floors[g]]
        if not below:
            return slots
        for g in below:
            fixed[g] = floors[g]


def split_like(
    quota: int, reference: list[int], layout: StorageLayout, what: str, state_share: float | None = None
) -> list[int]:
    """Slots per pool group for a lower tier: one slot each, then the rest of ``quota`` bytes shared
    in the byte proportions of the ``reference`` slot counts (the GPU tier's). ``state_share``
    (hybrid models): the share of the rest that the pool groups holding recurrent states take
    together, the others sharing what is left (each side in the reference's proportions); None
    or a layout without both kinds: the reference's proportions. A quota that cannot hold one
    slot of every pool group is a ``ValueError``."""
    groups = layout.pool_groups
    slot_bytes = [g.slot_bytes for g in groups]
    rest = quota - sum(slot_bytes)
    if rest < 0:
        raise ValueError(
            f"{what} quota {quota} bytes is too small: it must hold one slot of every pool group, "
            f"{sum(slot_bytes)} bytes (slot bytes per pool group: {slot_bytes})"
        )
    ref = [n * b for n, b in zip(reference, slot_bytes)]
    states = sum(r for r, g in zip(ref, groups) if g.holds_states)
    if state_share is None or states in (0, sum(ref)):
        total = sum(ref)
        return [1 + rest * r // total // b for r, b in zip(ref, slot_bytes)]
    kv = sum(ref) - states
    shares = [state_share * r / states if g.holds_states else (1.0 - state_share) * r / kv for r, g in zip(ref, groups)]
    return [1 + int(rest * w) // b for w, b in zip(shares, slot_bytes)]
