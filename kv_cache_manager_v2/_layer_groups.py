"""Layers -> layer groups (layer groups), and each layer group's policy: which blocks it needs.

Every window-dependent rule lives here (SPEC 5.1, 5.3, 5.4): the stale range at a history
length, which blocks a match needs pages for, and which blocks are anchors whose loss makes
the blocks after them useless.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._common import LayerGroupId, LayerId
from ._config import AttentionLayerConfig
from ._typed import TypedList
from ._utils import div_up


class LayerGroup:
    """Attention shape shared by the layers of one group: window (None = full) and sink blocks."""

    __slots__ = ("num_sink_blocks", "tokens_per_block", "window_size")

    def __init__(self, window_size: int | None, num_sink_blocks: int, tokens_per_block: int) -> None:
        self.window_size = window_size
        self.num_sink_blocks = num_sink_blocks
        self.tokens_per_block = tokens_per_block

    def __repr__(self) -> str:
        return f"LayerGroup(window_size={self.window_size}, num_sink_blocks={self.num_sink_blocks})"

    @property
    def is_swa(self) -> bool:
        return self.window_size is not None

    def stale_range(self, history_length: int) -> tuple[int, int]:
        """Blocks ``[beg, end)`` out of the window (and not sinks) at ``history_length`` (SPEC 5.1).

        The live window is positions ``[h + 1 - W, h]``: the next token attends to the W - 1 before it.
        """
        w = self.window_size
        if w is None:
            return (0, 0)
        t = self.tokens_per_block
        beg = min(div_up(history_length, t), self.num_sink_blocks)
        return (beg, max(beg, (history_length + 1 - w) // t))

    def stale_end(self, history_length: int) -> int:
        """End of the stale range (0 for full attention): the hot-path form of ``stale_range``."""
        w = self.window_size
        if w is None:
            return 0
        return max(self.num_sink_blocks, (history_length + 1 - w) // self.tokens_per_block)

    def history_releasing_after(self, stale_end: int) -> int:
        """The least history at which ``stale_end(history)`` exceeds ``stale_end`` (blocks up to
        there were released): when the window moves next. Sliding-window layer groups only."""
        w = self.window_size
        assert w is not None
        if self.num_sink_blocks > stale_end:
            return 0
        return (stale_end + 1) * self.tokens_per_block + w - 1

    def scratch_range(self, capacity: int, history_length: int, max_rewind_len: int) -> tuple[int, int]:
        """Blocks ``[beg, end)`` of a step ``history -> capacity`` that will be out of the window
        once the step is history (SPEC 5.7): they only need memory while one layer runs.

        ``stale(max(0, capacity - max_rewind_len)) ∩ [ceil(history / T), ceil(capacity / T))``;
        empty for full attention.
        """
        if self.window_size is None:
            return (0, 0)
        t = self.tokens_per_block
        beg, end = self.stale_range(max(0, capacity - max_rewind_len))
        lo = max(beg, div_up(history_length, t))
        return (lo, max(lo, min(end, div_up(capacity, t))))

    def num_blocks_with_pages(self, capacity: int, history_length: int) -> int:
        """Blocks a request of this shape holds pages for (stale blocks need none)."""
        nb = div_up(capacity, self.tokens_per_block)
        beg, end = self.stale_range(history_length)
        return nb - max(0, min(end, nb) - min(beg, nb))

    def peak_pages(self, length: int) -> int:
        """Most pages one request holds while it decodes from nothing to ``length`` tokens (at
        capacity ``n`` its history is ``n - 1``). Full attention: the last length. A window: the
        need is highest right after a block boundary, so those lengths are the candidates."""
        if length <= 0:
            return 0
        if self.window_size is None:
            return self.num_blocks_with_pages(length, length - 1)
        t = self.tokens_per_block
        best = self.num_blocks_with_pages(length, length - 1)
        # past window + sinks + two blocks the need repeats with period t
        last = min(length, self.window_size + (self.num_sink_blocks + 2) * t)
        for n in range(1, last + 1, t):
            best = max(best, self.num_blocks_with_pages(n, n - 1))
        return best

    def is_anchor(self, ordinal: int) -> bool:
        """Whether later blocks are useless without this block's page (full attention, sinks)."""
        return self.window_size is None or ordinal < self.num_sink_blocks


class LayerGroupRegistry:
    """Dense ``LayerGroupId`` per distinct attention shape, in first-seen order of the layers."""

    layer_groups: TypedList[LayerGroupId, LayerGroup]
    layer_to_layer_group: dict[LayerId, LayerGroupId]
    layers_of: TypedList[LayerGroupId, list[LayerId]]
    tokens_per_block: int
    #: layer groups with a window: the only ones whose blocks go stale
    swa_layer_groups: list[LayerGroupId]

    def __init__(self, layers: Sequence[AttentionLayerConfig], tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.layer_groups = TypedList([])
        self.layer_to_layer_group = {}
        self.layers_of = TypedList([])
        index: dict[tuple[int | None, int], LayerGroupId] = {}
        for layer in layers:
            w = layer.sliding_window_size
            sinks = div_up(layer.num_sink_tokens or 0, tokens_per_block) if w is not None else 0
            lc_id = index.get((w, sinks))
            if lc_id is None:
                lc_id = LayerGroupId(len(self.layer_groups))
                index[(w, sinks)] = lc_id
                self.layer_groups.items.append(LayerGroup(w, sinks, tokens_per_block))
                self.layers_of.items.append([])
            self.layer_to_layer_group[layer.layer_id] = lc_id
            self.layers_of[lc_id].append(layer.layer_id)
        self.swa_layer_groups = [LayerGroupId(i) for i, lc in enumerate(self.layer_groups) if lc.is_swa]

    def __len__(self) -> int:
        return len(self.layer_groups)

    def ids(self) -> list[LayerGroupId]:
        return [LayerGroupId(i) for i in range(len(self.layer_groups))]
