"""Recurrent-state layers (issue #26): config, the live state per request and beam, snapshots
for prefix reuse, the matching rule, eviction, tiers, beams, events, sizing, through the fake
engine (recurrent records: the state after ``position`` tokens) and the invariant checker."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
from conftest import REC, MakeManager, make_config, toks
from fake_engine import FakeEngine, KVMismatch

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BlockRemovedEvent,
    BlockStoredEvent,
    BufferConfig,
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    Priority,
    RemoteCacheTierConfig,
    SsmLayerConfig,
)
from kv_cache_manager_v2._config import LayerConfig
from kv_cache_manager_v2.redis_server import LocalRedisServer

T = 32
CONV = 64
STATE = 256
#: a typical step of short requests: with the default one (4096 tokens) a 256 KiB GPU holds one
#: request's blocks, so the split gives the small states only the slots of one request
SHORT_STEP = BatchDesc([KVCacheDesc(160, 150)] * 4)


def hybrid_layers(num_ssm: int = 3, num_attention: int = 1, window: int | None = None, t: int = T) -> list[LayerConfig]:
    """``num_ssm`` recurrent layers then ``num_attention`` attention layers (``window``: theirs)."""
    out: list[LayerConfig] = []
    for i in range(num_ssm):
        out.append(SsmLayerConfig(LayerId(i), [BufferConfig("conv_state", CONV), BufferConfig("ssm_state", STATE)]))
    for i in range(num_attention):
        out.append(
            AttentionLayerConfig(
                LayerId(num_ssm + i),
                [BufferConfig("key", REC * t), BufferConfig("value", REC * t)],
                sliding_window_size=window,
            )
        )
    return out


def live_states_until_a_snapshot_goes(m: KVCacheManager) -> list[KVCache]:
    """Resumed requests without tokens (a live state each) until the state pool evicts a snapshot
    (the caller closes them)."""
    g = state_group(m)
    slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    evicted = m.reuse_statistics.snapshots_evicted
    others = []
    for i in range(slots):
        kv = m.create_kv_cache(id=i)
        assert kv.resume()
        others.append(kv)
        if m.reuse_statistics.snapshots_evicted > evicted:
            break
    return others


def state_group(m: KVCacheManager) -> LayerGroupId:
    groups = [
        LayerGroupId(g)
        for g in range(m.num_layer_groups)
        if m.get_layer_group_info(LayerGroupId(g)).kind == "recurrent"
    ]
    assert len(groups) == 1
    return groups[0]


def prefill(
    engine: FakeEngine, kv: KVCache, tokens: Sequence[int], upto: int, chunk: int = 1 << 30, cut: bool = True
) -> None:
    """Resume, check the reused prefix and state, then compute and commit up to ``upto`` in chunks
    of at most ``chunk`` tokens, cut at snapshot positions when ``cut``."""
    assert kv.resume()
    pos = kv.history_length
    engine.check_all(kv, tokens, pos)
    while pos < upto:
        end = min(upto, pos + chunk)
        nxt = kv.next_snapshot_position(pos)
        if cut and nxt is not None:
            end = min(end, nxt)
        assert kv.resize(end)
        engine.step(kv, tokens, pos, end)
        kv.commit(list(tokens[pos:end]))
        pos = end


def decode(engine: FakeEngine, kv: KVCache, tokens: Sequence[int], upto: int) -> None:
    for pos in range(kv.history_length, upto):
        assert kv.resize(pos + 1)
        engine.step(kv, tokens, pos, pos + 1)
        kv.commit([tokens[pos]])


# ---------------------------------------------------------------------- config
def test_config_validation() -> None:
    layers = hybrid_layers()
    for bad in (0, -32, 48, 1000):
        with pytest.raises(ValueError, match=rf"ssm_reuse_interval.*tokens_per_block \({T}\).*got {bad}"):
            make_config(layers, T, ssm_reuse_interval=bad)
    for wrong in (True, "64", 64.0):  # compiled too: refused before a typed read of the field
        with pytest.raises(TypeError, match="ssm_reuse_interval must be an int"):
            make_config(layers, T, ssm_reuse_interval=wrong)
    with pytest.raises(ValueError, match="tokens_per_block_override must be None"):
        SsmLayerConfig(LayerId(0), [BufferConfig("ssm_state", 64, 8)])
    with pytest.raises(ValueError, match="appears twice"):
        SsmLayerConfig(LayerId(0), [BufferConfig("ssm_state", 64), BufferConfig("ssm_state", 32)])
    with pytest.raises(ValueError, match="must not be empty"):
        SsmLayerConfig(LayerId(0), [])
    with pytest.raises(ValueError, match="appears twice"):
        make_config([*layers, SsmLayerConfig(LayerId(0), [BufferConfig("s", 64)])], T)
    assert make_config(layers, T).snapshot_interval == 512
    assert make_config(layers, T, ssm_reuse_interval=64).snapshot_interval == 64
    assert make_config(hybrid_layers(t=1024), 1024, quota=1 << 24).snapshot_interval == 1024
    assert make_config(hybrid_layers(num_ssm=0), T).snapshot_interval == 0


def test_layer_groups_and_memory_per_request_is_the_buffer_bytes(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T)
    g = state_group(m)
    info = m.get_layer_group_info(g)
    assert info.layer_ids == (0, 1, 2) and info.window_size is None and info.num_sink_blocks == 0
    desc = m.pool_group_descs[info.pool_group_index]
    assert sum(p.slot_bytes for p in desc.pools) == 3 * (CONV + STATE)  # one slot: a request's whole state
    kv = m.create_kv_cache(input_tokens=toks(1, 100))
    used = m.get_storage_statistics()[info.pool_group_index]
    assert kv.resume()
    after = m.get_storage_statistics()[info.pool_group_index]
    assert used.free - after.free == 1
    for layer in (0, 1, 2):
        for role, size in (("conv_state", CONV), ("ssm_state", STATE)):
            assert m.get_page_stride(LayerId(layer), role) == size
    assert kv.resize(200)  # growth takes KV pages, never another state page
    assert m.get_storage_statistics()[info.pool_group_index].free == after.free
    with pytest.raises(ValueError, match="'full_attention' group"):
        kv.get_ssm_state_index(LayerGroupId(1 - g))
    kv.close()
    assert m.get_storage_statistics()[info.pool_group_index].free == used.free


def test_state_index_needs_an_active_cache_and_stays_across_suspend(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T)
    engine = FakeEngine(m)
    g = state_group(m)
    tokens = toks(2, 80)
    kv = m.create_kv_cache(input_tokens=tokens)
    with pytest.raises(ValueError, match="SUSPENDED"):
        kv.get_ssm_state_index(g)
    prefill(engine, kv, tokens, 50)
    index = kv.get_ssm_state_index(g)
    kv.suspend()
    with pytest.raises(ValueError, match="SUSPENDED"):
        kv.get_ssm_state_index(g)
    assert kv.resume()
    assert kv.get_ssm_state_index(g) == index
    engine.check_all(kv, tokens, 50)
    decode(engine, kv, tokens, 80)
    with pytest.raises(ValueError, match="beam"):
        kv.get_ssm_state_index(g, 1)
    kv.close()


def test_next_snapshot_position(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=128)
    kv = m.create_kv_cache(input_tokens=toks(3, 300))  # prompt end 288
    assert [kv.next_snapshot_position(p) for p in (0, 127, 128, 255, 256, 287, 288, 500)] == [
        128,
        128,
        256,
        256,
        288,
        288,
        384,
        512,
    ]
    kv.close()
    plain = make_manager(hybrid_layers(num_ssm=0), T)
    kv = plain.create_kv_cache(input_tokens=toks(3, 300))
    assert kv.next_snapshot_position(0) is None
    kv.close()


# ---------------------------------------------------------------------- snapshots and matching
def test_no_reuse_before_the_first_snapshot(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=128)
    engine = FakeEngine(m)
    prompt = toks(4, 200)  # prompt end 192
    a = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, a, prompt, 96)
    a.close()
    assert m.reuse_statistics.snapshots_taken == 0
    assert m.probe_reuse(None, prompt) == 0  # the attention blocks are there, no state is
    b = m.create_kv_cache(input_tokens=prompt)
    assert b.history_length == 0
    prefill(engine, b, prompt, 128)
    b.close()
    assert m.reuse_statistics.snapshots_taken == 1
    assert m.probe_reuse(None, prompt) == 128
    c = m.create_kv_cache(input_tokens=prompt)
    assert c.history_length == 128
    prefill(engine, c, prompt, 200)  # checks the copied state holds the state at 128
    decode(engine, c, prompt + toks(5, 10), 210)
    c.close()
    stats = m.reuse_statistics
    assert stats.snapshots_reused == 1 and stats.snapshots_taken == 2  # and the prompt end, 192


def test_a_commit_past_a_boundary_takes_no_snapshot(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=64)
    engine = FakeEngine(m)
    prompt = toks(6, 100)
    a = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, a, prompt, 96, chunk=96, cut=False)  # 0 -> 96 jumps over 64; 96 is the prompt end
    a.close()
    assert m.reuse_statistics.snapshots_taken == 1
    assert m.probe_reuse(None, prompt) == 96
    assert m.probe_reuse(None, prompt[:95]) == 0  # a match never ends between snapshots


def test_prompt_end_snapshot_is_reused_by_the_next_turn(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T)  # interval 512: only prompt ends
    engine = FakeEngine(m)
    turn1 = toks(7, 100)
    answer = toks(8, 20)
    a = m.create_kv_cache(input_tokens=turn1)
    prefill(engine, a, turn1, 100)
    decode(engine, a, turn1 + answer, 120)
    a.close()
    turn2 = turn1 + answer + toks(9, 50)
    assert m.probe_reuse(None, turn2) == 96
    b = m.create_kv_cache(input_tokens=turn2)
    assert b.history_length == 96
    prefill(engine, b, turn2, len(turn2))
    b.close()
    turn3 = turn2 + toks(10, 40)
    assert m.probe_reuse(None, turn3) == len(turn2) // T * T


def test_the_fake_engine_catches_a_wrong_state(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=64)
    engine = FakeEngine(m)
    prompt = toks(11, 130)
    a = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, a, prompt, 130)
    a.close()
    other = toks(12, 64)
    b = m.create_kv_cache(input_tokens=other)
    prefill(engine, b, other, 64)
    with pytest.raises(KVMismatch, match="state at position 64"):
        engine.check_all(b, prompt, 64)  # another sequence's state
    b.close()


def test_hybrid_match_never_exceeds_attention_and_probe_equals_create(make_manager: MakeManager) -> None:
    """Random prompts sharing prefixes, random chunkings (some jumping over snapshot positions),
    sliding-window attention: what ``probe_reuse`` reports ``create`` reuses, it ends at a
    snapshot, and the reused state is the state at that position."""
    rng = random.Random(13)
    m = make_manager(hybrid_layers(num_ssm=2, num_attention=2, window=48), T, quota=4 << 20, ssm_reuse_interval=64)
    attention_only = make_manager(hybrid_layers(num_ssm=0, num_attention=2, window=48), T, quota=4 << 20)
    engine = FakeEngine(m)
    engine_a = FakeEngine(attention_only)
    bases = [toks(100 + i, 400) for i in range(3)]
    for round_ in range(25):
        base = rng.choice(bases)
        n = rng.randrange(1, 400)
        prompt = base[: rng.randrange(0, n + 1)] + toks(1000 + round_, 0 if rng.random() < 0.5 else 20)
        prompt = (prompt + base)[:n] if rng.random() < 0.5 else prompt
        if not prompt:
            continue
        probed = m.probe_reuse(None, prompt)
        assert probed <= attention_only.probe_reuse(None, prompt)
        assert probed % T == 0
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.history_length == probed
        cut = rng.random() < 0.7
        prefill(engine, kv, prompt, len(prompt), chunk=rng.choice([16, 32, 50, 100, 1000]), cut=cut)
        kv.close()
        ref = attention_only.create_kv_cache(input_tokens=prompt)
        prefill(engine_a, ref, prompt, len(prompt), cut=False)
        ref.close()
    stats = m.reuse_statistics
    assert stats.snapshots_reused > 0 and stats.snapshots_taken > 0


# ---------------------------------------------------------------------- eviction, tiers, events
def _low_priority_at(ordinal: int, state: LayerGroupId) -> Callable[[int, LayerGroupId], Priority]:
    def callback(block: int, layer_group: LayerGroupId) -> Priority:
        return Priority(1 if (block == ordinal and layer_group == state) else 35)

    return callback


def test_snapshot_evicted_with_the_kv_kept_and_events_scoped(make_manager: MakeManager) -> None:
    events = KVCacheEventManager()
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.1, 0.9],
        ssm_reuse_interval=64,
        event_manager=events,
        ssm_snapshot_policy="interval",
    )
    engine = FakeEngine(m)
    g = state_group(m)
    prompt = toks(14, 200)  # snapshots at 64, 128, 192 (also the prompt end)
    a = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=_low_priority_at(5, g))
    prefill(engine, a, prompt, 200)
    a.close()
    assert m.reuse_statistics.snapshots_taken == 3
    stored = [e for e in m.get_latest_events() if isinstance(e, BlockStoredEvent)]
    assert sum(1 for e in stored if e.group_idx == g) == 3
    assert m.probe_reuse(None, prompt) == 192
    # live states of other requests fill the state pool: the low-priority snapshot goes first
    others = live_states_until_a_snapshot_goes(m)
    assert m.reuse_statistics.snapshots_evicted == 1
    removed = [e for e in m.get_latest_events() if isinstance(e, BlockRemovedEvent)]
    assert removed and all(e.group.group_idx == g for e in removed)  # the KV block stays announced
    assert m.probe_reuse(None, prompt) == 128  # the KV of blocks 4 and 5 stays, the match stops earlier
    b = m.create_kv_cache(input_tokens=prompt)
    assert b.history_length == 128
    for kv in others:
        kv.close()
    prefill(engine, b, prompt, 200)
    b.close()


def test_no_room_for_a_snapshot_skips_it(make_manager: MakeManager) -> None:
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.1, 0.9],
        ssm_reuse_interval=32,
        max_util_for_resume=1.0,
    )
    engine = FakeEngine(m)
    g = state_group(m)
    slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    held = [m.create_kv_cache(id=i) for i in range(slots - 1)]
    for kv in held:
        assert kv.resume()
    tokens = toks(15, 64)
    kv = m.create_kv_cache(input_tokens=tokens)
    prefill(engine, kv, tokens, 64)  # its live state takes the last slot: no room at 32 and 64
    stats = m.reuse_statistics
    assert stats.snapshots_taken == 0 and stats.snapshots_skipped == 2
    kv.close()
    for other in held:
        other.close()
    assert m.probe_reuse(None, tokens) == 0


def host_tier_manager(make_manager: MakeManager) -> KVCacheManager:
    """A small GPU tier (a tenth for the states) over a host tier (a tenth too: the share derived
    for these light states holds one), snapshots every 64 tokens."""
    return make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.1, 0.9],
        host_quota=256 << 10,
        lower_tier_state_share=0.1,
        ssm_reuse_interval=64,
        max_util_for_resume=1.0,
    )


def test_live_state_and_snapshots_spill_to_host_and_come_back(make_manager: MakeManager) -> None:
    m = host_tier_manager(make_manager)
    engine = FakeEngine(m)
    g = state_group(m)
    slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    prompt = toks(16, 150)
    a = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, a, prompt, 150)
    a.close()
    b_tokens = toks(17, 90)
    b = m.create_kv_cache(input_tokens=b_tokens)
    prefill(engine, b, b_tokens, 90)
    b.suspend()
    # fill the GPU state pool with other live states: b's state and the snapshots go to the host tier
    others = [m.create_kv_cache(id=i) for i in range(slots)]
    for kv in others:
        assert kv.resume()
    host = m.get_storage_statistics(CacheLevel(1))[m.get_layer_group_info(g).pool_group_index]
    assert host.free < host.total  # b's live state (held) and snapshots went down
    for kv in others:
        kv.close()
    assert b.resume()  # back with its bytes intact
    engine.check_all(b, b_tokens, 90)
    decode(engine, b, b_tokens + toks(18, 10), 100)
    b.close()
    assert m.probe_reuse(None, prompt) == 128
    c = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, c, prompt, 150)  # the snapshot at 128, onboarded and copied
    c.close()


def test_a_live_state_lost_to_a_disk_error_is_replaced_at_resume(make_manager: MakeManager, tmp_path: object) -> None:
    """A suspended request's live state goes to disk and the write fails: the state is lost, so the
    resume lets it go, starts the request over (a shorter state cannot be recovered) and takes a new
    live state page for it (it once resumed ACTIVE without one)."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.1, 0.9],
        disk_quota=256 << 10,
        disk_path=str(tmp_path),
        ssm_reuse_interval=64,
        max_util_for_resume=1.0,
    )
    engine = FakeEngine(m)
    g = state_group(m)
    slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    b_tokens = toks(21, 90)
    b = m.create_kv_cache(input_tokens=b_tokens)
    prefill(engine, b, b_tokens, 90)
    b.suspend()
    disk = m._storage.levels[CacheLevel(1)].items[m.get_layer_group_info(g).pool_group_index].pools[0]
    disk.error_hook = lambda op, off, n: op == "write"  # type: ignore[attr-defined]
    others = [m.create_kv_cache(id=i) for i in range(slots)]  # b's live state is pushed down: lost
    for kv in others:
        assert kv.resume()
    disk.error_hook = None  # type: ignore[attr-defined]
    assert m.get_tier_statistics(CacheLevel(1)).io_errors > 0
    for kv in others:
        kv.close()
    assert b.resume()
    assert b.history_length == 0 and b.num_committed_tokens == 0
    b.get_ssm_state_index(g)  # a live state again
    m.check_invariants()
    b.suspend()
    prefill(engine, b, b_tokens, 90)  # recomputed from the start
    engine.check_all(b, b_tokens, 90)
    b.close()


