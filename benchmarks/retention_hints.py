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
  ``1 - accuracy`` of the labels flipped (seed 0); a request said not to continue gets no hint;
* ``hintsdrop_<policy>_<accuracy>``: the same, a request said not to continue closed at
  ``DROP_PRIORITY`` (its own blocks evicted first until reused: the first version, for comparison);
* ``hintsown_<policy>_<accuracy>``: the same, the drop only from the end of the request's system
  prompt on (``Retention.start``: the prefix at least 2 conversations start with, ``system_prompts``);
* ``hintsh_<policy>_<accuracy>``: ``hints_`` with a horizon: a conversation expected back later
  than the cache's size over the trace's rate of prompt tokens gets no hint;
* a suffix ``_pinN``: each request pins (``KVCacheManager.pin``, once) the prefix at least N
  conversations start with; ``_ttlN``: pinned again by every request using it, for the cache's
  turnover (its size over the trace's rate of prompt tokens; ``--pin-ttl``); ``_ttl``: N by the
  rule ``sim._hints.pin_threshold`` (the smallest of 2, 4, 8, ... whose pins never need more than
  ``--pin-share`` of the cache at once); ``max_pinned_share`` = ``--pin-share`` (0.5);
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
from kv_cache_manager_v2.sim._hints import hint_retentions, pin_threshold  # noqa: E402
from kv_cache_manager_v2.sim._sessions import (  # noqa: E402
    continuation_pauses,
    continuers,
    conversations,
    shared_prefixes,
)
from kv_cache_manager_v2.sim._workload import TRACE_BLOCK_TOKENS  # noqa: E402

TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
T = 32
CAPS = [1_000_000, 3_000_000, 10_000_000]
RUNS = [
    "lru",
    "frequency",
    "hintsown_lru_0.9_ttl",
    "hintsown_lru_1.0_ttl",
    "hintsown_frequency_0.9_ttl",
    "hintsown_frequency_1.0_ttl",
    "optimum",
]


class TraceClock:
    """The manager's clock: the arrival time of the request being replayed, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gpu_manager(cap_tokens: int, policy: str, clock: TraceClock, **kw: Any) -> kvm.KVCacheManager:
    """A fresh manager of ``cap_tokens`` tokens, GPU tier only (T tokens a block, one full-attention
    layer, host backend: metadata only), under ``policy`` and ``clock``; ``kw``: more config."""
    layers = [kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])]
    cfg = kvm.KVCacheManagerConfig(
        T,
        [kvm.GpuCacheTierConfig(cap_tokens // T * 2 * 64)],
        layers,
        backend="host",
        eviction_policy=policy,  # type: ignore[arg-type]
        clock=clock,
        **kw,
    )
    return kvm.KVCacheManager(cfg)


def replay(
    reqs: list[SimRequest],
    cap_tokens: int,
    policy: str,
    retain: list[kvm.Retention | None] | None,
    pins: list[tuple[int, int] | None] | None = None,
    pin_share: float = 0.5,
    stats: dict[str, Any] | None = None,
    pin_ttl: float | None = None,
) -> float:
    """Hit rate of one replay through a fresh manager (``pins``: per request, the shared prefix
    (id, tokens) pinned once the request committed it, through ``KVCacheManager.pin``; with
    ``pin_ttl``, pinned again by every request using it, for that many seconds; counts in
    ``stats``)."""
    clock = TraceClock()
    m = gpu_manager(cap_tokens, policy, clock, max_pinned_share=pin_share)
    pinned: dict[int, int] = {}  # prefix id -> tokens pinned (-1: refused)
    refused = peak = 0
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
        target = pins[i] if pins is not None else None
        if target is not None and (pin_ttl is not None or pinned.get(target[0], 0) == 0):
            try:
                pinned[target[0]] = m.pin(prompt[: target[1]], duration_s=pin_ttl)
            except ValueError:  # beyond max_pinned_share
                pinned[target[0]] = -1
                refused += 1
        if pins is not None and i % 64 == 0:
            peak = max(peak, m.get_storage_statistics()[0].pinned)
        kv.close(retain[i] if retain is not None else None)
    if stats is not None:
        stats["pinned_prefixes"] = sum(1 for v in pinned.values() if v > 0)
        stats["pinned_tokens"] = sum(v for v in pinned.values() if v > 0)
        stats["pins_refused"] = refused
        stats["peak_pinned_tokens"] = peak * T
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
    ap.add_argument("--pin-share", type=float, default=0.5, help="max_pinned_share of the *_pinN runs")
    ap.add_argument("--pin-ttl", type=float, default=None, help="*_ttlN runs: seconds (default: the cache's turnover)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "retention_hints.json"))
    args = ap.parse_args()
    reqs = load_trace(args.trace, args.requests)
    pauses = continuation_pauses(reqs, TRACE_BLOCK_TOKENS)
    conv = conversations(continuers(reqs, TRACE_BLOCK_TOKENS))
    shared_by = [p[1] if p is not None else 0 for p in shared_prefixes(reqs, 1, TRACE_BLOCK_TOKENS, conv)]
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
            else:
                parts = run.split("_")
                pins = None
                stats: dict[str, Any] = {}
                ttl = None
                if parts[-1].startswith(("pin", "ttl")):  # pinN: prefixes at least N conversations start with
                    if parts[-1].startswith("ttl"):  # pinned by each use for a while
                        ttl = args.pin_ttl if args.pin_ttl is not None else cap / token_rate
                    if parts[-1] == "ttl":  # N by the rule: the smallest whose pins fit the pin share
                        budget = int(args.pin_share * cap)
                        parts[-1] += str(pin_threshold(reqs, budget, ttl or 0.0, TRACE_BLOCK_TOKENS, conv))
                        row[f"{run}_threshold"] = int(parts[-1][3:])
                    pins = shared_prefixes(reqs, int(parts.pop()[3:]) - 1, TRACE_BLOCK_TOKENS, conv)
                hints = None
                policy = parts[0]
                if parts[0] in ("hints", "hintsh", "hintsdrop", "hintsown"):
                    kind, policy, accuracy = parts
                    horizon = cap / token_rate if kind == "hintsh" else None
                    drop = kind in ("hintsdrop", "hintsown")
                    own = shared_by if kind == "hintsown" else None
                    hints = hint_retentions(pauses, float(accuracy), args.seed, horizon, drop, own)
                row[run] = round(replay(reqs, cap, policy, hints, pins, args.pin_share, stats, ttl), 4)
                if pins is not None:
                    row[f"{run}_pins"] = stats
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
