"""Behaviours users of the reference system expect: clamp by real allocation, close publishes the
tail, statistics (switch, copy-on-partial, SWA), constraints with a shared prompt, API shapes."""

from __future__ import annotations

import pytest
from conftest import REC, MakeManager, kv_layers
from fake_engine import FakeEngine

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    BufferId,
    KVCache,
    KVCacheDesc,
    LayerGroupId,
    LayerId,
    LogicError,
    OutOfPagesError,
)


def layer(i: int, window: int | None = None, sinks: int | None = None, size: int = 64) -> AttentionLayerConfig:
    return AttentionLayerConfig(LayerId(i), [BufferConfig("key", size)], window, sinks)


def decode_to(kv: KVCache, n: int) -> bool:
    """Grow one token at a time (history = capacity - 1), as a decode does; False at the first failure."""
    return all(kv.resize(cap, cap - 1) for cap in range(kv.capacity + 1, n + 1))


# ---------------------------------------------------------------- 1. clamp
def test_clamp_is_monotone_for_a_window_and_matches_a_real_decode(make_manager: MakeManager) -> None:
    m = make_manager([layer(0, window=32)], tokens_per_block=32, quota=64)  # one slot
    assert [m.clamp_max_seq_len_for_mem(1, b) for b in (96, 128, 160)] == [32, 32, 32]
    kv = m.create_kv_cache()
    kv.resume()
    assert decode_to(kv, 32) and not decode_to(kv, 33)
    kv.close()


@pytest.mark.parametrize(
    "layers, t, slots, batch",
    [
        ([layer(0, window=32)], 32, 3, 2),
        ([layer(0, window=40, sinks=8)], 16, 7, 2),
        ([layer(0), layer(1, window=24)], 8, 40, 3),
        ([layer(0, window=8), layer(1, window=8, sinks=4)], 4, 12, 2),
        ([layer(0)], 16, 9, 4),
    ],
)
def test_clamp_is_the_longest_length_every_request_reaches(
    make_manager: MakeManager, layers: list[AttentionLayerConfig], t: int, slots: int, batch: int
) -> None:
    m = make_manager(layers, tokens_per_block=t, quota=slots * 64 * len(layers))
    bound = 50 * t
    n = m.clamp_max_seq_len_for_mem(batch, bound)
    assert 0 < n <= bound
    caches = [m.create_kv_cache() for _ in range(batch)]
    for kv in caches:
        kv.resume()
    for cap in range(1, n + 1):  # the whole batch decodes in lockstep up to n
        assert all(kv.resize(cap, cap - 1) for kv in caches), cap
    if n < bound:
        assert not all(kv.resize(n + 1, n) for kv in caches)  # one more token does not fit
    else:
        assert all(lc.window_size for lc in layers)  # only sliding windows fit any length
    for kv in caches:
        kv.close()


# ---------------------------------------------------------------- 2. close publishes the tail
def test_close_publishes_the_partial_last_block(make_manager: MakeManager) -> None:
    m = make_manager([layer(0, size=REC * 4)], tokens_per_block=4)
    engine = FakeEngine(m)
    toks = [11, 12, 13, 14, 15, 16]
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(6)
    engine.step(kv, toks, 0, 6)
    kv.commit(toks)
    kv.close()
    assert m.probe_reuse(input_tokens=[*toks, 99]) == 6  # a multi-turn follow-up reuses the tail
    follow = m.create_kv_cache(input_tokens=[*toks, 99])
    assert follow.resume()
    engine.check_all(follow, toks, 6)
    follow.close()


def test_stop_committing_then_close_publishes_only_what_was_committed_before(make_manager: MakeManager) -> None:
    m = make_manager([layer(0, size=REC * 4)], tokens_per_block=4)
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(8)
    kv.commit([1, 2, 3, 4, 5])
    kv.stop_committing()  # publishes [1..5]; what the request computes after must not be reused
    kv.close()
    assert m.probe_reuse(input_tokens=[1, 2, 3, 4, 5, 6, 7]) == 5