def test_beams_copy_the_state(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=64)
    engine = FakeEngine(m)
    g = state_group(m)
    prompt = toks(19, 70)
    kv = m.create_kv_cache(input_tokens=prompt, beam_width=2)
    assert kv.resume()
    assert kv.get_ssm_state_index(g, 0) != kv.get_ssm_state_index(g, 1)
    assert kv.resize(70)
    for beam in (0, 1):
        engine.step(kv, prompt, 0, 70, beam)
    kv.commit([prompt] * 2, [0, 0])
    seqs = [list(prompt), list(prompt)]
    engine.check_beam_field = False
    rng = random.Random(20)
    for pos in range(70, 90):
        assert kv.resize(pos + 1)
        new = [rng.randrange(1000), rng.randrange(1000)]
        for beam in (0, 1):
            engine.step(kv, seqs[beam] + [new[beam]], pos, pos + 1, beam)
        parents = [rng.randrange(2), rng.randrange(2)]
        seqs = [seqs[parents[b]] + [new[parents[b]]] for b in (0, 1)]
        kv.commit([[new[parents[b]]] for b in (0, 1)], parents)
        for beam in (0, 1):
            engine.check_all(kv, seqs[beam], pos + 1, beam)
    kv.close()


def test_a_beam_fork_at_a_snapshot_position_takes_the_snapshot(make_manager: MakeManager) -> None:
    """The documented protocol commits the last prompt chunk through the fork (``[chunk] * B``,
    indices ``[0] * B``): a prompt ending at a snapshot position keeps its snapshot, and a later
    block every beam shares keeps its own; the next turn resumes from them with the right state."""
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=128)
    engine = FakeEngine(m)
    prompt = toks(21, 96)  # block-aligned: the prompt end is a snapshot position
    kv = m.create_kv_cache(input_tokens=prompt, beam_width=2)
    assert kv.resume()
    assert kv.resize(96)
    for beam in (0, 1):
        engine.step(kv, prompt, 0, 96, beam)
    kv.commit([prompt] * 2, [0, 0])  # the fork
    assert m.reuse_statistics.snapshots_taken == 1
    seq = list(prompt)
    engine.check_beam_field = False  # (records of shared pages name the beam that wrote them last)
    for pos in range(96, 128):  # both beams continue beam 0 with the same tokens: shared blocks
        assert kv.resize(pos + 1)
        token = 7 + pos
        for beam in (0, 1):
            engine.step(kv, seq + [token], pos, pos + 1, beam)
        seq.append(token)
        kv.commit([[token], [token]], [0, 0])
    assert m.reuse_statistics.snapshots_taken == 2  # 128: a multiple of the interval
    m.check_invariants()
    kv.close()
    for upto in (96, 128):  # (beam 1 wrote the shared pages last: no writer-beam check)
        nxt = seq[:upto] + [1, 2]
        assert m.probe_reuse(None, nxt) == upto
        again = m.create_kv_cache(input_tokens=nxt)
        assert again.history_length == upto
        prefill(engine, again, nxt, upto + 2)
        again.close()
    m.check_invariants()


