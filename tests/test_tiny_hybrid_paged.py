"""The numpy engine on hybrid models with the manager holding every recurrent state: K/V in pages,
each recurrent layer's conv_state and ssm_state in the request's live state slot
(``KVCache.get_ssm_state_index`` + the page-index converter + ``get_buffers``), prefix reuse from
the manager's snapshots. Generations equal the dense recomputation from scratch (max error <= 1e-12)
with chunked prefill of arbitrary chunk sizes (cut at the snapshot positions by the adapter),
suspend/resume, a host tier and beams; every snapshot holds exactly the state at its position."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import tokens_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import TokenId, TokenIdExt
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from tiny_engine.engine import PagedEngine
from tiny_engine.model import TinyConfig, TinyModel, hybrid_layers, parallel_layers
from tiny_engine.workload import WorkloadParams, check_against_dense, make_adapter, run_workload

TOL = 1e-12
INTERVAL = 8  #: tokens between snapshots (two blocks of the tiny model's 4 tokens)
CONFIGS = {
    "3:1 hybrid": TinyConfig(layers=hybrid_layers()),  # recurrent x3, attention; twice (one SWA)
    "parallel": TinyConfig(layers=parallel_layers(), seed=1),  # attention + recurrence side by side
}
MODELS = {name: TinyModel(cfg) for name, cfg in CONFIGS.items()}


def setup(name: str, p: WorkloadParams | None = None) -> tuple[TinyModel, KVCacheResourceManager, PagedEngine]:
    model = MODELS[name]
    adapter = make_adapter(model.cfg, p or WorkloadParams(full_slots=200, swa_slots=200, ssm_reuse_interval=INTERVAL))
    return model, adapter, PagedEngine(model, adapter)


def live_state_error(model: TinyModel, engine: PagedEngine, kv: kvm.KVCache, tokens: Sequence[TokenIdExt]) -> float:
    """Largest difference between the request's live states in the pools and the dense reference's
    states after ``tokens``."""
    ref = model.dense_states(tokens) if tokens else {i: model.initial_state() for i in engine.states}
    err = 0.0
    for layer, bufs in engine.states.items():
        live = bufs.state(kv)
        err = max(err, float(np.abs(live.conv_state - ref[layer].conv_state).max()))
        err = max(err, float(np.abs(live.ssm_state - ref[layer].ssm_state).max()))
    return err


def run_request(
    adapter: KVCacheResourceManager, engine: PagedEngine, req: EngineRequest, chunks: Sequence[int] = (0,)
) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """Run one request alone to the end (its chunk size cycling through ``chunks``; 0: no limit);
    its steps ``(begin, end)`` and the logits of every sampled token."""
    steps: list[tuple[int, int]] = []
    logits: list[np.ndarray] = []
    while req.state is not RequestState.FINISHED:
        req.context_chunk_size = chunks[len(steps) % len(chunks)]
        assert adapter.prepare_resources([req]) == []
        steps.append((req.num_cached_tokens, req.num_cached_tokens + req.num_scheduled_tokens))
        out = engine.forward([req])
        if req.samples_this_step:
            lg = out[req.request_id]
            logits.append(lg)
            req.generated_tokens.append(TokenId(int(np.argmax(lg))))
        adapter.update_resources([req])
        if len(req.generated_tokens) >= req.max_new_tokens:
            req.state = RequestState.FINISHED
    adapter.free_resources(req)
    return steps, logits


def assert_equals_dense(model: TinyModel, req: EngineRequest, logits: list[np.ndarray]) -> None:
    ref = model.dense_logits(req.all_tokens()[:-1])
    p = len(req.prompt_tokens)
    err = max(float(np.abs(lg - ref[p - 1 + i]).max()) for i, lg in enumerate(logits))
    assert err <= TOL, err
    assert [int(np.argmax(ref[p - 1 + i])) for i in range(len(logits))] == [int(t) for t in req.generated_tokens]


# ---------------------------------------------------------------- reuse from snapshots


@pytest.mark.parametrize("name", list(MODELS))
def test_generation_resumed_from_a_snapshot_equals_recomputation(name: str) -> None:
    model, adapter, engine = setup(name)
    prompt = tokens_of(1, 27)
    first = EngineRequest(0, prompt, 6)
    steps, logits = run_request(adapter, engine, first, chunks=(5, 3, 7))
    assert first.num_reused_tokens == 0
    assert_equals_dense(model, first, logits)
    # chunks end at every snapshot position: multiples of 8 and the prompt end rounded to a block (24)
    ends = {e for _, e in steps}
    assert {8, 16, 24} <= ends
    stats = adapter.manager.reuse_statistics
    assert stats.snapshots_taken >= 4  # 8, 16, 24 and 32 (reached while decoding)
    # a follow-up turn: the whole conversation so far plus new tokens resumes from the snapshot at 32
    second = EngineRequest(1, first.all_tokens() + tokens_of(2, 9), 5)
    _, logits = run_request(adapter, engine, second, chunks=(4,))
    assert second.num_reused_tokens == 32
    assert adapter.manager.reuse_statistics.snapshots_reused == stats.snapshots_reused + 1
    assert_equals_dense(model, second, logits)
    # a shorter shared prefix resumes from the last snapshot at or before it (16: the match of 21
    # tokens ends there, never between snapshots)
    third = EngineRequest(2, prompt[:21] + tokens_of(3, 4), 3)
    _, logits = run_request(adapter, engine, third)
    assert third.num_reused_tokens == 16
    assert_equals_dense(model, third, logits)
    adapter.shutdown()


def test_the_engine_check_catches_a_stale_live_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is sensitive to the live slot: an engine that does not zero a new sequence's
    slot (the manager hands slots out as they are) computes from the previous owner's state."""
    model, adapter, engine = setup("3:1 hybrid")
    run_request(adapter, engine, EngineRequest(0, tokens_of(4, 13), 3))
    original = engine.states[0].state

    def stale(kv: kvm.KVCache, beam: int = 0) -> object:
        live = original(kv, beam)
        live.ssm_state[...] += 1.0  # what a previous owner might have left
        return live

    monkeypatch.setattr(engine.states[0], "state", stale)
    req = EngineRequest(1, tokens_of(5, 11), 3)
    _, logits = run_request(adapter, engine, req)
    with pytest.raises(AssertionError):
        assert_equals_dense(model, req, logits)
    adapter.shutdown()


