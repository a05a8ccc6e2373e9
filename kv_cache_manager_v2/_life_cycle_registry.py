"""The life cycle registry: which layers form which layer group, and each group's policy.

"Life cycle" is the reference system's word for what this package calls a *layer group*: layers
whose blocks are kept and released alike. Layers -> layer groups -> kind, one line per
layer kind in ``LAYER_KINDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._common import LayerGroupId, LayerId
from ._config import LayerConfig
from ._layers import _full_attention, _recurrent, _sliding_window
from ._layers._policy import LayerGroup
from ._typed import TypedList

#: the policy of a layer config when it is of the kind, else None
FromLayer = Callable[[LayerConfig, int], LayerGroup | None]
#: the policy of a group another manager announced: (window_size, num_sink_blocks, tokens_per_block)
FromAnnounced = Callable[[int | None, int, int], LayerGroup]


class LayerKind:
    """One layer kind: its event name and how its policy is built."""

    __slots__ = ("from_announced", "from_layer", "name")

    def __init__(self, name: str, from_layer: FromLayer, from_announced: FromAnnounced) -> None:
        self.name = name
        self.from_layer = from_layer
        self.from_announced = from_announced


#: every layer kind, the first that claims a layer config wins
LAYER_KINDS: list[LayerKind] = [
    LayerKind("sliding_window", _sliding_window.from_layer, _sliding_window.from_announced),
    LayerKind("full_attention", _full_attention.from_layer, _full_attention.from_announced),
    LayerKind("recurrent", _recurrent.from_layer, _recurrent.from_announced),
]


def layer_group_of(layer: LayerConfig, tokens_per_block: int) -> LayerGroup:
    """The policy of the layer group ``layer`` belongs to."""
    for kind in LAYER_KINDS:
        layer_group = kind.from_layer(layer, tokens_per_block)
        if layer_group is not None:
            return layer_group
    raise ValueError(f"layer {layer.layer_id}: no layer kind takes {layer!r}")


def announced_layer_group(
    kind: str, window_size: int | None, num_sink_blocks: int, tokens_per_block: int
) -> LayerGroup:
    """The policy of a layer group of ``kind`` another manager announced (KV events)."""
    for layer_kind in LAYER_KINDS:
        if layer_kind.name == kind:
            return layer_kind.from_announced(window_size, num_sink_blocks, tokens_per_block)
    raise ValueError(f"unknown layer kind {kind!r}; known: {[k.name for k in LAYER_KINDS]}")


class LayerGroupRegistry:
    """Dense ``LayerGroupId`` per distinct layer shape, in first-seen order of the layers."""

    layer_groups: TypedList[LayerGroupId, LayerGroup]
    layer_to_layer_group: dict[LayerId, LayerGroupId]
    layers_of: TypedList[LayerGroupId, list[LayerId]]
    tokens_per_block: int
    #: layer groups whose blocks go stale as history grows (``LayerGroup.releases_blocks``)
    releasing_layer_groups: list[LayerGroupId]

    #: layer groups that keep a live state per request and beam (``LayerGroup.keeps_live_state``)
    state_layer_groups: list[LayerGroupId]

    def __init__(self, layers: Sequence[LayerConfig], tokens_per_block: int, snapshot_interval: int = 0) -> None:
        self.tokens_per_block = tokens_per_block
        self.layer_groups = TypedList([])
        self.layer_to_layer_group = {}
        self.layers_of = TypedList([])
        index: dict[tuple[str, int, int, str], LayerGroupId] = {}
        for layer in layers:
            layer_group = layer_group_of(layer, tokens_per_block)
            key = layer_group.shape_key()
            layer_group_id = index.get(key)
            if layer_group_id is None:
                layer_group_id = LayerGroupId(len(self.layer_groups))
                index[key] = layer_group_id
                self.layer_groups.items.append(layer_group)
                self.layers_of.items.append([])
            self.layer_to_layer_group[layer.layer_id] = layer_group_id
            self.layers_of[layer_group_id].append(layer.layer_id)
        self.releasing_layer_groups = [
            LayerGroupId(i) for i, layer_group in enumerate(self.layer_groups) if layer_group.releases_blocks
        ]
        self.state_layer_groups = [
            LayerGroupId(i) for i, layer_group in enumerate(self.layer_groups) if layer_group.keeps_live_state
        ]
        for layer_group_id in self.state_layer_groups:
            self.layer_groups[layer_group_id].snapshot_interval = snapshot_interval

    def __len__(self) -> int:
        return len(self.layer_groups)

    def ids(self) -> list[LayerGroupId]:
        return [LayerGroupId(i) for i in range(len(self.layer_groups))]
