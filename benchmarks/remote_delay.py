"""The manager's time per step with the remote tier far away (issue 49, background loads).

    .venv/bin/python benchmarks/remote_delay.py            # JSON: benchmarks/remote_delay_results.json
    .venv/bin/python benchmarks/remote_delay.py --quick

A local redis-server holds ``docs`` shared documents (published by another manager, write-through).
The measured engine loop runs ``KVCacheResourceManager`` over a manager with GPU + host + that
remote tier, reached through ``DelayProxy``: a loopback proxy that holds every reply of the server
for ``delay`` seconds (0, and 0.05: "50 ms away"). ``arrivals`` new requests come each step, each a
document plus a unique question of ``question`` tokens (so every admission looks up blocks the
remote tier lacks), decoding ``decode`` tokens. The engine hands arrivals to
``prefetch_resources`` (the loading state: their prefixes come up in the background) and admits at
most ``max_admit`` of those whose loads are in place per step; a step is ``prefetch_resources``,
``prepare_resources`` (admission), a simulated forward pass of ``forward_ms`` (a sleep, not counted), the sampled
tokens, ``update_resources`` and ``free_resources`` of the finished. The manager's time per step
is the wall time of those calls. Configurations: background loads (``load_workers=2``, the
default) at each delay, and the synchronous path (``load_workers=0``: every admission waits for
its lookup and fetch round trips) at each delay. Each configuration runs ``repeat`` times; the
figures are those of the run with the median p99 (after one unmeasured warm-up run). No model data is computed (pages hold whatever
their memory holds): the figures are the manager's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULTS: dict[str, Any] = dict(
    layers=8,
    page_bytes=1024,  # per buffer (key, value) and layer: 16 KiB per block over 8 layers
    tokens_per_block=16,
    docs=16,
    doc_blocks=32,
    question=64,
    requests=240,
    arrivals=2,
    max_admit=4,  # new requests the engine admits per step at most (of those whose loads are in place)
    decode=16,
    forward_ms=10.0,
    repeat=5,
    delays=[0.0, 0.05],
)
QUICK = dict(DEFAULTS, requests=60, repeat=1)


def _config(p: dict[str, Any], url: str, write_through: bool, load_workers: int) -> Any:
    import kv_cache_manager_v2 as kvm

    layers = [
        kvm.AttentionLayerConfig(
            kvm.LayerId(i), [kvm.BufferConfig("key", p["page_bytes"]), kvm.BufferConfig("value", p["page_bytes"])]
        )
        for i in range(p["layers"])
    ]
    slot = p["layers"] * 2 * p["page_bytes"]
    tiers = [
        kvm.GpuCacheTierConfig(4096 * slot),
        kvm.HostCacheTierConfig(2048 * slot),
        kvm.RemoteCacheTierConfig(url, "remote-delay", timeout_ms=5000, write_through=write_through),
    ]
    return kvm.KVCacheManagerConfig(
        p["tokens_per_block"], tiers, layers, backend="host", max_util_for_resume=1.0, load_workers=load_workers
    )


def _docs(p: dict[str, Any]) -> list[list[int]]:
    n = p["doc_blocks"] * p["tokens_per_block"]
    return [[1_000_000 * (d + 1) + i for i in range(n)] for d in range(p["docs"])]


def _publish(p: dict[str, Any], url: str) -> None:
    """Another replica computes every document and writes it through to the remote tier."""
    import kv_cache_manager_v2 as kvm

    m = kvm.KVCacheManager(_config(p, url, True, 0))
    try:
        for doc in _docs(p):
            kv = m.create_kv_cache(None, doc)
            assert kv.resume() and kv.resize(len(doc))
            kv.commit(doc)
            kv.close()
        assert m.flush_remote_writes(60.0)
    finally:
        m.shutdown()


def _run(p: dict[str, Any], url: str, load_workers: int) -> dict[str, Any]:
    """One engine loop through the adapter; the manager's seconds per step and what the requests waited."""
    from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

    a = KVCacheResourceManager(_config(p, url, False, load_workers))
    docs = _docs(p)
    waiting: list[Any] = []
    running: list[Any] = []
    step_s: list[float] = []
    admitted_after: list[int] = []  # steps each request waited before its first served step
    arrived: dict[int, int] = {}
    next_id = 0
    step = 0
    forward_s = p["forward_ms"] / 1000.0
    reused = 0
    try:
        while next_id < p["requests"] or waiting or running:
            start = time.perf_counter()
            new: list[Any] = []
            for _ in range(p["arrivals"]):
                if next_id < p["requests"]:
                    doc = docs[next_id % len(docs)]
                    question = [50_000_000 + next_id * 10_000 + i for i in range(p["question"])]
                    new.append(EngineRequest(next_id, doc + question, p["decode"]))
                    arrived[next_id] = step
                    next_id += 1
            a.prefetch_resources(new)  # queued: their prefixes load in the background
            waiting += new
            ready = [r for r in waiting if not a.is_loading(r)][: p["max_admit"]]
            batch = running + ready
            unserved = a.prepare_resources(batch)
            served = [r for r in batch if r not in unserved]
            elapsed = time.perf_counter() - start
            time.sleep(forward_s)  # the forward pass (not the manager's time)
            for r in served:
                if r.samples_this_step:
                    r.generated_tokens.append(7)
            start = time.perf_counter()
            a.update_resources(served)
            finished = [r for r in served if len(r.generated_tokens) >= r.max_new_tokens]
            for r in finished:
                r.state = RequestState.FINISHED
                a.free_resources(r)
            elapsed += time.perf_counter() - start
            step_s.append(elapsed)
            for r in waiting:
                if r in served:
                    admitted_after.append(step - arrived[r.request_id])
                    reused += r.num_reused_tokens
            running = [r for r in served if r not in finished] + [r for r in running if r in unserved]
            waiting = [r for r in waiting if r not in served]
            step += 1
        waits = dict(a.loading_requests)
    finally:
        a.shutdown()
    ms = sorted(x * 1000.0 for x in step_s)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return {
        "steps": len(ms),
        "manager_ms_per_step": {
            "mean": round(statistics.fmean(ms), 3),
            "p50": round(pct(0.5), 3),
            "p90": round(pct(0.9), 3),
            "p99": round(pct(0.99), 3),
            "max": round(ms[-1], 3),
        },
        "steps_waited_before_admission": {
            "mean": round(statistics.fmean(admitted_after), 2),
            "max": max(admitted_after),
        },
        "loading_requests": waits,
        "reused_tokens_per_request": round(reused / p["requests"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "remote_delay_results.json"))
    args = parser.parse_args()
    p = dict(QUICK if args.quick else DEFAULTS)
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.delay_proxy import DelayProxy
    from kv_cache_manager_v2.redis_server import LocalRedisServer, find_redis_server

    binary = find_redis_server()
    if binary is None:
        raise SystemExit("no redis-server found")
    results: dict[str, Any] = {"params": p, "compiled": kvm.compiled, "runs": {}}
    with LocalRedisServer(binary) as server:
        _publish(p, server.url)
        _run(dict(p, requests=20), server.url, 2)  # warm-up (lazy imports, first connections): not counted
        configs = [(load_workers, delay) for load_workers in (2, 0) for delay in p["delays"]]
        proxies = {delay: DelayProxy(server.port, delay) for delay in p["delays"]}
        runs: dict[tuple[int, float], list[dict[str, Any]]] = {c: [] for c in configs}
        try:
            for _ in range(p["repeat"]):  # interleaved: a busy machine slows every configuration alike
                for load_workers, delay in configs:
                    runs[(load_workers, delay)].append(_run(p, proxies[delay].url, load_workers))
        finally:
            for proxy in proxies.values():
                proxy.close()
        for (load_workers, delay), its in runs.items():
            its.sort(key=lambda r: r["manager_ms_per_step"]["p99"])
            name = f"{'background' if load_workers else 'synchronous'}_delay_{int(delay * 1000)}ms"
            chosen = its[len(its) // 2]
            chosen["p99_of_each_run"] = [r["manager_ms_per_step"]["p99"] for r in its]
            results["runs"][name] = chosen
            print(name, json.dumps(chosen["manager_ms_per_step"]), flush=True)
    bg = results["runs"]
    slow = bg["background_delay_50ms"]["manager_ms_per_step"]["p99"]
    fast = bg["background_delay_0ms"]["manager_ms_per_step"]["p99"]
    results["background_p99_ratio_50ms_to_0ms"] = round(slow / fast, 3)
    sync = bg["synchronous_delay_50ms"]["manager_ms_per_step"]["p99"]
    results["synchronous_p99_ratio_50ms_to_0ms"] = round(
        sync / bg["synchronous_delay_0ms"]["manager_ms_per_step"]["p99"], 3
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"background p99 ratio (50 ms / 0 ms): {results['background_p99_ratio_50ms_to_0ms']}; wrote {args.out}")


if __name__ == "__main__":
    main()
