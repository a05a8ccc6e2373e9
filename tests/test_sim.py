"""The simulator's replay: the LRU oracle on the Mooncake trace, workloads, the scheduler under pressure,
data checks, and that the proxy-sized manager has the real shape's slot counts."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from conftest import SHARED_TRACE, TRACES, trace_id

from kv_cache_manager_v2 import KVCacheManager, KVCacheManagerConfig, SsmLayerConfig
from kv_cache_manager_v2.engine import KVCacheResourceManager
from kv_cache_manager_v2.sim import (
    PRESETS,
    ConversationParams,
    SchedulerOptions,
    SimUserError,
    TierSpec,
    generate_conversations,
    load_trace,
    model_shape,
    simulate,
)
from kv_cache_manager_v2.sim._check import DataChecker, DataCheckError
from kv_cache_manager_v2.sim._models import (
    ModelShape,
    manager_config,
    parse_quota,
    proxy_page_bytes,
)
from kv_cache_manager_v2.sim._replay import Replay
from kv_cache_manager_v2.sim._workload import SimRequest

ONE_AT_A_TIME = SchedulerOptions(max_batch=1, time_scale=0.0, prompt_only=True)
SMALL = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token
SWA = ModelShape("swa", 4, 2, 16, "fp16", window=48, swa_every=2, sinks=4)


def gpu(tokens: int, shape: ModelShape = SMALL) -> list[TierSpec]:
    return [TierSpec("gpu", tokens * shape.bytes_per_token, f"{tokens}tok")]


def lru_hit_rate(records: list[dict[str, Any]], capacity_blocks: int) -> float:
    """Plain LRU over 512-token prefix blocks (traces/README.md): a block hits when its whole prefix was seen."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for rec in records:
        keys = []
        pid = 0
        for h in rec["hash_ids"]:
            pid = hash((pid, h))
            keys.append(pid)
        n = 0
        while n < len(keys) and keys[n] in cache:
            n += 1
        hits += n
        total += len(keys)
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits / total


@pytest.mark.parametrize("trace", TRACES, ids=trace_id)
@pytest.mark.parametrize("capacity_tokens", [200_000, 1_000_000, 10**8])
def test_trace_hit_rate_matches_plain_lru(capacity_tokens: int, trace: str) -> None:
    """Oracle: one request at a time, 512-token blocks, prompts only, one GPU tier of a token capacity."""
    n = 700
    with open(trace) as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    expected = lru_hit_rate(records, capacity_tokens // 512)
    reqs = load_trace(trace, n)
    rep = simulate(SMALL, gpu(capacity_tokens), 512, reqs, {}, ONE_AT_A_TIME)
    assert rep["requests"]["finished"] == n
    assert abs(rep["hit_rate"]["blocks"] - expected) <= 0.01, (rep["hit_rate"], expected)
    assert rep["prefill"]["prompt_blocks"] == sum(len(r["hash_ids"]) for r in records)
    if capacity_tokens < 10**8:
        assert rep["tiers"][0]["dropped_pages"] > 0
    else:
        assert rep["tiers"][0]["dropped_pages"] == 0


def test_trace_tokens_are_equal_for_equal_ids(tmp_path: Any) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [5, 9]}\n\n'
        '{"timestamp": 10, "input_length": 600, "output_length": 0, "hash_ids": [5, 7]}\n'
    )
    a, b = load_trace(str(path))
    pa, pb = a.prompt_tokens(), b.prompt_tokens()
    assert len(pa) == 700 and len(pb) == 600
    assert pa[:512] == pb[:512] and pa[512] != pb[512]
    assert list(pa[:3]) == [5 * 512, 5 * 512 + 1, 5 * 512 + 2]
    assert b.output_length == 1 and b.source_line == 3  # output 0: the prefill still samples one token
    assert min(a.output_base, b.output_base) >= 1 << 31 and a.output_base != b.output_base


