"""A request in the replay's simulated engine (:class:`Live`), and what its admission counts."""

from __future__ import annotations

from typing import Any

from ..engine import EngineRequest
from ._replay_types import ReplayResult, RequestOutcome
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
