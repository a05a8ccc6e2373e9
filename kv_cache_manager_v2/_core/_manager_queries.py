"""ManagerQueries: the read-only side of :class:`KVCacheManager`: the memory layout kernels
index (buffers, pools, page indices) and the statistics; the manager adds requests, resizing,
batches and shut-down."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

from .._common import (
    GPU_LEVEL,
    AggregatedPageDesc,
    BufferId,
    CacheLevel,
    CacheTier,
    LayerGroupId,
    LayerGroupInfo,
    LayerId,
    LoadPlanStatistics,
    MemAddress,
    PageIndexMode,
    PoolDesc,
    PoolGroupDesc,
    PoolIndex,
    RemoteStatistics,
    ReuseStatistics,
    StorageStatistics,
    TierStatistics,
)
from .._config import KVCacheManagerConfig
from .._exceptions import LogicError
from .._layers._policy import LayerGroup
from .._life_cycle_registry import LayerGroupRegistry
from .._page_index import PageIndexConverter
from .._reuse._tree import ReuseTree
from .._storage._backend import MemoryBackend
from .._storage._layout import BufferAttr, StorageLayout
from .._storage._remote._store import RemoteStore
from .._storage._storage_manager import StorageManager
from .._utils import check_int, check_type
from ._context import CacheContext
from ._load_plan import LoadPlanner
from ._pools import aggregated_pages


class ManagerQueries:
    """The queries of :class:`KVCacheManager` that change nothing: memory layout and statistics."""

    #: True until construction completes (a half-built manager has nothing to release)
    _is_shut_down: bool = True
    # set by KVCacheManager.__init__
    _config: KVCacheManagerConfig
    _registry: LayerGroupRegistry
    _layout: StorageLayout
    _backend: MemoryBackend
    _storage: StorageManager
    _tree: ReuseTree
    _remote: RemoteStore | None
    _ctx: CacheContext
    _planner: LoadPlanner
    num_layer_groups: int
    #: ``len(config.cache_tiers)`` (the config is not a native class: one attribute read is a lookup by name)
    _num_tiers: int

    # ------------------------------------------------------------------ layout for kernels
    @property
    def backend_name(self) -> str:
        """``"cuda"`` or ``"host"``: where the GPU tier lives."""
        return self._backend.name

    @property
    def backend(self) -> MemoryBackend:
        """The memory backend in use (CUDA or host emulation)."""
        return self._backend

    @property
    def config(self) -> KVCacheManagerConfig:
        """The configuration this manager was built from (layers, windows, tiers)."""
        return self._config

    @property
    def num_layers(self) -> int:
        """How many layers are configured."""
        return len(self._config.layers)

    @property
    def layer_ids(self) -> list[LayerId]:
        """The configured layers' ids, in config order."""
        return [LayerId(layer.layer_id) for layer in self._config.layers]

    @property
    def all_buffer_ids(self) -> list[BufferId]:
        """Every (layer, role) buffer, in memory layout order."""
        return list(self._layout.buffer_order)

    @property
    def layer_grouping(self) -> list[tuple[LayerId, ...]]:
        """Layer ids of each layer group (indexed by ``LayerGroupId``)."""
        return [tuple(ids) for ids in self._registry.layers_of]

    @property
    def cache_tier_list(self) -> list[CacheTier]:
        """The medium of each cache level, GPU first."""
        return [t.tier for t in self._config.cache_tiers]

    @property
    def pool_group_descs(self) -> list[PoolGroupDesc]:
        """Each pool group's slots and pools (base addresses, slot sizes) at the GPU level."""
        self._check_alive()
        return [
            PoolGroupDesc(
                g.index,
                g.num_slots,
                tuple(
                    PoolDesc(PoolIndex(i), g.memory_pool(i).base_address, size)
                    for i, size in enumerate(g.layout.slot_sizes)
                ),
            )
            for g in self._storage.gpu
        ]

    def get_layer_group_id(self, layer_id: object) -> LayerGroupId:
        """The layer group of ``layer_id`` (a ``LayerId``; the index of its block table); ValueError for an
        unknown layer."""
        layer_group = self._registry.layer_to_layer_group.get(LayerId(check_int("layer_id", layer_id)))
        if layer_group is None:
            raise ValueError(f"unknown layer_id {layer_id!r}; known: {self.layer_ids}")
        return layer_group

    def get_layer_group_info(self, layer_group_id: object) -> LayerGroupInfo:
        """Layers, window, sink blocks and pool group of one layer group (``LayerGroupId`` from
        ``get_layer_group_id``; groups are numbered ``0 .. len(layer_grouping) - 1``)."""
        layer_group = LayerGroupId(check_int("layer_group_id", layer_group_id))
        if layer_group >= self.num_layer_groups:
            raise ValueError(
                f"layer_group_id must be in [0, {self.num_layer_groups}) (layer groups of this manager), "
                f"got {layer_group}"
            )
        policy = self._registry.layer_groups[layer_group]
        return LayerGroupInfo(
            layer_group,
            tuple(self._registry.layers_of[layer_group]),
            policy.window_size,
            policy.num_sink_blocks,
            self._layout.pool_group_of_layer_group[layer_group],
            policy.kind,
        )

    def _layer_group_policy(self, layer_group_id: LayerGroupId) -> LayerGroup:
        """The policy of a layer group (for the engine adapter's capacity planning)."""
        return self._registry.layer_groups[layer_group_id]

    def _buffer(self, layer_id: object, role: str) -> BufferAttr:
        layer = LayerId(check_int("layer_id", layer_id))
        attr = self._layout.buffers.get(BufferId(layer, role))
        if attr is None:
            self.get_layer_group_id(layer)
            roles = [r for (lid, r) in self._layout.buffer_order if lid == layer]
            raise ValueError(f"layer {layer} has no buffer with role {role!r}; its roles: {roles}")
        return attr

    def get_mem_pool_base_address(
        self, layer_id: object, role: str, index_mode: PageIndexMode | None = None
    ) -> MemAddress:
        """Base address for kernel page indices of this buffer in ``index_mode`` (None: SHARED)."""
        self._check_alive()
        attr = self._buffer(layer_id, role)
        base = self._storage.gpu[attr.pool_group].memory_pool(attr.pool).base_address
        if index_mode is None or index_mode is PageIndexMode.SHARED:
            return MemAddress(base + attr.offset)
        if index_mode is PageIndexMode.PER_LAYER:
            return base
        raise TypeError(f"index_mode must be a PageIndexMode or None, got {index_mode!r}")

    def get_page_stride(self, layer_id: object, role: str) -> int:
        """Bytes of one kernel page of this buffer."""
        return self._buffer(layer_id, role).size

    def get_page_index_upper_bound(self, layer_id: object, role: str) -> int:
        """Kernel page indices of this buffer are below this bound."""
        self._check_alive()
        attr = self._buffer(layer_id, role)
        return self._storage.gpu[attr.pool_group].num_slots * attr.scale * attr.expansion

    def get_page_index_converter(self, layer_id: object, role: str) -> PageIndexConverter:
        """Turns a layer group's base page indices into the kernel page indices of ``layer_id``'s ``role`` buffer."""
        attr = self._buffer(layer_id, role)
        return PageIndexConverter(attr.scale, attr.expansion, attr.layer_offset, attr.pages_per_layer)

    def supports_index_mode(self, mode: PageIndexMode) -> bool | None:
        """PER_LAYER: True. SHARED: True without SWA scratch reuse; with it None, meaning "ask each
        request" (``KVCache.supports_index_mode``): scratch blocks need PER_LAYER."""
        check_type("mode", mode, PageIndexMode)
        if mode is PageIndexMode.PER_LAYER or self._ctx.max_rewind_len < 0:
            return True
        return None

    def get_aggregated_pages(self, buffer_ids: Sequence[BufferId]) -> Iterator[AggregatedPageDesc]:
        """Byte-contiguous runs of the requested buffers, one or more per pool (bulk transfer)."""
        self._check_alive()
        wanted: set[BufferId] = set()
        for bid in buffer_ids:
            parts = cast("Sequence[object]", bid)  # (objects: compiled code would turn a bool layer id into an int)
            self._buffer(parts[0], bid[1])
            wanted.add(BufferId(bid[0], bid[1]))
        yield from aggregated_pages(self._layout, self._storage, wanted)

    # ------------------------------------------------------------------ statistics
    @property
    def load_plan_statistics(self) -> LoadPlanStatistics:
        """What the load plan (``load_policy``) did so far and the tier costs it uses (a copy)."""
        p = self._planner
        costs = p.costs
        return LoadPlanStatistics(
            p.policy,
            p.tokens_per_s if p.tokens_per_s > 0.0 else None,
            tuple(p.loaded_tokens),
            tuple(p.recomputed_tokens),
            p.saved_s,
            p.cut_saved_s,
            p.cuts,
            tuple(1.0 / x if x > 0.0 else float("inf") for x in costs.seconds_per_byte),
            tuple(costs.latency_s),
            tuple(costs.wait_s(x) for x in range(len(costs.busy_until))),
        )

    @property
    def reuse_statistics(self) -> ReuseStatistics:
        """What prefix reuse did so far (a copy; all zero when ``enable_stats`` is False)."""
        s = self._ctx.stats
        return ReuseStatistics(
            s.reused_blocks,
            s.missed_blocks,
            s.reused_pages,
            s.allocated_pages,
            s.queried_tokens,
            s.reused_tokens,
            s.snapshots_taken,
            s.snapshots_skipped,
            s.snapshots_reused,
            self._tree.snapshots_evicted if self._ctx.enable_stats else 0,
            s.attention_matched_tokens,
            s.snapshots_interval,
            s.snapshots_branch,
            s.snapshots_last,
            s.snapshots_demand,
            self._tree.snapshots_evicted_unused if self._ctx.enable_stats else 0,
        )

    @property
    def remote_statistics(self) -> RemoteStatistics | None:
        """What the remote tier did so far (None without one)."""
        remote = self._remote
        return remote.statistics() if remote is not None else None

    def get_storage_statistics(self, level: object = GPU_LEVEL) -> list[StorageStatistics]:
        """Slot accounting per pool group at ``level``: free slots, and evictable ones (reusable
        pages, and suspended requests' pages as far as the levels below can take them). The remote
        tier has no slots: an empty list (see ``get_tier_statistics`` and ``remote_statistics``)."""
        self._check_alive()
        cache_level = self._check_level(level)
        if cache_level == self._storage.num_levels:
            return []
        return self._storage.statistics(cache_level)

    def get_tier_statistics(self, level: object = GPU_LEVEL) -> TierStatistics:
        """Usage, peak and traffic (offloaded / onboarded / dropped pages and bytes, disk errors)
        of cache ``level`` since the manager was created. The remote tier: pages written
        (offloaded), fetched (onboarded), writes dropped, failed round trips and refused values
        (io_errors); its usage reads 0 (the server is shared)."""
        return self._storage.tier_statistics(self._check_level(level))

    def take_iteration_stats(self) -> list[TierStatistics]:
        """One entry per cache level with the traffic since the previous call (peak usage: since
        then too), and start a new interval. An engine calls it once per step and logs it."""
        return self._storage.take_iteration_stats()

    @property
    def gpu_utilization(self) -> float:
        """Max over pool groups of unavailable / total GPU slots."""
        self._check_alive()
        return self._storage.utilization()

    # ------------------------------------------------------------------ checks
    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise LogicError("the manager was shut down: its memory is released; build a new KVCacheManager")

    def _check_level(self, level: object) -> CacheLevel:
        """A public ``level`` argument checked (an ``object``: compiled code would turn a bool into an int first)."""
        n = self._num_tiers
        cache_level = check_int("cache level", level)
        if cache_level >= n:
            raise ValueError(f"cache level must be in [0, {n}) ({n} tiers configured), got {cache_level}")
        return CacheLevel(cache_level)
