"""Run the end-to-end workload: paged engine + scheduler + adapter, checked against the dense reference.

python examples/tiny_engine/run.py [--requests 300] [--admission optimistic|guaranteed] [--host] [--disk] [--swa-scratch]
                                   [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kv_cache_manager_v2
from tiny_engine.model import TinyConfig
from tiny_engine.workload import WorkloadParams, check_against_dense, run_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--admission", choices=["optimistic", "guaranteed"], default="optimistic")
    ap.add_argument("--host", action="store_true", help="add a host tier (4x the GPU tier)")
    ap.add_argument(
        "--disk", action="store_true", help="host 1x and a disk tier 8x the GPU tier (background loads from disk)"
    )
    ap.add_argument("--swa-scratch", action="store_true", help="SWA prefill scratch slots")
    ap.add_argument("--json", help="write the summary as JSON here")
    args = ap.parse_args()
    p = WorkloadParams(
        num_requests=args.requests,
        seed=args.seed,
        admission=args.admission,
        host_tier=args.host or args.disk,
        disk_tier=args.disk,
        swa_scratch=args.swa_scratch,
    )
    t0 = time.perf_counter()
    res = run_workload(TinyConfig(), p)
    wall = time.perf_counter() - t0
    err = check_against_dense(res)
    s = res.scheduler.stats
    summary = {
        "compiled": kv_cache_manager_v2.compiled,
        "requests": len(res.requests),
        "steps": s.steps,
        "admission": args.admission,
        "host_tier": args.host or args.disk,
        "disk_tier": args.disk,
        "swa_scratch": args.swa_scratch,
        "preempted_suspend": s.preempted_suspend,
        "resumed": s.resumed,
        "preempted_recompute": s.preempted_recompute,
        "prompt_tokens": s.prompt_tokens,
        "reused_prompt_tokens": s.reused_prompt_tokens,
        "reuse_share": round(s.reuse_share, 4),
        "computed_tokens": s.computed_tokens,
        "max_batch": s.max_batch,
        "max_logit_error_vs_dense": err,
        "wall_s": round(wall, 2),
    }
    res.adapter.shutdown()
    print("all outputs equal the dense reference")
    for k, v in summary.items():
        print(f"  {k:24s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