def test_multi_turn_reuses_the_previous_answer() -> None:
    """Without memory pressure, turn k+1 reuses everything turn k computed: its prompt and all of its answer
    but the last token (sampled, never computed), the partial last block included."""
    params = ConversationParams(conversations=3, turns=3, system_prompts=1, system_tokens=100, seed=3)
    reqs = generate_conversations(params)
    by_index = {r.index: r for r in reqs}
    reused: dict[int, int] = {}
    holder: list[Replay] = []

    def snoop(rm: KVCacheResourceManager) -> None:  # every admitted request runs at least one step
        rm.manager.check_invariants()
        for live in holder[0].running:
            reused.setdefault(live.sim.index, live.req.num_reused_tokens)

    config = manager_config(SMALL, 16, gpu(1 << 20), False, proxy_page_bytes(16, False))
    replay = Replay(config, reqs, SchedulerOptions(), on_step=snoop)
    holder.append(replay)
    result = replay.run()
    assert result.finished == len(reqs) and result.preempted_recompute == 0
    followers = [r for r in reqs if r.after >= 0]
    assert followers
    for r in followers:
        prev = by_index[r.after]
        assert reused[r.index] == prev.prompt_length + prev.output_length - 1
    firsts = [r for r in reqs if r.after < 0]
    system_length = firsts[0].prompt_segments[0][1]
    assert all(reused[r.index] == system_length for r in firsts[1:])  # the shared system prompt


def test_generator_is_deterministic_and_respects_limit() -> None:
    p = ConversationParams(conversations=20, seed=7)
    a = generate_conversations(p)
    b = generate_conversations(p)
    assert [(r.arrival_ms, r.prompt_length, r.output_length, r.after) for r in a] == [
        (r.arrival_ms, r.prompt_length, r.output_length, r.after) for r in b
    ]
    assert all(r.after < r.index for r in a)
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)
    cut = generate_conversations(p, 10)
    assert len(cut) == 10 and all(r.after < 10 for r in cut)
    with pytest.raises(SimUserError, match="--rate"):
        generate_conversations(ConversationParams(rate=0))


def test_no_reuse_computes_every_prompt_token() -> None:
    reqs = generate_conversations(ConversationParams(conversations=10, seed=1))
    on = simulate(SMALL, gpu(1 << 20), 16, reqs, {}, SchedulerOptions())
    off = simulate(SMALL, gpu(1 << 20), 16, reqs, {}, SchedulerOptions(reuse=False))
    assert on["hit_rate"]["tokens"] > 0.3
    assert off["hit_rate"]["tokens"] == 0.0 and off["prefill"]["reused_tokens"] == 0
    assert off["prefill"]["computed_tokens"] == off["prefill"]["prompt_tokens"]
    assert on["prefill"]["computed_tokens"] + on["prefill"]["reused_tokens"] == on["prefill"]["prompt_tokens"]


def _checked_replay(
    shape: ModelShape, tokens: int, reqs: list[SimRequest], opts: SchedulerOptions, scratch: bool = False
) -> Any:
    config = manager_config(shape, 16, gpu(tokens, shape), scratch, proxy_page_bytes(16, True))
    steps = [0]

    def audit(rm: KVCacheResourceManager) -> None:
        steps[0] += 1
        if steps[0] % 7 == 0:
            rm.manager.check_invariants()

    return Replay(config, reqs, opts, check_data=True, on_step=audit).run()


@pytest.mark.parametrize(("shape", "capacity"), [(SMALL, 1200), (SWA, 700)], ids=["full", "swa"])
def test_pressure_preempts_and_data_stays_correct(shape: ModelShape, capacity: int) -> None:
    """A GPU tier far too small for the offered load, no admission watermark: requests are suspended and
    freed for recompute, some are resumed, all finish, and every page holds the right tokens."""
    params = ConversationParams(
        conversations=14, turns=2, system_prompts=2, system_tokens=200, user_tokens=150, output_tokens=60, seed=5
    )
    reqs = generate_conversations(params)
    opts = SchedulerOptions(max_batch=16, max_num_tokens=256, chunk=64, watermark=0.0, time_scale=0.0)
    r = _checked_replay(shape, capacity, reqs, opts)
    assert r.finished == len(reqs) and r.rejected == 0
    assert r.preempted_suspend > 0 and r.preempted_recompute > 0 and r.resumed > 0
    assert r.readmissions > 0 and r.records_checked > 0
    assert r.levels[0].peak_used <= r.levels[0].capacity


def host(tokens: int, shape: ModelShape = SMALL) -> list[TierSpec]:
    return [TierSpec("host", tokens * shape.bytes_per_token, f"{tokens}tok")]