# ---------------------------------------------------------------------- sizing and levels
def test_sizing_counts_live_states_and_snapshots(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, quota=64 << 10, initial_pool_ratio=[0.1, 0.9])
    g = state_group(m)
    state_slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    kv_slots = m.pool_group_descs[1 - m.get_layer_group_info(g).pool_group_index].num_slots
    # a request holds one live state whatever its length: the batch is bounded by the state slots
    assert m.clamp_max_seq_len_for_mem(state_slots, 10_000) == kv_slots // state_slots * T
    assert m.clamp_max_seq_len_for_mem(state_slots + 1, 10_000) == 0
    # the default split counts a live state and one snapshot per request, whatever the interval
    default = make_manager(hybrid_layers(), T, quota=1 << 20)
    few = make_manager(hybrid_layers(), T, quota=1 << 20, ssm_reuse_interval=4096)
    states = [
        mm.pool_group_descs[mm.get_layer_group_info(state_group(mm)).pool_group_index].num_slots
        for mm in (default, few)
    ]
    assert states[0] == states[1] > 0
    # a constraint batch of 7 requests needs 7 live states (however long), whatever the ratio says
    batch = BatchDesc([KVCacheDesc(100, 99)] * 7)
    tight = make_manager(hybrid_layers(), T, quota=64 << 10, initial_pool_ratio=[0.01, 0.99], constraints=[batch])
    assert tight.pool_group_descs[tight.get_layer_group_info(state_group(tight)).pool_group_index].num_slots == 7
    with pytest.raises(ValueError, match="too small"):
        make_manager(hybrid_layers(), T, quota=8 << 10, constraints=[BatchDesc([KVCacheDesc(1, 0)] * 9)])