# ---------------------------------------------------------------- 3, 5, 6. statistics
def test_stats_can_be_switched_off(make_manager: MakeManager) -> None:
    m = make_manager([layer(0)], tokens_per_block=4, enable_stats=False)
    for _ in range(2):
        kv = m.create_kv_cache(input_tokens=list(range(12)))
        kv.resume()
        assert kv.resize(12)
        kv.commit(list(range(kv.history_length, 12)))
        kv.close()
    assert m.reuse_statistics == kvm.ReuseStatistics()


def test_copy_on_partial_counts_as_an_allocated_page(make_manager: MakeManager) -> None:
    m = make_manager([layer(0)], tokens_per_block=4)
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(12)
    kv.commit(list(range(12)))
    kv.close()
    before = m.reuse_statistics
    b = m.create_kv_cache(input_tokens=[*range(9), 50, 51])  # 9 of 12 cached tokens: 2 blocks + 1 partial
    assert b.history_length == 9
    assert b.resume()
    st = m.reuse_statistics
    assert st.reused_blocks - before.reused_blocks == 3
    assert st.reused_pages - before.reused_pages == 2
    assert st.allocated_pages - before.allocated_pages == 1  # the private copy
    b.close()


def test_swa_stats_count_skipped_blocks_and_reused_pages_apart(make_manager: MakeManager) -> None:
    m = make_manager([layer(0, window=8)], tokens_per_block=4)
    toks = list(range(100, 116))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(16)
    kv.commit(toks)
    kv.close()
    before = m.reuse_statistics
    b = m.create_kv_cache(input_tokens=[*toks[:15], 7])  # 15-token match: blocks 0, 1 out of the window
    assert b.history_length == 15
    st = m.reuse_statistics
    assert st.reused_blocks - before.reused_blocks == 4  # tokens skipped: 4 blocks
    assert st.reused_pages - before.reused_pages == 1  # block 2; block 3 is the partial one (copied on resume)
    b.close()


# ---------------------------------------------------------------- 4. constraints with a shared prompt
def test_constraints_count_shared_prompt_blocks_once_and_only_in_the_window(make_manager: MakeManager) -> None:
    layers = [layer(0, window=128, sinks=32, size=64), layer(1, size=64)]
    batch = BatchDesc([KVCacheDesc(576, 575)] * 4, system_prompt_length=64)
    # full: 4 x 18 blocks - 3 x 2 shared = 66; SWA: 4 x (1 sink + 4 window) - 3 x 1 shared sink = 17
    m = make_manager(layers, tokens_per_block=32, quota=(66 + 17) * 64, constraints=[batch])
    assert [s.total for s in m.get_storage_statistics()] == [83]  # one pool group (equal slot sizes)
    system = list(range(64))
    first = m.create_kv_cache()
    first.resume()
    assert first.resize(64)
    first.commit(system)
    first.close()
    caches = [m.create_kv_cache(input_tokens=[*system, r]) for r in range(4)]
    for kv in caches:
        assert kv.resume() and kv.history_length == 64
        assert kv.resize(576, 575)  # the constraint's shape: window pages only, shared sink once
    assert m.get_storage_statistics()[0].free == 0
    for kv in caches:
        kv.close()


def _two_pool_groups(t: int) -> tuple[list[AttentionLayerConfig], int]:
    """Two layer groups (full attention, a window) of different slot sizes, so two pool groups,
    and the bytes of one slot of each."""
    buffers = [BufferConfig("key", 2 * REC * t), BufferConfig("value", 2 * REC * t)]
    big = AttentionLayerConfig(LayerId(1), buffers, sliding_window_size=8 * t)
    return [*kv_layers(1, t), big], (2 + 4) * REC * t


