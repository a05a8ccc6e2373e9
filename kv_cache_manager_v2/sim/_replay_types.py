"""The replay's inputs and outputs: how the simulated engine schedules (:class:`SchedulerOptions`)
and the raw counters a replay leaves (:class:`ReplayResult`, one :class:`LevelUsage` per cache level)."""

from __future__ import annotations

import json
import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._common import CacheLevel
from .._core._kv_cache_manager import KVCacheManager
from .._utils import check_int
from ._check import DataChecker
from ._models import SimUserError
from ._ssm_policy import add_counters
from ._step_cost import StepCost
from ._tier_io import TierLinks
from ._workload import SimRequest

#: the longest simulated step (an hour): beyond it the simulated clock means nothing
MAX_STEP_MS = 3_600_000.0


@dataclass(frozen=True)
class SchedulerOptions:
    """How the simulated engine schedules (see the module doc)."""

    max_batch: int = 256  #: requests per step
    max_num_tokens: int = 8192  #: tokens per step (prefill chunks + one per decoding request)
    chunk: int = 2048  #: prefill chunk per request and step (0: the whole prompt at once)
    watermark: float = 0.01  #: share of every GPU pool group admission leaves free or evictable
    step_ms: float = 15.0  #: simulated time of a step, plus its tokens at tokens_per_s
    tokens_per_s: float = 50_000.0
    time_scale: float = 1.0  #: multiplies arrival times (0: everything arrives at once)
    reuse: bool = True  #: False: every request in its own reuse scope (no prefix reuse at all)
    prompt_only: bool = False  #: requests end after their prompt (one sampled token, no decode steps)
    #: a step's compute time (``sim/_compute.py``: the roofline or a calibration file); None: step_ms
    #: plus its tokens at tokens_per_s. One instance serves replays one after the other (``take_ms``
    #: empties it each step)
    cost: StepCost | None = None
    #: the links of the tiers below the GPU (``_tier_io``): loads delay their step, offloads occupy
    #: their link (None: pages move in no time)
    links: TierLinks | None = None
    #: the manager's measured CPU time of each step is added to the step's time (not deterministic)
    count_manager_time: bool = False
    #: ``--load-policy``: the manager's ``load_policy``, priced by ``links`` and planned at each
    #: request's prefill rate, with disk loads in the background (``_loading.prepare_loading``); None:
    #: the manager's default with no prefill rate (every match loaded), a step waiting for its loads
    load_policy: str | None = None

    def validate(self) -> None:
        for name, v, lo in (
            ("--max-batch", self.max_batch, 1),
            ("--max-num-tokens", self.max_num_tokens, 1),
            ("--chunk", self.chunk, 0),
        ):
            check_int(name, v)
            if v < lo:
                raise SimUserError(f"{name} must be >= {lo}, got {v}")
        if not 0.0 <= self.watermark < 1.0:
            raise SimUserError(f"--watermark must be in [0, 1), got {self.watermark}")
        for name, x, ok, allowed in (
            ("--step-ms", self.step_ms, 0 <= self.step_ms <= MAX_STEP_MS, f"in [0, {MAX_STEP_MS:.0f}] (an hour)"),
            ("--tokens-per-s", self.tokens_per_s, 0 < self.tokens_per_s < math.inf, "a finite number > 0"),
            ("--time-scale", self.time_scale, 0 <= self.time_scale < math.inf, "a finite number >= 0"),
        ):
            if not ok:
                raise SimUserError(f"{name} must be {allowed}, got {x}")


@dataclass
class LevelUsage:
    """Use and traffic of one cache level, summed over pool groups; bytes are proxy bytes (see
    ``_models``). Traffic and the occupied peak come from the manager's tier statistics."""

    level: int
    capacity: int = 0
    peak_used: int = 0  #: held by requests (active, or suspended where they cannot spill), sampled each step
    peak_occupied: int = 0  #: held by requests or kept as reusable cache (the allocator's high-water mark)
    reusable_at_end: int = 0  #: holding reusable blocks when the replay ended (every request done)
    snapshots_at_end: int = 0  #: of those, recurrent-state snapshots (hybrid models)
    peak_pinned: int = 0  #: in pinned pages (--pin-system-prompts), sampled each step
    peak_retained: int = 0  #: in pages under close-time retention (--retention-hints), sampled each step
    offloaded_pages: int = 0  #: evicted into this level from the one above
    offloaded_bytes: int = 0
    onboarded_pages: int = 0  #: copied from this level up (reuse, resume)
    onboarded_bytes: int = 0
    dropped_pages: int = 0  #: dropped for good here
    dropped_bytes: int = 0
    io_errors: int = 0
    declined_pages: int = 0  #: write admission: dropped instead of written here (its link's backlog full)
    declined_bytes: int = 0
    max_step_offloaded_pages: int = 0  #: most pages offloaded into this level in one step
    max_step_onboarded_pages: int = 0  #: most pages onboarded from this level in one step
    reused_tokens: int = 0  #: prompt tokens of first admissions reused from blocks found at this level
    hit_blocks: int = 0  #: prompt blocks hit (see ReplayResult.hit_blocks) found at this level


