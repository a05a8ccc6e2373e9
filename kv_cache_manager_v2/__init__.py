"""kv_cache_manager_v2: engine-agnostic paged KV-cache manager for LLM inference.

The same sources run interpreted (fast mode) or compiled with mypyc (production mode);
``compiled`` tells which one was imported.
"""

from __future__ import annotations

from . import _core
from ._common import (
    BAD_PAGE_INDEX,
    DEFAULT_PRIORITY,
    GPU_LEVEL,
    AggregatedPageDesc,
    BeamIndex,
    BlockOrdinal,
    BufferId,
    CacheLevel,
    CacheTier,
    HalfOpenRange,
    KVCacheStatus,
    LayerGroupId,
    LayerGroupInfo,
    LayerId,
    MemAddress,
    PageIndexMode,
    PageStatus,
    PoolDesc,
    PoolGroupDesc,
    PoolGroupIndex,
    PoolIndex,
    Priority,
    RemoteStatistics,
    ReuseScope,
    ReuseStatistics,
    ScratchDesc,
    SlotId,
    StorageStatistics,
    TierStatistics,
    TokenId,
    TokenIdExt,
)
from ._config import (
    EVICTION_POLICIES,
    SNAPSHOT_POLICIES,
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    EvictionPolicy,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
    SnapshotPolicy,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from ._core._kv_cache import KVCache
from ._core._kv_cache_manager import KVCacheManager
from ._core._request_state import default_priority
from ._events import (
    AllBlocksClearedEvent,
    BlockMovedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    KVCacheEvent,
    KVCacheEventManager,
    LayerGroupSpec,
    block_hash,
)
from ._exceptions import CuError, LogicError, OutOfMemoryError, OutOfPagesError
from ._page_index import PageIndexConverter

#: True when the package's modules are mypyc-compiled extension modules (production mode).
compiled: bool = not str(getattr(_core._kv_cache, "__file__", "")).endswith(".py")

#: the old name of ``LayerGroupId`` (before "layer group" became the only word), kept for callers
LifeCycleId = LayerGroupId

__all__ = [
    "BAD_PAGE_INDEX",
    "DEFAULT_PRIORITY",
    "EVICTION_POLICIES",
    "GPU_LEVEL",
    "SNAPSHOT_POLICIES",
    "AggregatedPageDesc",
    "AllBlocksClearedEvent",
    "AttentionLayerConfig",
    "BatchDesc",
    "BeamIndex",
    "BlockMovedEvent",
    "BlockOrdinal",
    "BlockRemovedEvent",
    "BlockStoredEvent",
    "BufferConfig",
    "BufferId",
    "CacheLevel",
    "CacheTier",
    "CuError",
    "DiskCacheTierConfig",
    "EvictionPolicy",
    "GpuCacheTierConfig",
    "HalfOpenRange",
    "HostCacheTierConfig",
    "KVCache",
    "KVCacheDesc",
    "KVCacheEvent",
    "KVCacheEventManager",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KVCacheStatus",
    "LayerGroupId",
    "LayerGroupInfo",
    "LayerGroupSpec",
    "LayerId",
    "LifeCycleId",
    "LogicError",
    "MemAddress",
    "OutOfMemoryError",
    "OutOfPagesError",
    "PageIndexConverter",
    "PageIndexMode",
    "PageStatus",
    "PoolDesc",
    "PoolGroupDesc",
    "PoolGroupIndex",
    "PoolIndex",
    "Priority",
    "RemoteCacheTierConfig",
    "RemoteStatistics",
    "ReuseScope",
    "ReuseStatistics",
    "ScratchDesc",
    "SlotId",
    "SnapshotPolicy",
    "SsmLayerConfig",
    "StorageStatistics",
    "SwaScratchReuseConfig",
    "TierStatistics",
    "TokenId",
    "TokenIdExt",
    "block_hash",
    "compiled",
    "default_priority",
]