@pytest.mark.parametrize("host", [False, True])
def test_constraint_batch_resumes_past_the_resume_gate(make_manager: MakeManager, host: bool) -> None:
    """Issue 38.3: a quota of exactly 32 slots per pool group, a constraint of 32 one-block
    requests, ``max_util_for_resume=0.95``: every request of the batch resumes (the gate once
    refused the last ones at 30/32 used), new or resumed again after a suspend, GPU only or over a
    host tier; the KV of each is intact."""
    t = 8
    layers, both = _two_pool_groups(t)
    m = make_manager(
        layers,
        t,
        quota=32 * both,
        host_quota=4 * both if host else None,
        constraints=[BatchDesc([KVCacheDesc(1, 0)] * 32)],
        max_util_for_resume=0.95,
    )
    assert [s.total for s in m.get_storage_statistics()] == [32, 32]
    engine = FakeEngine(m)
    caches = [m.create_kv_cache(id=i) for i in range(32)]
    for i, kv in enumerate(caches):
        assert kv.resume(), i
        assert kv.resize(1)
        engine.step(kv, [1000 + i], 0, 1)
        kv.commit([1000 + i])
    assert [s.free for s in m.get_storage_statistics()] == [0, 0]
    for kv in caches:
        kv.suspend()
    for i, kv in enumerate(caches):
        assert kv.resume(), i
        engine.check_all(kv, [1000 + i], 1)
    for kv in caches:
        kv.close()


def test_the_resume_gate_applies_above_the_constraint_floor(make_manager: MakeManager) -> None:
    """Issue 38.3: the gate admits while the unavailable slots (with the request's pages placed)
    stay within what the constraints guarantee, and applies ``max_util_for_resume`` beyond: 16
    guaranteed of 32 at 0.25 admit 17 resumes of empty caches (the 17th sees 16 used), not 9."""
    t = 8
    batch = BatchDesc([KVCacheDesc(1, 0)] * 16)
    m = make_manager(kv_layers(1, t), t, quota=32 * 2 * REC * t, constraints=[batch], max_util_for_resume=0.25)
    assert [s.total for s in m.get_storage_statistics()] == [32]
    caches: list[KVCache] = []
    while True:
        kv = m.create_kv_cache()
        if not kv.resume():
            kv.close()
            break
        caches.append(kv)
        assert kv.resize(1)
    assert len(caches) == 17
    for kv in caches:
        kv.close()


# ---------------------------------------------------------------- 8. API shapes
def test_buffer_id_is_a_named_tuple() -> None:
    b = kvm.BufferId(LayerId(0), "key")
    assert b == (0, "key") and b.layer_id == 0 and b.role == "key"
    assert hash(b) == hash((0, "key"))


def test_capacity_history_and_stream_are_settable(make_manager: MakeManager) -> None:
    m = make_manager([layer(0)], tokens_per_block=4, quota=4 * 64)
    kv = m.create_kv_cache()
    kv.resume()
    kv.capacity = 10
    assert kv.capacity == 10 and kv.num_blocks == 3
    kv.history_length = 8
    assert kv.history_length == 8 and kv.capacity == 10
    with pytest.raises(OutOfPagesError, match="capacity 40"):
        kv.capacity = 40
    assert kv.capacity == 10
    with pytest.raises(LogicError):
        kv.history_length = 4
    kv.cuda_stream = 7
    assert kv.cuda_stream == 7
    with pytest.raises(TypeError):  # compiled: mypyc checks the annotation itself
        kv.cuda_stream = "s"  # type: ignore[assignment]
    kv.close()


def test_aggregated_page_desc_has_the_reference_names(make_manager: MakeManager) -> None:
    m = make_manager([layer(0), layer(1, window=8)], tokens_per_block=4)
    descs = list(m.get_aggregated_pages([BufferId(LayerId(1), "key")]))
    assert len(descs) == 1
    d = descs[0]
    assert d.base == d.base_address and d.buffers == d.buffer_ids == (BufferId(LayerId(1), "key"),)
    assert d.layer_group_id == m.get_layer_group_id(LayerId(1)) == LayerGroupId(1)
