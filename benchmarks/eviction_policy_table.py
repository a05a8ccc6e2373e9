"""Every eviction policy of the registry on a trace, through the simulator: ``kv-cache-sim
--eviction-policy all --sweep gpu=...`` (one replay per policy and GPU capacity), the hit rates
written to JSON (default ``benchmarks/eviction_policy_table_results.json``) and a table on stdout.

    python benchmarks/eviction_policy_table.py                       # the shared trace, 1M and 3M tokens
    python benchmarks/eviction_policy_table.py --requests 500 --gpu 1Mtok

The replay runs in whatever mode the package imports (compiled after a build in place: fast);
the figures are the same in both. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=SHARED_TRACE)
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
    ap.add_argument("--gpu", default="1Mtok,3Mtok", help="GPU capacities, one replay each")
    ap.add_argument("--extra", default="--prompt-only", help="more kv-cache-sim options (one string)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "eviction_policy_table_results.json"))
    args = ap.parse_args()
    cmd = [
        sys.executable,
        "-m",
        "kv_cache_manager_v2.sim",
        "--trace",
        args.trace,
        "--requests",
        str(args.requests),
        "--eviction-policy",
        "all",
        "--sweep",
        f"gpu={args.gpu}",
        "--no-progress",
        "--json",
        "-",
        *args.extra.split(),
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    sweep = json.loads(done.stdout)["sweep"]
    rows: list[dict[str, Any]] = []
    for rep in sweep["points"]:
        rows.append(
            {
                "gpu": rep["tiers"][0]["quota"],
                "gpu_tokens": rep["tiers"][0]["capacity_tokens"],
                "policy": rep["eviction_policy"],
                "hit_rate_tokens": rep["hit_rate"]["tokens_all_requests"],
                "hit_rate_blocks": rep["hit_rate"]["blocks_all_requests"],
                "dropped_pages": rep["tiers"][0]["dropped_pages"],
                "preemptions": rep["preemptions"],
            }
        )
    first = sweep["points"][0]
    out = {
        "what": "token / block hit rate of every eviction policy (kv-cache-sim --eviction-policy all), per GPU capacity",
        "command": " ".join(cmd[1:]).replace(args.trace, os.path.basename(args.trace)),
        "mode": first["mode"],
        "workload": first["workload"]["description"],
        "policies": sweep["policies"],
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    lru = {r["gpu"]: r["hit_rate_tokens"] for r in rows if r["policy"] == "lru"}
    print(f"{'gpu':<10}{'policy':<12}{'hit(tok)':>10}{'hit(blk)':>10}{'vs lru':>9}")
    for r in rows:
        gain = r["hit_rate_tokens"] / lru[r["gpu"]] - 1 if lru.get(r["gpu"]) else 0.0
        print(f"{r['gpu']:<10}{r['policy']:<12}{r['hit_rate_tokens']:>10.3f}{r['hit_rate_blocks']:>10.3f}{gain:>+9.1%}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
