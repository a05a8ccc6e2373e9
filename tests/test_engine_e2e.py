"""End to end: a tiny numpy transformer whose attention reads and writes K/V only through the pages
the adapter hands out, driven by a continuous-batching scheduler under memory pressure, must
produce exactly the dense reference's greedy tokens and logits for every request."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

from kv_cache_manager_v2 import BAD_PAGE_INDEX, CacheLevel, KVCache, LayerGroupId, LayerId, PageIndexMode
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from tiny_engine.model import TinyConfig
from tiny_engine.scheduler import Scheduler
from tiny_engine.workload import WorkloadParams, check_against_dense, run_workload


def held_slots(a: KVCacheResourceManager, reqs: list[EngineRequest]) -> list[int]:
    """Distinct GPU slots the requests' caches hold, per pool group: their pages in GPU memory (the
    pages themselves: a suspended cache's indices read -1, since with lower tiers its pages may move)
    and the step's scratch slots."""
    slots: list[set[int]] = [set() for _ in a.get_max_resource_count_per_pool_group()]
    groups = a.layer_group_pool_groups
    for r in reqs:
        kv = a.get_kv_cache(r)
        for p in kv.block_table.all_pages():
            if p.level == 0:
                slots[p.storage.index].add(p.slot)
        for lg, g in enumerate(groups):
            desc = kv.get_scratch_desc(LayerGroupId(lg))
            if desc is not None:
                slots[g].update(desc.slot_ids)
    return [len(s) for s in slots]


def spilled_pages(a: KVCacheResourceManager, reqs: list[EngineRequest]) -> int:
    return sum(1 for r in reqs for p in a.get_kv_cache(r).block_table.all_pages() if p.level > 0)


