"""A second process for tests/test_disk_persistent.py: a manager with a persistent disk tier.

    python disk_worker.py '<json spec>'

Spec: ``path``, ``mode`` and optional ``namespace``, ``gpu``/``disk`` (slots), ``prompts`` (token lists).
Modes:

- ``read``: open the directory, report the pages adopted and, per prompt, the reused length after
  checking every record of it through this process's own addresses (fake engine).
- ``publish``: compute and publish every prompt, then shut down (the blocks stay on disk).
- ``churn``: publish new prompts and evict them to disk in a loop until killed, printing
  ``ready`` once the first round is on disk (the parent kills it with SIGKILL mid-writes).
- ``hold``: open the directory, print ``ready`` and wait to be killed.
- ``fork``: publish every prompt and move its blocks down to the disk tier, start a
  ``multiprocessing`` child with the "fork" method (it sleeps), print ``ready <child pid>`` and
  wait to be killed.

Prints one JSON line (``read``/``publish``).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.synchronize
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KV_CACHE_MANAGER_V2_CHECK", "1")

from conftest import kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, publish

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)


def config(spec: dict[str, object]) -> KVCacheManagerConfig:
    gpu = int(spec.get("gpu", 4))  # type: ignore[call-overload]
    disk = int(spec.get("disk", 32))  # type: ignore[call-overload]
    return KVCacheManagerConfig(
        T,
        [
            GpuCacheTierConfig(gpu * SLOT),
            DiskCacheTierConfig(
                disk * SLOT, str(spec["path"]), persistent=True, namespace=str(spec.get("namespace", ""))
            ),
        ],
        kv_layers(2, T),
        backend="host",
        max_util_for_resume=1.0,
    )


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    m = KVCacheManager(config(spec))
    engine = FakeEngine(m)
    prompts: list[list[int]] = spec.get("prompts", [])
    out: dict[str, object] = {"compiled": kv_cache_manager_v2.compiled, "adopted": m.num_adopted_pages}
    if mode == "read":
        history = []
        for toks in prompts:
            kv = m.create_kv_cache(input_tokens=toks + [1])
            assert kv.resume()
            h = kv.history_length
            engine.check_all(kv, toks, h)
            history.append(h)
            kv.close()
        m.check_invariants()
        out["history"] = history
        out["checked"] = engine.pages_checked
        out["io_errors"] = m.get_tier_statistics(kv_cache_manager_v2.CacheLevel(1)).io_errors
    elif mode == "publish":
        for toks in prompts:
            publish(m, toks, engine=engine)
    elif mode == "churn":
        r = 0
        while True:
            for _ in range(8):
                publish(m, [(1000 + r) * 1000 + i for i in range(3 * T)], engine=engine)
                r += 1
            if r == 8:
                print("ready", flush=True)
    elif mode == "hold":
        print("ready", flush=True)
        time.sleep(600)
    elif mode == "fork":
        for toks in prompts:
            publish(m, toks, engine=engine)
        hog = m.create_kv_cache()  # takes every GPU slot: the published blocks go down to disk
        assert hog.resume() and hog.resize(int(spec.get("gpu", 4)) * T)
        hog.close()
        context = multiprocessing.get_context("fork")
        started = context.Event()
        child = context.Process(target=_sleep_started, args=(started,))
        child.start()
        # the child's fork handlers (which drop its copy of the lock) run before its target
        assert started.wait(60)
        print(f"ready {child.pid}", flush=True)
        time.sleep(600)
    m.shutdown()
    print(json.dumps(out), flush=True)


def _sleep_started(started: multiprocessing.synchronize.Event) -> None:
    started.set()
    time.sleep(600)


if __name__ == "__main__":
    main()
