"""A request in the replay's simulated engine (:class:`Live`), and what its admission counts."""

from __future__ import annotations

from typing import Any

from .._common import TierStatistics
from ..engine import EngineRequest, KVCacheResourceManager
from ..engine._request import RequestId
from ._replay_types import ReplayResult, RequestOutcome
from ._step_cost import StepCost
from ._tier_io import TierIO
from ._workload import SimRequest


class Live:
    """A request in the simulated engine."""

    def __init__(self, sim: SimRequest, req: EngineRequest, arrival_ms: float) -> None:
        self.sim = sim
        self.req = req
        self.prompt_length = len(req.prompt_tokens)
        self.arrival_ms = arrival_ms
        self.admitted = False  #: admitted at least once (the first admission counts for hit rates)
        self.full_check = True  #: --check-data: check every attended position at the next step
        self.tokens: Any = None  #: --check-data: prompt + outputs as uint32
        self.retry_at = -1  #: suspended: Replay.releases when it was last refused
        self.restarted = False  #: freed by the engine's restart, not yet admitted again
        self.first_ms = -1.0  #: when its first output token was sampled (the end of that step)
        self.out = RequestOutcome(sim.index, sim.source_line, arrival_ms, self.prompt_length)
        #: background loads (``--load-policy``): when its pages are in GPU memory (-1: no wait)
        self.ready_ms = -1.0


def prefill_rate(cost: StepCost, prompt_length: int, chunk: int, step_tokens: int) -> float | None:
    """Tokens per second a request prefills at in the replay's engine as it runs now: one chunk of
    its prompt (the whole prompt unchunked) a step, at the prompt's middle context, in a step of
    ``step_tokens`` tokens (the others as one chunk from the start), by the step cost. None: a
    step of no time."""
    n = prompt_length
    c = chunk if 0 < chunk < n else n
    cost.add_prefill(c, (n - c) // 2)
    if step_tokens > c:
        cost.add_prefill(step_tokens - c, 0)
    ms = cost.take_ms()
    return c * 1000.0 / ms if ms > 0.0 else None


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


def prepare_loading(
    rm: KVCacheResourceManager,
    io: TierIO | None,
    cost: StepCost,
    chunk: int,
    new: list[Live],
    clock: float,
    step_tokens: int,
) -> tuple[set[RequestId], list[TierStatistics]]:
    """Background loads (``--load-policy``): prepare newly admitted requests one at a time, each
    planned at its own prefill rate (``prefill_rate``, in this step of ``step_tokens`` tokens); a request whose pages come from a lower
    tier waits for its bytes on that tier's link (``TierIO.load``: ``Live.ready_ms``) while the
    others compute. Returns the unserved request ids, and the step's traffic before them (read
    first: the step waits for it, ``Replay._step_traffic``)."""
    m = rm.manager
    unserved: set[RequestId] = set()
    early = m.take_iteration_stats() if io is not None else []
    for live in new:
        m.set_prefill_rate(prefill_rate(cost, live.prompt_length, chunk, step_tokens))
        if rm.prepare_resources([live.req]):
            unserved.add(live.req.request_id)
            continue
        traffic = m.take_iteration_stats() if io is not None else []
        live.ready_ms = io.load(clock, traffic) if io is not None else clock
    return unserved, early


def count_admission(r: ReplayResult, live: Live, clock: float, t: int) -> None:
    """Count an admitted request's prompt and reuse (a first admission, a readmission, or after a restart)."""
    req = live.req
    reused = req.num_reused_tokens
    live.full_check = True
    per_level = req.num_reused_tokens_per_level
    out = live.out
    out.loaded_tokens += reused - (per_level[0] if per_level else 0)  # (found below the GPU)
    if live.restarted:  # its KV was lost with the engine, not preempted
        live.restarted = False
        r.restart_readmitted_tokens += req.num_tokens
        r.restart_readmitted_reused_tokens += reused
        out.recomputed_tokens += req.num_tokens - reused
        return
    if live.admitted:
        r.readmissions += 1
        r.readmitted_tokens += req.num_tokens
        r.readmitted_reused_tokens += reused
        out.recomputed_tokens += req.num_tokens - reused
        return
    live.admitted = True
    out.wait_ms = clock - live.arrival_ms
    out.reused_per_level = list(per_level)
    r.wait_ms.append(out.wait_ms)
    n = len(req.prompt_tokens)
    blocks = (n + t - 1) // t
    r.prompt_tokens += n
    r.reused_tokens += reused
    r.prompt_blocks += blocks
    hit = blocks if reused >= n - 1 else reused // t
    r.hit_blocks += hit
    # by the level each reused block was found in (the adapter splits reused tokens by block)
    partial = 0  # the level of the one partially reused block, if any
    for lvl, k in enumerate(per_level):
        usage = r.levels[lvl]
        usage.reused_tokens += k
        usage.hit_blocks += k // t
        hit -= k // t
        if k % t:
            partial = lvl
    if hit > 0:  # the last block, whose tokens were reused but for the always-computed last one
        r.levels[partial].hit_blocks += hit
