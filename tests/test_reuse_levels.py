"""Public read-only queries added for integrators: where a reusable prefix lives
(``probe_reuse_levels``) and what a layer group is (``get_layer_group_info``)."""

from __future__ import annotations

import pytest
from conftest import MakeManager, kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, publish, seq

from kv_cache_manager_v2 import GPU_LEVEL, KVCacheManager, LayerGroupId, LayerId, ReuseScope, compiled


def page_levels(m: KVCacheManager, toks: list[int]) -> list[int]:
    """Deepest level over the matched pages of each block, read from a fresh cache's block table."""
    kv = m.create_kv_cache(input_tokens=toks)
    try:
        table = kv.block_table
        nb = kv.num_blocks
        out = [0] * nb
        for lc in range(len(table)):
            for o, p in enumerate(table.pages[lc]):
                if p is not None:
                    out[o] = max(out[o], p.level)
            src = table.pending_copy[lc]
            if src is not None:
                out[nb - 1] = max(out[nb - 1], src.level)
        return out
    finally:
        kv.close()


def test_levels_of_a_prefix_spread_over_three_tiers(make_manager: MakeManager, tmp_path: object) -> None:
    m = make_manager(kv_layers(2, T), T, 4 * SLOT, host_quota=4 * SLOT, disk_quota=8 * SLOT, disk_path=str(tmp_path))
    engine = FakeEngine(m)
    seqs = [seq(r, 3 * T) for r in range(4)]
    for s in seqs:
        publish(m, s, engine=engine)
    assert m.probe_reuse_levels(None, seqs[0]) == [2, 2, 2]  # the oldest blocks are deepest
    assert m.probe_reuse_levels(None, seqs[3]) == [0, 0, 0]
    for s in seqs:
        for q in (s, s[: 2 * T + 3], s[:5] + [1, 2], s[: T + 1]):
            levels = m.probe_reuse_levels(None, q)
            assert len(levels) == -(-m.probe_reuse(None, q) // T)
            assert levels == page_levels(m, q), q
    assert m.probe_reuse_levels(None, seqs[1] + [7])[-1] == m.probe_reuse_levels(None, seqs[1])[-1]
    assert m.probe_reuse_levels(None, []) == [] and m.probe_reuse_levels(None, None) == []
    assert m.probe_reuse_levels(ReuseScope(salt=1), seqs[0]) == []
    kv = m.create_kv_cache(input_tokens=seqs[0])  # what the probe said is what resume brings up
    assert kv.resume()
    engine.check_all(kv, seqs[0], 3 * T)
    kv.close()
    assert m.probe_reuse_levels(None, seqs[0]) == [GPU_LEVEL] * 3
    with pytest.raises(TypeError, match=None if compiled else "reuse_scope"):  # compiled: mypyc's own message
        m.probe_reuse_levels(3, seqs[0])  # type: ignore[arg-type]


def test_levels_count_only_the_pages_a_sliding_window_needs(make_manager: MakeManager, tmp_path: object) -> None:
    """Out-of-window blocks need only their full-attention page: its level is the block's level."""
    layers = kv_layers(2, T, window=2 * T, swa_every=2)  # layer 0 slides (window 2 blocks), layer 1 is full
    m = make_manager(layers, T, 12 * SLOT // 2, host_quota=64 * SLOT // 2)
    engine = FakeEngine(m)
    long_doc = seq(1, 6 * T)
    publish(m, long_doc, engine=engine)
    for r in range(2, 5):
        publish(m, seq(r, 4 * T), engine=engine)
    levels = m.probe_reuse_levels(None, long_doc)
    assert levels == page_levels(m, long_doc) and len(levels) == 6
    assert max(levels) == 1  # pushed down by the later documents
    m.clear_reusable_blocks()
    assert m.probe_reuse_levels(None, long_doc) == []


def test_layer_group_info(make_manager: MakeManager) -> None:
    layers = [*kv_layers(3, T, window=12, swa_every=2, sink_tokens=5)]
    m = make_manager(layers)
    lg_swa = m.get_layer_group_id(LayerId(0))
    info = m.get_layer_group_info(lg_swa)
    assert (info.layer_group_id, info.layer_ids, info.window_size, info.num_sink_blocks) == (
        lg_swa,
        (LayerId(0), LayerId(2)),
        12,
        1,
    )
    full = m.get_layer_group_info(m.get_layer_group_id(LayerId(1)))
    assert (full.window_size, full.num_sink_blocks, full.layer_ids) == (None, 0, (LayerId(1),))
    assert (info.kind, full.kind) == ("sliding_window", "full_attention")  # the policy's name, as events say
    # the pool group whose slots hold the group: the one whose pools contain the layer's base address
    for lg in range(len(m.layer_grouping)):
        info = m.get_layer_group_info(LayerGroupId(lg))
        desc = m.pool_group_descs[info.pool_group_index]
        base = m.get_mem_pool_base_address(info.layer_ids[0], "key", None)
        assert any(p.base_address <= base < p.base_address + p.slot_bytes for p in desc.pools)
    with pytest.raises(ValueError, match="layer_group_id must be in"):
        m.get_layer_group_info(LayerGroupId(2))
    with pytest.raises(TypeError):
        m.get_layer_group_info("0")  # type: ignore[arg-type]
