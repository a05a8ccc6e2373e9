"""The replay: a continuous-batching scheduler over :class:`KVCacheResourceManager`, on a simulated clock.

Every step, in this order and within a token budget and a batch size:

1. running requests (one token if decoding, else their next prefill chunk), then suspended ones
   (oldest first; ``prepare_resources`` resumes them; one refused before is retried only once a
   request has finished or been freed since). A running request that cannot grow is preempted
   with ``suspend_resources`` (its KV is kept);
2. if none of them was refused, waiting requests first come first served: a request is admitted
   while every GPU pool group keeps room for everything it could need to finish (no reuse
   assumed) plus a watermark of free or evictable slots;
3. if nobody at all could be served, the latest request holding memory is freed
   (``free_resources``: preemption by recompute; its committed blocks stay reusable) and queued
   again at the front. With a host (or disk) tier a step that suspended someone frees nobody: the
   suspended requests' pages can now spill down, so the next step can resume one of them instead.

Served requests "compute" their step: the clock advances to the end of the step's loads from lower
tiers (``options.links``: ``_tier_io``), then by the step's cost (``StepCost``: the options'
``cost``, e.g. the roofline of ``sim/_compute.py``; without one ``step_ms`` plus the step's tokens
at ``tokens_per_s``); a request whose step ends at its last token samples the next output token
(its first one: its TTFT ends with the step); ``update_resources`` commits (``count_manager_time``:
the manager's CPU time of the step is added). No KV bytes are touched unless a :class:`DataChecker` is given.
Requests arrive at their timestamps (times ``time_scale``); a conversation's next turn also waits
for the previous answer. A request that could not fit in the GPU tier even alone is rejected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, cast

import numpy as np

from .._common import CacheLevel, ReuseScope, TierStatistics, TokenId, TokenIdExt
from .._config import KVCacheManagerConfig
from .._retention import Retention
from ..engine import EngineRequest, KVCacheResourceManager, RequestState
from ._check import DataChecker
from ._closing import Closing
from ._live import Live, count_admission
from ._loading import (
    has_room,
    load_plan_config,
    prepare_loading,
    projected_step,
    start_loading,
    step_links,
    woken,
)
from ._replay_types import (
    SERIES_FIELDS,
    LevelUsage,
    ReplayResult,
    SchedulerOptions,
    add_manager_counters,
    add_request_times,
    add_samples,
    set_workload_bounds,
)
from ._step_cost import LinearCost, StepCost
from ._tier_io import TierIO, tier_kind
from ._workload import SimRequest

#: bound once: mypyc looks a module's attribute up at every call (several times a step)
_clock: Final = time.perf_counter

#: pending samples moved into the result's series at once
FLUSH_SAMPLES = len(SERIES_FIELDS) * 4096


class Replay:
    """One replay of ``requests`` through a fresh manager built from ``config``."""

    def __init__(
        self,
        config: KVCacheManagerConfig,
        requests: list[SimRequest],
        options: SchedulerOptions,
        check_data: bool = False,
        progress: Callable[[int], None] | None = None,
        on_step: Callable[[KVCacheResourceManager], None] | None = None,
        on_finish: Callable[[KVCacheResourceManager], None] | None = None,
        split_ms: float = -1.0,
        restart: bool = False,
        bytes_scale: float = 1.0,
    ) -> None:
        options.validate()
        self.opts = options
        #: the time of a step's compute (``options.cost``; without one ``step_ms`` plus its tokens at ``tokens_per_s``)
        cost = options.cost
        self.cost: StepCost = cost if cost is not None else LinearCost(options.step_ms, options.tokens_per_s)
        self.requests = requests
        self.clock = 0.0
        self.config = config = dataclasses.replace(config, clock=lambda: self.clock / 1000.0)  # simulated seconds
        # the manager prices loads and queued writes as the replay times them
        config = self.config = load_plan_config(config, options.load_policy, options.links, bytes_scale)
        self._early: list[TierStatistics] = []  #: background loads: the step's traffic before its admissions
        self._copies_ms = -1.0  #: background loads: when the host copies of the step's admissions are done
        self.retain: Sequence[Retention | list[Retention] | None] | None = None  #: close-time hints by request index
        self.rm = KVCacheResourceManager(config)  # may raise ValueError (refused configuration)
        #: simulated time at which the counters are split (and the engine restarts, with ``restart``)
        self.split_ms = split_ms
        self.restart = restart
        self.t = config.tokens_per_block
        self.num_levels = len(config.cache_tiers)
        #: tier I/O (``options.links``; ``bytes_scale``: the model's bytes per proxy byte)
        self.io: TierIO | None = None
        if options.links is not None:
            self.io = TierIO([tier_kind(x) for x in config.cache_tiers], options.links, bytes_scale)
        self.count_manager_time = options.count_manager_time
        self.checker = DataChecker(self.rm) if check_data else None
        self.progress = progress
        self.on_step = on_step  #: called after every step (tests run the invariant checker there)
        self.on_finish = on_finish  #: called once at the end, before the manager is shut down (final metrics)
        self.closing = Closing(self.t)  #: close-time pins, hook and session ends
        self.result = ReplayResult(self.t, num_requests=len(requests))
        set_workload_bounds(self.result, requests, options)
        self.arrivals: list[tuple[float, int]] = []
        self.successors: dict[int, list[int]] = {}
        #: requests a later one continues (their output is in its prompt: EngineRequest.output_is_history)
        self.followed = {sim.after for sim in requests if sim.after >= 0}
        self.waiting: deque[Live] = deque()
        self.running: list[Live] = []
        self.suspended: list[Live] = []
        self.live: dict[int, Live] = {}
        self.totals = self.rm.get_max_resource_count_per_pool_group()
        self._step_manager_s = 0.0
        self.releases = 0  #: requests that finished or were freed so far (memory came back)
        self.suspended_now = False  #: the step being scheduled preempted a request by suspending it
        self._samples: list[float] = []  #: the served steps' samples not yet in the series (add_samples)
        self._flush_at = FLUSH_SAMPLES  # (read once: a module global is a dict lookup compiled)
        stats = self.rm.manager.get_storage_statistics()
        self.slot_bytes = [sum(s.slot_sizes) for s in stats]
        for lvl in range(self.num_levels):
            usage = LevelUsage(lvl)
            usage.capacity = sum(
                s.total * sum(s.slot_sizes) for s in self.rm.manager.get_storage_statistics(CacheLevel(lvl))
            )
            self.result.levels.append(usage)

    # ------------------------------------------------------------------ arrivals
    def _arrive(self, index: int, at_ms: float) -> None:
        heapq.heappush(self.arrivals, (at_ms, index))

    def _release_successors(self, index: int) -> None:
        for nxt in self.successors.pop(index, []):
            sim = self.requests[nxt]
            self._arrive(nxt, max(sim.arrival_ms * self.opts.time_scale, self.clock))

    def _admit_arrivals(self) -> None:
        o = self.opts
        while self.arrivals and self.arrivals[0][0] <= self.clock:
            at_ms, index = heapq.heappop(self.arrivals)
            sim = self.requests[index]
            prompt = sim.prompt_tokens()
            max_new = 1 if o.prompt_only else sim.output_length
            tokens = cast("Sequence[TokenIdExt]", prompt)  # array('I'): hashed by a memory copy
            scope = None if o.reuse else ReuseScope(salt=index)
            req = EngineRequest(index, tokens, max_new, o.chunk, scope, session_id=sim.session)
            req.output_is_history = index in self.followed
            live = Live(sim, req, at_ms)
            need = self.rm.get_needed_resource_to_completion_per_pool_group(req)
            if any(n > total for n, total in zip(need, self.totals)):
                self._reject(live)
                continue
            if self.checker is not None:
                out = np.arange(sim.output_base, sim.output_base + max_new, dtype=np.uint32)
                live.tokens = np.concatenate([np.frombuffer(prompt, dtype=np.uint32), out])
            self.live[index] = live
            self.waiting.append(live)

    def _reject(self, live: Live) -> None:
        r = self.result
        r.rejected += 1
        live.out.rejected = True
        r.outcomes.append(live.out)
        n = live.sim.prompt_length
        r.rejected_prompt_tokens += n
        r.rejected_prompt_blocks += (n + self.t - 1) // self.t
        if len(r.rejected_lines) < 5:
            r.rejected_lines.append(live.sim.source_line or live.sim.index)
        self.live.pop(live.sim.index, None)
        self._release_successors(live.sim.index)
        self._report_progress()

    def _report_progress(self) -> None:
        if self.progress is not None:
            self.progress(self.result.finished + self.result.rejected)

    # ------------------------------------------------------------------ the step
    def _step_tokens(self, live: Live) -> int:
        req = live.req
        n = live.prompt_length + len(req.generated_tokens) - req.num_cached_tokens
        c = req.context_chunk_size
        return c if c and n > c else n

    def _timed_prepare(self, batch: list[EngineRequest]) -> list[EngineRequest]:
        t0 = _clock()
        unserved = self.rm.prepare_resources(batch)
        self._step_manager_s += _clock() - t0
        return unserved

    def _schedule(self) -> list[Live]:
        """Prepare this step's batch (see the module doc); returns the served requests."""
        o = self.opts
        self.suspended_now = False
        rm = self.rm
        budget = o.max_num_tokens
        old: list[Live] = []
        batch: list[EngineRequest] = []
        running, suspended = self.running, self.suspended
        num_running = len(running)
        for i in range(num_running + len(suspended)):
            if len(old) >= o.max_batch:
                break
            live = running[i] if i < num_running else suspended[i - num_running]
            if live.ready_ms > self.clock:
                continue  # its pages are still on their way (background loads)
            if i >= num_running and live.retry_at == self.releases and num_running:
                continue  # refused, and no request has released memory since: do not resume it in vain
            n = self._step_tokens(live)
            if n <= budget or not old:
                old.append(live)
                batch.append(live.req)
                budget -= n
        served: list[Live] = []
        refused = False
        if old:
            refusals = self._timed_prepare(batch)
            if not refusals:
                served = old
            else:
                refused = True
                unserved = {r.request_id for r in refusals}
                for live in old:
                    if live.req.request_id not in unserved:
                        served.append(live)
                        continue
                    live.retry_at = self.releases
                    if live in running:
                        t0 = _clock()
                        rm.suspend_resources(live.req)
                        self._step_manager_s += _clock() - t0
                        running.remove(live)
                        suspended.append(live)
                        self.result.preempted_suspend += 1
                        self.suspended_now = True
            for live in served if self.suspended else ():
                if live in self.suspended:
                    self.suspended.remove(live)
                    self.running.append(live)
                    self.result.resumed += 1
                    live.full_check = True
                    live.retry_at = -1
        if not refused and self.waiting and len(served) < o.max_batch:
            served += self._admit(budget, len(served), bool(self.running or self.suspended))
        return served

    def _admit(self, budget: int, batch_size: int, others: bool) -> list[Live]:
        """Admit waiting requests first come first served within the step's budget and batch and the
        GPU's room (the module doc); returns those served this step. Under ``--load-policy`` each is
        prepared as admitted (``prepare_loading``, planned at the step it is in, ``projected_step``):
        one waiting for its loads takes no share of this step's tokens or batch (it joins the first
        step after them in its place among the running requests); the first refused ends it."""
        o = self.opts
        rm = self.rm
        t0 = _clock()
        free = rm.get_num_free_blocks_per_pool_group()
        new: list[Live] = []
        served: list[Live] = []
        background = o.load_policy is not None
        if background:
            self._early += start_loading(rm, self.io)
        while self.waiting and batch_size + len(served) < o.max_batch:
            live = self.waiting[0]
            n = self._step_tokens(live)
            if n > budget and (batch_size or served):
                break
            need = rm.get_needed_resource_to_completion_per_pool_group(live.req)
            if (others or new) and not has_room(free, need, self.totals, o.watermark):
                break
            self.waiting.popleft()
            for g, k in enumerate(need):
                free[g] -= k
            if background:
                step = projected_step(rm, o, self.waiting, self._step_tokens, self.totals, budget - n, free)
                copied = prepare_loading(rm, self.io, self.cost, o.chunk, live, self.clock, step, len(self.waiting))
                if copied is None:
                    self.waiting.appendleft(live)
                    break
                self._copies_ms = max(self._copies_ms, copied)
                self._admitted(live)
            new.append(live)
            if live.ready_ms > self.clock:
                continue  # waiting for its loads: no share of this step (its memory is held)
            served.append(live)
            budget -= n
        self._step_manager_s += _clock() - t0
        if background or not new:
            return served
        unserved = {r.request_id for r in self._timed_prepare([x.req for x in new])}
        served = []
        for live in reversed(new):
            if live.req.request_id in unserved:
                self.waiting.appendleft(live)
        for live in new:
            if live.req.request_id not in unserved:
                served.append(live)
                self._admitted(live)
        return served

    def _admitted(self, live: Live) -> None:
        self.running.append(live)
        count_admission(self.result, live, self.clock, self.t)

    def _break_deadlock(self, suspended_now: bool) -> None:
        if suspended_now and self.num_levels > 1:
            return  # their pages can spill now: the next step resumes one of them instead
        holders = self.running + self.suspended
        if not holders:
            if self.waiting:  # alone and still refused (e.g. the resume utilisation limit)
                self._reject(self.waiting.popleft())
            return
        victim = max(holders, key=lambda x: x.sim.index)
        t0 = _clock()
        self.rm.free_resources(victim.req)
        self._step_manager_s += _clock() - t0
        (self.running if victim in self.running else self.suspended).remove(victim)
        self.waiting.appendleft(victim)
        self.releases += 1
        self.result.preempted_recompute += 1

    def _run_step(self, served: list[Live]) -> None:
        r = self.result
        cost = self.cost
        finished: list[Live] = []
        firsts: list[Live] = []  #: sampling their first output token
        checker = self.checker
        for live in served:
            req = live.req
            n = req.num_scheduled_tokens  # (> 0: the request is served)
            cached = req.num_cached_tokens
            if cached < live.prompt_length:
                r.prefill_computed += n
                cost.add_prefill(n, cached)
            else:  # (n > 1: generated tokens computed again after a recompute, or a match into outputs)
                r.decode_computed += n
                if n == 1:
                    cost.add_decode(cached)
                else:
                    cost.add_prefill(n, cached)
            if checker is not None:
                checker.step(req, live.tokens, live.full_check)
                live.full_check = False
            generated = req.generated_tokens
            if cached + n == live.prompt_length + len(generated):  # the step samples (samples_this_step)
                if not generated:
                    firsts.append(live)
                generated.append(TokenId(live.sim.output_base + len(generated)))
                if len(generated) >= req.max_new_tokens:
                    finished.append(live)
        ms = cost.take_ms()
        r.compute_ms += ms
        begin = self.clock
        ready = self._step_traffic()  # (its loads first: see _tier_io)
        if self._copies_ms > ready:  # (background loads: its requests' host copies)
            ready = self._copies_ms
        self._copies_ms = -1.0
        self.clock = ready + ms
        t0 = _clock()
        self.rm.update_resources([x.req for x in served])
        for live in finished:
            live.req.state = RequestState.FINISHED
            self.rm.free_resources(live.req, self.retain[live.sim.index] if self.retain is not None else None)
            if self.closing.wanted(live.sim):
                self.closing.closed(self.rm.manager, self.result, live)
        self._step_manager_s += _clock() - t0
        if self.count_manager_time:
            self.clock += self._step_manager_s * 1000.0
        end = self.clock  # the step's tokens are out
        for live in firsts:
            live.first_ms = end
            live.out.first_step_ms = end - begin
        r.request_steps += len(served)
        if len(served) > r.max_batch:
            r.max_batch = len(served)
        if finished:
            self.releases += 1
        for live in finished:
            self.running.remove(live)
            del self.live[live.sim.index]
            r.finished += 1
            r.output_tokens += len(live.req.generated_tokens)
            r.blocks_replayed += (live.req.num_tokens + self.t - 1) // self.t
            out = live.out
            k = len(live.req.generated_tokens)
            out.output_tokens = k
            out.ttft_ms = live.first_ms - live.arrival_ms
            out.tpot_ms = (end - live.first_ms) / (k - 1) if k > 1 else 0.0
            out.e2e_ms = end - live.arrival_ms
            r.outcomes.append(out)
            self._release_successors(live.sim.index)
        if finished:
            self._report_progress()

    def _sample(self) -> None:
        r = self.result
        used_total = 0
        cached_total = 0
        m = self.rm.manager
        for lvl in range(self.num_levels):
            stats = m.get_storage_statistics(CacheLevel(lvl))
            used = 0
            occupied = 0
            pinned = 0
            retained = 0
            for i, s in enumerate(stats):
                b = self.slot_bytes[i]
                taken = s.total - s.free
                used += (taken - s.evictable) * b
                occupied += taken * b
                if s.pinned:
                    pinned += s.pinned * b
                if s.retained:
                    retained += s.retained * b
            usage = r.levels[lvl]
            if pinned > usage.peak_pinned:
                usage.peak_pinned = pinned
            if retained > usage.peak_retained:
                usage.peak_retained = retained
            if used > usage.peak_used:
                usage.peak_used = used
            if lvl == 0:
                used_total = used
                cached_total = occupied - used
        cap = r.levels[0].capacity
        hit = r.reused_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        self._samples.extend((self.clock / 1000.0, used_total / cap, cached_total / cap, hit, float(len(self.running))))

    def _step_traffic(self) -> float:
        """The step's tier traffic (``take_iteration_stats``: since the previous step, read once its
        batch is prepared); returns when its loads are done (``_tier_io``; now without links)."""
        if self.num_levels == 1:
            return self.clock  # nothing moves between levels
        traffic = self.rm.manager.take_iteration_stats()
        for it in traffic:
            usage = self.result.levels[it.level]
            if it.offloaded_pages > usage.max_step_offloaded_pages:
                usage.max_step_offloaded_pages = it.offloaded_pages
            if it.onboarded_pages > usage.max_step_onboarded_pages:
                usage.max_step_onboarded_pages = it.onboarded_pages
        io = self.io
        if self._early:
            traffic = self._early + traffic
            self._early = []
        return step_links(self.rm.manager, io, self.clock, traffic) if io is not None else self.clock

    # ------------------------------------------------------------------ driver
    def run(self) -> ReplayResult:
        """Replay every request; returns the counters (the manager is shut down after)."""
        o = self.opts
        r = self.result
        for sim in self.requests:
            if sim.after >= 0:
                self.successors.setdefault(sim.after, []).append(sim.index)
            else:
                self._arrive(sim.index, sim.arrival_ms * o.time_scale)
        wall0 = _clock()
        try:
            while self.arrivals or self.waiting or self.running or self.suspended:
                self.advance()
        except BaseException:
            # the error is what the caller needs; the manager (maybe already shut down) lets its memory go
            with contextlib.suppress(Exception):
                self.rm.shutdown()
            raise
        r.wall_s = _clock() - wall0
        r.sim_time_ms = self.clock
        self._finish()
        return r

    def advance(self) -> None:
        """One iteration of the replay loop: admit arrivals, schedule, run the step."""
        r = self.result
        if not (self.waiting or self.running or self.suspended):
            self.clock = max(self.clock, self.arrivals[0][0])
        if 0 <= self.split_ms <= self.clock:
            self._split()
        self._admit_arrivals()
        self._step_manager_s = 0.0
        served = self._schedule()
        if not served:
            wake = woken(self.running, self.arrivals, self.clock)
            if wake > self.clock:  # every request it could serve waits for its loads
                self.clock = wake
            else:
                self._break_deadlock(self.suspended_now)
            r.manager_s += self._step_manager_s
            if self.count_manager_time:
                self.clock += self._step_manager_s * 1000.0
            return
        self._sample()  # after prepare: the step's pages are all allocated (its peak)
        self._run_step(served)
        r.steps += 1
        r.manager_s += self._step_manager_s
        self._samples.append(self._step_manager_s * 1e6)
        if len(self._samples) >= self._flush_at:
            add_samples(r, self._samples)
        if self.on_step is not None:
            self.on_step(self.rm)

    def _split(self) -> None:
        """``split_ms`` is reached: note the counters; with ``restart``, the engine restarts: every
        live request is freed (its committed blocks stay reusable) and queued again at the front, the
        manager is shut down and a new one opens the same configuration (a persistent disk tier's
        blocks come back)."""
        self.split_ms = -1.0
        r = self.result
        r.split_prompt_blocks = r.prompt_blocks
        r.split_hit_blocks = r.hit_blocks
        r.split_prompt_tokens = r.prompt_tokens
        r.split_reused_tokens = r.reused_tokens
        if not self.restart:
            return
        holders = self.running + self.suspended
        for live in holders:
            self.rm.free_resources(live.req)
            live.restarted = True
        self.waiting.extendleft(reversed(holders))
        self.releases += len(holders)
        self.running = []
        self.suspended = []
        self._collect()
        self.rm = KVCacheResourceManager(self.config)
        r.adopted_pages = self.rm.manager.num_adopted_pages
        if self.checker is not None:
            self.checker = DataChecker(self.rm)
            for live in holders:
                live.full_check = True

    def _collect(self) -> None:
        """Add the manager's counters to the result (they restart with a new manager) and shut it down."""
        add_manager_counters(self.result, self.rm.manager, self.checker)
        self.rm.shutdown()

    def _finish(self) -> None:
        add_samples(self.result, self._samples)
        add_request_times(self.result)
        if self.io is not None:
            self.result.io_wait_ms = self.io.load_ms
            self.result.io_write_stall_ms = self.io.write_stall_ms
            self.result.io_background_ms = self.io.background_ms
        if self.opts.load_policy is not None:
            self.result.load_plan = dataclasses.asdict(self.rm.manager.load_plan_statistics)
        if self.on_finish is not None:
            self.on_finish(self.rm)
        self._collect()
