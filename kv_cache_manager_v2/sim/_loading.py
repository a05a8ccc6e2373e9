"""Background loads in the replay (``--load-policy``): each admitted request planned at its own
prefill rate, its loads on its tier's links while the others compute (docs/design.md, "The
simulator")."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import cast

from .._common import TierStatistics
from .._config import KVCacheManagerConfig, LoadPolicy
from .._core._kv_cache_manager import KVCacheManager
from ..engine import KVCacheResourceManager
from ._live import Live
from ._replay_types import SchedulerOptions
from ._step_cost import StepCost
from ._tier_io import FREE, TierIO, TierLinks, priced_tiers


def load_plan_config(
    config: KVCacheManagerConfig, policy: str | None, links: TierLinks | None, bytes_scale: float
) -> KVCacheManagerConfig:
    """``config`` with its tiers priced as the replay times their links (reads for the load plan,
    writes for write admission), with ``load_policy`` (None: as configured) and the manager's own
    refinement off; without tier I/O (``links`` None) pages move in no time: free links, no
    write admission."""
    if links is None:
        config = dataclasses.replace(config, max_write_backlog_s=None)
        if policy is None:
            return config
    tiers = priced_tiers(config.cache_tiers, links if links is not None else TierLinks(FREE, FREE, FREE), bytes_scale)
    if policy is None:
        return dataclasses.replace(config, cache_tiers=tiers)
    return dataclasses.replace(
        config, cache_tiers=tiers, load_policy=cast("LoadPolicy", policy), refine_tier_costs=False
    )


def step_rate(cost: StepCost, prompt_length: int, chunk: int, step_tokens: int) -> tuple[float | None, float]:
    """Tokens per second a request prefills at in the replay's engine as it runs now: one chunk of
    its prompt a step, at the prompt's middle context, in a step of ``step_tokens`` tokens (the
    others as one chunk from the start), by the step cost; a prompt within one chunk finishes in
    this step whatever it recomputes, so its tokens cost only what they add to the others' step
    (None: a step of no time). And the time, ms, of the others' step without it (0: none), the
    steps it waits through while it loads."""
    n = prompt_length
    c = chunk if 0 < chunk < n else n
    others = 0.0
    if step_tokens > c:
        cost.add_prefill(step_tokens - c, 0)
        others = cost.take_ms()
        cost.add_prefill(step_tokens - c, 0)
    cost.add_prefill(c, (n - c) // 2)
    ms = cost.take_ms()
    if c == n and ms > others > 0.0:
        ms -= others
    return (c * 1000.0 / ms if ms > 0.0 else None), others


def woken(running: list[Live], arrivals: list[tuple[float, int]], clock: float) -> float:
    """Background loads: when the first running request's loads are done (or the next arrival, if
    sooner); -1 when none waits."""
    wake = -1.0
    for live in running:
        if live.ready_ms > clock and (wake < 0 or live.ready_ms < wake):
            wake = live.ready_ms
    if wake > 0 and arrivals and clock < arrivals[0][0] < wake:
        wake = arrivals[0][0]
    return wake


def tell_link_waits(m: KVCacheManager, io: TierIO, clock: float) -> None:
    """Tell the manager each link's backlog at ``clock`` (``set_tier_wait``: how long a read or a
    write queued now waits, ``TierIO.busy_until``; reads included, which it does not queue itself)."""
    for lvl in range(1, len(io.busy_until)):
        busy = io.busy_until[lvl] - clock
        m.set_tier_wait(lvl, busy / 1000.0 if busy > 0.0 else 0.0)


def step_links(m: KVCacheManager, io: TierIO, clock: float, traffic: list[TierStatistics]) -> float:
    """``TierIO.step`` of a step starting at ``clock``, then ``tell_link_waits`` (the manager's write
    admission sees the links' reads too); returns when the step's loads are done."""
    done = io.step(clock, traffic)
    tell_link_waits(m, io, clock)
    return done


def prepare_loading(
    rm: KVCacheResourceManager,
    io: TierIO | None,
    cost: StepCost,
    chunk: int,
    live: Live,
    clock: float,
    step_tokens: int,
    waiting: int,
) -> float | None:
    """Background loads (``--load-policy``): prepare a newly admitted request, planned at its own
    prefill rate and step time (``step_rate``, in this step of ``step_tokens`` tokens); its traffic
    queues on the links at once (``TierIO.load``). A request whose pages come from disk (a level
    read apart, ``TierIO.apart``) waits for them (``Live.ready_ms``) while the others compute, as in
    the adapter's loading state; host copies are ordered within the step: the request joins this
    step, which waits for them. The plan sees what an engine would tell it: each link's backlog
    (``set_tier_wait``: how long a read queued now waits, ``TierIO.busy_until``), the ``waiting``
    requests queued for the engine (``set_engine_queue``) and the others' step time (``set_prefill_rate``'s
    ``step_s``: the steps it would wait through).
    Returns when the step's copies for it are done (``clock`` if none; None: refused, left as it
    was)."""
    m = rm.manager
    m.set_engine_queue(waiting)
    rate, others_ms = step_rate(cost, live.prompt_length, chunk, step_tokens)
    m.set_prefill_rate(rate, others_ms / 1000.0 if others_ms > 0.0 else None)
    if io is not None:
        tell_link_waits(m, io, clock)
    if rm.prepare_resources([live.req]):
        return None
    live.ready_ms = clock
    if io is None:
        return clock
    traffic = m.take_iteration_stats()
    apart = io.waits_apart(traffic)
    done = io.load(clock, traffic, not apart)
    if apart:
        live.ready_ms = done
        return clock
    return done


def start_loading(rm: KVCacheResourceManager, io: TierIO | None) -> list[TierStatistics]:
    """Background loads (``--load-policy``): before a step's admissions, its traffic so far (read
    first: the step waits for it, ``Replay._step_traffic``)."""
    return rm.manager.take_iteration_stats() if io is not None else []


def projected_step(
    rm: KVCacheResourceManager,
    opts: SchedulerOptions,
    waiting: deque[Live],
    step_tokens: Callable[[Live], int],
    totals: list[int],
    budget: int,
    free: list[int],
) -> int:
    """The step's tokens when the ``waiting`` requests are admitted as they would be (first come
    first served, within what is left of its ``budget`` and the GPU's ``free`` blocks of
    ``totals``): the step a request admitted now is planned at (``prepare_loading``)."""
    free = list(free)
    left = budget
    for k, live in enumerate(waiting):
        n = step_tokens(live)
        if k >= opts.max_batch or n > left:
            break
        need = rm.get_needed_resource_to_completion_per_pool_group(live.req)
        if not has_room(free, need, totals, opts.watermark):
            break
        for g, x in enumerate(need):
            free[g] -= x
        left -= n
    return opts.max_num_tokens - left


def has_room(free: list[int], need: list[int], totals: list[int], watermark: float) -> bool:
    """Admission's room test: whether every GPU pool group keeps ``watermark`` of its ``totals``
    blocks free after ``need`` more are taken from ``free``."""
    return not any(f - k < watermark * tot for f, k, tot in zip(free, need, totals))