# ---------------------------------------------------------------- the snapshot-position property


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt_len=st.integers(1, 30),
    chunks=st.lists(st.integers(0, 11), min_size=1, max_size=5),
    decode=st.integers(1, 14),
    seed=st.integers(0, 1000),
)
def test_every_snapshot_holds_exactly_the_state_at_its_position(
    name: str, prompt_len: int, chunks: list[int], decode: int, seed: int
) -> None:
    """After a request with random chunking and decode length, a probe for every prefix length q
    reuses exactly up to the last snapshot position at or before q (multiples of the interval, the
    prompt end rounded down to a block), and the live state it starts from is the dense reference's
    state at that position (the bug class: a chunk-end state cached under a boundary position)."""
    model, adapter, engine = setup(name)
    t = model.cfg.tokens_per_block
    req = EngineRequest(0, tokens_of(seed, prompt_len), decode)
    _, logits = run_request(adapter, engine, req, chunks)
    assert_equals_dense(model, req, logits)
    seq = req.all_tokens()
    history = len(seq) - 1  # the last sampled token is never computed
    prompt_end = (prompt_len - 1) // t * t  # the adapter creates the cache with all but the last token
    snapshots = {p for p in range(INTERVAL, history + 1, INTERVAL)} | ({prompt_end} if prompt_end else set())
    states: dict[int, float] = {}
    for q in range(1, history + 1):
        probe = EngineRequest(1 + q, seq[:q] + [TokenId(96)], 1)
        assert adapter.prepare_resources([probe]) == []
        reused = probe.num_reused_tokens
        assert reused == max((p for p in snapshots if p <= q), default=0), (q, reused, sorted(snapshots))
        if reused and reused not in states:
            states[reused] = live_state_error(model, engine, adapter.get_kv_cache(probe), seq[:reused])
        adapter.free_resources(probe)
    assert all(err <= TOL for err in states.values()), states
    assert set(states) == {p for p in snapshots if p <= history}
    adapter.shutdown()


