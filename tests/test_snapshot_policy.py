"""Where hybrid models keep recurrent-state snapshots (``ssm_snapshot_policy``, issue 36): branch
points planned at admission from the match, the prompt's last full block, demand promotion, the
interval snapshots of "auto" on a lower tier; statistics by kind. Through the fake engine (its
recurrent records are the state after each position) and the invariant checker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import REC, MakeManager, make_config, toks
from fake_engine import FakeEngine
from test_recurrent import CONV, STATE, T, decode, hybrid_layers, prefill, state_group

from kv_cache_manager_v2 import (
    DEFAULT_PRIORITY,
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    LayerGroupId,
    LayerId,
    Priority,
    SsmLayerConfig,
    TokenId,
)
from kv_cache_manager_v2._common import MAX_CAPACITY
from kv_cache_manager_v2._config import LOWER_TIER_TOKENS_PER_STATE, LayerConfig
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

PREFIX = 1000  #: shared tokens: its last full block ends at 992
SHARED = PREFIX // T * T


def run(m: KVCacheManager, engine: FakeEngine, prompt: list[int], decoded: int = 0) -> int:
    """One request: probe, create (the probe's reuse), prefill cut at snapshot positions, decode,
    close; its reused tokens."""
    probed = m.probe_reuse(None, prompt)
    kv = m.create_kv_cache(input_tokens=prompt)
    assert kv.history_length == probed
    prefill(engine, kv, prompt, len(prompt), chunk=300)  # checks the reused prefix and state
    if decoded:
        decode(engine, kv, prompt + toks(99, decoded), len(prompt) + decoded)
    kv.close()
    m.check_invariants()
    return probed


@pytest.mark.parametrize("policy", ["branch", "auto"])
@pytest.mark.parametrize("suffix", [64, 376, 1300])
def test_a_branch_point_snapshot_gives_the_third_request_the_whole_shared_prefix(
    make_manager: MakeManager, policy: str, suffix: int
) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy=policy)
    engine = FakeEngine(m)
    prefix = toks(1, PREFIX)
    interval = 512 if policy == "auto" else 0  # "auto" keeps the interval snapshots too
    assert run(m, engine, prefix + toks(2, suffix)) == 0
    # the second leaves the first's path at 992 (no snapshot there yet): it plans one
    kv = m.create_kv_cache(input_tokens=prefix + toks(3, suffix))
    assert kv.next_snapshot_position(kv.history_length) == SHARED
    kv.close()
    assert run(m, engine, prefix + toks(3, suffix)) == interval
    assert m.reuse_statistics.snapshots_branch == 1
    assert run(m, engine, prefix + toks(4, suffix)) == SHARED
    stats = m.reuse_statistics
    assert (stats.snapshots_interval > 0) == (policy == "auto") and stats.snapshots_last == 3
    assert stats.attention_matched_tokens == 3 * SHARED  # the second (created twice) and third requests
    assert stats.reused_tokens == SHARED + 2 * interval


@pytest.mark.parametrize("suffix", [64, 376, 1300])
def test_the_interval_policy_reuses_up_to_the_last_multiple_of_the_interval(
    make_manager: MakeManager, suffix: int
) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="interval")
    engine = FakeEngine(m)
    prefix = toks(1, PREFIX)
    for seed in (2, 3, 4):
        reused = run(m, engine, prefix + toks(seed, suffix))
    assert reused == 512
    assert m.reuse_statistics.snapshots_branch == 0


def test_demand_promotion_at_the_end_of_a_previous_output(make_manager: MakeManager) -> None:
    """A next turn whose attention match (the previous prompt and output) ends at a leaf one
    interval or more past its hybrid match (the previous prompt's last block) plans a snapshot
    there; a request sharing that conversation then reuses it."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=128)
    engine = FakeEngine(m)
    turn1 = toks(5, 200)
    answer = toks(99, 161)  # run() decodes (computes and commits) these tokens
    assert run(m, engine, turn1, decoded=len(answer)) == 0
    history = turn1 + answer
    end = len(history) // T * T  # 352: the output's last full block
    turn2 = history + toks(6, 50)
    kv = m.create_kv_cache(input_tokens=turn2)
    assert kv.history_length == 192
    assert kv.next_snapshot_position(192) == end
    kv.close()
    assert run(m, engine, turn2) == 192
    assert m.reuse_statistics.snapshots_demand == 1
    assert run(m, engine, history + toks(7, 40)) == end
    # a shorter gap (under one interval) plans nothing
    short = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=512)
    engine = FakeEngine(short)
    run(short, engine, turn1, decoded=len(answer))
    kv = short.create_kv_cache(input_tokens=turn2)
    assert kv.next_snapshot_position(192) == (len(turn2) // T * T)
    kv.close()


def test_branch_policy_takes_no_interval_snapshot_auto_does(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=64)
    kv = m.create_kv_cache(input_tokens=toks(1, 300))
    assert [kv.next_snapshot_position(p) for p in (0, 287, 288)] == [288, 288, MAX_CAPACITY + 1]
    kv.close()
    auto = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_reuse_interval=64, ssm_snapshot_policy="auto")
    kv = auto.create_kv_cache(input_tokens=toks(1, 300))  # "branch" and the interval snapshots
    assert [kv.next_snapshot_position(p) for p in (0, 256, 287, 288)] == [64, 288, 288, 320]
    kv.close()


def test_auto_takes_interval_snapshots_at_the_lowest_priority_with_a_host_tier(make_manager: MakeManager) -> None:
    """With a host tier "auto" keeps the interval snapshots too, at priority 0: under pressure they
    are the first pages moved down, and a match takes them from there (the state exact)."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=1 << 20,
        host_quota=8 << 20,
        ssm_snapshot_policy="auto",
        ssm_reuse_interval=64,
        lower_tier_state_share=0.125,  # room for every snapshot (the derived share: ~12 of these light states)
    )
    engine = FakeEngine(m)
    prompt = toks(1, 300)
    kv = m.create_kv_cache(input_tokens=prompt)
    assert [kv.next_snapshot_position(p) for p in (0, 64, 256)] == [64, 128, 288]
    kv.close()
    run(m, engine, prompt)
    stats = m.reuse_statistics
    assert stats.snapshots_interval == 3 and stats.snapshots_last == 2  # 256: the prompt's last multiple of 64
    for _ in range(6):  # other requests push the reusable pages down to the host tier
        run(m, engine, toks(50 + _, 300))
    assert run(m, engine, prompt[:200] + toks(8, 20)) == 192
    assert m.get_tier_statistics(1).offloaded_pages > 0


def test_unused_snapshots_evicted_are_counted(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, quota=1 << 20, ssm_snapshot_policy="interval", ssm_reuse_interval=64)
    engine = FakeEngine(m)
    prompt = toks(1, 300)
    run(m, engine, prompt)
    assert run(m, engine, prompt[:100] + toks(2, 10)) == 64
    for seed in range(10, 30):
        run(m, engine, toks(seed, 300))
    stats = m.reuse_statistics
    assert stats.snapshots_evicted > stats.snapshots_evicted_unused > 0
    assert stats.snapshots_evicted - stats.snapshots_evicted_unused <= stats.snapshots_reused


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match=r"ssm_snapshot_policy must be one of 'interval', 'branch', 'auto', got 'x'"):
        make_config(hybrid_layers(), T, ssm_snapshot_policy="x")
    with pytest.raises(TypeError, match="ssm_snapshot_policy"):
        make_config(hybrid_layers(), T, ssm_snapshot_policy=1)


def test_plan_snapshot(make_manager: MakeManager) -> None:
    """A position planned by the engine (e.g. the end of the output) is kept like the others;
    bad positions are refused; the interval policy ignores it."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch")
    engine = FakeEngine(m)
    prompt = toks(1, 100)
    kv = m.create_kv_cache(input_tokens=prompt)
    with pytest.raises(ValueError, match="position must be >= 0, got -32"):
        kv.plan_snapshot(-32)
    with pytest.raises(TypeError):
        kv.plan_snapshot("64")  # type: ignore[arg-type]
    kv.plan_snapshot(0)  # nothing: no full block
    kv.plan_snapshot(31)
    kv.plan_snapshot(96)  # the prompt end: planned already
    assert [kv.next_snapshot_position(p) for p in (0, 96)] == [96, MAX_CAPACITY + 1]
    kv.plan_snapshot(190)  # the last full block: 160
    assert [kv.next_snapshot_position(p) for p in (0, 96)] == [96, 160]
    seq = prompt + toks(2, 80)
    prefill(engine, kv, prompt, 100)
    decode(engine, kv, seq, 170)
    kv.close()
    assert m.reuse_statistics.snapshots_last == 2
    assert run(m, engine, seq[:170] + toks(3, 5)) == 160
    plain = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="interval")
    kv = plain.create_kv_cache(input_tokens=prompt)
    kv.plan_snapshot(160)
    assert kv.next_snapshot_position(96) == 512
    kv.close()


