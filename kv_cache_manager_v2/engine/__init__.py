"""Engine integration: a resource-manager adapter over :class:`KVCacheManager` (seed 002).

from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager
"""

from __future__ import annotations

from ._buffers import CudaBufferView
from ._request import EngineRequest, RequestId, RequestState
from ._resource_manager import KVCacheResourceManager, step_tokens

__all__ = ["CudaBufferView", "EngineRequest", "KVCacheResourceManager", "RequestId", "RequestState", "step_tokens"]
