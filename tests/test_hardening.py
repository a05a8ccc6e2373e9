"""Edges found by trying the library as a demanding user and as an attacker would (issue #9):
live index views, huge sizes, partial-match scaling, scope roots, token validation, re-entrancy,
threads, post-shutdown queries, host-backend reservations."""

from __future__ import annotations

import gc
import threading
from array import array
from collections.abc import Callable

import numpy as np
import pytest
from conftest import REC, kv_layers
from fake_engine import FakeEngine

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LayerGroupId,
    LayerId,
    LogicError,
    OutOfMemoryError,
    Priority,
    ReuseScope,
)

MakeManager = Callable[..., KVCacheManager]
T = 8
LG0 = LayerGroupId(0)


def free(m: KVCacheManager) -> int:
    return m.get_storage_statistics()[0].free


# ---------------------------------------------------------------- 1. views of the indices
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
    assert free(m) == 12


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


# ---------------------------------------------------------------- 2. huge sizes
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
    assert calls == [] and kv.capacity == T and free(m) == 63
    with pytest.raises(ValueError, match="capacity must be at most"):
        kv.resize(2**40)
    kv.close()


# ---------------------------------------------------------------- 3. partial matching scales
def test_partial_match_looks_at_a_few_siblings_whatever_their_number(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 4000)
    template = list(range(1, 2 * T + 1))  # a chat template shared by every conversation
    for conv in range(600):
        kv = m.create_kv_cache()
        kv.resume()
        toks = [*template, 7, 7, 7, conv + 100, *range(4)]  # next block: same first tokens
        assert kv.resize(len(toks))
        kv.commit(toks)
        kv.close()
    node = m._tree.roots[(None, None)].children()[0].children()[0]
    query = [7, 7, 7, 345, 0, 1]
    assert len(node.partial_candidates(query)) <= 2
    best, n = node.best_partial(query, m._tree.partial_groups)
    brute = max(node.children(), key=lambda c: sum(1 for _ in iter_common(c.tokens, query)))
    assert best is not None and n == 6 and best.tokens[:6] == brute.tokens[:6]
    assert m.probe_reuse(input_tokens=[*template, *query]) == 2 * T + 6
    assert m.probe_reuse(input_tokens=[*template, 7, 7, 7, 99999]) == 2 * T + 3


def iter_common(a: tuple[object, ...], b: list[int]) -> list[int]:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(1)
    return out


# ---------------------------------------------------------------- 4. scope roots
def test_empty_scope_roots_go_away_with_their_last_block(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 8)
    for salt in range(200):
        kv = m.create_kv_cache(ReuseScope(salt=salt))
        kv.resume()
        assert kv.resize(T)
        kv.commit(list(range(T)))
        kv.close()  # one cached block per salt; 8 slots: older salts are evicted
    assert len(m._tree.roots) <= 8
    m.clear_reusable_blocks()
    assert len(m._tree.roots) == 0


# ---------------------------------------------------------------- 5. token validation
def test_partially_matched_tokens_are_validated(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(3)
    kv.commit([11, 12, 13])
    kv.close()
    with pytest.raises(TypeError, match="input_tokens"):
        m.create_kv_cache(input_tokens=[11.0, 12.0, 13.0, 14.0])  # type: ignore[list-item]
    assert m.num_open_caches == 0


@pytest.mark.parametrize(
    "tokens, error",
    [
        ([1, -1], ValueError),
        ([1, 2**32], ValueError),
        ([True, 2], TypeError),
        ([np.int64(3), 2], TypeError),
        (np.arange(20, dtype=np.int64), TypeError),
        ([1, b""], ValueError),
        ([1, 2.5], TypeError),
        ([*range(100), -3], ValueError),  # far past any block the match looks at
    ],
)
def test_bad_tokens_are_refused_in_both_modes(make_manager: MakeManager, tokens: object, error: type) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(2 * T)
    kv.commit(list(range(2 * T)))
    kv.close()
    with pytest.raises(error, match="input_tokens"):
        m.create_kv_cache(input_tokens=tokens)  # type: ignore[arg-type]
    with pytest.raises(error, match="input_tokens"):
        m.probe_reuse(input_tokens=tokens)  # type: ignore[arg-type]
    k = m.create_kv_cache()
    k.resume()
    assert k.resize(200)
    with pytest.raises(error, match="accepted_input_tokens"):
        k.commit(tokens)  # type: ignore[arg-type]
    assert k.num_committed_tokens == 0
    k.close()
    assert m.num_open_caches == 0


# ---------------------------------------------------------------- 6. re-entrancy
def test_a_priority_callback_cannot_call_back_into_the_manager(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 16)
    holder: list[KVCache] = []

    def closes_its_own_cache(o: int, lc: int) -> Priority:
        holder[0].close()
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=closes_its_own_cache)  # type: ignore[arg-type]
    holder.append(kv)
    kv.resume()
    before = free(m)
    with pytest.raises(LogicError, match="another call"):
        kv.resize(4 * T)
    assert kv.status is KVCacheStatus.ACTIVE and kv.capacity == 0 and free(m) == before
    m.check_invariants()
    kv.close()
    assert free(m) == 16