def test_sizing_counts_a_live_state_per_beam(make_manager: MakeManager) -> None:
    """Constraints, ``clamp_max_seq_len_for_mem`` and the typical step count one live state per
    beam: two requests of three beams need six, and run side by side in exactly those."""
    beams = 3
    batch = BatchDesc([KVCacheDesc(100, 99, beam_width=beams)] * 2)
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.01, 0.99],
        constraints=[batch],
        max_util_for_resume=1.0,
    )
    g = state_group(m)
    assert m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots == 2 * beams
    kv_slots = m.pool_group_descs[1 - m.get_layer_group_info(g).pool_group_index].num_slots
    assert m.clamp_max_seq_len_for_mem(2, 10_000, beam_width=beams) == kv_slots // 2 * T
    assert m.clamp_max_seq_len_for_mem(3, 10_000, beam_width=beams) == 0
    assert m.clamp_max_seq_len_for_mem(2 * beams, 10_000) == kv_slots // (2 * beams) * T
    with pytest.raises(ValueError, match="beam_width must be >= 1, got 0"):
        m.clamp_max_seq_len_for_mem(1, 100, beam_width=0)
    with pytest.raises(ValueError, match=r"KVCacheDesc\.beam_width must be at most 256, got 257"):
        KVCacheDesc(1, 0, beam_width=257)
    with pytest.raises(TypeError, match=r"KVCacheDesc\.beam_width must be an int"):
        KVCacheDesc(1, 0, beam_width=True)
    # through the fake engine: both requests fork and decode, every beam's state checked
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(23)
    caches: list[tuple[KVCache, list[list[int]]]] = []
    for r in range(2):
        prompt = toks(40 + r, 70)
        kv = m.create_kv_cache(input_tokens=prompt, beam_width=beams)
        assert kv.resume()
        assert kv.resize(70)
        for beam in range(beams):
            engine.step(kv, prompt, 0, 70, beam)
        kv.commit([prompt] * beams, [0] * beams)
        caches.append((kv, [list(prompt) for _ in range(beams)]))
    assert len({kv.get_ssm_state_index(g, b) for kv, _ in caches for b in range(beams)}) == 2 * beams
    late = m.create_kv_cache(input_tokens=toks(49, 40))
    assert not late.resume()  # every state slot is a live beam state
    for pos in range(70, 80):
        for i, (kv, seqs) in enumerate(caches):
            assert kv.resize(pos + 1)
            new = [rng.randrange(1000) for _ in range(beams)]
            for beam in range(beams):
                engine.step(kv, seqs[beam] + [new[beam]], pos, pos + 1, beam)
            parents = [rng.randrange(beams) for _ in range(beams)]
            seqs = [seqs[parents[b]] + [new[parents[b]]] for b in range(beams)]
            kv.commit([[new[parents[b]]] for b in range(beams)], parents)
            for beam in range(beams):
                engine.check_all(kv, seqs[beam], pos + 1, beam)
            caches[i] = (kv, seqs)
        m.check_invariants()
    for kv, _ in caches:
        kv.close()
    assert late.resume()
    late.close()
    # the default split weights a typical step's beams: more live states, so more state slots
    shapes = [BatchDesc([KVCacheDesc(4096, 3584, beam_width=w)] * 4) for w in (1, 4)]
    states = [
        mm.pool_group_descs[mm.get_layer_group_info(state_group(mm)).pool_group_index].num_slots
        for mm in (make_manager(hybrid_layers(), T, quota=1 << 20, typical_step=s) for s in shapes)
    ]
    assert states[1] > states[0] > 0


