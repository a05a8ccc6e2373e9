"""The main job's speed: ``kv-cache-sim`` replaying a trace in this checkout and in another one (the
tree an optimisation started from), alternating processes, each on its own compiled core.

    .venv/bin/python benchmarks/sim_speed.py --before /tmp/old --trace /tmp/long.jsonl --rounds 5
    .venv/bin/python benchmarks/sim_speed.py --before /tmp/old --trace A.jsonl --trace B.jsonl

``--before`` is a checkout (``git worktree add`` or ``git archive | tar -x``) with its compiled core
built in place (``python setup_mypyc.py build_ext --inplace``); this checkout needs its own
(``scripts/sim.sh`` builds it). Each round runs every trace once per side, the sides in turn (who
goes first alternates), so a machine that slows down for a while slows both. Per run: the replay's
wall seconds and prompt blocks per second from the simulator's JSON report, and the process's user
CPU seconds. Per trace: the ratio before / after of each round, their median and geometric mean,
and whether every figure of the two reports is identical (``report_figures``: everything but
timings, the build mode and the trace's path; fields one side does not have are skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import write_results  # noqa: E402

from kv_cache_manager_v2.sim._report import report_figures  # noqa: E402

#: the simulator, run as a module of the checkout on ``PYTHONPATH`` (stdout: its text report)
SIM = "import sys; from kv_cache_manager_v2.sim._cli import main; sys.exit(main())"


def _run(tree: str, trace: str, args: list[str]) -> dict[str, Any]:
    """One replay of ``trace`` on ``tree``'s compiled core: its JSON report and user CPU seconds."""
    env = dict(os.environ, PYTHONPATH=tree)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-c", SIM, "--trace", trace, "--json", out, *args]
        before = os.times()
        res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        after = os.times()
        if res.returncode != 0:
            raise SystemExit(f"kv-cache-sim failed in {tree}:\n{res.stderr[-2000:]}")
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
    if report.get("mode") != "compiled":
        raise SystemExit(f"{tree}: the simulator ran interpreted (build its compiled core first)")
    user = after.children_user - before.children_user
    return {"report": report, "user_s": user}


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where the figures of two reports differ (a field only one side has is skipped: a newer
    tree may report more)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() & b.keys()) for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "/"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the other checkout (its compiled core built in place)")
    ap.add_argument("--trace", action="append", required=True, help="a trace to replay (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu", default="32GiB", help="kv-cache-sim --gpu")
    ap.add_argument(
        "--sim-args",
        default="",
        help="more kv-cache-sim options for both sides, e.g. '--step-ms 15': the time model of a tree from "
        "before the roofline (sim/_compute.py), so both replay the same schedule",
    )
    ap.add_argument("--label", default="", help="a note stored with the results (e.g. the commits)")
    ap.add_argument("--out", default=os.path.join(HERE, "sim_speed_results.json"))
    a = ap.parse_args()
    sides = {"before": os.path.abspath(a.before), "after": ROOT}
    a.trace = [os.path.abspath(t) for t in a.trace]  # (each side runs in its own directory)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {"before": [], "after": []} for t in a.trace}
    first_reports: dict[str, dict[str, Any]] = {}
    for rnd in range(a.rounds):
        order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
        for trace in a.trace:
            for side in order:
                r = _run(sides[side], trace, ["--gpu", a.gpu, *a.sim_args.split()])
                replay = r["report"]["replay"]
                runs[trace][side].append(
                    {"replay_s": replay["wall_s"], "blocks_per_s": replay["blocks_per_s"], "user_s": r["user_s"]}
                )
                first_reports.setdefault(f"{trace}:{side}", r["report"])
                print(
                    f"round {rnd + 1} {side:6s} {os.path.basename(trace)}: replay {replay['wall_s']:.2f} s, "
                    f"{replay['blocks_per_s']:,.0f} blocks/s",
                    flush=True,
                )
    results = []
    for trace in a.trace:
        before, after = runs[trace]["before"], runs[trace]["after"]
        ratios = [b["replay_s"] / f["replay_s"] for b, f in zip(before, after)]
        diffs = _differences(
            report_figures(first_reports[f"{trace}:before"]), report_figures(first_reports[f"{trace}:after"])
        )
        results.append(
            {
                "trace": trace,
                "before": before,
                "after": after,
                "speedup_per_round": ratios,
                "speedup_median": statistics.median(ratios),
                "speedup_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                "speedup_of_medians": statistics.median(b["replay_s"] for b in before)
                / statistics.median(f["replay_s"] for f in after),
                "figures_identical": not diffs,
                "figures_differ_at": diffs[:20],
            }
        )
        r = results[-1]
        print(
            f"{os.path.basename(trace)}: speed-up median {r['speedup_median']:.2f}x, geomean "
            f"{r['speedup_geomean']:.2f}x, rounds {min(ratios):.2f}-{max(ratios):.2f}x; figures identical: "
            f"{r['figures_identical']}"
        )
    params = {"before": sides["before"], "rounds": a.rounds, "gpu": a.gpu, "label": a.label}
    write_results(a.out, params, results)


if __name__ == "__main__":
    main()
