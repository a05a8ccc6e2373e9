"""Sliding window with attention sinks: a request keeps its leading sink blocks and the blocks
its window covers; the blocks in between are released as the window moves past them."""

from __future__ import annotations

from .._config import AttentionLayerConfig, LayerConfig
from .._utils import div_up
from ._policy import LayerGroup


class SlidingWindowGroup(LayerGroup):
    """Layers with a window of ``window_size`` tokens and ``num_sink_blocks`` sink blocks.

    The live window at history ``h`` is positions ``[h + 1 - W, h]``: the next token attends
    to the ``W - 1`` before it.
    """

    __slots__ = ("window",)

    def __init__(self, window_size: int, num_sink_blocks: int, tokens_per_block: int) -> None:
        super().__init__("sliding_window", window_size, num_sink_blocks, tokens_per_block)
        #: the window as a plain int (``window_size`` is typed optional for the base class)
        self.window = window_size
        self.releases_blocks = True

    def stale_range(self, history_length: int) -> tuple[int, int]:
        tokens_per_block = self.tokens_per_block
        beg = min(div_up(history_length, tokens_per_block), self.num_sink_blocks)
        return (beg, max(beg, (history_length + 1 - self.window) // tokens_per_block))

    def stale_end(self, history_length: int) -> int:
        return max(self.num_sink_blocks, (history_length + 1 - self.window) // self.tokens_per_block)

    def is_stale(self, ordinal: int, history_length: int) -> bool:
        return self.num_sink_blocks <= ordinal < self.stale_end(history_length)

    def history_releasing_after(self, stale_end: int) -> int:
        if self.num_sink_blocks > stale_end:
            return 0
        return (stale_end + 1) * self.tokens_per_block + self.window - 1

    def scratch_range(self, capacity: int, history_length: int, max_rewind_len: int) -> tuple[int, int]:
        """``stale(max(0, capacity - max_rewind_len)) ∩ [ceil(history / T), ceil(capacity / T))``."""
        tokens_per_block = self.tokens_per_block
        beg, end = self.stale_range(max(0, capacity - max_rewind_len))
        lo = max(beg, div_up(history_length, tokens_per_block))
        return (lo, max(lo, min(end, div_up(capacity, tokens_per_block))))

    def is_anchor(self, ordinal: int) -> bool:
        """Sinks only: a match needs them whatever its length."""
        return ordinal < self.num_sink_blocks

    def peak_pages(self, length: int) -> int:
        """The need is highest right after a block boundary, so those lengths are the candidates;
        past the window, the sinks and two blocks it repeats with period ``T``."""
        if length <= 0:
            return 0
        tokens_per_block = self.tokens_per_block
        best = self.num_blocks_with_pages(length, length - 1)
        last = min(length, self.window + (self.num_sink_blocks + 2) * tokens_per_block)
        for n in range(1, last + 1, tokens_per_block):
            best = max(best, self.num_blocks_with_pages(n, n - 1))
        return best

    def admission_blocks(self, final_capacity: int, chunk: int) -> int:
        """A chunk of ``c`` tokens spans at most ``(c + W + 2T - 3) // T`` blocks of its window
        whatever its alignment, plus the sinks (never more than the whole sequence's blocks)."""
        tokens_per_block = self.tokens_per_block
        num_blocks = div_up(final_capacity, tokens_per_block)
        chunk_tokens = final_capacity if chunk == 0 else min(chunk, final_capacity)
        return min(
            num_blocks,
            self.num_sink_blocks + (chunk_tokens + self.window + 2 * tokens_per_block - 3) // tokens_per_block,
        )


def from_layer(layer: LayerConfig, tokens_per_block: int) -> LayerGroup | None:
    """The policy of ``layer`` when it has a sliding window, else None."""
    if not isinstance(layer, AttentionLayerConfig):
        return None
    window = layer.sliding_window_size
    if window is None:
        return None
    return SlidingWindowGroup(window, div_up(layer.num_sink_tokens or 0, tokens_per_block), tokens_per_block)


def from_announced(window_size: int | None, num_sink_blocks: int, tokens_per_block: int) -> LayerGroup:
    """The policy of a sliding-window group another manager announced (KV events)."""
    if window_size is None:
        raise ValueError("a sliding-window layer group needs its window size")
    return SlidingWindowGroup(window_size, num_sink_blocks, tokens_per_block)
