"""Issue #31: the frequency policy's adaptive aging against LRU, on documents and on long chats.

    python benchmarks/eviction_adaptive.py                 # both traces, 1M / 3M / 10M tokens (~10 min)
    python benchmarks/eviction_adaptive.py --check         # exit 1 unless the issue's bounds hold
    python benchmarks/eviction_adaptive.py --caps 1000000 --requests 1500   # quicker

Replays, with ``benchmarks/eviction_study.py``'s block-level simulator (T = 32, GPU tier only, the
manager's reuse path), four policies:

* ``lru``: the manager's ``eviction_policy="lru"`` (tail-first release);
* ``frequency_before``: use-rate GreedyDual as shipped by issue #18 (``rgdsf16``);
* ``frequency_deadlines``: the same plus issue #31's first adaptive aging (``adaptive_aging``:
  disagreements with LRU estimated from LRU deadlines);
* ``frequency``: the same with the aging learnt from a simulated LRU (``shadow_aging``, what
  the manager ships now).

on two traces:

* ``shared``: the shared Mooncake trace (``../shared/traces/synthetic_trace.jsonl``: documents
  re-queried at random times; skipped when absent);
* ``multiturn``: ``benchmarks/multiturn_trace.py``'s long multi-turn chats with its defaults
  (700 conversations, about 8 turns, 5,566 requests, 17,940-token mean prompts), generated here.

Hit rate = matched prompt tokens / prompt tokens. ``--check``: on every trace and capacity
``frequency >= lru - 0.005``; the gain over LRU at 1M and 3M on the shared trace is reported
(issue #31 asked for +10 %; the policy before reached +9.6 % / +8.2 % there).
Output: a table and ``bench_results/eviction_adaptive.json``. The committed
``benchmarks/eviction_adaptive_results.json`` holds one run, plus the same table through the real
manager (``benchmarks/eviction_hit_rate.py --trace FILE``; ``frequency_before`` from the code before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eviction_study as study
import multiturn_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = {
    "lru": "lru_tail",
    "frequency_before": "rgdsf16",
    "frequency_deadlines": "adaptive_aging",
    "frequency": "shadow_aging",
}
TOLERANCE = 0.005  # frequency may trail LRU by this much


def traces(args: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    if os.path.exists(args.trace):
        out["shared"] = args.trace
    else:
        print(f"shared trace skipped: {os.path.normpath(args.trace)} not found")
    path = os.path.join(ROOT, "bench_results", "multiturn_trace.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for rec in multiturn_trace.generate():
            f.write(json.dumps(rec) + "\n")
    out["multiturn"] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="*", type=int, default=study.CAPS, help="capacities in tokens")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests of each trace")
    ap.add_argument("--trace", default=study.TRACE, help="the shared Mooncake trace")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "eviction_adaptive.json"))
    ap.add_argument("--check", action="store_true", help=f"exit 1 unless frequency >= lru - {TOLERANCE} everywhere")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    failures: list[str] = []
    for trace_name, path in traces(args).items():
        reqs = study.load_trace(path, args.requests)
        print(f"{trace_name}: {len(reqs)} requests, T={study.T}; token hit rate")
        print(f"{'capacity':>10}" + "".join(f"{p:>21}" for p in POLICIES) + f"{'vs lru':>10}")
        rows: dict[str, Any] = {}
        for cap in args.caps:
            row: dict[str, Any] = {}
            for name, sim in POLICIES.items():
                t0 = time.perf_counter()
                res = study.Replay(reqs, cap, study.POLICIES[sim](reqs)).run()
                row[name] = round(res["hit"], 4)
                row[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
            gain = row["frequency"] / row["lru"] - 1.0
            row["frequency_gain_over_lru"] = round(gain, 4)
            row["frequency_before_gain_over_lru"] = round(row["frequency_before"] / row["lru"] - 1.0, 4)
            rows[str(cap)] = row
            if row["frequency"] < row["lru"] - TOLERANCE:
                failures.append(f"{trace_name} at {cap}: frequency {row['frequency']} < lru {row['lru']} - {TOLERANCE}")
            print(f"{cap / 1e6:>9g}M" + "".join(f"{row[p]:>21.4f}" for p in POLICIES) + f"{gain:>+10.1%}", flush=True)
        results[trace_name] = {"path": os.path.normpath(path), "requests": len(reqs), "capacities": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "benchmark": "eviction_adaptive",
                "tokens_per_block": study.T,
                "metric": "matched prompt tokens / prompt tokens",
                "policies": POLICIES,
                "tolerance": TOLERANCE,
                "traces": results,
                "failures": failures,
            },
            f,
            indent=1,
        )
    print(f"JSON: {args.json}")
    if args.check and failures:
        print("\n".join(failures))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
