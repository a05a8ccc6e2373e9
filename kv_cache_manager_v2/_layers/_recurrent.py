"""Recurrent-state layers (Mamba, SSM, gated delta-net): no per-token KV, one fixed-size state per
sequence. A request holds no page for any block: it holds one live-state page per beam (the
``BlockTable.state_pages``), and the reuse tree holds snapshots of the state at some blocks (the
group's page of that block's node), copied from the live state when history ended there."""

from __future__ import annotations

from typing import Final

from .._config import LayerConfig, SsmLayerConfig
from ._policy import LayerGroup

#: a block ordinal no request reaches: every block is stale for a recurrent group
_NEVER: Final = 1 << 62


class RecurrentGroup(LayerGroup):
    """Recurrent layers sharing one state layout (``layout``: their buffer roles and sizes).

    For blocks, every block is stale at every history: the group needs no per-block page, and a
    match never asks for one (the matcher cuts a match back to a snapshot itself). Its per-request
    page count is the live state: one page."""

    __slots__ = ("layout",)

    def __init__(self, tokens_per_block: int, layout: str) -> None:
        super().__init__("recurrent", None, 0, tokens_per_block)
        self.layout = layout
        self.releases_blocks = True
        self.keeps_live_state = True

    def shape_key(self) -> tuple[str, int, int, str]:
        return (self.kind, -1, 0, self.layout)

    def stale_range(self, history_length: int) -> tuple[int, int]:
        return (0, _NEVER)

    def stale_end(self, history_length: int) -> int:
        return _NEVER

    def is_stale(self, ordinal: int, history_length: int) -> bool:
        return True

    def history_releasing_after(self, stale_end: int) -> int:
        return _NEVER

    def num_blocks_with_pages(self, capacity: int, history_length: int) -> int:
        """The live state: one page once the request has any capacity."""
        return 1 if capacity > 0 else 0

    def snapshot_pages(self, history_length: int) -> int:
        """One per snapshot interval of history, plus the prompt end."""
        interval = self.snapshot_interval
        return history_length // interval + 1 if interval > 0 and history_length > 0 else 0

    def is_anchor(self, ordinal: int) -> bool:
        """A snapshot is the whole state at its position: later ones never need it."""
        return False

    def peak_pages(self, length: int) -> int:
        return 1 if length > 0 else 0

    def admission_blocks(self, final_capacity: int, chunk: int) -> int:
        return 1


def layout_key(layer: SsmLayerConfig) -> str:
    """Roles and sizes of a recurrent layer's buffers, in a canonical order."""
    return ",".join(f"{b.role}:{b.size}" for b in sorted(layer.buffers, key=lambda b: b.role))


def from_layer(layer: LayerConfig, tokens_per_block: int) -> LayerGroup | None:
    """The policy of ``layer`` when it is a recurrent-state layer, else None."""
    if not isinstance(layer, SsmLayerConfig):
        return None
    return RecurrentGroup(tokens_per_block, layout_key(layer))


def from_announced(window_size: int | None, num_sink_blocks: int, tokens_per_block: int) -> LayerGroup:
    """The policy of a recurrent group another manager announced (KV events)."""
    return RecurrentGroup(tokens_per_block, "")
