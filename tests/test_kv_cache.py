"""KVCache through the fake engine: batches, prefill chunks, decode, shrink, suspend/resume,
override buffers, both index modes and live views of them, all-or-nothing resize, huge sizes,
slot accounting, window releases, bad input, queries after shutdown."""

from __future__ import annotations

import gc
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import REC, MakeManager, free_slots, kv_layers
from conftest import toks as tokens
from fake_engine import FakeEngine, KVMismatch
from tier_helpers import seq

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    KVCache,
    KVCacheManager,
    KVCacheStatus,
    LayerGroupId,
    LayerId,
    LogicError,
    PageIndexMode,
    PageStatus,
    Priority,
)

T = 8
LG0 = LayerGroupId(0)


def run_request(engine: FakeEngine, kv: KVCache, toks: list[int], chunks: list[int], decode: int) -> None:
    """Prefill in chunks, then decode one token at a time, checking and writing KV each step."""
    h = kv.history_length
    for c in chunks + [1] * decode:
        assert kv.resize(h + c, h)
        engine.step(kv, toks, h, h + c)
        kv.commit(toks[h : h + c])
        h += c
        assert kv.history_length == h == kv.num_committed_tokens


@pytest.mark.parametrize("mode", list(PageIndexMode))
def test_batch_prefill_and_decode_through_fake_engine(make_manager: MakeManager, mode: PageIndexMode) -> None:
    m = make_manager(kv_layers(3, T))
    engine = FakeEngine(m, mode)
    reqs = []
    for r in range(4):
        kv = m.create_kv_cache(id=r)
        assert kv.status is KVCacheStatus.SUSPENDED and kv.capacity == 0
        assert kv.resume()
        reqs.append((kv, tokens(r, 100)))
    # interleave: each step every request advances (prefill chunks of uneven sizes, then decode)
    for step_chunks in ([13, 5, 21, 8], [7, 16, 3, 9], [1, 1, 1, 1], [1, 1, 1, 1], [20, 1, 9, 30]):
        for (kv, toks), c in zip(reqs, step_chunks):
            h = kv.history_length
            assert kv.resize(h + c)
            engine.step(kv, toks, h, h + c)
            kv.commit(toks[h : h + c])
    for kv, toks in reqs:
        engine.check_all(kv, toks, kv.history_length)
        idx = kv.get_base_page_indices(LayerGroupId(0))
        assert isinstance(idx, memoryview) and idx.format == "i" and len(idx) == kv.num_blocks
        assert all(i != BAD_PAGE_INDEX for i in idx)
    all_slots = [i for kv, _ in reqs for i in kv.get_base_page_indices(LayerGroupId(0))]
    assert len(all_slots) == len(set(all_slots)), "a slot was handed to two blocks"
    for kv, _ in reqs:
        kv.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == [s.total for s in m.get_storage_statistics()]
    assert engine.pages_checked > 0


@pytest.mark.parametrize("kind", ["list", "tuple", "array", "range", "deque"])
def test_commit_accepts_any_token_sequence(make_manager: MakeManager, kind: str) -> None:
    """Prefill commits of every sequence type publish the same blocks (block-aligned or not)."""
    from collections import deque

    m = make_manager(kv_layers(1, T))
    toks = list(range(1000, 1000 + 3 * T + 5))
    as_kind: dict[str, Callable[[list[int]], Any]] = {
        "list": list,
        "tuple": tuple,
        "array": lambda x: array("I", x),
        "range": lambda x: range(x[0], x[0] + len(x)),
        "deque": deque,
    }
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(len(toks))
    kv.commit(as_kind[kind](toks[: T + 3]))  # from an empty tail: blocks cut from the input
    kv.commit(as_kind[kind](toks[T + 3 :]))  # onto a partial tail
    assert kv.committed_tokens == toks
    kv.close()
    assert m.probe_reuse(None, toks + [1]) == len(toks)
    kv = m.create_kv_cache(input_tokens=toks + [1])
    assert kv.history_length == len(toks) and kv.committed_tokens == toks
    kv.close()


