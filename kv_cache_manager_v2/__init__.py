"""Engine-agnostic paged KV-cache manager for LLM inference: a map of the package.

Main objects
    KVCacheManager(KVCacheManagerConfig)  one per model: memory tiers (GpuCacheTierConfig,
        HostCacheTierConfig, DiskCacheTierConfig, RemoteCacheTierConfig), layers
        (AttentionLayerConfig, SsmLayerConfig of BufferConfig), prefix reuse, eviction
        (EvictionPolicy), retention the engine controls (RequestRetention of RetentionRange,
        Retention at close, pin/unpin), sessions (SessionId) and their Directives
        (DirectiveOutcome, DirectiveStatus), hybrid snapshot policy (SnapshotPolicy), statistics
        (StorageStatistics, TierStatistics, ReuseStatistics), load or recompute (LoadPolicy,
        LoadPlanStatistics).
    KVCache  one per request (create_kv_cache): its block table, per layer group, of pages
        that kernels address by index (get_base_page_indices, PageIndexConverter).
    KVCacheEventManager  block stored / removed / moved events for KV-aware routers.
    Errors: LogicError (misuse), ValueError / TypeError (bad input), CuError (driver),
        OutOfMemoryError, OutOfPagesError. Memory shortage in serving returns False instead.

The step cycle of a request
    kv = manager.create_kv_cache(input_tokens=prompt[:-1])  SUSPENDED, the cached prefix reused
    kv.resume(stream)            pages locked in GPU memory (False: no room, nothing changed)
    kv.resize(n)                 room for n tokens; kv.commit(tokens) after the forward pass
    decode: manager.resize_batch(caches), manager.commit_batch(caches, tokens) each step
    kv.suspend() under pressure (pages may move down the tiers), kv.close() when done
    probe_reuse(...) tells how much of a prompt is cached without creating a cache.
    manager.prefetch(prompt) (a queued request) reads its cached prefix up from disk / the
    remote tier in the background: a Prefetch, done when in place; kv.prefetch / kv.ready alike.

Engine adapter
    kv_cache_manager_v2.engine: KVCacheResourceManager (prepare_resources, update_resources,
    free_resources per step) over EngineRequest, for engines with a resource-manager loop.

Simulator
    kv-cache-sim (python -m kv_cache_manager_v2.sim): replays a workload or a Mooncake trace
    through the engine adapter and reports hit rates by tier, memory, TTFT/TPOT/queueing
    percentiles, throughput and the manager's CPU time.

More: kv_cache_manager_v2.events (ZMQ publisher, KV-aware router), kv_cache_manager_v2.metrics
(Prometheus). Usage: README.md; how it works, guarantees and the engine contract: docs/design.md.

Constants: BAD_PAGE_INDEX (the index of a block without a page), GPU_LEVEL (cache level 0),
DEFAULT_PRIORITY (retention priority of blocks), EVICTION_POLICIES (the EvictionPolicy values),
SNAPSHOT_POLICIES (the SnapshotPolicy values);
compiled is True when the package runs mypyc-compiled (production mode), False interpreted (fast
mode). Modules whose names start with an underscore are private.
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
    LoadPlanStatistics,
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
    SessionId,
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
    LoadPolicy,
    RemoteCacheTierConfig,
    SnapshotPolicy,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from ._core._directives import Directives
from ._core._kv_cache import KVCache
from ._core._kv_cache_manager import KVCacheManager
from ._core._prefetch import Prefetch
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
from ._retention import RequestRetention, Retention, RetentionRange
from ._sessions import DirectiveOutcome, DirectiveStatus
from ._storage._policy_registry import POLICIES as _EVICTION_POLICY_TABLE

#: True when the package's modules are mypyc-compiled extension modules (production mode).
compiled = not str(getattr(_core._kv_cache, "__file__", "")).endswith(".py")


def _restore_class_docs() -> None:
    """Compiled: the docstrings of the classes mypyc made non-native (it gives them a filler) and the
    annotations of dataclasses as written (it gives them runtime types, ``type`` for a union), from the
    build's ``_compiled_docs.json`` (setup_mypyc.py); native classes and functions have docs in C."""
    import dataclasses
    import inspect
    import json
    import os
    import sys
    from typing import Any

    try:
        with open(os.path.join(os.path.dirname(__file__), "_compiled_docs.json"), encoding="utf-8") as f:
            found: dict[str, dict[str, dict[str, Any]]] = json.load(f)
    except OSError:
        return
    for module, classes in found.items():
        for name, docs in classes.items():
            cls = getattr(sys.modules.get(module), name, None)
            if not isinstance(cls, type):
                continue
            if cls.__doc__ == "mypyc filler docstring" and docs["doc"] is not None:
                cls.__doc__ = docs["doc"]
            annotations: dict[str, str] = docs["annotations"]
            if dataclasses.is_dataclass(cls) and annotations:
                cls.__annotations__ = annotations
                for field in dataclasses.fields(cls):
                    field.type = annotations.get(field.name, field.type)
                init = vars(cls).get("__init__")
                if inspect.isfunction(init):
                    init.__annotations__ = {k: annotations.get(k, v) for k, v in init.__annotations__.items()}