# ---------------------------------------------------------------- workloads: pressure, suspend, host tier


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tiers", ["gpu", "host", "disk"])
def test_workload_under_pressure_equals_the_dense_reference(name: str, tiers: str) -> None:
    """Shared prefixes, follow-ups during generation, chunk sizes 0/5/8/16, a GPU tier small enough
    to suspend requests (live states spilled to the host tier and back when there is one; with a
    disk tier too, down to disk and back through background loads) and to evict snapshots: every
    token's logits equal the dense reference within 1e-12."""
    host_tier = tiers != "gpu"
    p = WorkloadParams(
        num_requests=70,
        full_slots=30,
        swa_slots=60,
        state_slots=24,
        host_tier=host_tier,
        disk_tier=tiers == "disk",
        ssm_reuse_interval=INTERVAL,
    )
    res = run_workload(CONFIGS[name], p)
    assert check_against_dense(res, atol=TOL) <= TOL
    stats = res.adapter.manager.reuse_statistics
    sched = res.scheduler.stats
    assert sched.reused_prompt_tokens > 0 and stats.snapshots_reused > 0 and stats.snapshots_taken > 0
    assert sched.preempted_suspend + sched.preempted_recompute > 0  # the pressure was real
    assert stats.snapshots_evicted > 0 or tiers == "disk"  # (the disk tier has room for every snapshot)
    if host_tier:
        host = res.adapter.manager.get_tier_statistics(kvm.CacheLevel(1))
        assert host.offloaded_pages > 0
    if tiers == "disk":
        disk = res.adapter.manager.get_tier_statistics(kvm.CacheLevel(2))
        reads = res.adapter.manager._ctx.reads
        assert disk.offloaded_pages > 0 and reads is not None and reads.num_installed + reads.num_discarded > 0
    res.adapter.manager.check_invariants()
    res.adapter.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
def test_suspend_and_resume_keep_the_live_state(name: str) -> None:
    """A request suspended between every step (its slot kept, or spilled to the host tier under
    pressure and brought back) generates what the dense reference does."""
    p = WorkloadParams(full_slots=60, swa_slots=60, state_slots=12, host_tier=True, ssm_reuse_interval=INTERVAL)
    model, adapter, engine = setup(name, p)
    req = EngineRequest(0, tokens_of(7, 23), 7, context_chunk_size=5)
    others = [EngineRequest(10 + i, tokens_of(20 + i, 17), 2) for i in range(4)]
    logits: list[np.ndarray] = []
    g = engine.states[model.cfg.recurrent_layers[0]].layer_group
    slots: list[int] = []
    while req.state is not RequestState.FINISHED:
        assert adapter.prepare_resources([req]) == []
        kv = adapter.get_kv_cache(req)
        slots.append(kv.get_ssm_state_index(g))
        out = engine.forward([req])
        if req.samples_this_step:
            logits.append(out[0])
            req.generated_tokens.append(TokenId(int(np.argmax(out[0]))))
        adapter.update_resources([req])
        if len(req.generated_tokens) >= req.max_new_tokens:
            req.state = RequestState.FINISHED
            break
        adapter.suspend_resources(req)
        if others:  # other requests take the GPU's state slots meanwhile: the suspended state spills
            other = others.pop()
            run_request(adapter, engine, other)
    adapter.free_resources(req)
    assert_equals_dense(model, req, logits)
    assert len(set(slots)) > 1 or not others  # it moved at least once (spilled and brought back)
    adapter.shutdown()