def test_fake_engine_detects_corruption(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    kv.resume()
    toks = tokens(1, 40)
    run_request(engine, kv, toks, [20], 0)
    engine.corrupt(kv, 5)
    with pytest.raises(KVMismatch, match="position 5"):
        engine.check_all(kv, toks, 20)
    kv.close()


def test_decode_growth_within_block_changes_only_lengths(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(9)
    idx = kv.get_base_page_indices(LayerGroupId(0))
    before = list(idx)
    free_before = free_slots(m)
    for cap in range(10, 17):
        assert kv.resize(cap)
        assert list(idx) == before and free_slots(m) == free_before
    assert kv.resize(17)
    assert len(idx) == 2 and list(idx) == before  # a view keeps its length; its entries stay live
    idx = kv.get_base_page_indices(LayerGroupId(0))
    assert len(idx) == 3 and free_slots(m)[0] == free_before[0] - 1
    kv.close()


def test_capacity_shrink_releases_tail_and_keeps_data(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    kv.resume()
    toks = tokens(2, 64)
    run_request(engine, kv, toks, [10], 0)
    assert kv.resize(64)
    total_free = free_slots(m)[0]
    assert kv.resize(11)  # speculative room given back
    assert kv.num_blocks == 2 and free_slots(m)[0] == total_free + 6
    engine.check_all(kv, toks, 10)
    with pytest.raises(LogicError, match="below history"):
        kv.resize(9)
    run_request(engine, kv, toks, [30], 3)
    kv.close()


def test_suspend_resume_keeps_pages_and_data(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    kv.resume()
    toks = tokens(3, 60)
    run_request(engine, kv, toks, [17], 2)
    idx_before = list(kv.get_base_page_indices(LayerGroupId(0)))
    kv.suspend()
    assert kv.status is KVCacheStatus.SUSPENDED
    assert kv.block_table.pages[0][0] is not None and kv.block_table.pages[0][0].status is PageStatus.HELD
    with pytest.raises(LogicError, match="ACTIVE"):
        kv.resize(30)
    assert kv.resume()
    assert kv.block_table.pages[0][0] is not None and kv.block_table.pages[0][0].status is PageStatus.LOCKED
    assert list(kv.get_base_page_indices(LayerGroupId(0))) == idx_before
    run_request(engine, kv, toks, [10], 5)
    kv.close()
    kv.close()  # idempotent
    assert kv.status is KVCacheStatus.CLOSED


def test_tokens_per_block_override_buffers(make_manager: MakeManager) -> None:
    layers = [
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 32 * 2, 2), BufferConfig("value", 32 * T)])
        for i in range(2)
    ]
    m = make_manager(layers)
    for mode in PageIndexMode:
        engine = FakeEngine(m, mode)
        assert engine.buffers[0].expansion == T // 2
        kv = m.create_kv_cache()
        kv.resume()
        run_request(engine, kv, tokens(4, 50), [11, 20], 4)
        kv.close()


def test_resize_is_all_or_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), quota=2 * 32 * T * 2 * 10)  # 10 slots of 2 layers x K,V
    assert m.get_storage_statistics()[0].total == 10
    engine = FakeEngine(m)
    a, b = m.create_kv_cache(), m.create_kv_cache()
    a.resume()
    b.resume()
    ta, tb = tokens(5, 80), tokens(6, 80)
    run_request(engine, a, ta, [40], 0)  # 5 slots
    run_request(engine, b, tb, [24], 0)  # 3 slots
    idx_before = list(b.get_base_page_indices(LayerGroupId(0)))
    assert not b.resize(24 + 3 * T)  # needs 3 more, 2 free
    assert (b.capacity, b.history_length, b.num_blocks) == (24, 24, 3)
    assert list(b.get_base_page_indices(LayerGroupId(0))) == idx_before
    assert free_slots(m) == [2]
    engine.check_all(b, tb, 24)
    engine.check_all(a, ta, 40)
    assert b.resize(24 + 2 * T)  # exactly fits
    assert free_slots(m) == [0]
    a.close()
    assert b.resize(24 + 3 * T)  # evicts a's committed pages, now reusable only
    b.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == [10]


