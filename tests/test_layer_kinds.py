"""Layer kinds: each policy against a brute-force reading of its rule, and the registry."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, LayerGroupId, LayerId, SsmLayerConfig
from kv_cache_manager_v2._layers._full_attention import FullAttentionGroup
from kv_cache_manager_v2._layers._policy import LayerGroup
from kv_cache_manager_v2._layers._recurrent import RecurrentGroup
from kv_cache_manager_v2._layers._sliding_window import SlidingWindowGroup
from kv_cache_manager_v2._life_cycle_registry import (
    LAYER_KINDS,
    LayerGroupRegistry,
    announced_layer_group,
    layer_group_of,
)

SHAPES = [(None, 0), (1, 0), (8, 0), (8, 1), (13, 2), (40, 3), (128, 2)]


def _policy(window: int | None, sinks: int, tokens_per_block: int) -> LayerGroup:
    if window is None:
        return FullAttentionGroup(tokens_per_block)
    return SlidingWindowGroup(window, sinks, tokens_per_block)


def _stale_blocks(window: int | None, sinks: int, tokens_per_block: int, history_length: int) -> set[int]:
    """Blocks nothing attends to any more: past the sinks, wholly before the live window
    ``[h + 1 - W, h]``."""
    if window is None:
        return set()
    first_live = history_length + 1 - window
    return {o for o in range(sinks, history_length // tokens_per_block + 1) if (o + 1) * tokens_per_block <= first_live}


@pytest.mark.parametrize("window, sinks", SHAPES)
@pytest.mark.parametrize("tokens_per_block", [1, 4, 8])
def test_stale_blocks_match_the_attended_positions(window: int | None, sinks: int, tokens_per_block: int) -> None:
    policy = _policy(window, sinks, tokens_per_block)
    assert policy.releases_blocks == (window is not None)
    for history in range(300):
        expected = _stale_blocks(window, sinks, tokens_per_block, history)
        beg, end = policy.stale_range(history)
        assert set(range(beg, end)) == expected, history
        assert set(range(policy.stale_end(0), policy.stale_end(history))) == expected, history
        assert policy.stale_end(history) >= policy.stale_end(0)
        assert {o for o in range(history // tokens_per_block + 2) if policy.is_stale(o, history)} == expected
        for capacity in (history, history + 1, history + 3 * tokens_per_block):
            num_blocks = -(-capacity // tokens_per_block)
            assert policy.num_blocks_with_pages(capacity, history) == num_blocks - len(
                {o for o in expected if o < num_blocks}
            )


@pytest.mark.parametrize("window, sinks", SHAPES)
def test_history_releasing_after_is_the_next_window_move(window: int | None, sinks: int) -> None:
    policy = _policy(window, sinks, 4)
    for history in range(200):
        done = policy.stale_end(history)
        moves_at = policy.history_releasing_after(done)
        assert moves_at > history
        if window is None:
            assert all(policy.stale_end(h) == 0 for h in range(history, 400))
        else:
            assert policy.stale_end(moves_at) > done
            assert policy.stale_end(moves_at - 1) == done


@pytest.mark.parametrize("window, sinks", SHAPES)
def test_peak_pages_is_the_most_pages_a_decode_holds(window: int | None, sinks: int) -> None:
    policy = _policy(window, sinks, 4)
    best = 0
    for length in range(0, 250):
        if length > 0:
            best = max(best, policy.num_blocks_with_pages(length, length - 1))
        assert policy.peak_pages(length) == best, length


@pytest.mark.parametrize("window, sinks", SHAPES)
def test_anchors_are_every_block_or_the_sinks(window: int | None, sinks: int) -> None:
    policy = _policy(window, sinks, 4)
    assert [o for o in range(10) if policy.is_anchor(o)] == (list(range(10)) if window is None else list(range(sinks)))


def _layer(layer_id: int, window: int | None = None, sinks: int | None = None) -> AttentionLayerConfig:
    return AttentionLayerConfig(LayerId(layer_id), [BufferConfig("key", 64)], window, sinks)


def test_registry_groups_equal_shapes_in_first_seen_order() -> None:
    layers = [_layer(0, 16, 5), _layer(1), _layer(2, 16, 8), _layer(3, 32), _layer(4)]
    registry = LayerGroupRegistry(layers, 8)
    # 5 and 8 sink tokens are one sink block of 8 tokens each: the same shape
    assert [list(ids) for ids in registry.layers_of] == [[0, 2], [1, 4], [3]]
    kinds = [(g.kind, g.window_size, g.num_sink_blocks) for g in registry.layer_groups]
    assert kinds == [("sliding_window", 16, 1), ("full_attention", None, 0), ("sliding_window", 32, 0)]
    assert registry.releasing_layer_groups == [0, 2]
    assert registry.layer_to_layer_group[LayerId(4)] == 1
    assert len(registry) == 3 and registry.ids() == [0, 1, 2]


def test_every_kind_is_one_registry_entry() -> None:
    assert [kind.name for kind in LAYER_KINDS] == ["sliding_window", "full_attention", "recurrent"]
    assert isinstance(layer_group_of(_layer(0), 4), FullAttentionGroup)
    assert isinstance(layer_group_of(_layer(0, 9, 4), 4), SlidingWindowGroup)
    ssm = SsmLayerConfig(LayerId(2), [BufferConfig("ssm_state", 64)])
    assert isinstance(layer_group_of(ssm, 4), RecurrentGroup)
    for kind in LAYER_KINDS:  # what a manager announces rebuilds the same policy (a recurrent
        # group's buffer layout is not announced: it decides grouping only)
        for layer in (_layer(0), _layer(1, 9, 4), ssm):
            policy = kind.from_layer(layer, 4)
            if policy is not None:
                again = announced_layer_group(policy.kind, policy.window_size, policy.num_sink_blocks, 4)
                assert again.shape_key()[:3] == policy.shape_key()[:3]
                assert type(again) is type(policy)


def test_recurrent_layers_group_by_buffer_layout() -> None:
    def ssm(layer_id: int, conv: int, state: int) -> SsmLayerConfig:
        return SsmLayerConfig(LayerId(layer_id), [BufferConfig("conv_state", conv), BufferConfig("ssm_state", state)])

    layers = [ssm(0, 16, 64), _layer(1), ssm(2, 16, 64), ssm(3, 16, 128)]
    registry = LayerGroupRegistry(layers, 8, 64)
    assert [list(ids) for ids in registry.layers_of] == [[0, 2], [1], [3]]
    assert registry.state_layer_groups == [0, 2]
    assert [g.kind for g in registry.layer_groups] == ["recurrent", "full_attention", "recurrent"]
    assert [g.snapshot_interval for g in registry.layer_groups] == [64, 0, 64]
    policy = registry.layer_groups[LayerGroupId(0)]
    # no page for any block (every block stale at every history), one live state per request
    for history in (0, 1, 7, 8, 100):
        assert policy.stale_range(history)[0] == 0 and policy.stale_range(history)[1] > 10**9
        assert all(policy.is_stale(o, history) for o in range(20))
        assert policy.num_blocks_with_pages(history + 1, history) == 1
    assert policy.num_blocks_with_pages(0, 0) == 0
    assert [policy.peak_pages(n) for n in (0, 1, 1000)] == [0, 1, 1]
    assert policy.admission_blocks(1000, 0) == 1 and not policy.is_anchor(0)


def test_announced_layer_group_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown layer kind 'mamba'"):
        announced_layer_group("mamba", None, 0, 4)
    with pytest.raises(ValueError, match="needs its window size"):
        announced_layer_group("sliding_window", None, 0, 4)