# ---------------------------------------------------------------- beams


@pytest.mark.parametrize("name", list(MODELS))
def test_beams_resumed_from_a_snapshot_equal_recomputation(name: str) -> None:
    """Two beams over a prompt whose prefix is reused from a snapshot: each beam's state lives in its
    own slot, a beam continuing the other gets that beam's state (the manager copies it), and every
    step's logits equal the dense reference of that beam's sequence."""
    model, adapter, engine = setup(name)
    m = adapter.manager
    prompt = tokens_of(8, 26)
    run_request(adapter, engine, EngineRequest(0, prompt[:19] + tokens_of(9, 3), 2))  # snapshots at 8, 16
    kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=2)
    assert kv.resume()
    start = kv.history_length
    assert start == 16
    g = engine.states[model.cfg.recurrent_layers[0]].layer_group
    assert kv.get_ssm_state_index(g, kvm.BeamIndex(0)) != kv.get_ssm_state_index(g, kvm.BeamIndex(1))
    assert kv.resize(len(prompt))
    last = [engine.step_sequence(kv, prompt, start, len(prompt), beam)[-1] for beam in (0, 1)]
    kv.commit([prompt[start:]] * 2, [0, 0])
    seqs = [list(prompt), list(prompt)]
    worst = 0.0
    for step in range(9):
        pos = len(seqs[0])
        # beam b tries its best token (beam 1: its second best), then each beam continues a parent
        new = [TokenId(int(np.argsort(last[b])[-1 - b])) for b in (0, 1)]
        assert kv.resize(pos + 1)
        outs = [engine.step_sequence(kv, seqs[b] + [new[b]], pos, pos + 1, b)[-1] for b in (0, 1)]
        parents = ([0, 0], [1, 0], [0, 1])[step % 3]  # both continue beam 0; swapped; each its own
        seqs = [seqs[parents[b]] + [new[parents[b]]] for b in (0, 1)]
        last = [outs[parents[b]] for b in (0, 1)]
        kv.commit([[new[parents[b]]] for b in (0, 1)], parents)
        for b in (0, 1):
            worst = max(worst, float(np.abs(last[b] - model.dense_logits(seqs[b])[-1]).max()))
            assert live_state_error_beam(model, engine, kv, seqs[b], b) <= TOL
    assert worst <= TOL, worst
    assert seqs[0] != seqs[1]
    kv.close()
    adapter.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
def test_beams_sharing_a_block_leave_its_exact_snapshot(name: str) -> None:
    """A beam request forked with the prompt's last chunk (``[chunk] * 2``, indices ``[0, 0]``) whose
    beams both continue beam 0: the blocks they share are published, and those ending at snapshot
    positions (the block-aligned prompt end, multiples of the interval) keep beam 0's state, which
    is the dense reference's state at that position."""
    model, adapter, engine = setup(name)
    m = adapter.manager
    prompt = tokens_of(11, 12)  # 3 blocks: the prompt end (12) is a snapshot position
    kv = m.create_kv_cache(input_tokens=prompt, beam_width=2)
    assert kv.resume()
    assert kv.resize(len(prompt))
    last = [engine.step_sequence(kv, prompt, 0, len(prompt), beam)[-1] for beam in (0, 1)]
    kv.commit([prompt] * 2, [0, 0])
    seq = list(prompt)
    for pos in range(len(prompt), 17):  # past 16 (a multiple of the interval)
        token = TokenId(int(np.argmax(last[0])))
        assert kv.resize(pos + 1)
        last = [engine.step_sequence(kv, seq + [token], pos, pos + 1, b)[-1] for b in (0, 1)]
        seq.append(token)
        kv.commit([[token], [token]], [0, 0])
    assert m.reuse_statistics.snapshots_taken == 2
    kv.close()
    for upto in (12, 16):
        probe = EngineRequest(100 + upto, seq[:upto] + [TokenId(96)], 1)
        assert adapter.prepare_resources([probe]) == []
        assert probe.num_reused_tokens == upto
        assert live_state_error(model, engine, adapter.get_kv_cache(probe), seq[:upto]) <= TOL
        adapter.free_resources(probe)
    adapter.shutdown()


