"""N replicas of the simulated engine, each with its own manager, behind a round-robin router;
optionally sharing one remote tier (Redis). Request ``i`` goes to replica ``i % N`` (a
conversation's turns land on different replicas, which is where a shared tier helps).

The replicas advance on one simulated time line: the replica whose next step is earliest steps
next, so what one replica publishes is in Redis before another, later in simulated time, looks it
up. A finished request's successor (the next turn) arrives at its own replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TypeVar

from .._common import RemoteStatistics
from .._config import KVCacheManagerConfig
from ..engine import KVCacheResourceManager
from ._replay import Replay
from ._replay_types import LevelUsage, ReplayResult, SchedulerOptions
from ._workload import SimRequest


class ReplicaReplay(Replay):
    """One replica: it replays only the requests routed to it (see the module doc)."""

    def __init__(
        self,
        fleet: list[ReplicaReplay],
        config: KVCacheManagerConfig,
        requests: list[SimRequest],
        options: SchedulerOptions,
        check_data: bool = False,
        on_step: Callable[[KVCacheResourceManager], None] | None = None,
        bytes_scale: float = 1.0,
    ) -> None:
        super().__init__(config, requests, options, check_data, None, on_step, bytes_scale=bytes_scale)
        self.fleet = fleet
        #: what the manager's remote tier did, read before it shuts down
        self.remote: RemoteStatistics | None = None

    def _release_successors(self, index: int) -> None:
        fleet = self.fleet
        for nxt in self.successors.pop(index, []):
            sim = self.requests[nxt]
            fleet[nxt % len(fleet)]._arrive(nxt, max(sim.arrival_ms * self.opts.time_scale, self.clock))

    def next_time(self) -> float:
        """Simulated time of this replica's next step (-1: nothing to do until a request arrives)."""
        if self.waiting or self.running or self.suspended:
            return self.clock
        if self.arrivals:
            return max(self.clock, self.arrivals[0][0])
        return -1.0

    def finish(self) -> ReplayResult:
        self.result.sim_time_ms = self.clock
        self.remote = self.rm.manager.remote_statistics
        self._finish()
        return self.result


#: a kind of replica (``earliest`` returns the fleet's own type)
R = TypeVar("R", bound=ReplicaReplay)


def run_replicas(
    configs: Sequence[KVCacheManagerConfig],
    requests: list[SimRequest],
    options: SchedulerOptions,
    check_data: bool = False,
    on_step: Callable[[KVCacheResourceManager], None] | None = None,
    bytes_scale: float = 1.0,
) -> tuple[list[ReplayResult], list[RemoteStatistics | None]]:
    """Replay ``requests`` over one replica per config (round-robin); per replica its counters and
    its remote tier's statistics (None without one). ``bytes_scale``: the model's bytes per proxy byte."""
    fleet: list[ReplicaReplay] = []
    wall0 = time.perf_counter()
    try:
        for cfg in configs:
            fleet.append(ReplicaReplay(fleet, cfg, requests, options, check_data, on_step, bytes_scale))
        n = len(fleet)
        for sim in requests:
            if sim.after >= 0:
                fleet[sim.after % n].successors.setdefault(sim.after, []).append(sim.index)
            else:
                fleet[sim.index % n]._arrive(sim.index, sim.arrival_ms * options.time_scale)
        while True:
            best, _ = earliest(fleet)
            if best is None:
                break
            best.advance()
            if best.rm.manager.remote_statistics is not None:
                # what the step sent is in Redis before any later step (simulated time) looks
                best.rm.manager.flush_remote_writes()
    except BaseException:
        shut_down(fleet)
        raise
    return finish(fleet, wall0), [rep.remote for rep in fleet]


def earliest(fleet: Sequence[R]) -> tuple[R | None, float]:
    """The replica whose next step is earliest in simulated time, and that time (None: all idle)."""
    best: R | None = None
    best_t = 0.0
    for rep in fleet:
        t = rep.next_time()
        if t >= 0 and (best is None or t < best_t):
            best, best_t = rep, t
    return best, best_t


def shut_down(fleet: Sequence[ReplicaReplay]) -> None:
    """Shut every replica's manager down after a failure (Ctrl-C, SIGTERM: maybe inside a manager's
    call, which then refuses shutdown; one already shut down)."""
    for rep in fleet:
        with contextlib.suppress(Exception):
            rep.rm.shutdown()


def finish(fleet: Sequence[ReplicaReplay], wall0: float) -> list[ReplayResult]:
    """Every replica's result; the fleet's wall time since ``wall0`` counted once (one process ran
    them all), on the first."""
    results = [rep.finish() for rep in fleet]
    for i, res in enumerate(results):
        res.wall_s = time.perf_counter() - wall0 if i == 0 else 0.0
    return results


def merge_results(results: Sequence[ReplayResult]) -> ReplayResult:
    """The fleet as one result: counters summed, the longest simulated time, per-step and per-request
    arrays (manager time, waits, TTFT, ...) joined replica after replica, replica 0's series."""
    first = results[0]
    out = ReplayResult(first.tokens_per_block)
    for f in dataclasses.fields(ReplayResult):
        values = [getattr(r, f.name) for r in results]
        if f.name in ("tokens_per_block",):
            continue
        if f.name in (
            "max_batch",
            "sim_time_ms",
            "trace_span_ms",
            "longest_request_tokens",
            "ideal_peak_tokens",
            "snapshot_interval",
        ):
            setattr(out, f.name, max(values))
        elif f.name == "first_arrival_ms":
            setattr(out, f.name, min(values))
        elif isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            setattr(out, f.name, sum(values))
        elif f.name == "rejected_lines":
            setattr(out, f.name, [x for v in values for x in v][:5])
        elif isinstance(values[0], array) and not f.name.startswith("series_"):  # per step or request: all
            merged = getattr(out, f.name)
            for v in values:
                merged.extend(v)
    out.num_requests = first.num_requests  # every replica saw the whole list
    for name in ("series_t_s", "series_used", "series_cached", "series_hit", "series_running"):
        getattr(out, name).extend(getattr(first, name))
    out.levels = [_merge_levels([r.levels[i] for r in results]) for i in range(len(first.levels))]
    return out


def _merge_levels(levels: Sequence[LevelUsage]) -> LevelUsage:
    """One level over the fleet: sizes and traffic summed, per-step maxima the largest."""
    out = LevelUsage(levels[0].level)
    for f in dataclasses.fields(LevelUsage):
        if f.name != "level":
            values = [getattr(lv, f.name) for lv in levels]
            setattr(out, f.name, max(values) if f.name.startswith("max_") else sum(values))
    return out
