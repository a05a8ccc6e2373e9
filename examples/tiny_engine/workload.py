"""A serving workload with shared prefixes, run end to end and checked against the dense reference."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import ReuseScope, TokenId, TokenIdExt
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

from .engine import PagedEngine
from .model import TinyConfig, TinyModel
from .scheduler import Scheduler


@dataclass
class WorkloadParams:
    num_requests: int = 300
    seed: int = 0
    full_slots: int = 50  #: slots of each pool group holding a full-attention layer group
    swa_slots: int = 250  #: slots of each pool group holding only sliding-window layer groups
    max_batch_size: int = 24
    max_num_tokens: int = 64
    admission: str = "optimistic"
    arrivals_per_step: int = 3
    followup_prob: float = 0.15  #: per step: a new request continuing a running one's tokens
    num_prefixes: int = 6
    host_tier: bool = False  #: add a host tier 4x the GPU tier (evicted and suspended pages spill there)
    #: with the host tier: a disk tier 8x the GPU tier under a host tier of 1x (pages go down to disk,
    #: and come back through background loads: new and suspended requests wait in the loading state)
    disk_tier: bool = False
    swa_scratch: bool = False  #: SWA prefill scratch slots (out-of-window blocks of a step share a few slots)
    #: hybrid models: GPU room for this many recurrent states (live slots and snapshots) besides the KV
    state_slots: int = 80
    ssm_reuse_interval: int | None = None  #: hybrid models: tokens between state snapshots (None: default)
    ssm_snapshot_policy: kvm.SnapshotPolicy = "interval"  #: hybrid models: which snapshots requests keep
    #: hybrid models, "auto" with the host tier: tokens between the snapshots written there (None: from bytes)
    ssm_lower_tier_interval: int | None = None


@dataclass
class WorkloadResult:
    model: TinyModel
    adapter: KVCacheResourceManager
    scheduler: Scheduler
    requests: list[EngineRequest] = field(default_factory=list)
    followups: dict[int, int] = field(default_factory=dict)  #: request id -> the request it continues


def make_adapter(cfg: TinyConfig, p: WorkloadParams) -> KVCacheResourceManager:
    """An adapter whose pool groups get ``full_slots`` (groups with full attention) or ``swa_slots`` slots."""
    t = cfg.tokens_per_block
    layer_groups: dict[tuple[int | None, int], int] = {}  # (window, sink blocks) -> layers
    for spec in cfg.layers:
        if not spec.has_attention:
            continue
        key = (spec.window, -(-spec.sink_tokens // t) if spec.window is not None else 0)
        layer_groups[key] = layer_groups.get(key, 0) + 1
    groups: dict[int, bool] = {}  # slot bytes -> has full attention (first-seen order = pool group order)
    for (window, _), n in layer_groups.items():  # attention layers only (see below for recurrent ones)
        size = 2 * cfg.kv_page_bytes * n
        groups[size] = groups.get(size, False) or window is None
    ratio = [size * (p.full_slots if full else p.swa_slots) for size, full in groups.items()]
    if cfg.recurrent_layers:  # the state pool group too: ask a throwaway manager for the order and sizes
        ratio = _hybrid_pool_bytes(cfg, p)
    total = sum(ratio)
    tiers: list[kvm.GpuCacheTierConfig | kvm.HostCacheTierConfig | kvm.DiskCacheTierConfig] = [
        kvm.GpuCacheTierConfig(total)
    ]
    if p.host_tier:
        tiers.append(kvm.HostCacheTierConfig((1 if p.disk_tier else 4) * total))
    if p.disk_tier:
        tiers.append(kvm.DiskCacheTierConfig(8 * total, tempfile.gettempdir()))  # (files unlinked at once)
    mgr_cfg = kvm.KVCacheManagerConfig(
        tokens_per_block=t,
        cache_tiers=tiers,
        layers=cfg.layer_configs(),
        initial_pool_ratio=[r / total for r in ratio],
        swa_scratch_reuse=kvm.SwaScratchReuseConfig() if p.swa_scratch else None,
        backend="host",
        ssm_reuse_interval=p.ssm_reuse_interval,
        ssm_snapshot_policy=p.ssm_snapshot_policy,
        ssm_lower_tier_interval=p.ssm_lower_tier_interval,
    )
    return KVCacheResourceManager(mgr_cfg)


def _hybrid_pool_bytes(cfg: TinyConfig, p: WorkloadParams) -> list[int]:
    """Bytes per pool group of a hybrid model, in the manager's pool-group order: ``state_slots``
    slots for the recurrent states, ``full_slots`` for a group with full attention, else
    ``swa_slots`` (the manager's default split would size the states for 4096-token requests)."""
    probe = kvm.KVCacheManager(
        kvm.KVCacheManagerConfig(
            tokens_per_block=cfg.tokens_per_block,
            cache_tiers=[kvm.GpuCacheTierConfig(1 << 24)],
            layers=cfg.layer_configs(),
            backend="host",
        )
    )
    try:
        descs = probe.pool_group_descs
        slots = [p.swa_slots] * len(descs)
        for g in range(probe.num_layer_groups):
            info = probe.get_layer_group_info(kvm.LayerGroupId(g))
            if info.kind == "recurrent":
                slots[info.pool_group_index] = p.state_slots
            elif info.window_size is None:
                slots[info.pool_group_index] = p.full_slots
        return [n * sum(pool.slot_bytes for pool in d.pools) for n, d in zip(slots, descs)]
    finally:
        probe.shutdown()


def _prompt(rng: random.Random, prefixes: list[list[TokenIdExt]], vocab: int) -> list[TokenIdExt]:
    pre = prefixes[rng.randrange(len(prefixes))]
    cut = len(pre) if rng.random() < 0.7 else rng.randrange(1, len(pre) + 1)  # partial prefixes too
    return pre[:cut] + [TokenId(rng.randrange(vocab)) for _ in range(rng.choice([0, 1, 3, 5, 9, 14]))]


def run_workload(
    cfg: TinyConfig, p: WorkloadParams, observer: Callable[[Scheduler], None] | None = None
) -> WorkloadResult:
    """Run ``p.num_requests`` requests to completion; ``observer`` sees every step after prepare."""
    rng = random.Random(p.seed)
    model = TinyModel(cfg)
    adapter = make_adapter(cfg, p)
    engine = PagedEngine(model, adapter)
    prefixes: list[list[TokenIdExt]] = [
        [TokenId(rng.randrange(cfg.vocab_size)) for _ in range(rng.randrange(6, 41))] for _ in range(p.num_prefixes)
    ]
    requests: list[EngineRequest] = []
    followups: dict[int, int] = {}

    def new_request(prompt: list[TokenIdExt]) -> EngineRequest:
        salt = 1 if rng.random() < 0.1 else None
        r = EngineRequest(
            len(requests),
            prompt,
            max_new_tokens=rng.choice([1, 2, 4, 8, 12, 16]),
            context_chunk_size=rng.choice([0, 5, 8, 16]),
            reuse_scope=ReuseScope(salt=salt) if salt is not None else None,
            priority=rng.choice([35, 35, 35, 20, 60]),
        )
        requests.append(r)
        return r

    def on_step(s: Scheduler) -> None:
        # reuse during generation: continue a request that is still decoding
        if len(requests) < p.num_requests and rng.random() < p.followup_prob:
            gen = [r for r in s.running if r.state is RequestState.GENERATION and r.generated_tokens]
            if gen:
                src = gen[rng.randrange(len(gen))]
                r = new_request(src.all_tokens() + [TokenId(rng.randrange(cfg.vocab_size))])
                followups[r.request_id] = src.request_id
                s.add(r)
        if observer is not None:
            observer(s)

    sched = Scheduler(adapter, engine, p.max_batch_size, p.max_num_tokens, p.admission, on_step)
    while len(requests) < p.num_requests or not sched.done:
        for _ in range(p.arrivals_per_step):
            if len(requests) < p.num_requests:
                sched.add(new_request(_prompt(rng, prefixes, cfg.vocab_size)))
        if sched.stats.steps > 50 * p.num_requests:
            raise RuntimeError(f"workload not done after {sched.stats.steps} steps: {sched.stats}")
        sched.step()
    return WorkloadResult(model, adapter, sched, requests, followups)


def check_against_dense(res: WorkloadResult, atol: float = 1e-5) -> float:
    """Every request's greedy tokens and logits equal the dense reference; returns the max logit error."""
    worst = 0.0
    for r in res.requests:
        assert r.state is RequestState.FINISHED, r
        ref = res.model.dense_logits(r.all_tokens()[:-1])
        got = res.scheduler.logits[r.request_id]
        assert len(got) == len(r.generated_tokens) == r.max_new_tokens, (r, len(got))
        p = len(r.prompt_tokens)
        for i, lg in enumerate(got):
            want = ref[p - 1 + i]
            err = float(np.max(np.abs(lg - want)))
            worst = max(worst, err)
            if err > atol:
                raise AssertionError(f"request {r.request_id} token {i}: logits differ by {err:.3g}")
            if int(np.argmax(want)) != int(r.generated_tokens[i]):
                raise AssertionError(f"request {r.request_id} token {i}: greedy token differs from the dense reference")
    return worst