class RequestOutcome:
    """One request's times (simulated ms) and tokens, for ``--per-request``: made when it finished
    or was rejected (``rejected``: never served; its times are -1)."""

    def __init__(self, index: int, line: int, arrival_ms: float, prompt_tokens: int) -> None:
        self.index = index  #: in the workload
        self.line = line  #: in the trace file (0: built-in conversations)
        self.arrival_ms = arrival_ms
        self.prompt_tokens = prompt_tokens
        self.rejected = False
        self.wait_ms = -1.0  #: arrival to its first admission (queueing delay)
        self.ttft_ms = -1.0
        self.tpot_ms = -1.0
        self.e2e_ms = -1.0
        self.output_tokens = 0
        #: prompt tokens reused at its first admission, per level (GPU first)
        self.reused_per_level: list[int] = []
        #: tokens reused from levels below the GPU, over all its admissions (onboarded for it)
        self.loaded_tokens = 0
        #: tokens computed again after a preemption by recompute or an engine restart
        self.recomputed_tokens = 0
        #: the time of the step that sampled its first token (ms)
        self.first_step_ms = 0.0

    def to_json(self, tiers: Sequence[str], run: str | None) -> str:
        """One line of ``--per-request``: ``tiers`` name the levels (GPU first); ``run`` labels the
        replay when a run has several (a sweep point, a policy). Times in ms, null if rejected."""
        done = not self.rejected
        doc: dict[str, object] = {
            "index": self.index,
            "line": self.line or None,
            "arrival_ms": round(self.arrival_ms, 6),
            "rejected": self.rejected,
            "wait_ms": round(self.wait_ms, 6) if done else None,
            "ttft_ms": round(self.ttft_ms, 6) if done else None,
            "tpot_ms": round(self.tpot_ms, 6) if done else None,
            "e2e_ms": round(self.e2e_ms, 6) if done else None,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "reused_tokens": {tiers[i]: k for i, k in enumerate(self.reused_per_level) if i < len(tiers)},
            "loaded_tokens": self.loaded_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "first_step_ms": round(self.first_step_ms, 6) if done else None,
        }
        if run is not None:
            doc["run"] = run
        return json.dumps(doc)