@pytest.mark.parametrize(("policy", "interval_priority"), [("interval", 35), ("auto", 0)])
def test_auto_gives_interval_and_prompt_end_snapshots_the_lowest_priority(
    make_manager: MakeManager, policy: str, interval_priority: int
) -> None:
    """Without a lower tier too: "auto"'s interval snapshots and its prompt's last block (usually
    in the prompt's own unique suffix) are evicted before any other snapshot or KV (priority 0);
    positions known to be shared (a branch point, demand, the engine's ``plan_snapshot``: a
    conversation's next turn) keep the callback's priority."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy=policy, ssm_reuse_interval=64)
    engine = FakeEngine(m)
    run(m, engine, toks(1, 300))
    prompt = toks(2, 100)
    kv = m.create_kv_cache(input_tokens=prompt)
    kv.plan_snapshot(190)  # prompt + output: 160
    prefill(engine, kv, prompt, 100)
    decode(engine, kv, prompt + toks(3, 80), 170)
    kv.close()
    m.check_invariants()
    g = state_group(m)
    priorities = sorted(
        ((node.ordinal + 1) * T, page.priority) for node in m._tree.nodes() if (page := node.page(g)) is not None
    )
    low = interval_priority
    planned = [(160, 35)] if policy == "auto" else []  # "interval" ignores plan_snapshot
    # the first request: 64 .. 256 and its prompt's last block 288; the second: 64, 128 (decoded),
    # its prompt's last block 96 and the planned 160
    assert priorities == sorted(
        [(64, low), (128, low), (192, low), (256, low), (288, low), (64, low), (96, low), (128, low), *planned]
    )


def snapshot_levels(m: KVCacheManager) -> dict[int, int]:
    """The cache level of each snapshot in the tree, by its position."""
    g = state_group(m)
    return {(node.ordinal + 1) * T: int(page.level) for node in m._tree.nodes() if (page := node.page(g)) is not None}


@pytest.mark.parametrize("policy", ["interval", "auto"])
def test_auto_writes_interval_snapshots_to_the_host_tier_and_a_hit_promotes_one(
    make_manager: MakeManager, policy: str
) -> None:
    """Under "auto" a periodic snapshot is copied from the live state straight into the host tier
    (the GPU keeps its KV and the planned snapshots); a match ending there brings it up to the GPU
    with the request's pages, and the live state resumed from it is exact (the fake engine's
    records). Under "interval" every snapshot starts in GPU memory."""
    m = make_manager(
        hybrid_layers(), T, quota=16 << 20, host_quota=16 << 20, ssm_snapshot_policy=policy, ssm_reuse_interval=64
    )
    engine = FakeEngine(m)
    prompt = toks(1, 300)
    run(m, engine, prompt)
    below = 1 if policy == "auto" else 0
    # 256: with a lower tier "auto" keeps the prompt's last multiple of the interval like its last block
    assert snapshot_levels(m) == {64: below, 128: below, 192: below, 256: 0, 288: 0}
    g = state_group(m)
    priorities = {(n.ordinal + 1) * T: page.priority for n in m._tree.nodes() if (page := n.page(g)) is not None}
    assert priorities == {64: 35 - 35 * below, 128: 35 - 35 * below, 192: 35 - 35 * below, 256: 35, 288: 35}
    assert m.reuse_statistics.snapshots_last == 1 + below
    # nothing was evicted from the GPU: its KV stayed, the host got only snapshots
    kv_groups = [LayerGroupId(g) for g in range(m.num_layer_groups) if g != state_group(m)]
    assert {int(p.level) for node in m._tree.nodes() for g in kv_groups if (p := node.page(g)) is not None} == {0}
    assert m.get_tier_statistics(1).offloaded_pages == 3 * below
    assert run(m, engine, prompt[:200] + toks(8, 20)) == 192  # prefill() checked the resumed state
    assert snapshot_levels(m) == {64: below, 128: below, 192: 0, 256: 0, 288: 0}
    assert m.get_tier_statistics(1).onboarded_pages == below
    assert run(m, engine, prompt[:200] + toks(9, 20)) == 192  # the promoted snapshot, from the GPU
    assert m.get_tier_statistics(1).onboarded_pages == below


def tier_slots(m: KVCacheManager, level: int) -> list[tuple[int, int, bool]]:
    """(slots, slot bytes, holds recurrent states) per pool group of a tier."""
    return [(g.num_slots, g.layout.slot_bytes, g.layout.holds_states) for g in m._storage.levels[level]]


def state_share(slots: list[tuple[int, int, bool]]) -> float:
    """The share of a tier's bytes in its recurrent-state pool groups."""
    return sum(n * b for n, b, s in slots if s) / sum(n * b for n, b, _ in slots)


