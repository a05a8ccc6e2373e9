"""Turning base page indices (slot ids) into the page indices a kernel uses (README.md, "API in short")."""

from __future__ import annotations

from collections.abc import Sequence

from ._common import BAD_PAGE_INDEX, PageIndexMode, ScratchDesc
from ._exceptions import LogicError


class PageIndexConverter:
    """Maps base indices of one buffer to kernel page indices.

    Byte address of an output index ``x``: ``base(mode) + x * page_stride`` where ``base`` is
    ``get_mem_pool_base_address(layer, role, mode)``. Each block yields ``expansion`` indices.
    """

    def __init__(self, scale: int, expansion: int, layer_offset: int, pages_per_layer: int) -> None:
        self.scale = scale
        self.expansion = expansion
        self.layer_offset = layer_offset
        self.pages_per_layer = pages_per_layer

    def __repr__(self) -> str:
        return (
            f"PageIndexConverter(scale={self.scale}, expansion={self.expansion}, "
            f"layer_offset={self.layer_offset}, pages_per_layer={self.pages_per_layer})"
        )

    def __call__(
        self,
        base_indices: Sequence[int],
        index_mode: PageIndexMode | None = None,
        scratch: ScratchDesc | None = None,
    ) -> list[int]:
        if scratch is not None and index_mode is None:
            raise LogicError("a converter given a ScratchDesc needs an explicit index_mode (PER_LAYER)")
        if scratch is not None and index_mode is PageIndexMode.SHARED:
            raise LogicError("scratch blocks can only be addressed with PageIndexMode.PER_LAYER")
        s = self.scale
        e = self.expansion
        a = self.layer_offset if index_mode is PageIndexMode.PER_LAYER else 0
        p = self.pages_per_layer
        out: list[int] = []
        sb = scratch.range.beg if scratch is not None else 0
        se = scratch.range.end if scratch is not None else 0
        for o, b in enumerate(base_indices):
            if sb <= o < se:
                assert scratch is not None
                q = (o - sb) * p
                idx = scratch.slot_ids[q // s] * s + ((q % s) + a) % s
            elif b == BAD_PAGE_INDEX:
                out.extend([BAD_PAGE_INDEX] * e)
                continue
            else:
                idx = b * s + a
            if e == 1:
                out.append(idx)
            else:
                out.extend(range(idx * e, idx * e + e))
        return out