def test_default_split_admits_a_typical_step_request_with_a_heavy_state(make_manager: MakeManager) -> None:
    """A state as heavy as 50 KV blocks (Qwen3-Next: 37.7 MiB vs 768 KiB): the default split
    (typical step: 4096 tokens) counts the live state and one snapshot, so a quota holding those
    and the request's 128 blocks admits it. Counting a snapshot per 512 tokens (9 states) left
    the KV pool 53 blocks, 1696 tokens."""
    kv_block = 2 * REC * T  # one attention layer
    layers: list[LayerConfig] = [
        SsmLayerConfig(LayerId(i), [BufferConfig("conv_state", 1024), BufferConfig("ssm_state", 25 * kv_block - 1024)])
        for i in range(2)
    ]
    layers.append(AttentionLayerConfig(LayerId(2), [BufferConfig("key", REC * T), BufferConfig("value", REC * T)]))
    m = make_manager(layers, T, quota=240 * kv_block, max_util_for_resume=1.0)  # 2 state slots: both used
    assert m.clamp_max_seq_len_for_mem(1, 4096) == 4096
    engine = FakeEngine(m)
    prompt = toks(31, 4096 + 64)
    a = m.create_kv_cache(input_tokens=prompt[:4096])
    prefill(engine, a, prompt, 4096)
    a.close()
    m.check_invariants()
    # the one snapshot slot kept the prompt end: a follow-up turn resumes from it
    assert m.probe_reuse(None, prompt) == 4096
    b = m.create_kv_cache(input_tokens=prompt)
    assert b.num_committed_tokens == 4096
    prefill(engine, b, prompt, len(prompt))
    b.close()
    m.check_invariants()