def derived_share(layers: list[LayerConfig]) -> float:
    """The default share of a lower tier in recurrent states: one state per
    ``LOWER_TIER_TOKENS_PER_STATE`` tokens of KV, from the layers' buffer bytes."""
    state = sum(b.size for layer in layers if isinstance(layer, SsmLayerConfig) for b in layer.buffers)
    kv_per_token = sum(b.size for layer in layers if not isinstance(layer, SsmLayerConfig) for b in layer.buffers) / T
    return state / (state + LOWER_TIER_TOKENS_PER_STATE * kv_per_token)


def scaled_state_layers(factor: int) -> list[LayerConfig]:
    """``hybrid_layers()`` with recurrent-state buffers ``factor`` times larger."""
    return [
        dataclasses.replace(layer, buffers=[BufferConfig(b.role, b.size * factor) for b in layer.buffers])
        if isinstance(layer, SsmLayerConfig)
        else layer
        for layer in hybrid_layers()
    ]


@pytest.mark.parametrize(
    ("factor", "typical_tokens", "share", "capped"),
    [
        (1, T, None, False),  # 960 bytes of state, 15 tokens of KV: 0.14 %
        (16, T, None, False),  # 240 tokens: 2.1 %
        (256, T, None, False),  # 3,840 tokens: 26 %
        (256, 1 << 15, None, True),  # the GPU gives its states less than that: its share
        (16, T, 0.5, False),  # the explicit share overrides
        (256, T, 0.0, False),
    ],
)
def test_the_default_lower_tier_state_share_holds_one_state_per_n_tokens_of_kv(
    factor: int, typical_tokens: int, share: float | None, capped: bool
) -> None:
    """``lower_tier_state_share`` None ("auto"): a host tier holds one recurrent state per
    ``LOWER_TIER_TOKENS_PER_STATE`` tokens of its KV, so heavier states get a larger share (at
    most the GPU's); an explicit share overrides."""
    layers = scaled_state_layers(factor)
    step = BatchDesc([KVCacheDesc(capacity=typical_tokens, history_length=0)])
    kw: dict[str, object] = {"ssm_snapshot_policy": "auto", "typical_step": step}
    if share is not None:
        kw["lower_tier_state_share"] = share
    m = KVCacheManager(make_config(layers, T, 16 << 20, 32 << 20, **kw))
    try:
        gpu, host = tier_slots(m, 0), tier_slots(m, 1)
        (n_state, _, _), (n_kv, _, _) = sorted(host, key=lambda g: not g[2])
        assert (derived_share(layers) > state_share(gpu)) == capped
        if share is not None:
            assert abs(state_share(host) - share) < 0.01
        elif capped:
            assert abs(state_share(host) - state_share(gpu)) < 0.01
        else:  # one state (one more: the slot every group gets) per N tokens of KV
            assert abs(n_state - 1 - (n_kv - 1) * T / LOWER_TIER_TOKENS_PER_STATE) <= 1
            assert n_state > 2
    finally:
        m.shutdown()