class Auditor:
    """Checks, every step after prepare, what the adapter reports against what the manager holds."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        # request id -> (cache, peak it was said to reach, highest seen), per pool group
        self.tracked: dict[int, tuple[KVCache, list[int], list[int]]] = {}
        self.steps = 0
        self.swa_released = 0
        self.scratch_steps = 0  #: (request, step) pairs with scratch slots
        self.spilled = 0  #: steps where a suspended request had pages below the GPU tier
        self.lower_peaks = 0  #: requests that peaked below their needed-to-completion (scratch)

    def __call__(self, s: Scheduler) -> None:
        a = s.adapter
        self.steps += 1
        lower_tiers = len(a.manager.cache_tier_list) > 1
        # a suspended request's GPU pages are available when lower tiers can take them (plenty here)
        holders = s.running if lower_tiers else s.running + s.suspended
        total = a.get_max_resource_count_per_pool_group()
        free = a.get_num_free_blocks_per_pool_group()
        # every slot that is not available is one some request holds
        assert [t - f for t, f in zip(total, free)] == held_slots(a, holders)
        assert a.get_num_free_blocks() == sum(free) and a.get_max_resource_count() == sum(total)
        self.spilled += spilled_pages(a, s.suspended) > 0
        for r in s.running:
            if not r.num_scheduled_tokens:
                continue
            kv = a.get_kv_cache(r)
            held = held_slots(a, [r])
            self.scratch_steps += kv.has_scratch_slots
            entry = self.tracked.get(r.request_id)
            if entry is None or entry[0] is not kv:  # first step of this admission
                need = a.get_needed_resource_to_completion_per_pool_group(r)
                self.tracked[r.request_id] = (kv, [n + h for n, h in zip(need, held)], held)
            else:
                self.tracked[r.request_id] = (kv, entry[1], [max(x, h) for x, h in zip(entry[2], held)])
            t = self.cfg.tokens_per_block
            for lg, layer_ids in enumerate(a.manager.layer_grouping):
                spec = self.cfg.layers[layer_ids[0]]
                if spec.window is None:
                    continue
                idx = kv.get_base_page_indices(LayerGroupId(lg))
                sink_blocks = -(-spec.sink_tokens // t)
                below_window = range(sink_blocks, max(0, (r.num_cached_tokens + 1 - spec.window) // t))
                if len(below_window):
                    assert all(idx[o] == BAD_PAGE_INDEX for o in below_window)  # released by the manager
                    self.swa_released += 1

    def check_peaks(self, exact: bool = True) -> int:
        """Needed-to-completion at admission vs the peak seen; returns how many peaked lower (an
        upper bound is all that is promised with scratch slots)."""
        lower = 0
        for rid, (_, said, seen) in self.tracked.items():
            if exact:
                assert seen == said, f"request {rid}: needed-to-completion said the peak is {said}, it was {seen}"
            else:
                assert all(x <= y for x, y in zip(seen, said)), f"request {rid}: peak {seen} above the bound {said}"
            lower += seen != said
        return lower


def run_and_check(p: WorkloadParams) -> tuple[Any, Auditor]:
    cfg = TinyConfig()
    audit = Auditor(cfg)
    res = run_workload(cfg, p, audit)
    check_against_dense(res)
    audit.lower_peaks = audit.check_peaks(exact=not p.swa_scratch)
    assert len(audit.tracked) == p.num_requests
    a = res.adapter
    assert a.num_requests == 0 and a.manager.num_open_caches == 0
    a.manager.clear_reusable_blocks()
    assert a.get_num_free_blocks() == a.get_max_resource_count()
    return res, audit


def test_end_to_end_under_memory_pressure_equals_the_dense_reference() -> None:
    p = WorkloadParams(num_requests=300)
    res, audit = run_and_check(p)
    st = res.scheduler.stats
    try:
        assert all(r.state is RequestState.FINISHED for r in res.requests)
        assert st.preempted_suspend > 0 and st.resumed > 0
        assert st.reuse_share > 0.3, st.reuse_share
        assert audit.swa_released > 0
        t = res.model.cfg.tokens_per_block
        assert any(r.num_reused_tokens % t for r in res.requests)  # partial-block reuse happened
        # reuse during generation: a follow-up reused tokens its source generated
        by_id = {r.request_id: r for r in res.requests}
        assert any(by_id[f].num_reused_tokens > len(by_id[src].prompt_tokens) for f, src in res.followups.items()), (
            res.followups
        )
    finally:
        res.adapter.shutdown()


def test_end_to_end_with_a_host_tier_equals_the_dense_reference() -> None:
    """Suspended requests' pages spill to the host tier while others run, and come back on resume
    (prepare_resources) with their data; evicted reusable blocks are reused from host."""
    res, audit = run_and_check(WorkloadParams(num_requests=200, seed=4, host_tier=True))
    try:
        st = res.scheduler.stats
        assert st.preempted_suspend > 0 and st.resumed > 0
        assert audit.spilled > 0  # some suspended request had pages in host memory at some step
        host = res.adapter.manager.get_tier_statistics(CacheLevel(1))
        assert host.offloaded_pages > 0 and host.onboarded_pages > 0
        assert any(r.num_reused_tokens_per_level[1] for r in res.requests)  # reuse straight from host
    finally:
        res.adapter.shutdown()


def test_end_to_end_with_a_disk_tier_and_background_loads_equals_the_dense_reference() -> None:
    """Host 1x and disk 8x: pages go down to disk; new requests' prefixes and suspended requests'
    pages come back through background loads (the loading state) while others run."""
    res, _ = run_and_check(WorkloadParams(num_requests=200, seed=4, host_tier=True, disk_tier=True))
    try:
        a = res.adapter
        disk = a.manager.get_tier_statistics(CacheLevel(2))
        assert disk.offloaded_pages > 0 and disk.onboarded_pages > 0
        reads = a.manager._ctx.reads
        assert reads is not None and reads.num_installed > 0  # loaded in the background
        assert a.loading_requests["disk"] > 0
    finally:
        res.adapter.shutdown()


def test_end_to_end_with_swa_scratch_equals_the_dense_reference() -> None:
    """Prefill steps whose early blocks leave the window put them in shared scratch slots; the engine
    addresses them through get_kernel_page_indices (the ScratchDesc); needed-to-completion stays an
    upper bound (scratch steps take fewer slots)."""
    res, audit = run_and_check(WorkloadParams(num_requests=150, seed=5, swa_scratch=True))
    try:
        assert audit.scratch_steps > 0 and audit.lower_peaks > 0
        assert res.scheduler.stats.preempted_suspend > 0 and res.scheduler.stats.resumed > 0
    finally:
        res.adapter.shutdown()


def test_guaranteed_admission_never_preempts() -> None:
    """Admitting only what fits to completion (per pool group) must never need a preemption."""
    res, _ = run_and_check(WorkloadParams(num_requests=150, seed=1, admission="guaranteed"))
    try:
        st = res.scheduler.stats
        assert st.preempted_suspend == 0 and st.preempted_recompute == 0 and st.unserved_admissions == 0
        assert st.max_batch > 4
    finally:
        res.adapter.shutdown()


def test_writes_through_get_buffers_are_read_by_the_engine() -> None:
    """The adapter's pool view aliases the memory the engine attends over: corrupting one cached
    key of a decoding request through it changes that request's logits."""
    cfg = TinyConfig()
    corrupted: list[int] = []

    def corrupt(s: Scheduler) -> None:
        if corrupted:
            return
        for r in s.running:
            if (
                r.state is RequestState.GENERATION
                and r.num_scheduled_tokens
                and len(r.generated_tokens) + 2 < r.max_new_tokens
            ):
                a = s.adapter
                view = a.get_buffers(LayerId(0), "key", np.float64, cfg.kv_page_shape)
                engine_view = s.engine.buffers[0].views["key"]
                assert view.ctypes.data == engine_view.ctypes.data and view.shape == engine_view.shape
                page = a.get_kernel_page_indices(r, LayerId(0), "key", PageIndexMode.PER_LAYER)[0]
                view[page, 0] += 1.0  # position 0: every full-attention query reads it
                addr = a.manager.get_mem_pool_base_address(LayerId(0), "key", PageIndexMode.PER_LAYER)
                got = np.frombuffer(
                    a.manager.backend.read(addr + page * a.manager.get_page_stride(LayerId(0), "key"), 8)
                )
                assert got[0] == engine_view[page, 0, 0, 0]
                corrupted.append(r.request_id)
                return

    res = run_workload(cfg, WorkloadParams(num_requests=30, seed=3, followup_prob=0.0), corrupt)
    try:
        assert corrupted
        with pytest.raises(AssertionError, match="logits differ"):
            check_against_dense(res)
    finally:
        res.adapter.shutdown()