def live_state_error_beam(
    model: TinyModel, engine: PagedEngine, kv: kvm.KVCache, tokens: Sequence[TokenIdExt], beam: int
) -> float:
    ref = model.dense_states(tokens)
    err = 0.0
    for layer, bufs in engine.states.items():
        live = bufs.state(kv, beam)
        err = max(err, float(np.abs(live.conv_state - ref[layer].conv_state).max()))
        err = max(err, float(np.abs(live.ssm_state - ref[layer].ssm_state).max()))
    return err


# ---------------------------------------------------------------- snapshot policies (issue 36)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("suffix", [6, 13, 37])
def test_branch_point_snapshot_resumes_the_third_request_exactly(name: str, suffix: int) -> None:
    """Policy "branch": the second request with a shared prefix (23 tokens: 5 full blocks) plans
    a snapshot where it leaves the first one's path (20, no snapshot there yet), the adapter cuts
    its chunks there; the third reuses those 20 tokens whatever its suffix, probe_reuse says so
    before, and its generation and live state equal the dense recomputation."""
    p = WorkloadParams(full_slots=200, swa_slots=200, ssm_reuse_interval=INTERVAL, ssm_snapshot_policy="branch")
    model, adapter, engine = setup(name, p)
    prefix = tokens_of(20, 23)
    for i, chunks in enumerate([(0,), (5, 3, 7), (4,)]):
        prompt = prefix + tokens_of(21 + i, suffix)
        probed = adapter.manager.probe_reuse(None, prompt[:-1])
        req = EngineRequest(i, prompt, 4)
        steps, logits = run_request(adapter, engine, req, chunks)
        assert req.num_reused_tokens == probed == (20 if i == 2 else 0)
        assert_equals_dense(model, req, logits)
        if i == 1:
            assert 20 in {e for _, e in steps}
    stats = adapter.manager.reuse_statistics
    assert stats.snapshots_branch == 1 and stats.snapshots_interval == 0
    probe = EngineRequest(9, prefix[:20] + tokens_of(30, 5), 1)
    assert adapter.prepare_resources([probe]) == []
    assert probe.num_reused_tokens == 20
    assert live_state_error(model, engine, adapter.get_kv_cache(probe), prefix[:20]) <= TOL
    adapter.free_resources(probe)
    adapter.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["branch", "auto"])
