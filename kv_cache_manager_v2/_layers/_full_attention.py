"""Full attention: every position attends to every earlier one, so every block keeps its page."""

from __future__ import annotations

from typing import Final

from .._config import AttentionLayerConfig, LayerConfig
from .._utils import div_up
from ._policy import LayerGroup

#: history no request reaches: a full-attention group never releases a block
_NEVER: Final = 1 << 62


class FullAttentionGroup(LayerGroup):
    """Layers without a window: nothing goes stale, every block is an anchor."""

    __slots__ = ()

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__("full_attention", None, 0, tokens_per_block)

    def stale_range(self, history_length: int) -> tuple[int, int]:
        return (0, 0)

    def stale_end(self, history_length: int) -> int:
        return 0

    def is_stale(self, ordinal: int, history_length: int) -> bool:
        return False

    def history_releasing_after(self, stale_end: int) -> int:
        return _NEVER

    def num_blocks_with_pages(self, capacity: int, history_length: int) -> int:
        return div_up(capacity, self.tokens_per_block)

    def is_anchor(self, ordinal: int) -> bool:
        return True

    def peak_pages(self, length: int) -> int:
        return div_up(length, self.tokens_per_block) if length > 0 else 0

    def admission_blocks(self, final_capacity: int, chunk: int) -> int:
        return div_up(final_capacity, self.tokens_per_block)


def from_layer(layer: LayerConfig, tokens_per_block: int) -> LayerGroup | None:
    """The policy of ``layer`` when it is a full-attention layer, else None."""
    if not isinstance(layer, AttentionLayerConfig) or layer.sliding_window_size is not None:
        return None
    return FullAttentionGroup(tokens_per_block)


def from_announced(window_size: int | None, num_sink_blocks: int, tokens_per_block: int) -> LayerGroup:
    """The policy of a full-attention group another manager announced (KV events)."""
    return FullAttentionGroup(tokens_per_block)
