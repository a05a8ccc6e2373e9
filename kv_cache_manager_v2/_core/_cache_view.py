"""CacheView: what one request's cache shows: its status, lengths, committed tokens,
block tables and page indices, read (and the index buffers attached) without changing its pages.

:class:`~._kv_cache.KVCache` builds the state machine, resize and commit on it.
"""

from __future__ import annotations

from collections.abc import Iterator

from .._common import (
    BAD_PAGE_INDEX,
    BeamIndex,
    HalfOpenRange,
    KVCacheStatus,
    PageIndexMode,
    ReuseScope,
    ScratchDesc,
    TokenIdExt,
)
from .._exceptions import LogicError
from .._utils import check_int, check_type
from ._block_table import BlockTable
from ._commit import next_snapshot_position
from ._request_state import RequestState


class CacheView(RequestState):
    """The queries of a request's cache (see ``KVCache``, the public class)."""

    # ------------------------------------------------------------------ properties
    @property
    def status(self) -> KVCacheStatus:
        """ACTIVE (pages locked in GPU memory), SUSPENDED or CLOSED."""
        return self._status

    @property
    def committed_tokens(self) -> list[TokenIdExt]:
        """A copy of the committed token sequence (beam 0's; see ``get_committed_tokens``)."""
        return [tok for block in self._committed_blocks for tok in block] + self._tail

    def get_committed_tokens(self, beam: object = BeamIndex(0)) -> list[TokenIdExt]:
        """A copy of one beam's committed token sequence (``beam``: a ``BeamIndex``)."""
        blocks, tail = self._seq(self._check_beam(beam))
        return [tok for block in blocks for tok in block] + tail

    @property
    def reuse_scope(self) -> ReuseScope:
        """The scope its blocks are reused in (only between requests of equal scope)."""
        return self._reuse_scope

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block (the manager's)."""
        return self._tokens_per_block

    @property
    def beam_width(self) -> int:
        """Beams of this request (set by ``create_kv_cache``; fixed for its life)."""
        return self._beam_width

    @property
    def id(self) -> object:
        """The ``id`` given to ``create_kv_cache`` (any object; None by default)."""
        return self._id

    @property
    def cuda_stream(self) -> int:
        """The stream (``CUstream`` handle) the request's kernels run on; 0 (the legacy default
        stream) until set here or by ``resume``. The manager's copies of the request's pages wait
        for the kernels queued there, and the kernels queued there after a copy wait for it; a
        stream replaced here (or left by ``close``) is still waited for by the next copy."""
        return self._cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: object) -> None:
        self._set_stream(check_int("cuda_stream (a CUstream handle)", value))

    def _set_stream(self, stream: int) -> None:
        """``cuda_stream = stream`` past its check (compiled, ``resume`` calling the property's
        setter on ``self`` crashed: a method instead)."""
        if self._stream_counted and stream != self._cuda_stream:
            streams = self._ctx.storage.copier.streams
            streams.acquire(stream)
            streams.release(self._cuda_stream)
        self._cuda_stream = stream

    @property
    def num_blocks(self) -> int:
        """Blocks covered by ``capacity``: ``ceil(capacity / tokens_per_block)``."""
        return self._num_blocks

    @property
    def block_table(self) -> BlockTable:
        """This request's pages and indices, beam 0's (for introspection)."""
        return self._table

    @property
    def block_tables(self) -> list[BlockTable]:
        """Every beam's block table (for introspection)."""
        return list(self._tables)

    @property
    def has_scratch_slots(self) -> bool:
        """Whether this step has scratch blocks (then only ``PageIndexMode.PER_LAYER`` addresses them)."""
        return self._table.has_scratch_slots

    def get_scratch_desc(self, layer_group_id: object) -> ScratchDesc | None:
        """Scratch blocks of this step for the layer group and the slots they share (None: none).

        Pass it to the ``PageIndexConverter`` (with ``PageIndexMode.PER_LAYER``) to address them.
        """
        layer_group = self._check_layer_group(layer_group_id)
        slots = self._table.scratch_slots[layer_group]
        if not slots:
            return None
        beg, end = self._table.scratch[layer_group]
        return ScratchDesc(HalfOpenRange(beg, end), tuple(slots))

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER addresses every block; SHARED every block except scratch ones."""
        check_type("mode", mode, PageIndexMode)
        return mode is PageIndexMode.PER_LAYER or not self._table.has_scratch_slots

    # ------------------------------------------------------------------ indices
    def get_base_page_indices(self, layer_group_id: object, beam_id: object = BeamIndex(0)) -> memoryview:
        """Slot id per block (``BAD_PAGE_INDEX`` for none): an int32 ``memoryview`` the manager keeps
        up to date in place (wrap it with numpy at will; do not write to it). Its length is the
        block count when fetched: fetch it again after a ``resize`` that changes ``num_blocks``.
        A recurrent group's blocks have no page (all ``BAD_PAGE_INDEX``): its live state is at
        ``get_ssm_state_index``."""
        if type(layer_group_id) is int and type(beam_id) is int and beam_id == 0:
            indices = self._table.views.items
            if 0 <= layer_group_id < len(indices):
                return indices[layer_group_id]  # the per-step path: no helper calls
        layer_group = self._check_layer_group(layer_group_id)
        return self._tables[self._check_beam(beam_id)].views[layer_group]

    def set_base_page_index_buf(self, beam: object, layer_group_id: object, buf: memoryview | None) -> None:
        """Have the manager write this layer group's indices into ``buf`` (1-D int32, writable).

        Entries past the cache's blocks are set to ``BAD_PAGE_INDEX``; ``None`` detaches.
        """
        beam_index = self._check_beam(beam)
        layer_group = self._check_layer_group(layer_group_id)
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("set_base_page_index_buf() on a CLOSED cache")
        table = self._tables[beam_index]
        if buf is None:
            table.attach_user_buf(layer_group, None)
            return
        if not isinstance(buf, memoryview):
            raise TypeError(f"buf must be a memoryview (or None), got {type(buf).__name__}")
        if (
            buf.readonly
            or buf.ndim != 1
            or buf.itemsize != 4
            or buf.format not in ("i", "=i", "<i", "@i")
            or not buf.c_contiguous
        ):
            raise ValueError(
                "buf must be a writable, C-contiguous, 1-D memoryview of int32 (format 'i'); got "
                f"format={buf.format!r} itemsize={buf.itemsize} ndim={buf.ndim} readonly={buf.readonly}"
            )
        if len(buf) < self._num_blocks:
            raise ValueError(f"buf holds {len(buf)} entries but the cache has {self._num_blocks} blocks")
        table.attach_user_buf(layer_group, buf.cast("B").cast("i"))

    def get_ssm_state_index(self, layer_group_id: object, beam: object = BeamIndex(0)) -> int:
        """The base page index of beam ``beam``'s live recurrent state in layer group
        ``layer_group_id`` (a ``"recurrent"`` group): one slot holds the state of every layer of
        the group; per layer and buffer, ``PageIndexConverter`` applies as for KV pages. The
        index stays the same across suspend/resume while the state stayed in GPU memory; fetch
        it again after each resume."""
        layer_group = self._check_layer_group(layer_group_id)
        beam_index = self._check_beam(beam)
        groups = self._ctx.state_layer_groups
        if layer_group not in groups:
            kind = self._ctx.layer_groups[layer_group].kind
            raise ValueError(
                f"get_ssm_state_index: layer group {layer_group} is a {kind!r} group; a recurrent "
                f"group is one of {[int(g) for g in groups]}"
            )
        page = self._tables[beam_index].state_page(layer_group)
        if self._status is not KVCacheStatus.ACTIVE or page is None:
            raise ValueError(
                f"get_ssm_state_index: the cache is {self._status.name}; its live state has an index only "
                "while it is ACTIVE (after resume())"
            )
        return int(page.slot)

    def next_snapshot_position(self, position: object) -> int | None:
        """The least position after ``position`` where the manager keeps a snapshot of the
        recurrent state (per ``ssm_snapshot_policy``: multiples of the snapshot interval, the
        prompt's last full block, where the prompt leaves a cached path, ...; ``MAX_CAPACITY + 1``
        when none is ahead); None without recurrent layers. A commit that ends history exactly
        there takes the snapshot: cut prefill chunks at these positions."""
        after = check_int("position", position)
        if not self._ctx.state_layer_groups:
            return None
        return next_snapshot_position(self, after)

    def get_aggregated_page_indices(
        self, layer_group_id: object, beam_id: object = BeamIndex(0), valid_only: bool = False
    ) -> Iterator[int]:
        """Slot ids of the blocks: one slot aggregates every buffer of the layer group."""
        for idx in self.get_base_page_indices(layer_group_id, beam_id):
            if not valid_only or idx != BAD_PAGE_INDEX:
                yield idx
