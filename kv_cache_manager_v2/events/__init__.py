"""KV-cache events over the wire (issue #14): msgpack schema, ZMQ publisher, router-side prefix index.

Needs the ``events`` extra (``pip install kv_cache_manager_v2[events]``: msgspec, pyzmq); the core
package never imports this subpackage. These modules are not compiled by mypyc (``setup_mypyc.py``):
msgspec structs and pyzmq are used from plain Python, off the scheduler's hot path. The event queue
the manager writes to is ``kv_cache_manager_v2.KVCacheEventManager`` (compiled).
"""

from __future__ import annotations

try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kv_cache_manager_v2.events needs msgspec and pyzmq: pip install 'kv_cache_manager_v2[events]'"
    ) from e

from ._stream import ReplicaEndpoints
from .index import ReplicaIndex, prompt_block_hashes
from .publisher import ZmqEventPublisher
from .router import KVAwareRouter, PrefixRouter, RouteDecision
from .schema import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_tokens,
    decode_batch,
    digest_stand_in,
    encode_batch,
    to_wire,
)

__all__ = [
    "AllBlocksCleared",
    "BlockMoved",
    "BlockRemoved",
    "BlockStored",
    "KVAwareRouter",
    "KVEventBatch",
    "PrefixRouter",
    "ReplicaEndpoints",
    "ReplicaIndex",
    "RouteDecision",
    "ZmqEventPublisher",
    "block_tokens",
    "decode_batch",
    "digest_stand_in",
    "encode_batch",
    "prompt_block_hashes",
    "to_wire",
]
