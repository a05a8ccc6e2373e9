"""Life cycles, stale ranges, the storage layout examples of SPEC 5.2, and converter outputs."""

from __future__ import annotations

import pytest
from conftest import make_config

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    HalfOpenRange,
    KVCacheManager,
    LayerId,
    PageIndexConverter,
    PageIndexMode,
    ScratchDesc,
    SlotId,
)
from kv_cache_manager_v2._layers._policy import LayerGroup
from kv_cache_manager_v2._life_cycle_registry import announced_layer_group

KIB = 1024


def _policy(window: int | None, sinks: int, tokens_per_block: int) -> LayerGroup:
    kind = "full_attention" if window is None else "sliding_window"
    return announced_layer_group(kind, window, sinks, tokens_per_block)


def kv8k(n: int, swa_even: bool = False, extra: list[BufferConfig] | None = None) -> list[AttentionLayerConfig]:
    return [
        AttentionLayerConfig(
            LayerId(i),
            [BufferConfig("key", 8 * KIB), BufferConfig("value", 8 * KIB), *(extra or [])],
            sliding_window_size=128 if swa_even and i % 2 == 0 else None,
        )
        for i in range(n)
    ]


def manager(layers: list[AttentionLayerConfig], t: int = 32) -> KVCacheManager:
    return KVCacheManager(make_config(layers, tokens_per_block=t, quota=64 << 20))


def test_four_full_layers_one_pool_of_64k() -> None:
    m = manager(kv8k(4))
    assert m.layer_grouping == [(0, 1, 2, 3)]
    (pg,) = m.pool_group_descs
    assert [p.slot_bytes for p in pg.pools] == [64 * KIB]
    assert m.get_page_index_converter(LayerId(2), "value").layer_offset == 5
    m.shutdown()


def test_swa_on_even_layers_two_layer_groups_share_one_pool_group() -> None:
    m = manager(kv8k(4, swa_even=True))
    assert m.layer_grouping == [(0, 2), (1, 3)]
    assert len(m.pool_group_descs) == 1
    assert [p.slot_bytes for p in m.pool_group_descs[0].pools] == [32 * KIB]
    m.shutdown()


def test_different_sizes_two_pool_groups() -> None:
    layers = kv8k(2) + [
        AttentionLayerConfig(LayerId(2 + i), [BufferConfig("key", 4 * KIB), BufferConfig("value", 4 * KIB)], 128)
        for i in range(2)
    ]
    m = manager(layers)
    assert len(m.pool_group_descs) == 2
    assert [[p.slot_bytes for p in g.pools] for g in m.pool_group_descs] == [[32 * KIB], [16 * KIB]]
    m.shutdown()


def test_block_quant_buffers_give_two_pools_sizes_descending() -> None:
    m = manager(kv8k(4, extra=[BufferConfig("key_block_quant", 512)]))
    (pg,) = m.pool_group_descs
    assert [p.slot_bytes for p in pg.pools] == [64 * KIB, 4 * 512]
    conv = m.get_page_index_converter(LayerId(1), "key_block_quant")
    assert (conv.scale, conv.layer_offset, conv.pages_per_layer) == (4, 1, 1)
    m.shutdown()


def test_tokens_per_block_override_expands_pages() -> None:
    layers = [AttentionLayerConfig(LayerId(0), [BufferConfig("key", 256, 8), BufferConfig("value", 1024)])]
    m = manager(layers)
    conv = m.get_page_index_converter(LayerId(0), "key")
    assert conv.expansion == 4 and conv.scale == 2
    assert m.get_page_stride(LayerId(0), "key") == 256
    # key expands to 1024 bytes per block, same as value: one coalesced buffer of two
    assert [p.slot_bytes for p in m.pool_group_descs[0].pools] == [2048]
    assert conv([3, -1], PageIndexMode.PER_LAYER) == [24, 25, 26, 27, -1, -1, -1, -1]
    m.shutdown()


@pytest.mark.parametrize(
    "window, sinks, h, expected",
    [
        (None, 0, 1000, (0, 0)),
        (128, 0, 0, (0, 0)),
        (128, 0, 1024, (0, 28)),  # live window [897, 1024]
        (128, 0, 158, (0, 0)),
        (128, 0, 159, (0, 1)),
        (128, 2, 1024, (2, 28)),
        (128, 2, 20, (1, 1)),
        (4096, 0, 1024, (0, 0)),
    ],
)
def test_stale_range(window: int | None, sinks: int, h: int, expected: tuple[int, int]) -> None:
    assert _policy(window, sinks, 32).stale_range(h) == expected