@pytest.mark.parametrize("host_tier", [False, True])
def test_workload_with_each_policy_equals_the_dense_reference(name: str, policy: str, host_tier: bool) -> None:
    """The pressure workload (shared prefixes, follow-ups, chunking, suspend, eviction) under the
    branch-point policies: every token's logits equal the dense reference within 1e-12."""
    p = WorkloadParams(
        num_requests=50,
        full_slots=30,
        swa_slots=60,
        state_slots=24,
        host_tier=host_tier,
        ssm_reuse_interval=INTERVAL,
        ssm_snapshot_policy="branch" if policy == "branch" else "auto",
        ssm_lower_tier_interval=INTERVAL,  # (from bytes: wider than these prompts, the tiny states are heavy)
    )
    res = run_workload(CONFIGS[name], p)
    assert check_against_dense(res, atol=TOL) <= TOL
    stats = res.adapter.manager.reuse_statistics
    assert stats.snapshots_reused > 0 and stats.snapshots_branch + stats.snapshots_demand > 0
    assert (stats.snapshots_interval > 0) == (policy == "auto")
    res.adapter.manager.check_invariants()
    res.adapter.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    ("policy", "history", "reused"), [("interval", True, 24), ("branch", True, 28), ("branch", False, 12)]
)
def test_conversation_snapshot_resumes_the_next_turn_exactly(
    name: str, policy: str, history: bool, reused: int
) -> None:
    """A request whose output is history (``output_is_history``: a conversation's next turn starts
    with it) gets a snapshot at the last full block of prompt + output: the next turn reuses up to
    it (policy "interval": up to the last multiple of the interval; without the flag: the prompt's
    last full block) and generates what the dense recomputation does."""
    p = WorkloadParams(full_slots=200, swa_slots=200, ssm_reuse_interval=INTERVAL, ssm_snapshot_policy=policy)
    model, adapter, engine = setup(name, p)
    first = EngineRequest(0, tokens_of(40, 13), 16)  # history at the end: 13 + 16 - 1 = 28 tokens
    first.output_is_history = history
    _, logits = run_request(adapter, engine, first, chunks=(5,))
    assert_equals_dense(model, first, logits)
    second = EngineRequest(1, first.all_tokens() + tokens_of(41, 6), 3)
    _, logits = run_request(adapter, engine, second, chunks=(3, 7))
    assert second.num_reused_tokens == reused
    assert_equals_dense(model, second, logits)
    probe = EngineRequest(2, first.all_tokens()[:28] + tokens_of(42, 2), 1)
    assert adapter.prepare_resources([probe]) == []
    assert probe.num_reused_tokens == (reused if history else 28)  # the second turn planned 28 (demand)
    kv = adapter.get_kv_cache(probe)
    assert live_state_error(model, engine, kv, first.all_tokens()[: probe.num_reused_tokens]) <= TOL
    adapter.free_resources(probe)
    adapter.shutdown()


def snapshot_levels(adapter: KVCacheResourceManager, position: int) -> list[int]:
    """The cache level of each snapshot (one per recurrent layer group) of the block ending at ``position``."""
    m = adapter.manager
    groups = [
        kvm.LayerGroupId(g)
        for g in range(m.num_layer_groups)
        if m.get_layer_group_info(kvm.LayerGroupId(g)).kind == "recurrent"
    ]
    t = m.config.tokens_per_block
    return [
        int(page.level)
        for node in m._tree.nodes()
        if (node.ordinal + 1) * t == position
        for g in groups
        if (page := node.page(g)) is not None
    ]


def resumed_states(engine: PagedEngine, kv: kvm.KVCache) -> list[np.ndarray]:
    """Copies of the request's live states (every recurrent layer, both buffers)."""
    out: list[np.ndarray] = []
    for bufs in engine.states.values():
        live = bufs.state(kv)
        out += [live.conv_state.copy(), live.ssm_state.copy()]
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_a_snapshot_promoted_from_the_host_tier_is_byte_exact(name: str) -> None:
    """Policy "auto" with a host tier: a periodic snapshot is written straight to the host tier; the
    first request resuming from it promotes it to the GPU, and its live state equals the dense
    recomputation's; a later request resumes from the promoted copy to the same bytes, and its
    generation equals the dense recomputation."""
    p = WorkloadParams(
        full_slots=200,
        swa_slots=200,
        ssm_reuse_interval=INTERVAL,
        ssm_snapshot_policy="auto",
        host_tier=True,
        ssm_lower_tier_interval=INTERVAL,
    )
    model, adapter, engine = setup(name, p)
    prompt = tokens_of(50, 27)
    first = EngineRequest(0, prompt, 4)
    _, logits = run_request(adapter, engine, first, chunks=(5, 3, 7))
    assert_equals_dense(model, first, logits)
    num_groups = len(snapshot_levels(adapter, 16))
    assert num_groups > 0
    assert snapshot_levels(adapter, 16) == [1] * num_groups  # periodic: on the host tier
    assert snapshot_levels(adapter, 24) == [0] * num_groups  # the prompt's last full block: on the GPU
    host = adapter.manager.get_tier_statistics(kvm.CacheLevel(1))
    states: list[list[np.ndarray]] = []
    for i in range(2):  # the first promotes the snapshot from the host, the second takes it from the GPU
        probe = EngineRequest(10 + i, prompt[:21] + tokens_of(51 + i, 4), 1)
        assert adapter.prepare_resources([probe]) == []
        assert probe.num_reused_tokens == 16
        kv = adapter.get_kv_cache(probe)
        assert live_state_error(model, engine, kv, prompt[:16]) <= TOL
        states.append(resumed_states(engine, kv))
        adapter.free_resources(probe)
        assert snapshot_levels(adapter, 16) == [0] * num_groups
    assert all(np.array_equal(a, b) for a, b in zip(states[0], states[1], strict=True))
    onboarded = adapter.manager.get_tier_statistics(kvm.CacheLevel(1)).onboarded_pages - host.onboarded_pages
    assert onboarded == num_groups  # brought up once (the request's KV was in GPU memory)
    second = EngineRequest(2, prompt[:21] + tokens_of(53, 6), 5)
    _, logits = run_request(adapter, engine, second, chunks=(3, 7))
    assert second.num_reused_tokens == 16
    assert_equals_dense(model, second, logits)
    adapter.manager.check_invariants()
    adapter.shutdown()


