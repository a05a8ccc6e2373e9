"""Eviction order and exactness (tails before shared prefixes, never more slots than asked) and
the SWA key chain surviving evicted pages; through the fake engine, under every eviction policy."""

from __future__ import annotations

from conftest import REC, MakeManager, make_manager_per_policy, one_layer
from fake_engine import FakeEngine
from tier_helpers import compute

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    LayerId,
    Priority,
)

T = 16
make_manager = make_manager_per_policy  # (the fixture) every test here runs under each eviction policy


def test_tail_is_evicted_first_and_only_what_is_needed(make_manager: MakeManager) -> None:
    """Issue repro: one slot of pressure evicts the tail block, not the whole cached sequence."""
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    toks = list(range(1, 4 * T + 1))
    a = m.create_kv_cache()
    a.resume()
    compute(engine, a, toks, 4 * T)
    a.close()
    z = m.create_kv_cache()
    z.resume()
    assert z.resize(5 * T, 0)  # 4 free + one eviction
    assert m.probe_reuse(input_tokens=toks) == 3 * T
    assert m.get_storage_statistics()[0].free == 0
    z.close()
    b = m.create_kv_cache(input_tokens=toks)
    b.resume()
    engine.check_all(b, toks, 3 * T)  # the kept prefix holds the right KV
    b.close()


def test_a_shared_prefix_outlives_the_private_tails(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    prefix = list(range(1000, 1000 + 2 * T))
    seqs = [prefix + [r * 100 + i for i in range(2 * T)] for r in range(2)]
    caches = []
    for s in seqs:
        kv = m.create_kv_cache(input_tokens=s)
        kv.resume()
        compute(engine, kv, s, 4 * T)
        caches.append(kv)
    for kv in caches:
        kv.close()  # 6 blocks cached: prefix (2) + two tails (2 each); 2 free
    z = m.create_kv_cache()
    z.resume()
    assert z.resize(6 * T)  # 4 evictions: both tails, the prefix stays
    assert m.probe_reuse(input_tokens=prefix + [7]) == 2 * T
    assert m.probe_reuse(input_tokens=seqs[0]) == 2 * T
    assert m.get_storage_statistics()[0].free == 0
    z.close()


def test_evicting_a_sink_anchor_in_one_pool_group_frees_nothing_in_another(make_manager: MakeManager) -> None:
    """Dropping an anchor removes its subtree; the subtree's pages in other pool groups become
    garbage (evicted first) instead of being freed: free slots never grow beyond the request."""
    layers = [
        AttentionLayerConfig(LayerId(0), [BufferConfig("key", REC * T)]),
        AttentionLayerConfig(LayerId(1), [BufferConfig("key", 2 * REC * T)], sliding_window_size=T, num_sink_tokens=T),
    ]
    m = make_manager(layers, tokens_per_block=T, quota=3 * REC * T * 3, initial_pool_ratio=[0.5, 0.5])
    totals = [s.total for s in m.get_storage_statistics()]
    engine = FakeEngine(m)
    toks = list(range(1, T + 1))
    a = m.create_kv_cache()
    a.resume()
    compute(engine, a, toks, T)
    a.close()
    z = m.create_kv_cache()
    z.resume()
    assert z.resize(totals[1] * T)  # takes every slot of the SWA group: evicts a's sink page
    assert m.probe_reuse(input_tokens=toks + [0]) == 0
    st = m.get_storage_statistics()
    assert st[0].free == totals[0] - totals[1] - 1 and st[0].evictable == 1  # a's full-attention page: garbage
    z.close()
    m.clear_reusable_blocks()
    assert [s.free for s in m.get_storage_statistics()] == totals


def test_swa_key_chain_survives_an_evicted_page(make_manager: MakeManager) -> None:
    """Issue repro: window = T; block 0's page is evicted while the request still decodes; the
    chain of keys stays, so the whole sequence is reusable with the last window's page."""
    m = make_manager(one_layer(T, window=T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    toks = [(i * 7919) % 100_003 for i in range(5 * T)]
    a = m.create_kv_cache()
    a.resume()
    compute(engine, a, toks, 2 * T - 1)  # block 0 full and published; out of the window soon
    hog = m.create_kv_cache()
    hog.resume()
    assert hog.resize(7 * T)  # takes 7 of 8 slots: evicts block 0's page (now out of the window)
    hog.close()
    for n in range(2 * T, 5 * T + 1):
        compute(engine, a, toks, n)
    a.close()
    assert m.probe_reuse(input_tokens=[*toks, 7]) == 5 * T
    b = m.create_kv_cache(input_tokens=[*toks, 7])
    assert b.history_length == 5 * T
    assert b.resume()
    engine.check_all(b, toks, 5 * T)
    b.close()


def test_priority_classes_still_come_first(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    engine = FakeEngine(m)
    hi = list(range(1, 2 * T + 1))
    lo = list(range(500, 500 + 2 * T))
    for toks, prio in ((hi, 90), (lo, 10)):
        kv = m.create_kv_cache(custom_priority_callback=lambda o, lc, p=prio: Priority(p))
        kv.resume()
        compute(engine, kv, toks, 2 * T)
        kv.close()
    z = m.create_kv_cache()
    z.resume()
    assert z.resize(2 * T)  # the low-priority request's blocks go, tail first, even though newer
    assert m.probe_reuse(input_tokens=hi) == 2 * T
    assert m.probe_reuse(input_tokens=lo) == 0
    z.close()
