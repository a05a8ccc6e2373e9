"""Issue 36: the hybrid models' hit rate against the attention-only bound, per trace, preset, GPU
quota and host tier.

    bash scripts/sim.sh --list-models >/dev/null             # build the compiled core once
    .venv/bin/python benchmarks/hybrid_table.py              # the whole table (hours on 2 cores)
    .venv/bin/python benchmarks/hybrid_table.py --gpus 32 --traces synthetic --presets qwen3-next-80b-a3b

Each row is one ``kv-cache-sim --sweep ssm-policy=interval,auto,kv --json`` (LRU, T = 32), run one
at a time: ``interval`` (the behaviour before issue 36), ``auto`` (the default) and ``kv`` (the
attention layers alone: a snapshot at every block, the bound) under the same tiers. Traces: the
Mooncake-format synthetic trace (``--trace-file``, by default ``../shared/traces/synthetic_trace.jsonl``)
and the simulator's built-in conversations; presets qwen3-next-80b-a3b and nemotron-h-8b; GPU 8,
32 and 80 GiB, each without and with a host tier of 4x the GPU. A row records per policy the token
hit rate over all requests, snapshots taken by kind, reused, evicted and evicted unused, the
tokens the attention layers alone matched, and the ratios auto / kv and auto / interval.

Rows are appended to ``--out`` as they finish (a rerun skips the rows already there unless
``--fresh``), so a partial table survives an interrupted run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import write_results  # noqa: E402

TRACES = ("synthetic", "conversations")
PRESETS = ("qwen3-next-80b-a3b", "nemotron-h-8b")
GPUS = (8, 32, 80)
POLICIES = ("interval", "auto", "kv")
KINDS = ("interval", "branch", "last", "demand")


def row_key(trace: str, preset: str, gpu: int, host: bool) -> str:
    return f"{trace}/{preset}/{gpu}GiB" + (f"+{4 * gpu}GiB host" if host else "")


def sim_args(a: argparse.Namespace, trace: str, preset: str, gpu: int, host: bool) -> list[str]:
    args = ["--model", preset, "--gpu", f"{gpu}GiB", "--sweep", "ssm-policy=" + ",".join(POLICIES)]
    if host:
        args += ["--host", f"{4 * gpu}GiB"]
    if trace == "synthetic":
        args += ["--trace", a.trace_file]
        if a.requests:
            args += ["--requests", str(a.requests)]
    return args + ["--no-progress", "--json", "-"]


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: the hit rate and the snapshot counters; the ratios to the bound and to interval."""
    out: dict[str, Any] = {}
    for rep in points:
        snap = rep["snapshots"] or {}
        entry: dict[str, Any] = {"hit_rate": rep["hit_rate"]["tokens_all_requests"]}
        if snap:
            entry["snapshots_taken"] = {k: snap.get(f"snapshots_{k}", 0) for k in KINDS}
            for k in ("taken", "reused", "evicted", "skipped"):
                entry[f"snapshots_{k}" if k != "taken" else "snapshots_total"] = snap[k]
            entry["snapshots_evicted_unused"] = snap.get("snapshots_evicted_unused", 0)
            entry["attention_matched_tokens"] = snap.get("attention_matched_tokens", 0)
            entry["snapshot_bytes_at_end"] = [t.get("snapshot_bytes_at_end", 0) for t in rep["tiers"]]
        entry["requests"] = rep["requests"]["finished"] if isinstance(rep.get("requests"), dict) else None
        out[rep["sweep_point"]] = entry
    auto, bound, interval = (out[p]["hit_rate"] for p in ("auto", "kv", "interval"))
    out["auto_over_kv"] = auto / bound if bound else None
    out["auto_over_interval"] = auto / interval if interval else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=list(TRACES), choices=TRACES)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--gpus", nargs="+", type=int, default=list(GPUS), help="GPU quotas in GiB")
    ap.add_argument(
        "--host", nargs="+", default=["no", "yes"], choices=["no", "yes"], help="rows without/with a host tier"
    )
    ap.add_argument("--trace-file", default=os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl"))
    ap.add_argument("--requests", type=int, default=0, help="first N requests of the trace file (0: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "hybrid_table_results.json"))
    ap.add_argument("--fresh", action="store_true", help="discard the rows already in --out")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if not a.fresh and os.path.exists(a.out):
        with open(a.out) as f:
            rows = json.load(f)["results"]
    done = {r["row"] for r in rows}
    env = {**os.environ, "PYTHONPATH": ROOT, "KVCM_EXPECT_COMPILED": "1"}  # this tree's (compiled) package
    for trace in a.traces:
        for gpu in a.gpus:
            for preset in a.presets:
                for host in (h == "yes" for h in a.host):
                    key = row_key(trace, preset, gpu, host)
                    if key in done:
                        continue
                    args = sim_args(a, trace, preset, gpu, host)
                    t0 = time.process_time()
                    before = os.times()
                    proc = subprocess.run(
                        [sys.executable, "-m", "kv_cache_manager_v2.sim", *args],
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                        env=env,
                    )
                    after = os.times()
                    if proc.returncode != 0:
                        print(f"{key}: kv-cache-sim failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
                        continue
                    doc = json.loads(proc.stdout)
                    points = doc["sweep"]["points"]
                    cpu = after.children_user + after.children_system - before.children_user - before.children_system
                    row = {
                        "row": key,
                        "trace": trace,
                        "preset": preset,
                        "gpu_gib": gpu,
                        "host_gib": 4 * gpu if host else 0,
                        "requests": a.requests if trace == "synthetic" else None,
                        "mode": points[0].get("mode"),
                        "cpu_s": round(cpu + time.process_time() - t0, 1),
                        "args": args,
                        **summarize(points),
                    }
                    rows.append(row)
                    print(
                        f"{key}: interval {row['interval']['hit_rate']:.3f} auto {row['auto']['hit_rate']:.3f} "
                        f"kv {row['kv']['hit_rate']:.3f} auto/kv {row['auto_over_kv'] or 0:.2f} ({row['cpu_s']} s CPU)",
                        flush=True,
                    )
                    write_results(
                        a.out, {"policies": list(POLICIES), "eviction_policy": "lru", "tokens_per_block": 32}, rows
                    )


if __name__ == "__main__":
    main()