def test_lower_tier_state_share_validation() -> None:
    for bad in (True, "0.1", [0.1]):
        with pytest.raises(TypeError, match="lower_tier_state_share must be a number or None"):
            make_config(hybrid_layers(), T, lower_tier_state_share=bad)
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"lower_tier_state_share must be in \[0, 1\]"):
            make_config(hybrid_layers(), T, lower_tier_state_share=bad)
    for good in (None, 0, 0.25, 1):
        assert make_config(hybrid_layers(), T, lower_tier_state_share=good).lower_tier_state_share == good


@pytest.mark.parametrize(
    ("policy", "share"),
    [
        ("auto", None),
        ("branch", None),
        ("interval", None),
        ("auto", 0.0),
        ("auto", 0.05),
        ("auto", 0.3),
        ("interval", 1.0),
    ],
)
def test_lower_tiers_size_the_state_pool_by_lower_tier_state_share(
    tmp_path: Path, policy: str, share: float | None
) -> None:
    """The GPU split is untouched; the host and disk tiers give the recurrent-state pool groups
    ``lower_tier_state_share`` of their bytes (default: derived from bytes, at most the GPU's
    share; under "interval" the GPU's share), and the KV pool groups the rest in
    the GPU's proportions; ``resize`` of a lower tier splits the same way."""
    quota, host, disk = 4 << 20, 16 << 20, 32 << 20
    swa = dataclasses.replace(hybrid_layers(0, 1, window=64, t=2 * T)[0], layer_id=LayerId(9))  # bigger slots
    layers = hybrid_layers() + [swa]  # two KV pool groups: full attention and sliding window
    step = BatchDesc([KVCacheDesc(capacity=T, history_length=0, beam_width=4)])  # states: ~40 % of the GPU
    kw: dict[str, object] = {"ssm_snapshot_policy": policy, "typical_step": step}
    if share is not None:  # None: the default, the field left out
        kw["lower_tier_state_share"] = share
    m = KVCacheManager(make_config(layers, T, quota, host, disk, str(tmp_path), **kw))
    plain = KVCacheManager(make_config(layers, T, quota, **kw))
    try:
        gpu = tier_slots(m, 0)
        assert gpu == tier_slots(plain, 0) and len(gpu) == 3
        expected = min(derived_share(layers), state_share(gpu)) if share is None else share
        if share is None and policy == "interval":
            expected = state_share(gpu)
        assert state_share(gpu) > 10 * derived_share(layers)  # the derived share is below the GPU's here
        for level, size in ((1, host), (2, disk)):
            for _ in range(2):
                slots = tier_slots(m, level)
                rest = size - sum(b for _, b, _ in slots)  # past one slot of each group
                (n_state, b_state), kv = next((n, b) for n, b, s in slots if s), [(n, b) for n, b, s in slots if not s]
                assert abs(n_state - (1 + int(rest * expected) // b_state)) <= 1
                assert (
                    (1 - expected) * rest - sum(b for _, b in kv)
                    < sum(n * b - b for n, b in kv)
                    <= (1 - expected) * rest
                )
                if expected < 1:  # the KV groups keep the GPU's proportions
                    kv_gpu = [n for n, _, s in gpu if not s]
                    assert abs(kv[0][0] / kv[1][0] - kv_gpu[0] / kv_gpu[1]) < 0.02 * kv_gpu[0] / kv_gpu[1]
                assert m.resize(level, size)  # the same split again
    finally:
        m.shutdown()
        plain.shutdown()


@pytest.mark.parametrize("share", [0.0, 0.125, 0.5, 1.0])
def test_reuse_through_a_host_tier_stays_exact_whatever_its_state_share(
    make_manager: MakeManager, share: float
) -> None:
    """Snapshots written to a host tier of any ``lower_tier_state_share`` come back exact (the
    fake engine checks every reused block and resumed state, the invariant checker the pools);
    the states the host holds never exceed its state pool."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=1 << 20,
        host_quota=1 << 20,
        ssm_snapshot_policy="auto",
        ssm_reuse_interval=64,
        lower_tier_state_share=share,
    )
    engine = FakeEngine(m)
    prompts = [toks(seed, 300) for seed in range(1, 25)]
    for prompt in prompts:
        run(m, engine, prompt)
    reused = [run(m, engine, prompt[:200] + toks(99, 20)) for prompt in prompts]
    host = tier_slots(m, 1)
    assert m.get_tier_statistics(1).state_bytes <= sum(n * b for n, b, s in host if s)
    # 192 is a periodic snapshot, written to the host: a state pool of one slot there keeps none
    assert reused == [192 if share > 0 else 0] * len(prompts)
    assert abs(state_share(host) - share) < 0.01


def test_reuse_through_a_host_tier_with_the_derived_state_share_is_exact(make_manager: MakeManager) -> None:
    """Heavy states, ``lower_tier_state_share`` None: the host's state pool is the derived share;
    the snapshots it keeps (evicted from the GPU or written there) come back exact (the fake engine
    checks the reused blocks and the resumed state, the invariant checker the pools), and no more
    prompts hit than the GPU and the host hold states for."""
    layers = scaled_state_layers(16)
    m = make_manager(layers, T, quota=1 << 20, host_quota=4 << 20, ssm_snapshot_policy="auto", ssm_reuse_interval=64)
    engine = FakeEngine(m)
    gpu, host = tier_slots(m, 0), tier_slots(m, 1)
    assert abs(state_share(host) - derived_share(layers)) < 0.005
    prompts = [toks(seed, 1100) for seed in range(1, 25)]
    for prompt in prompts:
        run(m, engine, prompt)
    assert m.get_tier_statistics(1).state_bytes <= sum(n * b for n, b, s in host if s)
    reused = [run(m, engine, prompt + toks(98, 20)) for prompt in reversed(prompts)]
    assert set(reused) == {0, 1088} and reused[0] == 1088  # the prompts' last full blocks
    assert reused.count(1088) <= sum(n for n, _, s in gpu + host if s)
    assert m.get_tier_statistics(1).onboarded_pages > 0  # some came up from the host


def heavy_state_layers() -> list[LayerConfig]:
    """``hybrid_layers()`` with recurrent states 16x larger: one block's KV (one attention layer,
    key + value: 2 x 32 x 32 bytes) weighs 2,048 bytes, the state of the three recurrent layers
    3 x (64 + 4,096) = 12,480 bytes."""
    return [
        dataclasses.replace(layer, buffers=[BufferConfig(b.role, b.size * 16) for b in layer.buffers])
        if isinstance(layer, SsmLayerConfig)
        else layer
        for layer in hybrid_layers()
    ]


def test_ssm_lower_tier_interval_validation() -> None:
    for bad in (True, "64", 64.0):
        with pytest.raises(TypeError, match="ssm_lower_tier_interval must be an int"):
            make_config(hybrid_layers(), T, ssm_lower_tier_interval=bad)
    for bad in (0, -64, 48):
        with pytest.raises(
            ValueError, match=r"ssm_lower_tier_interval must be a positive multiple of tokens_per_block"
        ):
            make_config(hybrid_layers(), T, ssm_lower_tier_interval=bad)
    assert make_config(hybrid_layers(), T, ssm_lower_tier_interval=96).ssm_lower_tier_interval == 96


@pytest.mark.parametrize(
    ("layers", "host", "policy", "override", "spacing"),
    [
        # 64 tokens = 2 blocks of KV = 4,096 bytes; at least twice the state (24,960): 512 = 8 x 64
        ("heavy", True, "auto", None, 512),
        ("heavy", True, "auto", 128, 128),  # the explicit knob
        ("heavy", False, "auto", None, 64),  # no tier below the GPU: the interval
        ("heavy", True, "interval", None, 64),  # "interval" writes nothing straight to a lower tier
        ("light", True, "auto", None, 64),  # 2 x (3 x 320) bytes <= 4,096: the interval itself
    ],
)
def test_auto_spaces_the_lower_tier_snapshots_by_bytes(
    make_manager: MakeManager, layers: str, host: bool, policy: str, override: int | None, spacing: int
) -> None:
    """Under "auto" with a tier below the GPU the periodic snapshots written there are spaced by
    bytes: the smallest power-of-two multiple of the interval whose span's KV weighs at least twice
    a snapshot (``ssm_lower_tier_interval`` overrides); the prompt's last block and the last multiple
    of that spacing are kept (GPU)."""
    kw: dict[str, object] = {"host_quota": 16 << 20} if host else {}
    if override is not None:
        kw["ssm_lower_tier_interval"] = override
    m = make_manager(
        heavy_state_layers() if layers == "heavy" else hybrid_layers(),
        T,
        quota=16 << 20,
        ssm_snapshot_policy=policy,
        ssm_reuse_interval=64,
        **kw,
    )
    kv = m.create_kv_cache(input_tokens=toks(1, 1100))  # prompt end 1088, its last multiple of 64: 1088
    positions = [0]
    while positions[-1] < 1088:
        positions.append(kv.next_snapshot_position(positions[-1]))
    kv.close()
    assert positions[1:] == sorted({*range(spacing, 1088, spacing), 1088})


def test_reuse_from_bytes_spaced_host_snapshots_is_exact(make_manager: MakeManager) -> None:
    """Heavy states under "auto" with a host tier: a request takes periodic snapshots at multiples
    of 512 only (on the host; its last one on the GPU), none at the multiples of the interval between; a request sharing 700 tokens
    resumes from the host's snapshot at 512, exact (the fake engine checks the reused blocks and
    the resumed state), and the invariants hold."""
    m = make_manager(
        heavy_state_layers(), T, quota=16 << 20, host_quota=16 << 20, ssm_snapshot_policy="auto", ssm_reuse_interval=64
    )
    engine = FakeEngine(m)
    prompt = toks(1, 1100)
    run(m, engine, prompt)
    # 1024: the prompt's last multiple of the spacing, kept on the GPU like its last block
    assert snapshot_levels(m) == {512: 1, 1024: 0, 1088: 0}
    assert m.reuse_statistics.snapshots_interval == 1
    assert run(m, engine, prompt[:700] + toks(8, 50)) == 512
    assert snapshot_levels(m)[512] == 0  # promoted with the request's pages


# ---------------------------------------------------------------------- an engine's priorities under "auto"
def snapshot_priorities(m: KVCacheManager, groups: list[LayerGroupId]) -> list[tuple[int, int, int]]:
    """(position, layer group, priority) of every snapshot in the tree."""
    return sorted(
        ((n.ordinal + 1) * T, int(g), int(p.priority)) for n in m._tree.nodes() for g in groups if (p := n.page(g))
    )


def live_states_until(m: KVCacheManager, evicted: int) -> list[KVCache]:
    """Resumed requests without tokens (a live state each) until ``evicted`` snapshots were evicted
    (the caller closes them)."""
    others: list[KVCache] = []
    while m.reuse_statistics.snapshots_evicted < evicted:
        kv = m.create_kv_cache(id=len(others))
        others.append(kv)
        assert kv.resume()
        m.check_invariants()
    return others


def test_auto_asks_an_engine_s_callback_for_every_snapshot_two_recurrent_groups(make_manager: MakeManager) -> None:
    """Under "auto" (the default) priority 0 for the interval and prompt-end snapshots is only the
    default: a request's own ``custom_priority_callback`` is asked for every snapshot block of each
    recurrent group, and its priority wins. Two recurrent groups, the snapshot at 128 at priority 1:
    pressure on the smaller state pool evicts it first, the others stay and serve exact states."""
    layers: list[LayerConfig] = [
        SsmLayerConfig(LayerId(0), [BufferConfig("conv_state", CONV), BufferConfig("ssm_state", STATE)]),
        SsmLayerConfig(LayerId(1), [BufferConfig("ssm_state", 2 * STATE)]),
        AttentionLayerConfig(LayerId(2), [BufferConfig("key", REC * T), BufferConfig("value", REC * T)]),
    ]
    m = make_manager(layers, T, quota=64 << 10, initial_pool_ratio=[0.05, 0.05, 0.9], ssm_reuse_interval=64)
    assert m.config.ssm_snapshot_policy == "auto"
    groups = [
        LayerGroupId(g)
        for g in range(m.num_layer_groups)
        if m.get_layer_group_info(LayerGroupId(g)).kind == "recurrent"
    ]
    assert len(groups) == 2
    asked: list[tuple[int, int]] = []

    def callback(block: int, layer_group: LayerGroupId) -> Priority:
        if layer_group in groups:
            asked.append((block, int(layer_group)))
        return Priority(1 if block == 3 and layer_group in groups else 35)

    engine = FakeEngine(m)
    prompt = toks(14, 200)  # interval snapshots at 64 and 128, the prompt's last block at 192
    kv = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=callback)
    prefill(engine, kv, prompt, 200)
    kv.close()
    assert sorted(set(asked)) == [(b, g) for b in (1, 3, 5) for g in groups]
    assert snapshot_priorities(m, groups) == [
        (pos, g, 1 if pos == 128 else 35) for pos in (64, 128, 192) for g in groups
    ]
    others = live_states_until(m, 1)
    kept = [(64, 0), (64, 1), (128, 0), (192, 0), (192, 1)]  # group 1's snapshot at 128 went
    assert [(pos, g) for pos, g, _ in snapshot_priorities(m, groups)] == kept
    assert m.probe_reuse(None, prompt[:150]) == 64
    for other in others:
        other.close()
    again = m.create_kv_cache(input_tokens=prompt + toks(15, 10))
    assert again.history_length == 192
    prefill(engine, again, prompt, 200)  # checks the reused blocks and both resumed states
    again.close()
    m.check_invariants()


def test_auto_keeps_a_snapshot_an_engine_protects_by_priority(make_manager: MakeManager) -> None:
    """A request's callback gives its prefix up to 128 and the interval snapshot there priority 100
    under "auto": pressure on the state pool evicts the other snapshots (the callback's 35) and
    keeps it; a request sharing 150 tokens resumes from it, exact. Without a callback "auto"'s 0
    stays the default."""
    m = make_manager(hybrid_layers(), T, quota=64 << 10, initial_pool_ratio=[0.1, 0.9], ssm_reuse_interval=64)
    engine = FakeEngine(m)
    g = state_group(m)

    def callback(block: int, layer_group: LayerGroupId) -> Priority:
        # the prefix up to 128 at 100 (a snapshot is capped at its KV's priority), its snapshot too
        return Priority(100 if block == 3 or (block < 3 and layer_group != g) else 35)

    prompt = toks(16, 200)
    kv = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=callback)
    prefill(engine, kv, prompt, 200)
    kv.close()
    assert snapshot_priorities(m, [g]) == [(64, g, 35), (128, g, 100), (192, g, 35)]
    others = live_states_until(m, 2)
    assert snapshot_priorities(m, [g]) == [(128, g, 100)]
    for other in others:
        other.close()
    assert run(m, engine, prompt[:150] + toks(17, 20)) == 128
    plain = toks(18, 200)
    assert run(m, engine, plain) == 0
    assert [p for pos, _, p in snapshot_priorities(m, [g]) if pos in (64, 128)] == [0, 0, 100]


@pytest.mark.parametrize(("priority", "snapshot_priority"), [(80, 80), (DEFAULT_PRIORITY, 0)])
def test_auto_through_the_adapter_an_engine_request_s_priority_wins(
    make_manager: MakeManager, priority: int, snapshot_priority: int
) -> None:
    """The adapter passes an ``EngineRequest.priority`` other than the default as the request's
    callback: under "auto" its interval and prompt-end snapshots get it; the default keeps 0."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_reuse_interval=64)
    rm = KVCacheResourceManager(manager=m)
    req = EngineRequest(0, toks(19, 200), 1, priority=priority)
    while req.state is RequestState.CONTEXT:
        assert rm.prepare_resources([req]) == []
        if req.samples_this_step:
            req.generated_tokens.append(TokenId(1))
        rm.update_resources([req])
    req.state = RequestState.FINISHED
    rm.free_resources(req)
    g = state_group(m)
    assert snapshot_priorities(m, [g]) == [(pos, g, snapshot_priority) for pos in (64, 128, 192)]
    m.check_invariants()