@pytest.mark.parametrize("window, sinks", [(None, 0), (1, 0), (8, 0), (8, 1), (40, 3), (128, 2)])
def test_stale_end_is_the_stale_range_past_the_sinks(window: int | None, sinks: int) -> None:
    lc = _policy(window, sinks, 8)
    for h in range(300):
        beg, end = lc.stale_range(h)
        assert set(range(beg, end)) == set(range(sinks, lc.stale_end(h))), h


def test_converter_modes_and_scratch() -> None:
    conv = PageIndexConverter(scale=4, expansion=1, layer_offset=3, pages_per_layer=2)
    assert conv([0, 5, -1]) == [0, 20, -1]
    assert conv([0, 5, -1], PageIndexMode.PER_LAYER) == [3, 23, -1]
    scratch = ScratchDesc(HalfOpenRange(1, 4), (SlotId(7), SlotId(9)))
    # blocks 1..3 use sub-pages q = 0, 2, 4 of scratch slots 7, 7, 9 (layer offset folded in mod S)
    assert conv([2, -1, -1, -1, 6], PageIndexMode.PER_LAYER, scratch) == [11, 31, 29, 39, 27]
    with pytest.raises(Exception, match="explicit index_mode"):
        conv([0], None, scratch)


def test_addresses_agree_between_modes() -> None:
    m = manager(kv8k(2))
    for layer, role in m.all_buffer_ids:
        conv = m.get_page_index_converter(layer, role)
        stride = m.get_page_stride(layer, role)
        for mode in PageIndexMode:
            base = m.get_mem_pool_base_address(layer, role, mode)
            (x,) = conv([7], mode)
            assert base + x * stride == m.pool_group_descs[0].pools[0].base_address + 7 * 32 * KIB + (
                [bid for bid in m.all_buffer_ids].index((layer, role)) * 8 * KIB
            )
    m.shutdown()


def _two_group_layers() -> list[AttentionLayerConfig]:
    # group 0: full attention, 2 x 8 KiB per layer; group 1: window 128, 2 x 4 KiB per layer
    return kv8k(2) + [
        AttentionLayerConfig(LayerId(2 + i), [BufferConfig("key", 4 * KIB), BufferConfig("value", 4 * KIB)], 128)
        for i in range(2)
    ]


def _slots(**kw: object) -> list[int]:
    m = KVCacheManager(make_config(_two_group_layers(), tokens_per_block=32, quota=64 << 20, **kw))
    out = [g.num_slots for g in m.pool_group_descs]
    m.shutdown()
    return out


def test_quota_split_by_initial_pool_ratio() -> None:
    full, swa = _slots(initial_pool_ratio=[0.75, 0.25])
    assert full * 32 * KIB == pytest.approx(48 << 20, rel=1e-3)
    assert swa * 16 * KIB == pytest.approx(16 << 20, rel=1e-3)


@pytest.mark.parametrize("ratio", [[0.4, 0.5], [3.0, 1.0], [float("nan"), 0.5], [float("inf"), 0.0]])
def test_initial_pool_ratio_must_be_shares_summing_to_one(ratio: list[float]) -> None:
    with pytest.raises(ValueError, match="initial_pool_ratio"):
        _slots(initial_pool_ratio=ratio)


def test_quota_split_by_typical_step_and_default() -> None:
    from kv_cache_manager_v2 import BatchDesc, KVCacheDesc

    # a 4096-token request needs 128 full blocks but only the window's 4 SWA blocks
    full, swa = _slots(typical_step=BatchDesc([KVCacheDesc(4096, 4095)]))
    assert full / swa == pytest.approx(128 / 4, rel=0.01)
    d_full, d_swa = _slots()  # default shape: a 512-token chunk ending a 4096-token prompt
    assert d_full / d_swa == pytest.approx(128 / 20, rel=0.05)  # window (4) + the chunk (16)


def test_constraints_are_floors() -> None:
    from kv_cache_manager_v2 import BatchDesc, KVCacheDesc

    batch = BatchDesc([KVCacheDesc(128, 0)] * 200)  # 200 requests x 4 blocks in each group
    full, swa = _slots(initial_pool_ratio=[0.99, 0.01], constraints=[batch])
    assert swa == 800  # raised from its 1% share to the floor
    assert full == ((64 << 20) - 800 * 16 * KIB) // (32 * KIB)  # the rest goes to the other group
    with pytest.raises(ValueError, match="too small"):
        _slots(constraints=[BatchDesc([KVCacheDesc(1 << 20, 0)] * 4)])
    with pytest.raises(ValueError, match="pool groups"):
        _slots(initial_pool_ratio=[1.0])
