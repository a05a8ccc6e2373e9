"""The policy interface of a layer group: which blocks a request holds pages for, and when.

Every rule that depends on a layer's kind (a full-attention layer keeps every block, a sliding
window releases the blocks it moved past) is a method here, overridden by one class per kind;
the core, the reuse tree and the engine adapter only ask. The methods are plain (mypyc: native
class, one vtable call each); the decode paths cache per layer group what they need.
"""

from __future__ import annotations

from .._utils import div_up


class LayerGroup:
    """The layers of one group share a kind and a shape; this object answers for all of them.

    ``kind`` and the announced ``window_size`` / ``num_sink_blocks`` describe the group to the
    outside (``LayerGroupInfo``, KV events); the block arithmetic is in the methods.
    """

    __slots__ = (
        "keeps_live_state",
        "kind",
        "num_sink_blocks",
        "releases_blocks",
        "snapshot_interval",
        "tokens_per_block",
        "window_size",
    )

    def __init__(self, kind: str, window_size: int | None, num_sink_blocks: int, tokens_per_block: int) -> None:
        #: the event kind announced for the group (``"full_attention"``, ``"sliding_window"``)
        self.kind = kind
        #: the window the group announces in tokens (None: it attends to every position)
        self.window_size = window_size
        #: leading blocks a window keeps whatever the history (0 without a window)
        self.num_sink_blocks = num_sink_blocks
        self.tokens_per_block = tokens_per_block
        #: whether blocks go stale as history grows (False: ``stale_range`` is always empty and
        #: ``stale_end`` 0; a match then needs the group's page at every block it walks)
        self.releases_blocks = False
        #: whether a request holds one live-state page per beam instead of per-block pages
        #: (recurrent layers); the reuse tree then holds snapshots of that state at some blocks
        self.keeps_live_state = False
        #: tokens between snapshots of the live state (0: none; set by the registry)
        self.snapshot_interval = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window_size={self.window_size}, num_sink_blocks={self.num_sink_blocks})"

    def shape_key(self) -> tuple[str, int, int, str]:
        """Layers whose keys are equal share one layer group."""
        window = self.window_size
        return (self.kind, -1 if window is None else window, self.num_sink_blocks, "")

    # ------------------------------------------------------------------ pages a request holds
    def stale_range(self, history_length: int) -> tuple[int, int]:
        """Blocks ``[beg, end)`` a request no longer needs at ``history_length``; also
        what a match of that length needs: a page for every block outside the range (docs/design.md, "Reuse")."""
        raise NotImplementedError

    def stale_end(self, history_length: int) -> int:
        """Blocks below this (past the kept leading ones) are released at ``history_length``:
        the hot-path form of ``stale_range``. Never below ``stale_end(0)``."""
        raise NotImplementedError

    def is_stale(self, ordinal: int, history_length: int) -> bool:
        """Whether block ``ordinal`` needs no page at ``history_length``."""
        beg, end = self.stale_range(history_length)
        return beg <= ordinal < end

    def history_releasing_after(self, stale_end: int) -> int:
        """The least history at which ``stale_end(history)`` exceeds ``stale_end``: when blocks
        are released next (a history beyond every capacity when they never are)."""
        raise NotImplementedError

    def num_blocks_with_pages(self, capacity: int, history_length: int) -> int:
        """Blocks a request at ``(history_length, capacity)`` holds pages for."""
        num_blocks = div_up(capacity, self.tokens_per_block)
        beg, end = self.stale_range(history_length)
        return num_blocks - max(0, min(end, num_blocks) - min(beg, num_blocks))

    def scratch_range(self, capacity: int, history_length: int, max_rewind_len: int) -> tuple[int, int]:
        """Blocks ``[beg, end)`` of a step ``history -> capacity`` that are stale once the step
        is history (docs/design.md, "SWA prefill scratch slots"): they need memory only while one layer runs. Empty by default."""
        return (0, 0)

    def snapshot_pages(self, history_length: int) -> int:
        """Snapshots of the live state a request at ``history_length`` leaves in the reuse cache
        (sizing: the share of the snapshot pool). None by default."""
        return 0

    # ------------------------------------------------------------------ reuse and eviction
    def is_anchor(self, ordinal: int) -> bool:
        """Whether the blocks after this one are useless to a match without its page."""
        raise NotImplementedError

    # ------------------------------------------------------------------ capacity
    def peak_pages(self, length: int) -> int:
        """Most pages one request holds while it decodes from nothing to ``length`` tokens (at
        capacity ``n`` its history is ``n - 1``)."""
        raise NotImplementedError

    def admission_blocks(self, final_capacity: int, chunk: int) -> int:
        """Pages a request not yet admitted may hold at once, over every alignment of its
        chunks of ``chunk`` tokens (0: the whole prompt at once) that prefix reuse may cause."""
        raise NotImplementedError