def test_a_host_tier_raises_the_hit_rate() -> None:
    """Same workload and GPU: blocks evicted from the GPU fall to host and are reused from there."""
    reqs = generate_conversations(ConversationParams(conversations=40, turns=3, system_prompts=3, seed=2))
    opts = SchedulerOptions(max_batch=32, chunk=512)
    alone = simulate(SMALL, gpu(12_000), 16, reqs, {}, opts)
    tiered = simulate(SMALL, gpu(12_000) + host(200_000), 16, reqs, {}, opts)
    assert tiered["hit_rate"]["blocks"] > alone["hit_rate"]["blocks"] + 0.1, (alone["hit_rate"], tiered["hit_rate"])
    assert alone["hit_rate"]["by_tier"] == {"gpu": alone["hit_rate"]["blocks"]}
    by_tier = tiered["hit_rate"]["by_tier"]
    assert set(by_tier) == {"gpu", "host"} and by_tier["host"] > 0.1
    assert sum(by_tier.values()) == pytest.approx(tiered["hit_rate"]["blocks"])
    assert sum(tiered["hit_rate"]["tokens_by_tier"].values()) == pytest.approx(tiered["hit_rate"]["tokens"])
    g, h = tiered["tiers"]
    assert alone["tiers"][0]["dropped_pages"] > 0 and g["dropped_pages"] == 0  # everything went down to host
    assert h["offloaded_pages"] > 0 and h["onboarded_pages"] > 0 and g["offloaded_pages"] == g["onboarded_pages"] == 0
    assert h["onboarded_bytes"] == h["onboarded_pages"] * SMALL.bytes_per_token * 16
    assert 0 < h["max_step_onboarded_pages"] <= h["onboarded_pages"]
    assert 0 < h["max_step_offloaded_pages"] <= h["offloaded_pages"]
    assert 0 < h["peak_occupied_fraction"] <= 1.0 and h["io_errors"] == 0


