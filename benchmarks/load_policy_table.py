"""Load or recompute, measured: ``kv-cache-sim --load-policy never,always,auto`` with its time model
(roofline on one H100, tier links, loads in the background) for a trace and the built-in
conversations, llama-3-8b and qwen3-32b, four tier setups (as ``time_model_table.py``): the GPU
alone, + a host tier 4x the GPU's, + host + disk, + host + a slow disk (200 MB/s). Per setup and
policy: mean / p90 TTFT, tokens loaded from below the GPU and recomputed by the plan; per setup:
the requests whose TTFT under auto exceeds their TTFT under never by more than one step (the step
that sampled their first token under never; joined by request index through ``--per-request``)
and how many of them loaded anything under auto (the others were only queued and batched
differently), how many were slower from their admission on (their TTFT less their wait for
admission: what their own loads cost them; the others were admitted later) and of those how many
loaded, the requests faster under auto by more than a step, and whether auto's mean and p90 are at
or below the better of never and always.

    .venv/bin/python benchmarks/load_policy_table.py --trace TRACE.jsonl --requests 1000 --time-scale 4

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
from time_model_table import GPU_KV, SIM, setups  # noqa: E402

POLICIES = ("never", "always", "auto")
#: a figure counts as at or below another within this relative tolerance (float noise only)
EPS = 1e-9


def run(workload: list[str], model: str, extra: list[str]) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """One run of the three policies: the report of each, and per policy the finished requests'
    (TTFT ms, first-token step ms, tokens loaded from below the GPU) by request index."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        per = os.path.join(tmp, "requests.jsonl")
        cmd = [sys.executable, "-c", SIM, *workload, "--model", model, *extra, "--no-progress"]
        cmd += ["--load-policy", ",".join(POLICIES), "--json", out, "--per-request", per]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"kv-cache-sim failed: {' '.join(cmd[3:])}\n{res.stderr[-2000:]}")
        with open(out) as f:
            doc: dict[str, Any] = json.load(f)
        reports = {rep["load_plan"]["policy"]: rep for rep in doc["sweep"]["points"]}
        times: dict[str, dict[int, Any]] = {p: {} for p in POLICIES}
        with open(per) as f:
            for line in f:
                row = json.loads(line)
                if row["ttft_ms"] is not None:
                    times[row["run"].rsplit("load=", 1)[1]][row["index"]] = (
                        row["ttft_ms"],
                        row["first_step_ms"],
                        row["loaded_tokens"],
                        row["wait_ms"],
                    )
    return reports, times


def summary(reports: dict[str, Any], times: dict[str, dict[int, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in POLICIES:
        rep = reports[p]
        t = rep["latency"]["ttft_s"]
        lp = rep["load_plan"]
        out[p] = {
            "ttft_mean_s": t["mean"],
            "ttft_p90_s": t["p90"],
            "hit_rate": rep["hit_rate"]["tokens_all_requests"],
            "loaded_tokens_below_gpu": sum(lp["loaded_tokens"][1:]),
            "recomputed_by_plan_tokens": sum(lp["recomputed_tokens"]),
            "plan_saved_s": lp["saved_s"],
            "cuts": lp["cut_matches"],
            "request_load_wait_s": lp["request_load_wait_s"],
            "step_load_wait_s": rep["tier_io"].get("load_wait_s"),
            "write_stall_s": rep["tier_io"].get("write_stall_s"),
            "simulated_s": rep["latency"]["throughput"]["span_s"],
        }
    never, auto = times["never"], times["auto"]
    both = [i for i in auto if i in never]
    slower = [i for i in both if auto[i][0] - never[i][0] > never[i][1]]
    worst = max((auto[i][0] - never[i][0] - never[i][1] for i in both), default=0.0)
    out["requests_compared"] = len(both)
    out["auto_slower_than_never_by_more_than_a_step"] = len(slower)
    out["auto_worst_excess_over_never_plus_a_step_ms"] = worst if slower else 0.0
    # of those, the ones that loaded anything under auto (the plan's own choice may be at fault);
    # the others only shared their steps and queue with requests that did (the runs diverged)
    out["auto_slower_requests_that_loaded"] = sum(1 for i in slower if auto[i][2] > 0)
    # of those, the ones slower from their admission on (TTFT less the wait for admission: their
    # loads and the steps they joined), and of these the ones that loaded anything; the rest were
    # admitted later (queued behind a different schedule)
    late = [i for i in slower if (auto[i][0] - auto[i][3]) - (never[i][0] - never[i][3]) > never[i][1]]
    out["auto_slower_after_admission"] = len(late)
    out["auto_slower_after_admission_that_loaded"] = sum(1 for i in late if auto[i][2] > 0)
    out["auto_faster_than_never_by_more_than_a_step"] = sum(1 for i in both if never[i][0] - auto[i][0] > never[i][1])
    for key in ("ttft_mean_s", "ttft_p90_s"):
        best = min(out["never"][key], out["always"][key])
        out[f"auto_{key}_at_or_below_best"] = out["auto"][key] <= best * (1 + EPS)
        out[f"auto_{key}_over_best"] = out["auto"][key] / best - 1.0 if best else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a Mooncake-format trace")
    p.add_argument("--models", default="llama-3-8b,qwen3-32b")
    p.add_argument("--requests", type=int, help="only the first N requests of the trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="the trace's arrivals this much slower")
    p.add_argument("--setups", help="only these setups (comma-separated names)")
    p.add_argument("--workloads", default="trace,conversations")
    p.add_argument("--out", default=os.path.join(HERE, "load_policy_results.json"))
    a = p.parse_args()
    trace = ["--trace", a.trace, *(["--requests", str(a.requests)] if a.requests else [])]
    if a.time_scale != 1.0:
        trace += ["--time-scale", str(a.time_scale)]
    workloads = {"trace": trace, "conversations": []}
    results: list[dict[str, Any]] = []
    for wname in a.workloads.split(","):
        for model in a.models.split(","):
            for name, extra in setups(GPU_KV[model]):
                if a.setups and name not in a.setups.split(","):
                    continue
                reports, times = run(workloads[wname], model, extra)
                r = {"workload": wname, "model": model, "setup": name, "args": extra, **summary(reports, times)}
                results.append(r)
                print(
                    f"{wname:13} {model:10} {name:19} TTFT mean/p90 s: "
                    + "  ".join(f"{q} {r[q]['ttft_mean_s']:.2f}/{r[q]['ttft_p90_s']:.2f}" for q in POLICIES)
                    + f"  auto>never+step: {r['auto_slower_than_never_by_more_than_a_step']}"
                    f"/{r['requests_compared']} ({r['auto_slower_requests_that_loaded']} loaded; after admission "
                    f"{r['auto_slower_after_admission']}, {r['auto_slower_after_admission_that_loaded']} loaded)"
                    f"  auto<never-step: {r['auto_faster_than_never_by_more_than_a_step']}"
                    f"  auto<=best: mean {r['auto_ttft_mean_s_at_or_below_best']} "
                    f"p90 {r['auto_ttft_p90_s_at_or_below_best']}",
                    flush=True,
                )
    params = {
        "trace": os.path.basename(a.trace),
        "requests": a.requests,
        "time_scale": a.time_scale,
        "gpu_kind": "h100",
        "gpu_kv": GPU_KV,
        "policies": POLICIES,
    }
    write_results(a.out, params, results)


if __name__ == "__main__":
    main()
