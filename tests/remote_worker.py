"""The second process of tests/test_remote.py: a manager of its own pointing at the same Redis.

    python remote_worker.py '<json spec>'

Spec: ``url``, ``namespace``, ``dtype``, ``salt``, ``read`` (tokens whose prefix another process
published: report the reused length after checking every record through this process's own
addresses), ``write`` (tokens to compute and publish with write-through, then flush). Prints one
JSON line: ``history``, ``checked``, ``flushed``, ``compiled``, ``stats``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KV_CACHE_MANAGER_V2_CHECK", "1")

from conftest import kv_layers
from fake_engine import FakeEngine

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
    ReuseScope,
)

T = 8


def main() -> None:
    spec = json.loads(sys.argv[1])
    remote = RemoteCacheTierConfig(
        spec["url"],
        spec["namespace"],
        dtype=spec.get("dtype", ""),
        write_through=True,
        timeout_ms=5000,
        max_pending_bytes=4 << 20,
    )
    slot = 2 * 2 * 32 * T
    cfg = KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[GpuCacheTierConfig(64 * slot), HostCacheTierConfig(64 * slot), remote],
        layers=kv_layers(2, T),
        backend="host",
    )
    m = KVCacheManager(cfg)
    engine = FakeEngine(m)
    scope = ReuseScope(salt=spec["salt"]) if spec.get("salt") is not None else None
    out: dict[str, object] = {"compiled": kv_cache_manager_v2.compiled, "checked": 0, "history": 0}
    read = spec.get("read")
    if read:
        kv = m.create_kv_cache(scope, read)
        out["history"] = kv.history_length
        assert kv.resume()
        engine.check_all(kv, read, kv.history_length)  # raises KVMismatch on any wrong record
        out["checked"] = engine.pages_checked
        kv.close()
    write = spec.get("write")
    if write:
        kv = m.create_kv_cache(scope, write[:1])
        assert kv.resume()
        h = kv.history_length
        assert kv.resize(len(write))
        engine.step(kv, write, h, len(write))
        kv.commit(write[h:])
        kv.close()
        out["flushed"] = m.flush_remote_writes(10.0)
    stats = m.remote_statistics
    assert stats is not None
    out["stats"] = dataclasses.asdict(stats)
    m.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
