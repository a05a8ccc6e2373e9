"""Issue #29: what the fault-proof publisher and the Prometheus collector cost.

    .venv/bin/python benchmarks/events_metrics.py [--quick] [--baseline-root /path/to/other/checkout]

* ``publish``: the scheduler's side, ``ZmqEventPublisher.publish(events)`` (us per call), for a
  decode-step batch (one 32-token BlockStored) and a prefill batch (one 2048-token run);
* ``throughput``: batches per second from the first publish until ``flush()`` returns and a
  ``KVAwareRouter`` on loopback applied them all (the publisher thread encodes, sends zero-copy
  with a tracker, buffers for replay);
* ``scrape``: ``KVCacheMetricsCollector.collect()`` and a full ``generate_latest`` of a manager with
  GPU + host + disk tiers (us per scrape; this runs on the scraping thread, never on the step path).

``--baseline-root`` runs the publisher scenarios again with the package found there (e.g. the
main checkout before this change) in a child process, for comparison. Output: a table and
``bench_results/events_metrics.json``. Interpreted mode only (``events/`` and ``metrics.py`` are
never compiled; the manager's events come from whichever mode is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _events(tokens: int) -> list[Any]:
    import kv_cache_manager_v2 as kvm

    layers = [kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])]
    config = kvm.KVCacheManagerConfig(
        tokens_per_block=32,
        cache_tiers=[kvm.GpuCacheTierConfig(16 << 20)],
        layers=layers,
        backend="host",
    )
    em = kvm.KVCacheEventManager()
    m = kvm.KVCacheManager(config, em)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(tokens)
    kv.commit(list(range(tokens)))
    kv.close()
    out = em.get_latest_events()
    m.shutdown()
    return out


def _consume(router: Any, done: threading.Event) -> None:
    """The router polls on its own thread, as a router process would."""
    while not done.is_set():
        router.poll(0.01)


def publisher_scenarios(n: int) -> dict[str, Any]:
    from kv_cache_manager_v2.events import KVAwareRouter, ReplicaEndpoints, ZmqEventPublisher

    out: dict[str, Any] = {}
    for name, tokens in (("decode", 32), ("prefill", 2048)):
        events = _events(tokens)
        with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", max_queue_size=n + 10) as pub:
            router = KVAwareRouter([ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)])
            try:
                pub.publish(events)
                deadline = time.monotonic() + 10
                while router.last_seq(0) < 0 and time.monotonic() < deadline:
                    router.poll(0.01)
                    router.catch_up(0)
                done = threading.Event()

                consumer = threading.Thread(target=_consume, args=(router, done))
                consumer.start()
                t0 = time.perf_counter()
                for _ in range(n):
                    pub.publish(events)
                t1 = time.perf_counter()
                last = pub.flush(60)
                while router.last_seq(0) < last and time.perf_counter() - t1 < 60:
                    time.sleep(0.001)
                t2 = time.perf_counter()
                done.set()
                consumer.join()
                out[name] = {
                    "publish_us": (t1 - t0) / n * 1e6,
                    "batches_per_s": n / (t2 - t0),
                    "router_lost": router.subscriptions[0].num_lost,
                    "router_last_seq": router.last_seq(0),
                    "last_seq": last,
                }
            finally:
                router.close()
    return out


def scrape_scenario(n: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState
    from kv_cache_manager_v2.metrics import register_metrics

    layers = [
        kvm.AttentionLayerConfig(kvm.LayerId(i), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])
        for i in range(4)
    ]
    with tempfile.TemporaryDirectory() as disk:
        config = kvm.KVCacheManagerConfig(
            tokens_per_block=32,
            cache_tiers=[
                kvm.GpuCacheTierConfig(1 << 20),
                kvm.HostCacheTierConfig(2 << 20),
                kvm.DiskCacheTierConfig(4 << 20, disk),
            ],
            layers=layers,
            backend="host",
        )
        a = KVCacheResourceManager(config)
        for i in range(40):
            r = EngineRequest(i, list(range(i * 1000, i * 1000 + 600)), 2)
            while len(r.generated_tokens) < 2:
                assert a.prepare_resources([r]) == []
                if r.samples_this_step:
                    r.generated_tokens.append(7)
                a.update_resources([r])
            r.state = RequestState.FINISHED
            a.free_resources(r)
        registry = CollectorRegistry()
        collector = register_metrics(adapter=a, registry=registry)
        collector.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            collector.collect()
        t1 = time.perf_counter()
        for _ in range(n):
            text = generate_latest(registry)
        t2 = time.perf_counter()
        a.shutdown()
    return {"collect_us": (t1 - t0) / n * 1e6, "generate_latest_us": (t2 - t1) / n * 1e6, "bytes": len(text)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline-root", help="another checkout: its publisher, for comparison")
    p.add_argument("--child", choices=["publisher"], help=argparse.SUPPRESS)
    p.add_argument("-n", type=int, default=0)
    a = p.parse_args()
    n = a.n or (2_000 if a.quick else 20_000)
    if a.child:
        print(json.dumps(publisher_scenarios(n)))
        return
    sys.path.insert(0, ROOT)
    import kv_cache_manager_v2 as kvm

    doc: dict[str, Any] = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "compiled": kvm.compiled,
        "batches": n,
        "publisher": publisher_scenarios(n),
        "scrape": scrape_scenario(max(100, n // 20)),
    }
    if a.baseline_root:
        env = dict(os.environ, PYTHONPATH=a.baseline_root)
        res = subprocess.run(
            [sys.executable, __file__, "--child", "publisher", "-n", str(n)],
            env=env,
            cwd=a.baseline_root,
            capture_output=True,
            text=True,
            check=True,
        )
        doc["baseline"] = {"root": a.baseline_root, "publisher": json.loads(res.stdout.strip().splitlines()[-1])}
    os.makedirs(os.path.join(ROOT, "bench_results"), exist_ok=True)
    path = os.path.join(ROOT, "bench_results", "events_metrics.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    for name, row in doc["publisher"].items():
        base = doc.get("baseline", {}).get("publisher", {}).get(name)
        extra = f"  (baseline: {base['publish_us']:.1f} us, {base['batches_per_s']:.0f}/s)" if base else ""
        print(f"publish {name:<8} {row['publish_us']:6.1f} us/call  {row['batches_per_s']:8.0f} batches/s{extra}")
    s = doc["scrape"]
    print(
        f"scrape: collect {s['collect_us']:.0f} us, generate_latest {s['generate_latest_us']:.0f} us ({s['bytes']} B)"
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
