"""Issue 52 under the time model: hit rate and time to first token of ``kv-cache-sim`` with and
without sessions, their end and hints, on the built-in conversations and the shared Mooncake trace
(reasoning share 0.4), at the capacities of ``benchmarks/sessions_table.py`` (which compares hit
rates with the offline optimum; an optimum's TTFT has no meaning, so this table has none).

    .venv/bin/python benchmarks/sessions_table.py   # hit rates against the optimum
    .venv/bin/python benchmarks/sessions_ttft.py    # this table

Per workload and GPU capacity (llama-3-8b on one H100, roofline; the trace at ``--time-scale 4``,
where one engine keeps up with its arrivals), two simulator runs:

* ``lru``: ``--reasoning-share 0.4``, nothing else;
* ``--sessions --session-end --retention-hints 0.9``: its own report is ``sessions_end`` (session
  ids and ``directives.end``, no hints), its hinted replay ``sessions_hints_0.9`` (the per-session
  close-time hints at 0.9 accuracy, reasoning dropped by token range, kept prefixes raised as a
  session's return nears).

Which hints are wrong (a share 0.1) is drawn by ``--hints-seed`` (0). One draw can cost more than
the hints gain: at 3M tokens seed 0 wrongly drops the trace's largest document (191k tokens) 40 s
before its session comes back, whose 128k-token recompute (about 20 s of GPU time) queues the
requests behind it. ``--seeds 0 1 2 3 4`` adds each draw's hinted replay and their mean (here at
``--caps 24ktok 48ktok 96ktok 1Mtok 3Mtok --jobs 2``: ``benchmarks/sessions_ttft_seeds_results.json``).

Output: a table and ``benchmarks/sessions_ttft_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "synthetic_trace.jsonl")
CAPS = {"conversations": ["24ktok", "48ktok", "96ktok"], "trace": ["1Mtok", "3Mtok", "10Mtok"]}
SESSIONS = ["--sessions", "--session-end", "--retention-hints", "0.9"]


def run_sim(args: list[str]) -> dict[str, Any]:
    """One ``kv-cache-sim`` run's JSON report."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        cmd = [sys.executable, "-m", "kv_cache_manager_v2.sim", *args, "--no-progress", "--json", out]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
    return report


def cell(hit_rate: float, ttft: dict[str, Any]) -> dict[str, float]:
    return {"token_hit_rate": round(hit_rate, 4), "ttft_mean_s": ttft["mean"], "ttft_p90_s": ttft["p90"]}


def seeds_cell(cells: list[dict[str, float]], seeds: list[int]) -> dict[str, Any]:
    """The hinted replay over several ``--hints-seed`` draws of which hints are wrong: means and each."""
    mean = {k: round(sum(c[k] for c in cells) / len(cells), 4) for k in cells[0]}
    return {"seeds": seeds, **mean, "per_seed": cells}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=list(CAPS), choices=list(CAPS))
    ap.add_argument("--caps", nargs="*", help="only these GPU capacities (default: each workload's three)")
    ap.add_argument(
        "--seeds", nargs="*", type=int, default=[0], help="hinted replays at each --hints-seed (default: 0 only)"
    )
    ap.add_argument("--jobs", type=int, default=1, help="simulator runs at once")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "sessions_ttft_results.json"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    cases = [(w, cap) for w in a.workloads for cap in CAPS[w] if not a.caps or cap in a.caps]
    runs: list[list[str]] = []
    for workload, cap in cases:
        base = ["--reasoning-share", "0.4", "--gpu", cap]
        base += ["--trace", a.trace, "--time-scale", "4"] if workload == "trace" else []
        runs += [base] + [[*base, *SESSIONS, "--hints-seed", str(seed)] for seed in a.seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        reports = list(pool.map(run_sim, runs))
    rows: list[dict[str, Any]] = []
    for k, (workload, cap) in enumerate(cases):
        lru, *sessions = reports[k * (1 + len(a.seeds)) : (k + 1) * (1 + len(a.seeds))]
        ses = sessions[0]
        hinted = [cell(x["retention_hints"]["token_hit_rate"], x["retention_hints"]["ttft_s"]) for x in sessions]
        row: dict[str, Any] = {
            "workload": workload,
            "gpu": cap,
            "lru": cell(lru["hit_rate"]["tokens"], lru["latency"]["ttft_s"]),
            "sessions_end": cell(ses["hit_rate"]["tokens"], ses["latency"]["ttft_s"]),
            "sessions_hints_0.9": hinted[0],  # (the first seed's)
        }
        if len(a.seeds) > 1:
            row["sessions_hints_0.9_seeds"] = seeds_cell(hinted, a.seeds)
        rows.append(row)
        print(
            f"{workload:13} {cap:>7}  "
            + "  ".join(
                f"{k} {v['token_hit_rate']:.3f} {v['ttft_mean_s']:.3f}/{v['ttft_p90_s']:.3f} s"
                for k, v in row.items()
                if isinstance(v, dict)
            ),
            flush=True,
        )
    doc = {
        "benchmark": "sessions_ttft",
        "unit": "token hit rate; TTFT mean / p90 in simulated seconds",
        "model": "llama-3-8b, h100 roofline (MFU 0.5, MBU 0.7)",
        "reasoning_share": 0.4,
        "hints_seeds": a.seeds,
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
