"""Layers -> life cycles (layer groups), and which blocks a life cycle no longer needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._common import LayerId, LifeCycleId
from ._config import AttentionLayerConfig
from ._utils import div_up


@dataclass(frozen=True)
class LifeCycle:
    """Attention shape shared by the layers of one group: window (None = full) and sink blocks."""

    window_size: int | None
    num_sink_blocks: int


class LifeCycleRegistry:
    """Dense ``LifeCycleId`` per distinct attention shape, in first-seen order of the layers."""

    life_cycles: list[LifeCycle]
    layer_to_life_cycle: dict[LayerId, LifeCycleId]
    layers_of: list[list[LayerId]]
    tokens_per_block: int

    def __init__(self, layers: Sequence[AttentionLayerConfig], tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.life_cycles = []
        self.layer_to_life_cycle = {}
        self.layers_of = []
        index: dict[LifeCycle, LifeCycleId] = {}
        for layer in layers:
            w = layer.sliding_window_size
            sinks = div_up(layer.num_sink_tokens or 0, tokens_per_block) if w is not None else 0
            lc = LifeCycle(w, sinks)
            lc_id = index.get(lc)
            if lc_id is None:
                lc_id = LifeCycleId(len(self.life_cycles))
                index[lc] = lc_id
                self.life_cycles.append(lc)
                self.layers_of.append([])
            self.layer_to_life_cycle[layer.layer_id] = lc_id
            self.layers_of[lc_id].append(layer.layer_id)

    def __len__(self) -> int:
        return len(self.life_cycles)

    def stale_range(self, lc_id: LifeCycleId, history_length: int) -> tuple[int, int]:
        """Blocks ``[beg, end)`` the life cycle no longer needs at this history length (SPEC 5.1)."""
        return stale_range(self.life_cycles[lc_id], history_length, self.tokens_per_block)


def stale_range(lc: LifeCycle, history_length: int, tokens_per_block: int) -> tuple[int, int]:
    """Blocks ``[beg, end)`` out of the window (and not sinks) at ``history_length``."""
    w = lc.window_size
    if w is None:
        return (0, 0)
    beg = min(div_up(history_length, tokens_per_block), lc.num_sink_blocks)
    return (beg, max(beg, (history_length + 1 - w) // tokens_per_block))