def lower_tier_spacing(adapter: KVCacheResourceManager) -> int:
    """The smallest power-of-two multiple of ``INTERVAL`` whose span's KV (every attention layer
    group's pages) weighs at least twice the recurrent state (every recurrent layer group's)."""
    m = adapter.manager
    state = kv = 0
    for g in range(m.num_layer_groups):
        info = m.get_layer_group_info(kvm.LayerGroupId(g))
        slot_bytes = sum(pool.slot_bytes for pool in m.pool_group_descs[info.pool_group_index].pools)
        if info.kind == "recurrent":
            state += slot_bytes
        else:
            kv += slot_bytes
    spacing = INTERVAL
    while spacing // m.config.tokens_per_block * kv < 2 * state:
        spacing *= 2
    return spacing


@pytest.mark.parametrize("name", list(MODELS))
def test_lower_tier_snapshots_spaced_by_bytes_resume_exactly(name: str) -> None:
    """Policy "auto" with a host tier and the tiny models' heavy states (the KV of one interval
    weighs less than twice a state): the periodic snapshots written to the host are spaced by bytes,
    none at the multiples of the interval between; a request resuming from the host's snapshot gets
    the state of the dense recomputation and generates what it generates."""
    p = WorkloadParams(
        full_slots=400, swa_slots=400, ssm_reuse_interval=INTERVAL, ssm_snapshot_policy="auto", host_tier=True
    )
    model, adapter, engine = setup(name, p)
    spacing = lower_tier_spacing(adapter)
    assert spacing > INTERVAL
    prompt = tokens_of(60, 2 * spacing + 13)  # last full block: 2 x spacing + 12
    first = EngineRequest(0, prompt, 3)
    _, logits = run_request(adapter, engine, first, chunks=(5, 3, 7))
    assert_equals_dense(model, first, logits)
    num_groups = len(snapshot_levels(adapter, spacing))
    assert num_groups > 0 and snapshot_levels(adapter, spacing) == [1] * num_groups  # on the host tier
    assert all(snapshot_levels(adapter, x) == [] for x in range(INTERVAL, 2 * spacing, INTERVAL) if x != spacing)
    # the prompt's last multiple of the spacing and its last full block: on the GPU
    assert snapshot_levels(adapter, 2 * spacing) == snapshot_levels(adapter, 2 * spacing + 12) == [0] * num_groups
    second = EngineRequest(1, prompt[: spacing + 5] + tokens_of(61, 6), 4)
    _, logits = run_request(adapter, engine, second, chunks=(3, 7))
    assert second.num_reused_tokens == spacing
    assert_equals_dense(model, second, logits)
    assert snapshot_levels(adapter, spacing) == [0] * num_groups  # promoted
    adapter.manager.check_invariants()
    adapter.shutdown()
