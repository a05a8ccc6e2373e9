"""What users wait for, by tier setup: ``kv-cache-sim`` with its time model (roofline on one GPU, tier
I/O) for a trace and the built-in conversations, a model per run, four tier setups: the GPU alone,
+ a host tier 4x the GPU's, + host + disk, + host + a slow disk (200 MB/s). Per run: hit rate,
mean/p50/p90 TTFT, output throughput, and the share of requests whose TTFT is higher than in the
GPU-only run of the same requests (joined by request index through ``--per-request``; higher: by
more than 5 % and 1 ms).

    .venv/bin/python benchmarks/time_model_table.py --trace TRACE.jsonl --time-scale 4

Runs whatever build is in place (``scripts/sim.sh`` builds the compiled one); the figures do not
depend on the mode, only the wall time does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import write_results  # noqa: E402

SIM = "import sys; from kv_cache_manager_v2.sim._cli import main; sys.exit(main())"

#: the GPU tier left for KV on one H100 (79.6 GiB) at 90 % use (71.6 GiB), after the BF16 weights
#: and ~2 GiB of activations: llama-3-8b (8.03B parameters: 15.0 GiB) leaves 54 GiB, qwen3-32b
#: (32.8B: 61.0 GiB) 8 GiB
GPU_KV = {"llama-3-8b": "54GiB", "qwen3-32b": "8GiB"}
GIB = {"54GiB": 54, "8GiB": 8}
#: a request's TTFT counts as higher than GPU-only beyond this share and this many ms (batching
#: shifts a step's requests by fractions of a step either way)
WORSE_SHARE = 0.05
WORSE_MS = 1.0


def setups(gpu: str) -> list[tuple[str, list[str]]]:
    host = f"{4 * GIB[gpu]}GiB"
    return [
        ("gpu", ["--gpu", gpu]),
        ("gpu+host", ["--gpu", gpu, "--host", host]),
        ("gpu+host+disk", ["--gpu", gpu, "--host", host, "--disk", "2TiB"]),
        ("gpu+host+slow disk", ["--gpu", gpu, "--host", host, "--disk", "2TiB", "--tier-bandwidth", "disk=200MB/s"]),
    ]


def run(workload: list[str], model: str, extra: list[str]) -> tuple[dict[str, Any], dict[int, float]]:
    """One replay: its JSON report and TTFT (ms) by request index."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        per = os.path.join(tmp, "requests.jsonl")
        cmd = [sys.executable, "-c", SIM, *workload, "--model", model, *extra, "--no-progress"]
        cmd += ["--json", out, "--per-request", per]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"kv-cache-sim failed: {' '.join(cmd[3:])}\n{res.stderr[-2000:]}")
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
        ttft: dict[int, float] = {}
        with open(per) as f:
            for line in f:
                row = json.loads(line)
                if row["ttft_ms"] is not None:
                    ttft[row["index"]] = row["ttft_ms"]
    return report, ttft


def row(report: dict[str, Any], ttft: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    lat = report["latency"]
    t = lat["ttft_s"]
    both = [i for i in ttft if i in base]
    worse = sum(1 for i in both if ttft[i] > base[i] * (1 + WORSE_SHARE) and ttft[i] > base[i] + WORSE_MS)
    better = sum(1 for i in both if ttft[i] < base[i] * (1 - WORSE_SHARE) and ttft[i] < base[i] - WORSE_MS)
    return {
        "hit_rate": report["hit_rate"]["tokens_all_requests"],
        "ttft_mean_s": t["mean"],
        "ttft_p50_s": t["p50"],
        "ttft_p90_s": t["p90"],
        "output_tokens_per_s": lat["throughput"]["output_tokens_per_s"],
        "simulated_s": lat["throughput"]["span_s"],
        "ttft_higher_than_gpu_only": worse / len(both) if both else None,
        "ttft_lower_than_gpu_only": better / len(both) if both else None,
        "load_wait_s": report["tier_io"].get("load_wait_s"),
        "write_stall_s": report["tier_io"].get("write_stall_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a Mooncake-format trace")
    p.add_argument("--models", default="llama-3-8b,qwen3-32b")
    p.add_argument("--requests", type=int, help="only the first N requests of the trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="also replay the trace with arrivals this much slower")
    p.add_argument("--out", default=os.path.join(HERE, "time_model_results.json"))
    a = p.parse_args()
    trace = ["--trace", a.trace, *(["--requests", str(a.requests)] if a.requests else [])]
    workloads = {"trace": trace}
    if a.time_scale != 1.0:  # the same trace, arriving slower (one GPU cannot keep up with some traces)
        workloads[f"trace x{a.time_scale:g}"] = [*trace, "--time-scale", str(a.time_scale)]
    workloads["conversations"] = []
    results: list[dict[str, Any]] = []
    for wname, workload in workloads.items():
        for model in a.models.split(","):
            base: dict[int, float] = {}
            for name, extra in setups(GPU_KV[model]):
                report, ttft = run(workload, model, extra)
                if name == "gpu":
                    base = ttft
                r = {"workload": wname, "model": model, "setup": name, "args": extra, **row(report, ttft, base)}
                results.append(r)
                print(
                    f"{wname:14} {model:10} {name:19} hit {r['hit_rate']:.3f}  TTFT mean {r['ttft_mean_s']:.2f} "
                    f"p50 {r['ttft_p50_s']:.2f} p90 {r['ttft_p90_s']:.2f} s  out {r['output_tokens_per_s']:,.0f} tok/s  "
                    f"TTFT higher than GPU-only {r['ttft_higher_than_gpu_only']:.1%} lower "
                    f"{r['ttft_lower_than_gpu_only']:.1%}",
                    flush=True,
                )
    params = {"trace": os.path.basename(a.trace), "time_scale": a.time_scale, "gpu_kind": "h100", "gpu_kv": GPU_KV}
    write_results(a.out, params, results)


if __name__ == "__main__":
    main()
