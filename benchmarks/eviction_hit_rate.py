"""Issue #18's acceptance check: prefix hit rate of each eviction policy through the real manager.

    .venv/bin/python setup_mypyc.py build_ext --inplace           # compiled mode (preferred: ~6x faster)
    .venv/bin/python benchmarks/eviction_hit_rate.py              # lru + frequency at 1M / 3M / 10M tokens
    .venv/bin/python benchmarks/eviction_hit_rate.py --check      # exit 1 if frequency misses a target
    .venv/bin/python benchmarks/eviction_hit_rate.py --policies frequency --caps 1000000 --requests 500

The shared Mooncake trace (``../shared/traces/synthetic_trace.jsonl``, 3,993 requests) replayed
one request at a time, prompt blocks only, T = 32, GPU tier only (one full-attention layer,
64-byte buffers, host backend: metadata only), exactly as ``benchmarks/run.py``'s replay drives
the manager: ``create_kv_cache(prompt[:-1])``, ``resume``, ``resize(input_length)``,
``commit(prompt[history:])``, ``close``. Trace block ``h`` is token ids ``h*512 ..``.

Token hit rate (``hit``) = tokens matched by ``create_kv_cache`` / input tokens (the issue's
metric); ``blk`` = the manager's ``ReuseStatistics.hit_rate``. Targets (issue #18, frequency):
>= 0.160 at 1M, >= 0.335 at 3M, >= 0.600 at 10M tokens. Runs in whichever mode imports (the JSON
says which). Output: a table and ``bench_results/eviction_hit_rate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from array import array
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
T = 32
CAPS = [1_000_000, 3_000_000, 10_000_000]
TARGETS = {1_000_000: 0.160, 3_000_000: 0.335, 10_000_000: 0.600}


def load(path: str, limit: int | None) -> list[tuple[int, list[int]]]:
    reqs: list[tuple[int, list[int]]] = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            reqs.append((r["input_length"], r["hash_ids"]))
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


def replay(reqs: list[tuple[int, list[int]]], cap_tokens: int, policy: str) -> dict[str, Any]:
    """One replay through a fresh manager with ``eviction_policy=policy``; its rates and cost."""
    sys.path.insert(0, ROOT)
    import kv_cache_manager_v2 as kvm

    layers = [kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])]
    slots = cap_tokens // T
    cfg = kvm.KVCacheManagerConfig(
        T, [kvm.GpuCacheTierConfig(slots * 2 * 64)], layers, backend="host", eviction_policy=policy
    )
    m = kvm.KVCacheManager(cfg)
    total_slots = m.get_storage_statistics()[0].total
    hit_tok = tot_tok = blocks = 0
    t0 = time.perf_counter()
    for i, (n, hash_ids) in enumerate(reqs):
        prompt = array("I", [h * 512 + k for h in hash_ids for k in range(512)][:n])
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        hit_tok += kv.history_length
        tot_tok += n
        blocks += (n + T - 1) // T
        if not (kv.resume() and kv.resize(n)):
            raise SystemExit(f"request {i} did not fit")
        kv.commit(prompt[kv.history_length :])
        kv.close()
    dt = time.perf_counter() - t0
    st = m.reuse_statistics
    dropped = sum(g.num_dropped for g in m._storage.gpu)
    m.shutdown()
    return {
        "policy": policy,
        "cap_tokens": cap_tokens,
        "slots": total_slots,
        "hit": hit_tok / tot_tok,
        "blk": st.hit_rate,
        "evicted_pages": dropped,
        "seconds": round(dt, 2),
        "us_per_block": dt / blocks * 1e6,
        "compiled": kvm.compiled,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="*", default=["lru", "frequency"])
    ap.add_argument("--caps", nargs="*", type=int, default=CAPS, help="GPU capacities in tokens")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "eviction_hit_rate.json"))
    ap.add_argument("--check", action="store_true", help="exit 1 unless frequency meets the issue's targets")
    args = ap.parse_args()
    if not os.path.exists(args.trace):
        print(f"skipped: {os.path.normpath(args.trace)} not found (the shared trace lives beside the repository)")
        return
    reqs = load(args.trace, args.requests)
    rows: list[dict[str, Any]] = []
    print(f"{len(reqs)} requests, T={T}, GPU tier only; hit = matched tokens / input tokens, blk = manager hit_rate")
    print(f"{'policy':<12}{'tokens':>10}{'hit':>9}{'blk':>9}{'evicted':>10}{'s':>8}{'us/block':>10}")
    for policy in args.policies:
        for cap in args.caps:
            r = replay(reqs, cap, policy)
            rows.append(r)
            print(
                f"{policy:<12}{cap / 1e6:>9g}M{r['hit']:>9.4f}{r['blk']:>9.4f}{r['evicted_pages']:>10,}"
                f"{r['seconds']:>8.1f}{r['us_per_block']:>10.2f}",
                flush=True,
            )
    failed = [
        r
        for r in rows
        if r["policy"] == "frequency" and args.requests is None and r["hit"] < TARGETS.get(r["cap_tokens"], 0.0)
    ]
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        doc = {
            "trace": os.path.basename(args.trace),
            "requests": len(reqs),
            "tokens_per_block": T,
            "targets": {str(k): v for k, v in TARGETS.items()},
            "results": rows,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        json.dump(doc, f, indent=1)
    print(f"JSON: {args.json}")
    if args.check and failed:
        for r in failed:
            print(f"target missed: frequency at {r['cap_tokens']} tokens: {r['hit']:.4f} < {TARGETS[r['cap_tokens']]}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
