"""What a hybrid model evicts first (issue 36): KV past the deepest snapshot on its path (no match
can use it) before KV a snapshot can use; a hit refreshes only the snapshot it used. Through the
fake engine (the reused prefix and state checked at every resume) and the invariant checker
(which recomputes every node's snapshot reach and every page's value)."""

from __future__ import annotations

import pytest
from conftest import MakeManager, toks
from fake_engine import FakeEngine
from test_recurrent import T, hybrid_layers, live_states_until_a_snapshot_goes, prefill, state_group
from test_snapshot_policy import run

from kv_cache_manager_v2 import KVCacheManager, LayerGroupId


def _kv_slots(m: KVCacheManager) -> int:
    """GPU slots of the attention layers' pool group."""
    group = next(LayerGroupId(g) for g in range(m.num_layer_groups) if LayerGroupId(g) != state_group(m))
    return m.pool_group_descs[m.get_layer_group_info(group).pool_group_index].num_slots


@pytest.mark.parametrize("eviction_policy", ["lru", "frequency"])
def test_kv_past_the_deepest_snapshot_is_evicted_first(make_manager: MakeManager, eviction_policy: str) -> None:
    """X's KV (all of it below its prompt-end snapshot) was released before A's; A's output past
    its prompt-end snapshot is evicted first all the same, and X stays whole."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.5, 0.5],
        ssm_snapshot_policy="interval",
        ssm_reuse_interval=512,
        eviction_policy=eviction_policy,
    )
    engine = FakeEngine(m)
    x, a = toks(1, 128), toks(2, 128)
    run(m, engine, x)  # 4 blocks, a snapshot at 128
    run(m, engine, a, decoded=96)  # 7 blocks: 4 below the snapshot at 128, 2 full blocks past it, 1 partial
    assert m.probe_reuse(None, x) == 128 and m.probe_reuse(None, a) == 128
    kv_slots = _kv_slots(m)
    # a new request takes every KV slot but two of the 10 the tree holds: exactly two are evicted
    c = toks(3, (kv_slots - 8) * T)
    kv = m.create_kv_cache(input_tokens=c)
    prefill(engine, kv, c, len(c), chunk=1 << 20, cut=False)
    m.check_invariants()
    assert m.probe_reuse(None, x) == 128  # the oldest usable KV stayed
    assert m.probe_reuse(None, a) == 128
    kv.close()
    assert run(m, engine, x + toks(4, 40)) == 128  # the reused KV and state are X's (the fake engine)


def test_a_hit_refreshes_only_the_snapshot_it_used(make_manager: MakeManager) -> None:
    """A's snapshots at 64, 128, 192, then U's. B's hit on A's 128 makes that one the most recent;
    A's 64 on the path above it keeps its place, the first to go (were the hit's whole path
    refreshed, A's 192 would go first)."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=64 << 10,
        initial_pool_ratio=[0.2, 0.8],
        ssm_snapshot_policy="interval",
        ssm_reuse_interval=64,
    )
    engine = FakeEngine(m)
    p, q = toks(21, 200), toks(22, 200)
    run(m, engine, p)
    run(m, engine, q)
    assert run(m, engine, p[:150] + toks(23, 40)) == 128
    assert m.reuse_statistics.snapshots_evicted == 0
    others = live_states_until_a_snapshot_goes(m)
    m.check_invariants()
    assert m.probe_reuse(None, p[:100] + toks(24, 10)) == 0  # A's 64 went
    assert m.probe_reuse(None, q[:100] + toks(24, 10)) == 64  # U's stayed
    assert m.probe_reuse(None, p[:150] + toks(24, 10)) == 128
    for kv in others:
        kv.close()
