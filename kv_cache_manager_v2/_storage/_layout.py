"""Storage layout: coalesced buffers, pools, pool groups, per-buffer attributes."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .._common import BufferId, LayerGroupId, LayerId, PoolGroupIndex, PoolIndex
from .._config import LayerConfig
from .._life_cycle_registry import LayerGroupRegistry
from .._typed import TypedList


@dataclass(frozen=True)
class CoalescedBuffer:
    """Buffers of one layer group with equal expanded size, packed side by side in one pool slot."""

    single_size: int
    buffer_ids: tuple[BufferId, ...]

    @property
    def slot_size(self) -> int:
        return self.single_size * len(self.buffer_ids)


@dataclass(frozen=True)
class BufferAttr:
    """Where one buffer lives: ``pool_base + slot * slot_size + offset`` holds its block data."""

    layer_group: LayerGroupId
    pool_group: PoolGroupIndex
    pool: PoolIndex
    offset: int  #: bytes from the start of the pool slot
    size: int  #: bytes of one kernel page
    expansion: int  #: kernel pages per block (E)
    scale: int  #: buffers in the coalesced buffer (S)
    layer_offset: int  #: offset / (size * E) (Lo)
    pages_per_layer: int  #: sub-pages one layer uses in this pool (P)


@dataclass(frozen=True)
class PoolGroupLayout:
    """Layer groups sharing one slot-size list; one pool per entry."""

    index: PoolGroupIndex
    slot_sizes: tuple[int, ...]
    layer_groups: tuple[LayerGroupId, ...]
    #: its layer groups keep recurrent states (live states and snapshots); a pool group never
    #: mixes them with per-block KV, so its usage is the state bytes of its level
    holds_states: bool = False

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot takes across all pools of the group."""
        return sum(self.slot_sizes)


class StorageLayout:
    """The full layout derived from the layer configs and layer groups."""

    coalesced: TypedList[LayerGroupId, list[CoalescedBuffer]]  #: sorted by size descending
    pool_groups: TypedList[PoolGroupIndex, PoolGroupLayout]
    pool_group_of_layer_group: TypedList[LayerGroupId, PoolGroupIndex]
    buffers: dict[BufferId, BufferAttr]
    buffer_order: list[BufferId]  #: config order (layer, then role)
    slot_util_frac_max: TypedList[LayerGroupId, Fraction]  #: max P / S over the layer group's layers and pools

    def __init__(self, layers: list[LayerConfig], registry: LayerGroupRegistry, tokens_per_block: int) -> None:
        num_lc = len(registry)
        expanded: dict[BufferId, tuple[int, int]] = {}  # size, expansion
        by_lc: list[dict[int, list[BufferId]]] = [{} for _ in range(num_lc)]
        self.buffer_order = []
        for layer in layers:
            layer_lc = registry.layer_to_layer_group[layer.layer_id]
            for b in layer.buffers:
                bid = BufferId(LayerId(layer.layer_id), b.role)
                override = b.tokens_per_block_override
                e = tokens_per_block // override if override else 1
                expanded[bid] = (b.size, e)
                by_lc[layer_lc].setdefault(b.size * e, []).append(bid)
                self.buffer_order.append(bid)
        coalesced: list[list[CoalescedBuffer]] = []
        group_of_sizes: dict[tuple[tuple[int, ...], bool], PoolGroupIndex] = {}
        group_lcs: list[list[LayerGroupId]] = []
        lc_group: list[PoolGroupIndex] = []
        for lc in range(num_lc):
            cbs = [CoalescedBuffer(size, tuple(ids)) for size, ids in by_lc[lc].items()]
            cbs.sort(key=lambda cb: (-cb.slot_size, -cb.single_size))
            coalesced.append(cbs)
            key = (tuple(cb.slot_size for cb in cbs), registry.layer_groups[LayerGroupId(lc)].keeps_live_state)
            g = group_of_sizes.get(key)
            if g is None:
                g = PoolGroupIndex(len(group_lcs))
                group_of_sizes[key] = g
                group_lcs.append([])
            group_lcs[g].append(LayerGroupId(lc))
            lc_group.append(g)
        self.coalesced = TypedList(coalesced)
        self.pool_group_of_layer_group = TypedList(lc_group)
        groups = [PoolGroupLayout(g, key[0], tuple(group_lcs[g]), key[1]) for key, g in group_of_sizes.items()]
        groups.sort(key=lambda pg: pg.index)
        self.pool_groups = TypedList(groups)
        self.buffers = {}
        fracs: list[Fraction] = []
        for lc in range(num_lc):
            frac = Fraction(0)
            for p, cb in enumerate(coalesced[lc]):
                per_layer: dict[LayerId, int] = {}
                for bid in cb.buffer_ids:
                    per_layer[bid[0]] = per_layer.get(bid[0], 0) + 1
                scale = len(cb.buffer_ids)
                for k, bid in enumerate(cb.buffer_ids):
                    size, e = expanded[bid]
                    self.buffers[bid] = BufferAttr(
                        layer_group=LayerGroupId(lc),
                        pool_group=lc_group[lc],
                        pool=PoolIndex(p),
                        offset=k * cb.single_size,
                        size=size,
                        expansion=e,
                        scale=scale,
                        layer_offset=k,
                        pages_per_layer=per_layer[bid[0]],
                    )
                frac = max(frac, Fraction(max(per_layer.values()), scale))
            fracs.append(frac)
        self.slot_util_frac_max = TypedList(fracs)