def test_probe_reuse_levels_report_where_the_snapshot_is(make_manager: MakeManager) -> None:
    m = host_tier_manager(make_manager)
    engine = FakeEngine(m)
    g = state_group(m)
    prompt = toks(21, 64)
    a = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, a, prompt, 64)
    a.close()
    assert m.probe_reuse_levels(None, prompt) == [CacheLevel(0), CacheLevel(0)]
    slots = m.pool_group_descs[m.get_layer_group_info(g).pool_group_index].num_slots
    others = [m.create_kv_cache(id=i) for i in range(slots)]
    for kv in others:
        assert kv.resume()  # the snapshot goes down to the host tier, the KV stays
    assert m.probe_reuse_levels(None, prompt) == [CacheLevel(0), CacheLevel(1)]
    for kv in others:
        kv.close()
    b = m.create_kv_cache(input_tokens=prompt + toks(22, 5))
    prefill(engine, b, prompt + toks(22, 5), 69)
    b.close()


def test_a_failing_priority_callback_at_a_snapshot_changes_nothing(make_manager: MakeManager) -> None:
    # the callback sets every snapshot's priority (under "auto" too: a request's own callback wins)
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=64, ssm_snapshot_policy="interval")
    engine = FakeEngine(m)
    g = state_group(m)
    fail = [False]

    def callback(block: int, layer_group: LayerGroupId) -> Priority:
        if fail[0] and layer_group == g:
            raise RuntimeError("callback failed")
        return Priority(35)

    tokens = toks(23, 200)
    kv = m.create_kv_cache(custom_priority_callback=callback)
    assert kv.resume()
    assert kv.resize(64)
    engine.step(kv, tokens, 0, 64)
    fail[0] = True
    with pytest.raises(RuntimeError, match="callback failed"):
        kv.commit(tokens[:64])  # a multi-token commit ending at a snapshot position
    assert kv.num_committed_tokens == 0 and kv.committed_tokens == []
    kv.commit(tokens[:63])
    with pytest.raises(RuntimeError, match="callback failed"):
        kv.commit([tokens[63]])  # the decode path
    assert kv.committed_tokens == tokens[:63]
    m.check_invariants()
    fail[0] = False
    kv.commit([tokens[63]])
    assert m.reuse_statistics.snapshots_taken == 1
    kv.close()
    assert m.probe_reuse(None, tokens[:100]) == 64
    # a beam fork ending at a snapshot position asks the callback before it forks anything
    beams = m.create_kv_cache(custom_priority_callback=callback, beam_width=2)
    assert beams.resume()
    assert beams.resize(128)
    fail[0] = True
    with pytest.raises(RuntimeError, match="callback failed"):
        beams.commit([tokens[64:192]] * 2, [0, 0])
    assert beams.num_committed_tokens == 0
    beams.commit(tokens[64:100])  # not forked: a commit without indices is still allowed
    m.check_invariants()
    beams.close()
    # commit_batch: the caches before the one whose callback raised are committed (as documented)
    fail[0] = False
    second_fails = [False]

    def second(block: int, layer_group: LayerGroupId) -> Priority:
        if second_fails[0]:
            raise RuntimeError("callback failed")
        return Priority(35)

    kvs = [m.create_kv_cache(custom_priority_callback=cb) for cb in (callback, second)]
    for kv in kvs:
        assert kv.resume()
        assert kv.resize(63)
        kv.commit(tokens[:63])
    assert m.resize_batch(kvs) == []
    second_fails[0] = True
    with pytest.raises(RuntimeError, match="callback failed"):
        m.commit_batch(kvs, [tokens[63], tokens[63]])
    assert [kv.num_committed_tokens for kv in kvs] == [64, 63]
    m.check_invariants()
    for kv in kvs:
        kv.close()


def test_snapshots_survive_a_restart_on_a_persistent_disk_tier(backend: str, tmp_path: object) -> None:
    def config() -> KVCacheManagerConfig:
        return KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=[GpuCacheTierConfig(256 << 10), DiskCacheTierConfig(1 << 20, str(tmp_path), persistent=True)],
            layers=hybrid_layers(),
            ssm_reuse_interval=64,
            typical_step=SHORT_STEP,
            backend=backend,  # type: ignore[arg-type]
        )

    prompt = toks(24, 150)
    m = KVCacheManager(config())
    engine = FakeEngine(m)
    kv = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, kv, prompt, 150)
    kv.close()
    m.shutdown()  # writes the tree's pages, snapshots included, to the disk tier
    again = KVCacheManager(config())
    assert again.num_adopted_pages > 0
    assert again.probe_reuse(None, prompt) == 128
    kv = again.create_kv_cache(input_tokens=prompt)
    prefill(FakeEngine(again), kv, prompt, 150)  # the adopted snapshot holds the state at 128
    kv.close()
    again.shutdown()