@dataclass
class ReplayResult:
    """Counters of one replay (raw; ``_report`` turns them into the report)."""

    tokens_per_block: int
    num_requests: int = 0
    finished: int = 0
    rejected: int = 0
    rejected_lines: list[int] = field(default_factory=list)  #: trace lines (else workload indices) of the first five
    rejected_prompt_tokens: int = 0  #: prompts of rejected requests (misses in the all-requests hit rates)
    rejected_prompt_blocks: int = 0
    longest_request_tokens: int = 0  #: the longest prompt + output of the workload (what a GPU tier must hold)
    trace_span_ms: float = 0.0  #: the last arrival time (times time_scale)
    first_arrival_ms: float = 0.0  #: the first arrival time (times time_scale): where throughput's span starts
    #: most tokens (prompt + output) held at once if every request ran alone from its arrival on
    #: (see ideal_peak_tokens): about what a GPU tier needs for the engine to keep up
    ideal_peak_tokens: int = 0
    prompt_tokens: int = 0  #: prompt tokens of first admissions
    reused_tokens: int = 0  #: of those, taken from the cache
    prompt_blocks: int = 0
    hit_blocks: int = 0  #: prompt blocks whose KV was reused whole (the last token is always computed)
    readmissions: int = 0
    readmitted_tokens: int = 0
    readmitted_reused_tokens: int = 0
    #: requests the engine's restart (--restart-at) freed, admitted again: not preemptions
    restart_readmitted_tokens: int = 0
    restart_readmitted_reused_tokens: int = 0
    prefill_computed: int = 0  #: tokens computed before a request's first output token (incl. recompute)
    decode_computed: int = 0
    output_tokens: int = 0
    steps: int = 0
    max_batch: int = 0
    preempted_suspend: int = 0
    preempted_recompute: int = 0
    resumed: int = 0
    sim_time_ms: float = 0.0
    compute_ms: float = 0.0  #: simulated time its steps computed (the step cost's, summed; not loads or the manager)
    wait_ms: array[float] = field(default_factory=lambda: array("d"))  #: arrival to first admission, per request
    #: per finished request, in finishing order (simulated ms): arrival to its first output token
    #: (TTFT), the mean time between its later output tokens (TPOT; 0 with one output token), and
    #: arrival to its last token (end to end)
    ttft_ms: array[float] = field(default_factory=lambda: array("d"))
    tpot_ms: array[float] = field(default_factory=lambda: array("d"))
    e2e_ms: array[float] = field(default_factory=lambda: array("d"))
    #: per request, finished or rejected, in that order (``--per-request``)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    io_wait_ms: float = 0.0  #: simulated time steps waited for their loads (tier I/O), summed
    io_write_stall_ms: float = 0.0  #: ... and for their links' write backlogs (``_tier_io.WRITE_BACKLOG_MS``)
    io_background_ms: float = 0.0  #: ... requests waited for their own loads (``--load-policy``), summed
    #: ``--load-policy``: the manager's ``load_plan_statistics`` at the end (JSON-ready)
    load_plan: dict[str, object] | None = None
    wall_s: float = 0.0
    manager_s: float = 0.0  #: CPU time inside adapter calls
    request_steps: int = 0  #: (request, step) pairs served
    step_us: array[float] = field(default_factory=lambda: array("d"))  #: manager time per step
    series_t_s: array[float] = field(default_factory=lambda: array("d"))
    series_used: array[float] = field(default_factory=lambda: array("d"))  #: GPU share held by requests
    series_cached: array[float] = field(default_factory=lambda: array("d"))  #: GPU share kept as reusable cache
    series_hit: array[float] = field(default_factory=lambda: array("d"))  #: cumulative token hit rate
    series_running: array[float] = field(default_factory=lambda: array("d"))
    levels: list[LevelUsage] = field(default_factory=list)
    pinned_prefixes: int = 0  #: shared prefixes pinned (--pin-system-prompts)
    pinned_tokens: int = 0
    pins_refused: int = 0  #: pins refused beyond max_pinned_share
    #: --session-end's directives.end: blocks dropped, deferred (in use), kept (shared)
    sessions_ended: list[int] = field(default_factory=lambda: [0, 0, 0])
    reused_blocks: int = 0  #: the manager's ReuseStatistics
    missed_blocks: int = 0
    reused_pages: int = 0
    allocated_pages: int = 0
    #: recurrent-state snapshots (hybrid models; the manager's ReuseStatistics)
    snapshots_taken: int = 0
    snapshots_skipped: int = 0
    snapshots_reused: int = 0
    snapshots_evicted: int = 0
    snapshot_interval: int = 0  #: tokens between snapshots (0: no recurrent layers)
    #: the manager's snapshot counters by kind (``_ssm_policy.COUNTERS``)
    snapshot_counters: dict[str, int] = field(default_factory=dict)
    records_checked: int = 0  #: --check-data
    layer_by_layer_steps: int = 0  #: --check-data steps with SWA scratch blocks (checked layer by layer)
    blocks_replayed: int = 0  #: blocks of prompt + output over all finished requests (replay speed)
    #: ``split_ms`` (``--restart-at``): the counters of first admissions before that time, and the
    #: pages the restarted manager adopted from the persistent disk tier (-1: no restart)
    split_prompt_blocks: int = 0
    split_hit_blocks: int = 0
    split_prompt_tokens: int = 0
    split_reused_tokens: int = 0
    adopted_pages: int = -1


def set_workload_bounds(result: ReplayResult, requests: Sequence[SimRequest], options: SchedulerOptions) -> None:
    """``result``'s figures of the workload itself: its first and last arrival, its longest request
    and ``ideal_peak_tokens``."""
    scale = options.time_scale
    if requests:
        result.first_arrival_ms = min(sim.arrival_ms for sim in requests) * scale
        result.trace_span_ms = max(sim.arrival_ms for sim in requests) * scale
    for sim in requests:
        need = sim.prompt_length + (1 if options.prompt_only else sim.output_length)
        result.longest_request_tokens = max(result.longest_request_tokens, need)
    result.ideal_peak_tokens = ideal_peak_tokens(requests, options)