@pytest.mark.parametrize("trace", TRACES, ids=trace_id)
def test_trace_with_a_host_tier_matches_lru_over_both_tiers(trace: str) -> None:
    """One request at a time, reusable blocks only: GPU + host behave like one LRU of both capacities."""
    n = 700
    with open(trace) as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    rep = simulate(SMALL, gpu(1_000_000) + host(2_000_000), 512, load_trace(trace, n), {}, ONE_AT_A_TIME)
    assert abs(rep["hit_rate"]["blocks"] - lru_hit_rate(records, 3_000_000 // 512)) <= 0.01, rep["hit_rate"]
    # the GPU holds the most recent 1M tokens: what it serves is what an LRU of 1M tokens would hit
    assert abs(rep["hit_rate"]["by_tier"]["gpu"] - lru_hit_rate(records, 1_000_000 // 512)) <= 0.01, rep["hit_rate"]
    assert rep["hit_rate"]["by_tier"]["host"] > 0.01


@pytest.mark.parametrize("shape", [SMALL, SWA], ids=["full", "swa"])
def test_suspended_requests_spill_to_host_instead_of_recomputing(shape: ModelShape) -> None:
    """The pressure workload of the test above, with a host tier: suspending frees GPU memory (the
    pages move to host and come back on resume with their data), so nothing is recomputed."""
    params = ConversationParams(
        conversations=14, turns=2, system_prompts=2, system_tokens=200, user_tokens=150, output_tokens=60, seed=5
    )
    reqs = generate_conversations(params)
    opts = SchedulerOptions(max_batch=16, max_num_tokens=256, chunk=64, watermark=0.0, time_scale=0.0)
    capacity = 1200 if shape is SMALL else 700
    config = manager_config(shape, 16, gpu(capacity, shape) + host(20_000, shape), False, proxy_page_bytes(16, True))
    r = Replay(config, reqs, opts, check_data=True, on_step=lambda rm: rm.manager.check_invariants()).run()
    assert r.finished == len(reqs) and r.records_checked > 0
    assert r.preempted_suspend > 0 and r.resumed == r.preempted_suspend and r.preempted_recompute == 0
    assert r.levels[1].peak_used > 0  # suspended requests' pages were held in the host tier
    assert r.levels[1].onboarded_pages > 0 and r.levels[0].dropped_pages == 0


def test_a_step_that_suspends_everyone_recomputes_nobody_with_a_host_tier() -> None:
    """Two requests cross a block boundary in the same step with the GPU full: both are suspended.
    GPU-only, one of them must be freed and recomputed; with a host tier the next step resumes one
    (the other's pages move to host) and the other follows when memory comes back."""
    reqs = [
        SimRequest(0, 0.0, [(1, 32)], 32, 64, 1 << 31),
        SimRequest(1, 1.0, [(5000, 33)], 33, 40, (1 << 31) + 1000),  # admitted a step later, one token longer
    ]
    opts = SchedulerOptions(watermark=0.0)
    out = []
    for tiers in (gpu(128), gpu(128) + host(4096)):
        config = manager_config(SMALL, 16, tiers, False, proxy_page_bytes(16, True))
        out.append(Replay(config, reqs, opts, check_data=True).run())
    alone, tiered = out
    assert alone.finished == tiered.finished == 2
    assert alone.preempted_recompute == 1 and alone.readmissions == 1
    assert tiered.preempted_recompute == 0 and tiered.preempted_suspend == tiered.resumed == 2
    assert tiered.levels[1].offloaded_pages > 0 and tiered.records_checked > 0


def test_swa_scratch_lowers_peak_memory_and_keeps_data() -> None:
    shape = ModelShape("swa", 4, 2, 16, "fp16", window=32, swa_every=2)
    reqs = [SimRequest(i, 0.0, [(1000 * i + 1, 900)], 900, 4, (1 << 31) + 100 * i) for i in range(3)]
    opts = SchedulerOptions(max_batch=1, chunk=512, time_scale=0.0)
    plain = _checked_replay(shape, 4096, reqs, opts)
    scratch = _checked_replay(shape, 4096, reqs, opts, scratch=True)
    assert plain.finished == scratch.finished == 3
    assert scratch.levels[0].peak_used < plain.levels[0].peak_used
    assert scratch.layer_by_layer_steps > 0 and plain.layer_by_layer_steps == 0


@pytest.mark.parametrize("vectorized", [True, False], ids=["by-layer-group", "layer-by-layer"])
def test_checker_catches_a_wrong_record(vectorized: bool) -> None:
    config = manager_config(SMALL, 16, gpu(4096), False, proxy_page_bytes(16, True))
    reqs = [SimRequest(0, 0.0, [(1, 100)], 100, 5, 1 << 31), SimRequest(1, 1.0, [(1, 100)], 100, 5, (1 << 31) + 99)]
    holder: list[Replay] = []

    def damage(rm: KVCacheResourceManager) -> None:
        # damage request 0's page at position 40 after its prefill wrote it: its decode steps do not
        # look there, but request 1 reuses the block and checks it in full at its first step
        for live in holder[0].running:
            if live.sim.index == 0 and live.req.num_cached_tokens == 100:
                checker = holder[0].checker
                assert isinstance(checker, DataChecker)
                checker.corrupt(live.req, 40)

    replay = Replay(config, reqs, SchedulerOptions(max_batch=1, time_scale=1.0), check_data=True, on_step=damage)
    holder.append(replay)
    assert isinstance(replay.checker, DataChecker) and replay.checker.vectorized
    replay.checker.vectorized = vectorized  # False: the path steps with scratch blocks take
    with pytest.raises(DataCheckError, match="position 40"):
        replay.run()


def test_too_long_requests_are_rejected_others_finish() -> None:
    reqs = [
        SimRequest(0, 0.0, [(1, 300)], 300, 10, 1 << 31),
        SimRequest(1, 1.0, [(5000, 5000)], 5000, 10, (1 << 31) + 100),
        SimRequest(2, 2.0, [(1, 200)], 200, 10, (1 << 31) + 200),
    ]
    rep = simulate(SMALL, gpu(1024), 16, reqs, {}, SchedulerOptions())
    assert rep["requests"] == {
        "total": 3,
        "finished": 2,
        "rejected": 1,
        "rejected_examples": [1],
        "rejected_prompt_tokens": 5000,
    }
    hit = rep["hit_rate"]  # the rejected prompt is a miss over all requests
    assert hit["tokens_all_requests"] == pytest.approx(rep["prefill"]["reused_tokens"] / 5500)
    assert hit["blocks_all_requests"] == pytest.approx(rep["prefill"]["hit_blocks"] / (19 + 13 + 313))
    load = rep["load"]
    assert load["longest_request_tokens"] == 5010 and load["gpu_quota_admitting_all"] == "5.1ktok"
    assert "rejected 1 of 3 requests as longer than the GPU tier holds" in load["warnings"][0]


def _slots(config: KVCacheManagerConfig) -> list[int]:
    m = KVCacheManager(config)
    try:
        return [s.total for s in m.get_storage_statistics()]
    finally:
        m.shutdown()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_proxy_manager_has_the_real_slot_counts(preset: str) -> None:
    shape = model_shape(preset)
    for t, quota in ((32, "1GiB"), (16, "3GiB"), (64, "40000tok")):
        spec = [TierSpec("gpu", parse_quota("--gpu", quota).bytes_for(shape), quota)]
        real = manager_config(shape, t, spec, False, shape.buffer_bytes_per_token * t)  # the real buffer sizes
        if shape.is_hybrid:  # the real state sizes, in the manager's config
            sizes = {
                b.role: b.size for layer in real.layers if isinstance(layer, SsmLayerConfig) for b in layer.buffers
            }
            assert sizes == {"conv_state": shape.conv_state_bytes, "ssm_state": shape.ssm_state_bytes}
        want = _slots(real)
        for check in (False, True):
            page = proxy_page_bytes(t, check, shape)
            assert page <= 4096  # still a proxy: a few bytes per block, not the model's KiB
            assert _slots(manager_config(shape, t, spec, False, page)) == want


def test_quota_parsing() -> None:
    shape = model_shape("llama-3-8b")
    assert parse_quota("--gpu", "16").bytes_for(shape) == 16 << 30
    assert parse_quota("--gpu", "512MiB").bytes_for(shape) == 512 << 20
    assert parse_quota("--gpu", "2GB").bytes_for(shape) == 2 * 10**9
    assert parse_quota("--gpu", "3Mtok").bytes_for(shape) == 3_000_000 * 131072
    assert parse_quota("--gpu", "300k tokens").bytes_for(shape) == 300_000 * 131072
    assert parse_quota("--gpu", "1.5GiB").bytes_for(shape) == 3 << 29
    for bad, what in (("1M", "ambiguous"), ("x", "cannot read"), ("3 parsecs", "unknown unit"), ("0", "less than")):
        with pytest.raises(SimUserError, match=what):
            parse_quota("--gpu", bad)


def test_presets_and_overrides() -> None:
    assert model_shape("llama-3-8b").bytes_per_token == 128 << 10
    oss = model_shape("gpt-oss-120b")
    assert oss.num_swa_layers == 18 and oss.window == 128
    custom = model_shape("custom", layers=10, kv_heads=2, head_dim=64, dtype="fp8", window=256, sinks=4)
    assert custom.bytes_per_token == 2 * 10 * 2 * 64 and custom.num_swa_layers == 5 and custom.sinks == 4
    assert model_shape("gpt-oss-20b", window=0).num_swa_layers == 0
    with pytest.raises(SimUserError, match="unknown model preset 'llama-9b'"):
        model_shape("llama-9b")
    with pytest.raises(SimUserError, match="--dtype"):
        model_shape("custom", layers=2, kv_heads=1, head_dim=16, dtype="fp4")
    with pytest.raises(SimUserError, match="--model custom needs its shape: give --kv-heads, --head-dim"):
        model_shape("custom", layers=2)  # (issue 47.18: it took llama-3-8b's heads silently)
    with pytest.raises(SimUserError, match="--sinks needs a --window"):
        model_shape("llama-3-8b", sinks=4)


def test_impossible_quota_is_a_user_error() -> None:
    shape = model_shape("llama-3-70b")
    with pytest.raises(SimUserError, match="cannot hold one block of llama-3-70b"):
        manager_config(shape, 32, [TierSpec("gpu", 1 << 20, "1MiB")], False, 4)


def test_checker_mix_separates_tokens_positions_buffers() -> None:
    from kv_cache_manager_v2.sim._check import _mix

    tok = np.arange(1000, dtype=np.uint32)
    pos = np.arange(1000, dtype=np.int64)
    a = _mix(tok, pos, np.uint32(1))
    assert len(set(a.tolist())) == 1000
    assert not np.any(a == _mix(tok, pos, np.uint32(2)))
    assert not np.any(a == _mix(tok + np.uint32(1), pos, np.uint32(1)))
    assert not np.any(a == _mix(tok, pos + 1, np.uint32(1)))


# layer counts of the published configs (attention, recurrent, manager layers) and the state of one
# recurrent layer in elements, worked out by hand from the config fields named in the preset docstrings
HYBRIDS = {
    "qwen3-next-80b-a3b": (12, 36, 48, 3 * (2 * 16 * 128 + 32 * 128), 32 * 128 * 128),
    "nemotron-h-8b": (4, 24, 28, 3 * (128 * 64 + 2 * 8 * 128), 128 * 64 * 128),
    "jamba-v0.1": (4, 28, 32, 3 * 8192, 8192 * 16),
    "falcon-h1-7b": (44, 44, 88, 3 * (24 * 128 + 2 * 256), 24 * 128 * 256),
    "granite-4.0-h-small": (4, 36, 40, 3 * (128 * 64 + 2 * 128), 128 * 64 * 128),
}


@pytest.mark.parametrize("preset", sorted(HYBRIDS))
def test_hybrid_presets_match_their_published_configs(preset: str) -> None:
    shape = model_shape(preset)
    attention, recurrent, manager_layers, conv, ssm = HYBRIDS[preset]
    assert (len(shape.kv_layers), len(shape.recurrent_layers)) == (attention, recurrent)
    ids = set(shape.kv_layers) | {shape.recurrent_layer_id(i) for i in shape.recurrent_layers}
    assert len(ids) == manager_layers  # a parallel layer is two manager layers, never one id twice
    assert (shape.conv_state_elems, shape.ssm_state_elems) == (conv, ssm)
    assert shape.state_bytes_per_request == recurrent * (conv + ssm) * 2  # bf16 as published
    assert shape.bytes_per_token == 2 * attention * shape.kv_heads * shape.head_dim * 2
    fp32 = model_shape(preset, state_dtype="fp32")
    assert fp32.state_bytes_per_request == 2 * shape.state_bytes_per_request and fp32.kv_layers == shape.kv_layers
    assert "recurrent layers" in shape.describe()
    with pytest.raises(SimUserError, match="keeps its layer count"):
        model_shape(preset, layers=3)


def test_state_dtype_needs_a_hybrid_model() -> None:
    with pytest.raises(SimUserError, match="--state-dtype: llama-3-8b has no recurrent layers"):
        model_shape("llama-3-8b", state_dtype="fp32")
    with pytest.raises(SimUserError, match="unknown --state-dtype 'fp64'"):
        model_shape("jamba-v0.1", state_dtype="fp64")


def test_the_shared_trace_cases_skip_with_a_reason_where_it_is_absent() -> None:
    """Issue 38.24: on a fresh clone (no shared trace beside it) the cases of the shared trace are
    collected and skipped with the reason shown, not silently left out."""
    repo, shared = TRACES
    assert trace_id(str(repo)) == "repo"
    assert isinstance(shared, type(pytest.param(0))) and shared.id == "shared" and shared.values == (SHARED_TRACE,)
    (mark,) = [m for m in shared.marks if m.name == "skipif"]
    assert mark.args == (not os.path.exists(SHARED_TRACE),)
    assert SHARED_TRACE in mark.kwargs["reason"]


def test_the_per_step_series_are_kept_value_for_value_across_bulk_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served steps' samples (time, GPU shares, hit rate, running, manager time) wait in one
    list and move into the result's arrays in bulk: moved every 7 steps, every series holds one
    value per step, the same values as when moved once at the end (manager time aside: measured)."""
    from kv_cache_manager_v2.sim import _replay
    from kv_cache_manager_v2.sim._replay_types import SERIES_FIELDS

    params = ConversationParams(conversations=6, turns=2, system_prompts=1, system_tokens=100, seed=2)
    reqs = generate_conversations(params)
    config = manager_config(SMALL, 16, gpu(1500), False, proxy_page_bytes(16, False))
    opts = SchedulerOptions(max_batch=4, max_num_tokens=128, chunk=64, time_scale=0.0)
    once = Replay(config, reqs, opts).run()
    seen: list[int] = []
    holder: list[Replay] = []
    monkeypatch.setattr(_replay, "FLUSH_SAMPLES", 6 * 7)
    replay = Replay(config, reqs, opts, on_step=lambda rm: seen.append(len(holder[0].result.series_t_s)))
    holder.append(replay)
    often = replay.run()
    assert once.steps == often.steps > 30 and 0 < max(seen) < often.steps  # moved during the run
    for name in SERIES_FIELDS:
        a, b = getattr(once, name), getattr(often, name)
        assert len(a) == len(b) == once.steps, name
        if name != "step_us":
            assert a == b, name
    assert once.series_t_s[-1] * 1000.0 <= once.sim_time_ms and sorted(once.series_t_s) == list(once.series_t_s)