def test_a_remote_tier_extends_a_hybrid_match_to_a_remote_snapshot(
    backend: str, redis_server: LocalRedisServer
) -> None:
    """Replicas share pages, snapshots included, through the remote tier: a replica with an empty
    local cache extends its match to the last block whose snapshot the remote tier holds (never
    between snapshots), probe_reuse equals what create reuses, and the fetched state is exact."""

    def manager(gpu: int = 256 << 10) -> KVCacheManager:
        return KVCacheManager(
            KVCacheManagerConfig(
                tokens_per_block=T,
                cache_tiers=[
                    GpuCacheTierConfig(gpu),
                    RemoteCacheTierConfig(redis_server.url, "hybrid", write_through=True),
                ],
                layers=hybrid_layers(window=96),
                ssm_reuse_interval=64,
                typical_step=SHORT_STEP,
                max_util_for_resume=1.0,
                backend=backend,  # type: ignore[arg-type]
            )
        )

    prompt = toks(25, 150)
    first, second = manager(), manager()
    kv = first.create_kv_cache(input_tokens=prompt)
    prefill(FakeEngine(first), kv, prompt, 150)
    kv.close()
    assert first.flush_remote_writes()
    assert first.probe_reuse(None, prompt) == 128
    assert second.probe_reuse(None, prompt) == 128  # snapshots at 64 and 128 (prompt end), from Redis
    assert second.probe_reuse(None, prompt[:127]) == 64  # never between snapshots
    kv = second.create_kv_cache(input_tokens=prompt)
    assert kv.history_length == 128 and second.reuse_statistics.snapshots_reused == 1
    prefill(FakeEngine(second), kv, prompt, 150)  # checks the reused KV and the fetched state at 128
    kv.close()
    second.check_invariants()
    # local blocks past the last remote snapshot (computed in one chunk: no snapshot) do not count
    third, fourth = manager(), manager()
    longer = toks(27, 250)
    kv = third.create_kv_cache(input_tokens=longer)
    prefill(FakeEngine(third), kv, longer, 250, cut=False)
    kv.close()
    assert third.reuse_statistics.snapshots_taken == 0
    kv = fourth.create_kv_cache(input_tokens=longer[:150])
    prefill(FakeEngine(fourth), kv, longer, 150)  # snapshots at 64 and 128, written through
    kv.close()
    assert fourth.flush_remote_writes()
    assert third.probe_reuse(None, longer) == 128  # KV to 224 locally, the last snapshot at 128
    kv = third.create_kv_cache(input_tokens=longer)
    assert kv.history_length == 128
    prefill(FakeEngine(third), kv, longer, 250)
    kv.close()
    third.check_invariants()
    # random workloads over three replicas with small GPUs: probe == create, every reuse exact
    rng = random.Random(26)
    replicas = [manager(96 << 10) for _ in range(3)]
    engines = [FakeEngine(r) for r in replicas]
    prefixes = [toks(300 + i, 256) for i in range(3)]
    remote_hits = 0
    for step in range(30):
        r = rng.randrange(3)
        m = replicas[r]
        tokens = prefixes[rng.randrange(3)][: rng.choice([64, 100, 160, 256])] + toks(400 + step, rng.randrange(40))
        want = m.probe_reuse(None, tokens)
        levels = m.probe_reuse_levels(None, tokens)  # level 1: the remote tier
        assert len(levels) == want // T
        kv = m.create_kv_cache(input_tokens=tokens)
        assert kv.history_length == want, (step, want, kv.history_length)
        remote_hits += CacheLevel(1) in levels
        # checks the reused KV and that the state (local or fetched) is exactly that of ``want`` tokens
        prefill(engines[r], kv, tokens, len(tokens), chunk=rng.choice([32, 64, 1 << 30]))
        kv.close()
        assert m.flush_remote_writes()
        m.check_invariants()
    assert remote_hits >= 5, remote_hits  # 14 of 30
    for m in (first, second, third, fourth, *replicas):
        m.shutdown()


def test_history_past_the_commit_takes_no_snapshot(make_manager: MakeManager) -> None:
    """The live state holds ``history`` tokens: a commit ending at a snapshot position below it
    would store a later state as that position's."""
    m = make_manager(hybrid_layers(), T, ssm_reuse_interval=64)
    engine = FakeEngine(m)
    tokens = toks(26, 100)
    kv = m.create_kv_cache()
    assert kv.resume()
    assert kv.resize(70)
    engine.step(kv, tokens, 0, 70)
    assert kv.resize(70, 70)  # history 70: the state holds 70 tokens
    kv.commit(tokens[:64])
    assert m.reuse_statistics.snapshots_taken == 0
    kv.commit(tokens[64:70])
    kv.close()
    assert m.probe_reuse(None, tokens) == 0


def test_extra_snapshot_positions_from_start_and_end(make_manager: MakeManager) -> None:
    layers = hybrid_layers()
    for name in ("ssm_snapshots_from_start", "ssm_snapshots_from_end"):
        for bad in (0, -32, 48):
            with pytest.raises(ValueError, match=rf"{name} entries must be positive multiples.*\({T}\), got {bad}"):
                make_config(layers, T, **{name: [bad]})
        with pytest.raises(TypeError, match=name):
            make_config(layers, T, **{name: [True]})
        with pytest.raises(TypeError, match=name):
            make_config(layers, T, **{name: 64})
    m = make_manager(layers, T, ssm_snapshots_from_start=[96], ssm_snapshots_from_end=[64, 32])
    engine = FakeEngine(m)
    system = toks(27, 96)  # a shared system prompt: snapshot at its end
    prompt = system + toks(28, 150)  # 246 tokens: prompt end 224, and 160, 192 before it
    kv = m.create_kv_cache(input_tokens=prompt)
    assert [kv.next_snapshot_position(p) for p in (0, 96, 160, 192, 224)] == [96, 160, 192, 224, 512]
    prefill(engine, kv, prompt, len(prompt))
    kv.close()
    assert m.reuse_statistics.snapshots_taken == 4
    # the same conversation re-sent with its last message changed reuses up to a block before
    edited = prompt[:200] + toks(29, 40)
    assert m.probe_reuse(None, edited) == 192
    another = system + toks(30, 80)  # another conversation with the same system prompt
    assert m.probe_reuse(None, another) == 96
    b = m.create_kv_cache(input_tokens=another)
    prefill(engine, b, another, len(another))
    b.close()