def test_closing_every_request_returns_every_slot(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T, window=16, swa_every=2))
    total = [s.total for s in m.get_storage_statistics()]
    caches = []
    for r in range(6):
        kv = m.create_kv_cache()
        kv.resume()
        assert kv.resize(10 + 7 * r)
        caches.append(kv)
    caches[0].suspend()
    for kv in caches:
        kv.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == total


def test_gc_closes_a_dropped_cache(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    kv.resize(50)
    assert m.num_open_caches == 1
    del kv
    gc.collect()
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()
    assert free_slots(m) == [m.get_storage_statistics()[0].total]


def test_set_base_page_index_buf_zero_copy(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(20)
    backing = array("i", [77] * 10)
    kv.set_base_page_index_buf(0, LayerGroupId(0), memoryview(backing))
    assert list(backing[:3]) == list(kv.get_base_page_indices(LayerGroupId(0)))
    assert list(backing[3:]) == [BAD_PAGE_INDEX] * 7
    assert kv.resize(40)
    assert list(backing[:5]) == list(kv.get_base_page_indices(LayerGroupId(0)))
    assert kv.resize(21)
    assert list(backing[3:]) == [BAD_PAGE_INDEX] * 7
    with pytest.raises(LogicError, match="larger buffer"):
        kv.resize(81)
    assert kv.capacity == 21
    kv.set_base_page_index_buf(0, LayerGroupId(0), None)
    assert kv.resize(81)
    kv.close()


@pytest.mark.parametrize("wrap", ["numpy", "memoryview"])
def test_views_of_the_indices_survive_every_operation(make_manager: MakeManager, wrap: str) -> None:
    m = make_manager(kv_layers(2, T), quota=2 * 2 * REC * T * 12)  # 12 slots
    engine = FakeEngine(m)
    toks = list(range(1000, 1100))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(3 * T)
    raw = kv.get_base_page_indices(LG0)
    view = np.frombuffer(raw, dtype=np.int32) if wrap == "numpy" else memoryview(raw)
    first = list(view)
    assert kv.resize(11 * T)  # grows past the storage's first capacity while the view is held
    assert list(view) == first  # the old view still reads the same blocks (live, in place)
    engine.step(kv, toks, 0, 11 * T)
    kv.commit(toks[: 11 * T])
    assert not kv.resize(13 * T)  # no memory: nothing changed, no BufferError
    assert kv.capacity == 11 * T
    other = m.create_kv_cache()
    other.resume()
    assert kv.resize(11 * T)  # a shrinking resize while views are held: pages freed, indices -1
    assert (
        other.resize(T)
        and len({*kv.get_base_page_indices(LG0).tolist(), *other.get_base_page_indices(LG0).tolist()}) == 12
    )
    m.check_invariants()
    kv.close()  # closes despite the view
    assert kv.status is KVCacheStatus.CLOSED and m.num_open_caches == 1
    assert all(x == -1 for x in view)
    other.close()
    m.clear_reusable_blocks()
    assert free_slots(m)[0] == 12


def test_a_dropped_cache_with_a_live_view_closes(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(5 * T)
    view = np.frombuffer(kv.get_base_page_indices(LG0), dtype=np.int32)
    del kv
    gc.collect()
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()  # not refused forever
    assert len(view) == 5
    m.shutdown()


def test_caller_buffer_is_released_on_close(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    backing = array("i", [0] * 16)
    kv.set_base_page_index_buf(0, LG0, memoryview(backing))
    assert kv.resize(3 * T)
    kv.close()
    backing.append(1)  # would raise BufferError if the manager still exported it


def test_a_huge_capacity_is_refused_without_per_block_work(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 64)
    calls: list[int] = []

    def cb(o: int, lc: int) -> Priority:
        calls.append(o)
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=cb)  # type: ignore[arg-type]
    kv.resume()
    assert kv.resize(T)
    calls.clear()
    assert not kv.resize(10**9)  # answered from counts: the callback never runs per block
    assert calls == [] and kv.capacity == T and free_slots(m)[0] == 63
    with pytest.raises(ValueError, match="capacity must be at most"):
        kv.resize(2**40)
    kv.close()


def test_priority_callback_is_called_and_validated(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    seen: list[tuple[int, int]] = []

    def cb(o: int, lc: int) -> Priority:
        seen.append((o, lc))
        return Priority(80)

    kv = m.create_kv_cache(custom_priority_callback=cb)  # type: ignore[arg-type]
    kv.resume()
    assert kv.resize(20)
    assert seen == [(0, 0), (1, 0), (2, 0)]
    assert kv.block_table.pages[0][1] is not None and kv.block_table.pages[0][1].priority == 80
    bad = m.create_kv_cache(custom_priority_callback=lambda o, lc: Priority(101))
    bad.resume()
    free = free_slots(m)
    with pytest.raises(ValueError, match="custom_priority_callback"):
        bad.resize(20)
    assert free_slots(m) == free and bad.capacity == 0
    kv.close()
    bad.close()


def test_clamp_max_seq_len_for_mem(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), quota=2 * 32 * T * 2 * 10)
    assert m.clamp_max_seq_len_for_mem(1, 10_000) == 80
    assert m.clamp_max_seq_len_for_mem(2, 10_000) == 40
    assert m.clamp_max_seq_len_for_mem(1, 30) == 30


def test_shutdown_and_clear_refuse_while_open(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    with pytest.raises(LogicError, match="still open"):
        m.shutdown()
    with pytest.raises(LogicError, match="still open"):
        m.clear_reusable_blocks()
    kv.close()
    m.clear_reusable_blocks()
    m.shutdown()
    m.shutdown()
    with pytest.raises(LogicError, match="shut down"):
        m.create_kv_cache()


def test_queries_after_shutdown_raise(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    m.shutdown()
    for query in (
        lambda: m.get_mem_pool_base_address(LayerId(0), "key"),
        lambda: m.get_storage_statistics(),
        lambda: m.pool_group_descs,
        lambda: m.gpu_utilization,
        lambda: m.clamp_max_seq_len_for_mem(1, 100),
        lambda: m.create_kv_cache(),
        lambda: m.get_quota(0),  # type: ignore[arg-type]
    ):
        with pytest.raises(LogicError, match="shut down"):
            query()


def _active(m: KVCacheManager, cap: int = 20) -> KVCache:
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(cap)
    return kv


BAD_CALLS: list[tuple[str, Callable[[KVCacheManager, KVCache], object], type[Exception], str]] = [
    ("resize negative", lambda m, kv: kv.resize(-1), ValueError, "capacity"),
    ("resize non-int", lambda m, kv: kv.resize(3.5), TypeError, ""),  # type: ignore[arg-type]
    ("history shrinks", lambda m, kv: (kv.commit([1] * 10), kv.resize(20, 5)), LogicError, "never shrinks"),
    ("negative token", lambda m, kv: kv.commit([-1]), ValueError, "outside"),
    ("empty bytes token", lambda m, kv: kv.commit([b""]), ValueError, "empty"),
    ("capacity below history", lambda m, kv: kv.resize(5, 10), LogicError, "below history"),
    ("resume active", lambda m, kv: kv.resume(), LogicError, "SUSPENDED"),
    ("bad stream", lambda m, kv: (kv.suspend(), kv.resume(-3)), ValueError, "cuda_stream"),
    ("commit past capacity", lambda m, kv: kv.commit([1] * 21), LogicError, "beyond capacity"),
    ("commit bad token", lambda m, kv: kv.commit([1 << 40]), ValueError, "outside"),
    ("commit str token", lambda m, kv: kv.commit(["a"]), TypeError, ""),  # type: ignore[list-item]
    ("commit after stop", lambda m, kv: (kv.stop_committing(), kv.commit([1])), LogicError, "stop_committing"),
    ("beam indices", lambda m, kv: kv.commit([1], [0]), ValueError, "beam"),
    ("bad layer group", lambda m, kv: kv.get_base_page_indices(LayerGroupId(5)), ValueError, "layer_group_id"),
    ("bad beam", lambda m, kv: kv.get_base_page_indices(LayerGroupId(0), 1), ValueError, "beam"),  # type: ignore[arg-type]
    ("buf not memoryview", lambda m, kv: kv.set_base_page_index_buf(0, LayerGroupId(0), bytearray(40)), TypeError, ""),  # type: ignore[arg-type]
    (
        "buf wrong format",
        lambda m, kv: kv.set_base_page_index_buf(0, LayerGroupId(0), memoryview(array("q", [0] * 8))),
        ValueError,
        "int32",
    ),  # type: ignore[arg-type]
    (
        "buf readonly",
        lambda m, kv: kv.set_base_page_index_buf(0, LayerGroupId(0), memoryview(bytes(40)).cast("i")),
        ValueError,
        "writable",
    ),  # type: ignore[arg-type]
    (
        "buf too short",
        lambda m, kv: kv.set_base_page_index_buf(0, LayerGroupId(0), memoryview(array("i", [0]))),
        ValueError,
        "entries",
    ),  # type: ignore[arg-type]
    ("unknown layer", lambda m, kv: m.get_layer_group_id(LayerId(99)), ValueError, "unknown layer_id"),
    ("unknown role", lambda m, kv: m.get_page_stride(LayerId(0), "query"), ValueError, "no buffer with role"),
    ("bad index mode", lambda m, kv: m.get_mem_pool_base_address(LayerId(0), "key", 1), TypeError, ""),  # type: ignore[arg-type]
    ("bad level", lambda m, kv: m.get_storage_statistics(3), ValueError, "cache level"),  # type: ignore[arg-type]
    ("bad scope", lambda m, kv: m.create_kv_cache(reuse_scope=5), TypeError, ""),  # type: ignore[arg-type]
    ("bad callback", lambda m, kv: m.create_kv_cache(custom_priority_callback=3), TypeError, "callable"),  # type: ignore[arg-type]
    ("bad clamp", lambda m, kv: m.clamp_max_seq_len_for_mem(0, 10), ValueError, "batch_size"),
    ("closed resize", lambda m, kv: (kv.close(), kv.resize(30)), LogicError, "CLOSED"),
    ("closed commit", lambda m, kv: (kv.close(), kv.commit([1])), LogicError, "CLOSED"),
]


@pytest.mark.parametrize("name, call, exc, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_changes_nothing(
    make_manager: MakeManager,
    name: str,
    call: Callable[[KVCacheManager, KVCache], object],
    exc: type[Exception],
    match: str,
) -> None:
    m = make_manager(kv_layers(2, T))
    kv = _active(m)
    with pytest.raises(exc, match=match or None):
        call(m, kv)
    if kv.status is KVCacheStatus.ACTIVE:
        assert kv.capacity == 20 and kv.num_blocks == 3
    kv.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == [m.get_storage_statistics()[0].total]


def test_unsupported_features_are_refused_clearly() -> None:
    from conftest import make_config

    from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManagerConfig

    with pytest.raises(ValueError, match="HostCacheTierConfig quota 100 bytes is too small: it must hold one slot"):
        KVCacheManager(KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 20), HostCacheTierConfig(100)], kv_layers(1)))
    with pytest.raises(ValueError, match="too small"):
        KVCacheManager(make_config(kv_layers(1), quota=100))
    with pytest.raises(TypeError, match="KVCacheManagerConfig"):
        KVCacheManager("config")  # type: ignore[arg-type]


@pytest.mark.parametrize("sinks", [None, 5])
def test_swa_releases_out_of_window_blocks_and_keeps_the_window(make_manager: MakeManager, sinks: int | None) -> None:
    m = make_manager(kv_layers(4, T, window=20, swa_every=2, sink_tokens=sinks))
    assert len(m.layer_grouping) == 2
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    kv.resume()
    toks = tokens(9, 200)
    run_request(engine, kv, toks, [40, 33], 30)
    swa = LayerGroupId(0)
    idx = kv.get_base_page_indices(swa)
    h = kv.history_length
    live = [o for o, i in enumerate(idx) if i != BAD_PAGE_INDEX]
    sink_blocks = (sinks + T - 1) // T if sinks else 0
    first_live = (h + 1 - 20) // T
    assert live == list(range(sink_blocks)) + list(range(first_live, kv.num_blocks))
    full = kv.get_base_page_indices(LayerGroupId(1))
    assert all(i != BAD_PAGE_INDEX for i in full)
    used = sum(s.unavailable for s in m.get_storage_statistics())
    assert used == len(live) + len(full)
    # one big prefill chunk: blocks already stale at the new history are never allocated
    kv2 = m.create_kv_cache()
    kv2.resume()
    assert kv2.resize(100, 0)
    engine.step(kv2, toks, 0, 100)
    kv2.commit(toks[:100])
    assert sum(i != BAD_PAGE_INDEX for i in kv2.get_base_page_indices(swa)) == sink_blocks + (
        kv2.num_blocks - (100 + 1 - 20) // T
    )
    run_request(engine, kv2, toks, [], 10)
    kv.close()
    kv2.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == [s.total for s in m.get_storage_statistics()]


def test_blocks_leaving_a_window_together_are_released_last_first(make_manager: MakeManager) -> None:
    t = 2
    slot = 2 * REC * t
    m = make_manager(kv_layers(1, t, window=4, swa_every=1), t, 11 * slot)
    engine = FakeEngine(m)
    toks = seq(1, 22)
    kv = m.create_kv_cache(input_tokens=toks)
    assert kv.resume() and kv.resize(22)
    engine.step(kv, toks, 0, 22)
    kv.commit(toks)  # blocks 0..8 leave the window in this one commit
    kv.close()
    other = m.create_kv_cache()
    assert other.resume() and other.resize(t)  # one slot of pressure: one page evicted
    other.close()
    assert m.probe_reuse(None, toks[:4]) == 4  # block 8 went, not block 0
    assert m.probe_reuse(None, toks[:18]) == 18 - 2  # block 8 is gone: the longest match ends before it
    b = m.create_kv_cache(input_tokens=toks[:4] + [7])
    assert b.history_length == 4 and b.resume()
    engine.check_all(b, toks, 4)
    b.close()


@pytest.mark.parametrize("sinks", [None, 5])
def test_a_sliding_window_only_model_gets_every_page_back_at_close(
    make_manager: MakeManager, sinks: int | None
) -> None:
    """Every layer windowed: close skips the blocks the window released (they hold no page) and
    releases the sinks and the window; a request reusing the prefix reads exact KV meanwhile."""
    m = make_manager(kv_layers(3, T, window=20, swa_every=1, sink_tokens=sinks))
    engine = FakeEngine(m)
    toks = tokens(7, 120)
    kv = m.create_kv_cache()
    kv.resume()
    run_request(engine, kv, toks, [50, 30], 25)
    live = sum(i != BAD_PAGE_INDEX for i in kv.get_base_page_indices(LayerGroupId(0)))
    assert 0 < live < kv.num_blocks
    assert sum(s.unavailable for s in m.get_storage_statistics()) == live
    kv.close()
    assert sum(s.unavailable for s in m.get_storage_statistics()) == 0
    reader = m.create_kv_cache(input_tokens=toks[:80])
    reader.resume()
    assert reader.history_length > 40
    engine.check_all(reader, toks, reader.history_length)
    reader.close()
    m.clear_reusable_blocks()
    assert free_slots(m) == [s.total for s in m.get_storage_statistics()]


def test_growth_uses_slots_released_by_another_layer_group_of_the_same_pool_group(make_manager: MakeManager) -> None:
    # layer 0 full attention (layer group 0), layer 1 window 8 (layer group 1); one pool group of 8 slots
    layers = [
        AttentionLayerConfig(LayerId(0), [BufferConfig("key", 32 * T), BufferConfig("value", 32 * T)]),
        AttentionLayerConfig(LayerId(1), [BufferConfig("key", 32 * T), BufferConfig("value", 32 * T)], 8),
    ]
    m = make_manager(layers, quota=2 * 32 * T * 8)
    assert len(m.pool_group_descs) == 1 and m.get_storage_statistics()[0].total == 8
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    kv.resume()
    t = tokens(11, 40)
    assert kv.resize(32, 0)  # 4 + 4 blocks: every slot
    engine.step(kv, t, 0, 32)
    assert free_slots(m) == [0]
    # history 32 releases 3 SWA blocks; full attention (grown first) needs one of them
    assert kv.resize(40, 32)
    engine.step(kv, t, 32, 40)
    kv.commit(t[:40])
    engine.check_all(kv, t, 40)
    kv.close()


def test_aggregated_pages_and_small_queries(make_manager: MakeManager) -> None:
    layers = [
        AttentionLayerConfig(
            LayerId(i), [BufferConfig("key", 32 * T), BufferConfig("value", 32 * T), BufferConfig("scale", 64)]
        )
        for i in range(2)
    ]
    m = make_manager(layers)
    pools = m.pool_group_descs[0].pools
    assert [p.slot_bytes for p in pools] == [4 * 32 * T, 2 * 64]
    runs = list(m.get_aggregated_pages([(LayerId(0), "key"), (LayerId(0), "value"), (LayerId(1), "value")]))
    assert [r.buffer_ids for r in runs] == [((0, "key"), (0, "value")), ((1, "value"),)]
    assert runs[0].base_address == pools[0].base_address and runs[0].size == 2 * 32 * T
    assert runs[1].base_address == pools[0].base_address + 3 * 32 * T and runs[1].stride == 4 * 32 * T
    (scale_run,) = m.get_aggregated_pages([(LayerId(1), "scale")])
    assert scale_run.pool_index == 1 and scale_run.base_address == pools[1].base_address + 64
    with pytest.raises(ValueError, match="role"):
        list(m.get_aggregated_pages([(LayerId(0), "nope")]))
    assert m.get_quota(0) == 1 << 20  # type: ignore[arg-type]
    assert m.gpu_utilization == 0.0
    kv = _active(m, 5 * T)
    assert m.gpu_utilization == pytest.approx(5 / m.get_storage_statistics()[0].total)
    assert list(kv.get_aggregated_page_indices(LayerGroupId(0), valid_only=True)) == list(
        kv.get_base_page_indices(LayerGroupId(0))
    )
    assert m.num_layers == 2 and m.layer_ids == [0, 1] and m.tokens_per_block == T
    assert m.supports_index_mode(PageIndexMode.SHARED) is True and kv.supports_index_mode(PageIndexMode.PER_LAYER)
    assert kv.get_scratch_desc(LayerGroupId(0)) is None and not kv.has_scratch_slots
    kv.close()


def test_reprs_say_what_state_things_are_in(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = _active(m, 20)
    assert repr(kv) == "KVCache(id=None, status=ACTIVE, capacity=20, history_length=0, committed=0, blocks=3)"
    assert "open_caches=1" in repr(m) and "layer_groups=1" in repr(m)
    kv.close()
