"""A continuous-batching scheduler driving the resource-manager adapter and the paged engine.

Every step: running requests first (decode or their next prefill chunk), then suspended ones
(oldest first, resumed if memory allows), then waiting ones (FCFS), within a token budget and
a batch size. ``prepare_resources`` says who could not be served:

- a waiting request stays waiting (and admission stops for this step: FCFS);
- a running request is preempted by ``suspend_resources`` (its KV is kept; it is resumed
  by a later step's prepare once memory allows);
- if nobody at all could be served, the lowest-priority, latest request holding memory is
  preempted by ``free_resources`` and queued again: it is recomputed later, mostly from
  its own committed blocks, which stay reusable.

With ``admission="guaranteed"`` a waiting request is only admitted when, in every pool group,
the blocks all admitted requests still need to finish (``get_needed_resource_to_completion``)
plus its own fit in the free blocks: then no preemption should ever happen.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kv_cache_manager_v2 import TokenId
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

from .engine import PagedEngine
from .model import Array


@dataclass
class SchedulerStats:
    steps: int = 0
    admitted: int = 0
    finished: int = 0
    preempted_suspend: int = 0
    resumed: int = 0
    preempted_recompute: int = 0
    unserved_admissions: int = 0
    loading_steps: int = 0  #: steps that served nothing while loads were in flight
    prompt_tokens: int = 0  #: prompt tokens of first admissions
    reused_prompt_tokens: int = 0  #: of those, taken from the reuse tree
    computed_tokens: int = 0
    max_batch: int = 0
    needed_checks: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    @property
    def reuse_share(self) -> float:
        return self.reused_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    def __init__(
        self,
        adapter: KVCacheResourceManager,
        engine: PagedEngine,
        max_batch_size: int = 16,
        max_num_tokens: int = 64,
        admission: str = "optimistic",
        on_step: Callable[[Scheduler], None] | None = None,
    ) -> None:
        if admission not in ("optimistic", "guaranteed"):
            raise ValueError(f"admission must be 'optimistic' or 'guaranteed', got {admission!r}")
        self.adapter = adapter
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.admission = admission
        self.on_step = on_step
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.suspended: list[EngineRequest] = []
        self.finished: list[EngineRequest] = []
        self.logits: dict[int, list[Array]] = {}
        self.arrival: dict[int, int] = {}
        self.first_admission: set[int] = set()
        self.stats = SchedulerStats()

    def add(self, req: EngineRequest) -> None:
        self.arrival[req.request_id] = len(self.arrival)
        self.logits[req.request_id] = []
        self.waiting.append(req)
        self.adapter.prefetch_resources([req])  # its cached prefix comes up from disk meanwhile

    @property
    def done(self) -> bool:
        return not (self.waiting or self.running or self.suspended)

    def _step_tokens(self, r: EngineRequest) -> int:
        n = r.num_tokens - r.num_cached_tokens
        c = r.context_chunk_size
        return min(n, c) if c else n

    def _fits_to_completion(self, r: EngineRequest, admitting: list[EngineRequest]) -> bool:
        """Whether every pool group has room for all admitted requests, those being admitted and ``r`` to finish."""
        a = self.adapter
        free = a.get_num_free_blocks_per_pool_group()
        need = a.get_needed_resource_to_completion_per_pool_group(r)
        for other in self.running + self.suspended + admitting:
            for g, n in enumerate(a.get_needed_resource_to_completion_per_pool_group(other)):
                need[g] += n
        return all(n <= f for n, f in zip(need, free))

    def _build_batch(self) -> list[EngineRequest]:
        budget = self.max_num_tokens
        batch: list[EngineRequest] = []
        admitting: list[EngineRequest] = []
        for r in self.running + self.suspended:
            if len(batch) >= self.max_batch_size:
                break
            n = self._step_tokens(r)
            if n <= budget or not batch:
                batch.append(r)
                budget -= n
        for r in list(self.waiting):
            if len(batch) >= self.max_batch_size:
                break
            if self.adapter.is_loading(r):  # its prefix is still coming up from disk: the next ones go first
                continue
            n = self._step_tokens(r)
            if n > budget and batch:
                break
            if self.admission == "guaranteed" and not self._fits_to_completion(r, admitting):
                break
            self.waiting.remove(r)
            batch.append(r)
            admitting.append(r)
            budget -= n
        return batch

    def step(self) -> list[EngineRequest]:
        """One engine step; returns the requests that finished in it."""
        a = self.adapter
        batch = self._build_batch()
        was_suspended = {r.request_id for r in self.suspended}
        was_new = [r for r in batch if not a.has_resources(r)]
        unserved = a.prepare_resources(batch)
        unserved_ids = {r.request_id for r in unserved}
        # the new ones that got no memory go back to the front, in order
        for r in reversed([r for r in was_new if r.request_id in unserved_ids]):
            self.waiting.appendleft(r)
            self.stats.unserved_admissions += 1
        served = [r for r in batch if r.request_id not in unserved_ids]
        for r in was_new:
            if r.request_id not in unserved_ids and r.request_id not in self.first_admission:
                self.first_admission.add(r.request_id)
                self.stats.prompt_tokens += len(r.prompt_tokens)
                self.stats.reused_prompt_tokens += r.num_reused_tokens
                self.stats.admitted += 1
        for r in unserved:
            if r in self.running:  # could not grow: preempt, keeping its KV
                a.suspend_resources(r)
                self.running.remove(r)
                self.suspended.append(r)
                self.stats.preempted_suspend += 1
        for r in served:
            if r.request_id in was_suspended:
                self.suspended.remove(r)
                self.stats.resumed += 1
            if r not in self.running:
                self.running.append(r)
        self.stats.steps += 1
        if not served:
            if any(a.is_loading(r) for r in [*self.waiting, *self.suspended]):
                time.sleep(0.001)  # loads in flight: not a deadlock, they land soon
                self.stats.loading_steps += 1
                return []
            self._break_deadlock()
            return []
        self.stats.max_batch = max(self.stats.max_batch, len(served))
        self.stats.computed_tokens += sum(r.num_scheduled_tokens for r in served)
        if self.on_step is not None:
            self.on_step(self)
        logits = self.engine.forward(served)
        for r in served:
            if r.samples_this_step:
                lg = logits[r.request_id]
                self.logits[r.request_id].append(lg)
                r.generated_tokens.append(TokenId(int(np.argmax(lg))))
        a.update_resources(served)
        done = []
        for r in served:
            if len(r.generated_tokens) >= r.max_new_tokens:
                r.state = RequestState.FINISHED
                a.free_resources(r)
                self.running.remove(r)
                self.finished.append(r)
                done.append(r)
                self.stats.finished += 1
        return done

    def _break_deadlock(self) -> None:
        holders = self.running + self.suspended
        if not holders:
            if self.waiting:
                raise RuntimeError(
                    f"request {self.waiting[0].request_id} cannot be admitted even with all memory free: "
                    "the KV cache is too small for it"
                )
            return
        victim = min(holders, key=lambda r: (r.priority, -self.arrival[r.request_id]))
        self.adapter.free_resources(victim)
        (self.running if victim in self.running else self.suspended).remove(victim)
        self.waiting.appendleft(victim)
        self.stats.preempted_recompute += 1

    def run(self, max_steps: int = 100_000) -> None:
        while not self.done:
            if self.stats.steps >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps: {self.stats}")
            self.step()