# ---------------------------------------------------------------------- issue 38
def _three_state_slots_manager(make_manager: MakeManager, **tiers: object) -> tuple[KVCacheManager, int]:
    """Issue 38's layout: one attention layer + one recurrent layer (``ssm_state`` only), T = 16,
    snapshots every 32 tokens, a GPU quota of 40.5 attention slots + 3.5 state slots (the pool
    ratio to match) over ``tiers`` (``make_config``'s lower tiers); returns the manager and the
    state pool's GPU slot count (3)."""
    t = 16
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig("key", REC * t), BufferConfig("value", REC * t)]),
        SsmLayerConfig(LayerId(1), [BufferConfig("ssm_state", STATE)]),
    ]
    attention, state = 2 * REC * t * 81 // 2, STATE * 7 // 2
    quota = attention + state
    probe = make_manager(layers, t, quota=quota, initial_pool_ratio=[0.5, 0.5], ssm_reuse_interval=32)
    ratio = [0.0, 0.0]
    for g in range(probe.num_layer_groups):
        info = probe.get_layer_group_info(LayerGroupId(g))
        ratio[info.pool_group_index] = (state if info.kind == "recurrent" else attention) / quota
    probe.shutdown()
    m = make_manager(
        layers,
        t,
        quota=quota,
        initial_pool_ratio=ratio,
        ssm_reuse_interval=32,
        max_util_for_resume=1.0,
        **tiers,
    )
    slots = m.pool_group_descs[m.get_layer_group_info(state_group(m)).pool_group_index].num_slots
    assert slots == 3
    return m, slots


def test_snapshot_placed_on_host(make_manager: MakeManager) -> None:
    """Issue 38.1: every GPU state slot is taken (two empty caches and the request's own live
    state), the host tier has room: the snapshots at 32 and 64 go to the host tier (the docs: skipped
    only with no room at any level), and a second request with the same prompt resumes from the
    one at 64, byte for byte."""
    m, slots = _three_state_slots_manager(make_manager, host_quota=1 << 20)
    engine = FakeEngine(m)
    pool_group = m.get_layer_group_info(state_group(m)).pool_group_index
    held = [m.create_kv_cache(id=i) for i in range(slots - 1)]
    for kv in held:
        assert kv.resume()
    prompt = toks(38, 70)
    kv = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, kv, prompt, 70)  # commits 0-32, 32-64, 64-70
    stats = m.reuse_statistics
    assert (stats.snapshots_taken, stats.snapshots_skipped) == (2, 0)
    host = m.get_storage_statistics(CacheLevel(1))[pool_group]
    assert host.total - host.free == 2  # both snapshots on the host tier
    kv.close()
    assert m.probe_reuse_levels(None, prompt)[-1] == CacheLevel(1)
    again = m.create_kv_cache(input_tokens=prompt)
    assert again.history_length == 64
    prefill(engine, again, prompt, 70)  # checks the state copied from the host snapshot at 64
    decode(engine, again, prompt + toks(39, 4), 74)
    assert m.reuse_statistics.snapshots_reused == 1
    again.close()
    for other in held:
        other.close()


def test_snapshot_skipped_with_no_room_at_any_level(make_manager: MakeManager) -> None:
    """Issue 38.1, the other side: with no tier below the GPU the same request skips both."""
    m, slots = _three_state_slots_manager(make_manager)
    engine = FakeEngine(m)
    held = [m.create_kv_cache(id=i) for i in range(slots - 1)]
    for kv in held:
        assert kv.resume()
    prompt = toks(38, 70)
    kv = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, kv, prompt, 70)
    assert (m.reuse_statistics.snapshots_taken, m.reuse_statistics.snapshots_skipped) == (0, 2)
    kv.close()
    for other in held:
        other.close()
    assert m.probe_reuse(None, prompt) == 0


def test_snapshot_placed_on_disk_and_a_failed_write_skips_it(make_manager: MakeManager, tmp_path: object) -> None:
    """Issue 38.1 with a disk tier below the GPU: the snapshot at 32 is written to disk (counted
    as offloaded there); the write of the one at 64 fails: skipped, its slot freed, the error
    counted on the disk tier; a later request resumes from the disk snapshot at 32."""
    m, slots = _three_state_slots_manager(make_manager, disk_quota=1 << 20, disk_path=str(tmp_path))
    engine = FakeEngine(m)
    pool_group = m.get_layer_group_info(state_group(m)).pool_group_index
    held = [m.create_kv_cache(id=i) for i in range(slots - 1)]
    for kv in held:
        assert kv.resume()
    prompt = toks(40, 70)
    kv = m.create_kv_cache(input_tokens=prompt)
    prefill(engine, kv, prompt, 32)
    assert m.reuse_statistics.snapshots_taken == 1
    disk = m._storage.levels[CacheLevel(1)].items[pool_group]
    assert disk.num_offloaded == 1 and disk.num_io_errors == 0
    disk.pools[0].error_hook = lambda op, off, n: op == "write"  # type: ignore[attr-defined]
    kv.suspend()
    used = disk.num_used
    prefill(engine, kv, prompt, 70)
    disk.pools[0].error_hook = None  # type: ignore[attr-defined]
    stats = m.reuse_statistics
    assert (stats.snapshots_taken, stats.snapshots_skipped) == (1, 1)
    assert disk.num_io_errors == 1 and disk.num_used == used
    m.check_invariants()
    kv.close()
    again = m.create_kv_cache(input_tokens=prompt)
    assert again.history_length == 32
    prefill(engine, again, prompt, 70)  # the state copied from the disk snapshot at 32
    again.close()
    for other in held:
        other.close()
