"""Issue 37: what close-time continuation hints are worth, against LRU, the frequency policy and an
offline optimum.

    .venv/bin/python benchmarks/retention_hints.py                       # 1M / 3M / 10M tokens
    .venv/bin/python benchmarks/retention_hints.py --caps 3000000 --runs lru hints_lru_0.9 optimum

The shared Mooncake trace (``../shared/traces/synthetic_trace.jsonl``) replayed one request at a
time through the manager (T = 32, GPU tier only, one full-attention layer, host backend: metadata
only), as ``benchmarks/eviction_hit_rate.py`` does: ``create_kv_cache(prompt[:-1])``, ``resume``,
``resize``, ``commit``, ``close``; the manager's clock is the trace's arrival time. Runs:

* ``lru``, ``frequency``: the eviction policies, no hints;
* ``hints_<policy>_<accuracy>``: the same policy, each request closed with the retention
  ``sim._hints.hint_retentions`` derives from the trace's future (whether a later request's prompt
  starts with this one's, up to its last full 512-token trace block, and after what pause), a share
  ``1 - accuracy`` of the labels flipped (seed 0);
* ``hintsh_<policy>_<accuracy>``: the same with a horizon: a conversation expected back later
  than the cache's size over the trace's rate of prompt tokens gets no hint;
* ``optimum``: ``belady`` below, a bound (not a policy): the hit rate of Belady's eviction (the
  block whose next use is farthest goes first, a deeper block first on ties) over the same
  32-token blocks, knowing the whole future; a request's leading cached blocks are its hit.

Hit rate = matched prompt tokens / prompt tokens. Output: a table and
``bench_results/retention_hints.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kv_cache_manager_v2 as kvm  # noqa: E402
from kv_cache_manager_v2.sim import SimRequest, load_trace  # noqa: E402
from kv_cache_manager_v2.sim._hints import continuation_pauses, hint_retentions  # noqa: E402
from kv_cache_manager_v2.sim._workload import TRACE_BLOCK_TOKENS  # noqa: E402

TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
T = 32
CAPS = [1_000_000, 3_000_000, 10_000_000]
RUNS = ["lru", "frequency", "hints_lru_0.9", "hints_lru_1.0", "optimum"]


class TraceClock:
    """The manager's clock: the arrival time of the request being replayed, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(reqs: list[SimRequest], cap_tokens: int, policy: str, retain: list[kvm.Retention | None] | None) -> float:
    """Hit rate of one replay through a fresh manager."""
    clock = TraceClock()
    layers = [kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])]
    cfg = kvm.KVCacheManagerConfig(
        T,
        [kvm.GpuCacheTierConfig(cap_tokens // T * 2 * 64)],
        layers,
        backend="host",
        eviction_policy=policy,  # type: ignore[arg-type]
        clock=clock,
    )
    m = kvm.KVCacheManager(cfg)
    hit = total = 0
    for i, r in enumerate(reqs):
        clock.now = r.arrival_ms / 1000.0
        prompt = r.prompt_tokens()
        n = len(prompt)
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        hit += kv.history_length
        total += n
        if not (kv.resume() and kv.resize(n)):
            raise SystemExit(f"request {i} did not fit")
        kv.commit(prompt[kv.history_length :])
        kv.close(retain[i] if retain is not None else None)
    m.shutdown()
    return hit / total


def block_keys(reqs: list[SimRequest]) -> list[tuple[list[int], list[int]]]:
    """Per request, its 32-token blocks as chain ids (a block's id names its whole prefix) and
    each block's token count."""
    ids: dict[tuple[int, int], int] = {}
    out: list[tuple[list[int], list[int]]] = []
    for r in reqs:
        prompt = r.prompt_tokens()
        chain: list[int] = []
        sizes: list[int] = []
        parent = -1
        for b in range(0, len(prompt), T):
            block = prompt[b : b + T]
            parent = ids.setdefault((parent, hash(block.tobytes())), len(ids))  # (64-bit: no collision here)
            chain.append(parent)
            sizes.append(len(block))
        out.append((chain, sizes))
    return out


def belady(blocks: list[tuple[list[int], list[int]]], cap_tokens: int) -> float:
    """The offline bound (see the module): matched prompt tokens / prompt tokens."""
    capacity = cap_tokens // T
    uses: dict[int, list[int]] = {}
    for i, (chain, _) in enumerate(blocks):
        for key in chain:
            uses.setdefault(key, []).append(i)
    pointer = dict.fromkeys(uses, 0)
    never = len(blocks)
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazily deleted
    hit = total = 0
    for i, (chain, sizes) in enumerate(blocks):
        n = sum(sizes)
        matched = 0
        for key, size in zip(chain, sizes):
            if key not in cached:
                break
            matched += size
        hit += min(matched, n - 1)
        total += n
        for depth, key in enumerate(chain):
            u = uses[key]
            p = pointer[key] + 1
            while p < len(u) and u[p] <= i:
                p += 1
            pointer[key] = p
            nxt = u[p] if p < len(u) else never
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        while len(cached) > capacity:
            neg_next, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_next:
                del cached[key]
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="*", type=int, default=CAPS, help="capacities in tokens")
    ap.add_argument("--runs", nargs="*", default=RUNS, help=f"of {RUNS} (hints_<policy>_<accuracy> in general)")
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--seed", type=int, default=0, help="of the flipped labels")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "retention_hints.json"))
    args = ap.parse_args()
    reqs = load_trace(args.trace, args.requests)
    pauses = continuation_pauses(reqs, TRACE_BLOCK_TOKENS)
    continued = sorted(p for p in pauses if p is not None)
    print(
        f"{len(reqs)} requests; {len(continued) / len(reqs):.1%} continued, median pause "
        f"{continued[len(continued) // 2]:.1f} s; token hit rate"
    )
    blocks = block_keys(reqs) if "optimum" in args.runs else []
    token_rate = sum(r.prompt_length for r in reqs) / max(1e-3, reqs[-1].arrival_ms / 1000.0)
    rows: dict[str, Any] = {}
    for cap in args.caps:
        row: dict[str, Any] = {}
        rows[str(cap)] = row
        for run in args.runs:
            t0 = time.perf_counter()
            if run == "optimum":
                row[run] = round(belady(blocks, cap), 4)
            elif run.startswith(("hints_", "hintsh_")):
                kind, policy, accuracy = run.split("_")
                horizon = cap / token_rate if kind == "hintsh" else None
                hints = hint_retentions(pauses, float(accuracy), args.seed, horizon)
                row[run] = round(replay(reqs, cap, policy, hints), 4)
            else:
                row[run] = round(replay(reqs, cap, run, None), 4)
            row[f"{run}_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{cap / 1e6:>9g}M {run:>22} {row[run]:.4f}", flush=True)
            write_json(args, reqs, continued, rows)  # after each run: a long sweep keeps what it measured
    print(f"JSON: {args.json}")


def write_json(args: argparse.Namespace, reqs: list[SimRequest], continued: list[float], rows: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "benchmark": "retention_hints",
                "compiled": kvm.compiled,
                "tokens_per_block": T,
                "metric": "matched prompt tokens / prompt tokens",
                "trace": os.path.normpath(args.trace),
                "requests": len(reqs),
                "continued_share": round(len(continued) / len(reqs), 4),
                "median_pause_s": continued[len(continued) // 2],
                "seed": args.seed,
                "capacities": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