if compiled:
    _restore_class_docs()
del _restore_class_docs

#: the old name of ``LayerGroupId`` (before "layer group" became the only word), kept for callers
LifeCycleId = LayerGroupId

#: docstrings of the public id types and aliases (typing objects, documented here, where users meet them)
_TYPE_DOCS = {
    "BeamIndex": "Index of a beam of a request (0 to beam_width - 1).",
    "BlockOrdinal": "Position of a block in a request: token position // tokens_per_block.",
    "CacheLevel": "Index of a cache tier in KVCacheManagerConfig.cache_tiers (0: GPU, then host, disk, remote).",
    "EvictionPolicy": "A name in EVICTION_POLICIES: "
    + "; ".join(f"{name!r} ({keeps})" for name, _, _, keeps in _EVICTION_POLICY_TABLE)
    + ".",
    "LoadPolicy": "'auto' (load a matched block below the GPU only when that beats recomputing it), "
    "'always' or 'never' (only matches wholly in GPU memory).",
    "SnapshotPolicy": "'interval' (periodic snapshots), 'branch' (where prompts branch, last blocks, demand) or "
    "'auto' (both; the periodic ones at the lowest priority): which recurrent-state snapshots requests keep.",
    "LayerGroupId": "Index of a layer group: layers whose blocks are kept and released alike (old name: LifeCycleId).",
    "LayerId": "Id of a model layer, as given in the layer configs.",
    "MemAddress": "A device or host memory address (an int).",
    "PoolGroupIndex": "Index of a pool group: the memory pools of layer groups whose pages have the same sizes.",
    "PoolIndex": "Index of a pool (one buffer role's memory) in its pool group.",
    "Priority": "Retention priority of a block: lower is evicted first (DEFAULT_PRIORITY unless set).",
    "SessionId": "A conversation or agent the engine names: a non-empty str (create_kv_cache(session_id=...)).",
    "SlotId": "Index of a page slot in a pool group's memory.",
    "TokenId": "A token id: an int in [0, 2**32).",
    "TokenIdExt": "A token: a TokenId, or a bytes digest standing for a multimodal item or extra id.",
}
for _name, _doc in _TYPE_DOCS.items():
    _public = globals()[_name]
    _public.__doc__ = _doc
    if hasattr(_public, "__supertype__"):  # a NewType: its repr names where users import it from
        _public.__module__ = __name__
del _name, _doc, _public

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
    "DirectiveOutcome",
    "DirectiveStatus",
    "Directives",
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
    "LoadPlanStatistics",
    "LoadPolicy",
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
    "Prefetch",
    "Priority",
    "RemoteCacheTierConfig",
    "RemoteStatistics",
    "RequestRetention",
    "Retention",
    "RetentionRange",
    "ReuseScope",
    "ReuseStatistics",
    "ScratchDesc",
    "SessionId",
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
