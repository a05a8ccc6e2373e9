"""Issue #50: the routing policies compared on 2, 4, 8 and 16 replicas of llama-3-8b on H100.

    .venv/bin/python benchmarks/routing_table.py [--replicas 2,4,8,16] [--workload trace,conversations]
        [--rr-only] [--out FILE]

For each workload and replica count: ``kv-cache-sim --replicas N --routing all`` (every policy and
the single-cache bound) at a load where round-robin queues (arrivals compressed by the replica
count: the trace's ``--time-scale`` is ``TRACE_SCALE / N``, the conversations' ``--rate``
``CONV_RATE * N``). Per policy: prefill tokens computed, hit rate and its share of the bound's,
max/min tokens computed per replica, TTFT p50/p90/p99, and round-robin's p90/p50 (the load test:
at least 5). ``--rr-only`` runs round-robin alone (to calibrate the load). Writes
``benchmarks/routing_table_results.json`` and prints a table. Run it compiled (``KVCM_EXPECT_COMPILED``
is not needed: the JSON records the mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2.sim import main as sim_main

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "synthetic_trace.jsonl")
#: the setup every run shares: the model, its GPU tier (an H100's KV share), the roofline on H100
#: (its host share: 256 GiB of a node's host memory per GPU)
COMMON = ["--model", "llama-3-8b", "--gpu", "48GiB", "--host", "256GiB", "--gpu-kind", "h100", "--no-progress"]
TRACE_SCALE = 2.4  #: --time-scale x N (every request of the trace)
#: the built-in conversations: longer questions, shorter answers and pauses than the defaults
CONVERSATIONS = ["--conversations", "1600", "--think-s", "1", "--user-tokens", "2048", "--output-tokens", "64"]
CONV_RATE = 0.875  #: new conversations per second per replica


def workload_args(name: str, n: int, trace: str) -> list[str]:
    if name == "trace":
        return ["--trace", trace, "--time-scale", f"{TRACE_SCALE / n:g}"]
    return [*CONVERSATIONS, "--rate", f"{CONV_RATE * n:g}"]


def run(name: str, n: int, policies: str, trace: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        args = [*COMMON, *workload_args(name, n, trace), "--replicas", str(n), "--routing", policies, "--json", out]
        t0 = time.perf_counter()
        rc = sim_main(args)
        if rc != 0:
            raise SystemExit(f"kv-cache-sim {' '.join(args)} failed ({rc})")
        with open(out) as f:
            doc: dict[str, Any] = json.load(f)["routing"]
    doc["args"] = args[:-2]
    doc["wall_s"] = time.perf_counter() - t0
    for p in doc["policies"].values():
        p.pop("ttft_cdf_s", None)
    return doc


def row(name: str, n: int, policy: str, p: dict[str, Any], bound: float) -> str:
    t = p["ttft_s"]
    lm = p["load_max_over_min"]
    vs = p["hit_rate_vs_bound"]
    return (
        f"| {name} | {n} | {policy} | {p['prefill_computed_tokens']:,} | {p['hit_rate']['tokens']:.3f} "
        f"| {'-' if vs is None else f'{vs:.2f}'} | {'-' if lm is None else f'{lm:.2f}'} "
        f"| {t['p50']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4,8,16")
    ap.add_argument("--workload", default="trace,conversations")
    ap.add_argument("--rr-only", action="store_true")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "routing_table_results.json"))
    a = ap.parse_args()
    doc: dict[str, Any] = {"mode": "compiled" if kvm.compiled else "interpreted", "runs": []}
    if os.path.exists(a.out) and not a.rr_only:
        with open(a.out) as f:
            doc["runs"] = [r for r in json.load(f).get("runs", [])]
    lines = [
        "| workload | replicas | policy | prefill tokens | hit rate | vs bound | max/min load | TTFT p50 s | p90 | p99 |"
    ]
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in a.workload.split(","):
        for n in [int(x) for x in a.replicas.split(",")]:
            r = run(name, n, "round-robin" if a.rr_only else "all", a.trace)
            r["workload"] = name
            rr = r["policies"]["round-robin"]["ttft_s"]
            r["round_robin_p90_over_p50"] = rr["p90"] / rr["p50"] if rr["p50"] else None
            bound = r["single_cache_bound"]["hit_rate"]["tokens"]
            for policy, p in r["policies"].items():
                lines.append(row(name, n, policy, p, bound))
            print(f"{name} x{n}: round-robin p90/p50 {r['round_robin_p90_over_p50']}, bound {bound:.3f}, "
                  f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            if not a.rr_only:
                doc["runs"] = [x for x in doc["runs"] if (x["workload"], x["count"]) != (name, n)] + [r]
                with open(a.out, "w") as f:
                    json.dump(doc, f, indent=1)
                    f.write("\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