def ideal_peak_tokens(requests: Sequence[SimRequest], options: SchedulerOptions) -> int:
    """The most tokens held at once if every request were served from its arrival without waiting:
    its prefill chunks and decode steps one step each, at ``step_ms`` plus its own tokens (or at
    what ``options.cost`` charges for them alone; its decode steps all at its middle context),
    holding its whole prompt + output meanwhile (no reuse assumed). The memory an engine needs to
    keep up with the arrivals (a rough upper bound of it; compute aside)."""
    o = options
    cost = o.cost
    events: list[tuple[float, int]] = []
    per_token_ms = 1000.0 / o.tokens_per_s
    for sim in requests:
        p = sim.prompt_length
        out = 1 if o.prompt_only else sim.output_length
        chunks = (p + o.chunk - 1) // o.chunk if o.chunk else 1
        if cost is None:
            duration = chunks * o.step_ms + p * per_token_ms + (out - 1) * (o.step_ms + per_token_ms)
        else:
            duration = 0.0
            size = o.chunk if o.chunk else p
            for done in range(0, p, size):
                cost.add_prefill(min(size, p - done), done)
                duration += cost.take_ms()
            cost.add_decode(p + out // 2)
            duration += (out - 1) * cost.take_ms()
        start = sim.arrival_ms * o.time_scale
        events.append((start, p + out))
        events.append((start + duration, -(p + out)))
    events.sort(key=lambda e: (e[0], e[1]))  # a request that ends frees its memory before one starts
    held = peak = 0
    for _, k in events:
        held += k
        if held > peak:
            peak = held
    return peak


#: the per-step series of ``ReplayResult``, in the order the replay notes a served step's values
SERIES_FIELDS = ("series_t_s", "series_used", "series_cached", "series_hit", "series_running", "step_us")


def add_samples(result: ReplayResult, samples: list[float]) -> None:
    """Move ``samples`` (``SERIES_FIELDS`` values a step, in that order) into ``result``'s series,
    value for value, and empty it. In bulk: one ``array('d').append`` costs ~700 instructions
    compiled (argument parsing twice), six a step."""
    if not samples:
        return
    packed = array("d", struct.pack(f"{len(samples)}d", *samples))  # C doubles, as array('d') keeps them
    width = len(SERIES_FIELDS)
    for k, name in enumerate(SERIES_FIELDS):
        series: array[float] = getattr(result, name)
        series.extend(packed[k::width])
    samples.clear()


def add_request_times(result: ReplayResult) -> None:
    """The finished requests' times (``outcomes``) into ``result``'s arrays, in finishing order."""
    done = [x for x in result.outcomes if not x.rejected]
    result.ttft_ms.extend([x.ttft_ms for x in done])
    result.tpot_ms.extend([x.tpot_ms for x in done])
    result.e2e_ms.extend([x.e2e_ms for x in done])


def add_manager_counters(r: ReplayResult, m: KVCacheManager, checker: DataChecker | None) -> None:
    """Add a manager's counters to ``r`` (every request gone; they restart with a new manager)."""
    st = m.reuse_statistics
    r.reused_blocks += st.reused_blocks
    r.missed_blocks += st.missed_blocks
    r.reused_pages += st.reused_pages
    r.allocated_pages += st.allocated_pages
    r.snapshots_taken += st.snapshots_taken
    r.snapshots_skipped += st.snapshots_skipped
    r.snapshots_reused += st.snapshots_reused
    r.snapshots_evicted += st.snapshots_evicted
    r.snapshot_interval = m.config.snapshot_interval
    add_counters(r.snapshot_counters, st)
    for usage in r.levels:
        ts = m.get_tier_statistics(CacheLevel(usage.level))
        usage.peak_occupied = max(usage.peak_occupied, ts.peak_used_bytes)
        # every request is gone: what the level still holds is reusable blocks
        stats = m.get_storage_statistics(CacheLevel(usage.level))
        usage.reusable_at_end = sum((x.total - x.free) * sum(x.slot_sizes) for x in stats)
        usage.snapshots_at_end = ts.state_bytes  # (no live state is left)
        usage.offloaded_pages += ts.offloaded_pages
        usage.offloaded_bytes += ts.offloaded_bytes
        usage.onboarded_pages += ts.onboarded_pages
        usage.onboarded_bytes += ts.onboarded_bytes
        usage.dropped_pages += ts.dropped_pages
        usage.dropped_bytes += ts.dropped_bytes
        usage.io_errors += ts.io_errors
        usage.declined_pages += ts.declined_pages
        usage.declined_bytes += ts.declined_bytes
    if checker is not None:
        r.records_checked += checker.records_checked
        r.layer_by_layer_steps += checker.layer_by_layer_steps