def test_a_one_token_commit_from_a_callback_changes_nothing(make_manager: MakeManager) -> None:
    """The decode commit's fast path is refused like any call while another is in progress,
    before the token goes in (it used to stay in the tail, unpublished)."""
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 16)
    other = m.create_kv_cache()
    other.resume()
    assert other.resize(2 * T)
    other.commit(list(range(T + 3)))
    before = other.committed_tokens

    def commits_the_other(o: int, lc: int) -> Priority:
        other.commit([7])
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=commits_the_other)  # type: ignore[arg-type]
    kv.resume()
    with pytest.raises(LogicError, match="another call"):
        kv.resize(4 * T)
    assert other.committed_tokens == before and other.history_length == T + 3
    m.check_invariants()
    kv.close()
    other.close()


def test_bytes_are_not_a_token_sequence(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    with pytest.raises(TypeError, match=r"\[digest\]"):
        m.create_kv_cache(input_tokens=b"\x01" * 32)
    with pytest.raises(TypeError, match="input_tokens"):
        m.probe_reuse(None, b"abc")
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(T)
    for bad in (b"a", b"abc", "abc"):
        with pytest.raises(TypeError, match="accepted_input_tokens"):
            kv.commit(bad)  # type: ignore[arg-type]
    assert kv.num_committed_tokens == 0
    kv.commit([b"a digest"])  # a digest token in a list is fine
    assert kv.committed_tokens == [b"a digest"]
    kv.close()


def test_a_cache_collected_during_a_call_is_closed_when_it_ends(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    victim = [m.create_kv_cache()]
    victim[0].resume()
    assert victim[0].resize(3 * T)

    def drops_the_other(o: int, lc: int) -> Priority:
        victim.clear()  # its last reference: __del__ runs inside resize()
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=drops_the_other)  # type: ignore[arg-type]
    kv.resume()
    assert kv.resize(T)
    assert m.num_open_caches == 1
    m.check_invariants()
    kv.close()


# ---------------------------------------------------------------- 7. threads
def test_overlapping_calls_from_two_threads_are_refused_not_corrupting() -> None:
    m = KVCacheManager(KVCacheManagerConfig(T, [GpuCacheTierConfig(2 * REC * T * 64)], kv_layers(1, T), backend="host"))
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def slow(o: int, lc: int) -> Priority:
        inside.set()
        release.wait(5)
        return Priority(35)

    a = m.create_kv_cache(custom_priority_callback=slow)  # type: ignore[arg-type]
    a.resume()
    t = threading.Thread(target=lambda: a.resize(2 * T))
    t.start()
    assert inside.wait(5)
    try:
        m.create_kv_cache()
    except LogicError as e:
        errors.append(e)
    release.set()
    t.join()
    assert len(errors) == 1 and "another call" in str(errors[0])
    assert a.capacity == 2 * T
    m.check_invariants()
    a.close()
    m.shutdown()


# ---------------------------------------------------------------- 8, 9. smaller edges
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


def test_host_backend_reserves_a_realistic_pool_lazily_and_refuses_an_impossible_one() -> None:
    layers = [
        AttentionLayerConfig(
            LayerId(i), [BufferConfig("key", 8 * 128 * 2 * 32), BufferConfig("value", 8 * 128 * 2 * 32)]
        )
        for i in range(32)
    ]
    m = KVCacheManager(KVCacheManagerConfig(32, [GpuCacheTierConfig(40 << 30)], layers, backend="host"))
    assert m.get_storage_statistics()[0].total == 10240  # 40 GiB of 4 MiB slots, reserved not committed
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(32 * 4)
    kv.close()
    m.shutdown()
    with pytest.raises(OutOfMemoryError, match="quota"):
        KVCacheManager(KVCacheManagerConfig(32, [GpuCacheTierConfig(1 << 52)], layers, backend="host"))
