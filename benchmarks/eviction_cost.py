"""Per-operation cost of the eviction policies (issue #18), fast (interpreted) vs production (mypyc) mode.

    .venv/bin/python benchmarks/eviction_cost.py            # both modes, both policies, JSON
    .venv/bin/python benchmarks/eviction_cost.py --quick    # seconds

Scenarios, each run for ``eviction_policy`` "lru" and "frequency":

* ``touch``: an evictor holding ``pages`` reusable one-block pages (uses 1..8, as a trace leaves
  them): take a random listed page out and list it again (what a cache hit and its release do to
  the evictor). ns per remove + add.
* ``victim``: the same evictor: pop the next victim and list it again. ns per pop + add.
* ``churn``: the manager at capacity, each request 8 blocks of one of 256 popular prefixes
  (Zipf-like) + 8 blocks of its own: create_kv_cache + resume + resize (evicting) + commit +
  close. us per prompt block, everything included (hashing, tree, the evictor, the use history).
* ``decode`` / ``admission``: ``benchmarks/run.py``'s scenarios of the same names (default sizes
  there) with the policy set; us per request per step / per admission.

Each scenario runs in a child process per mode (``benchmarks/run.py``'s fast copy of the sources
and in-place mypyc build), modes alternating, ``--repeats`` times; the best median is reported.
Output: a table and ``bench_results/eviction_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from array import array
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_common  # noqa: E402  (the benchmark manager)
import run as bench  # noqa: E402  (benchmarks/run.py: the fast copy, the build, the decode/admission scenarios)

POLICIES = ["lru", "frequency"]
SCENARIOS = ["touch", "victim", "churn", "decode", "admission"]
DEFAULTS = dict(pages=100_000, ops=400_000, churn_slots=20_000, churn_requests=4_000)
QUICK = dict(pages=2_000, ops=20_000, churn_slots=1_000, churn_requests=200)
T = 32


def _listed_pages(policy: str, n: int) -> tuple[Any, Any, list[Any]]:
    """A manager whose GPU evictor lists ``n`` reusable one-block pages (uses 1..8 under frequency)."""
    m = bench_common._manager(1, T, n, eviction_policy=policy)
    for r in range(n):
        kv = m.create_kv_cache()
        kv.resume()
        kv.resize(T)
        kv.commit(array("I", range(r * T, (r + 1) * T)))
        kv.close()
    ev = m._storage.gpu.items[0].evictor
    pages = ev.pages()
    assert len(pages) == n
    if policy == "frequency":  # a trace's mix of use counts, so the heap has work to do
        from kv_cache_manager_v2._storage._policies._use_history import frequency_state

        rng = random.Random(1)
        for p in pages:
            ev.remove(p)
            frequency_state(p).uses = rng.choice((1, 1, 1, 2, 2, 3, 5, 8))
            ev.add(p)
    return m, ev, pages


def scenario_touch(p: dict[str, Any]) -> dict[str, Any]:
    m, ev, pages = _listed_pages(p["policy"], p["pages"])
    rng = random.Random(2)
    order = [pages[rng.randrange(len(pages))] for _ in range(p["ops"])]
    samples = []
    for chunk in range(5):
        part = order[chunk::5]
        t0 = time.perf_counter()
        for page in part:
            ev.remove(page)
            ev.add(page)
        samples.append((time.perf_counter() - t0) / len(part) * 1e9)
    m.check_invariants()
    m.clear_reusable_blocks()
    m.shutdown()
    return {"unit": "ns/op", "samples": samples}


def scenario_victim(p: dict[str, Any]) -> dict[str, Any]:
    m, ev, _ = _listed_pages(p["policy"], p["pages"])
    n = p["ops"] // 5
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            ev.add(ev.pop_victim())
        samples.append((time.perf_counter() - t0) / n * 1e9)
    m.check_invariants()
    m.clear_reusable_blocks()
    m.shutdown()
    return {"unit": "ns/op", "samples": samples}


def scenario_churn(p: dict[str, Any]) -> dict[str, Any]:
    m = bench_common._manager(1, T, p["churn_slots"], eviction_policy=p["policy"])
    rng = random.Random(3)
    weights = [1.0 / (k + 1) for k in range(256)]
    prefixes = rng.choices(range(256), weights, k=p["churn_requests"])
    samples = []
    matched = total = 0
    per = max(1, len(prefixes) // 5)
    for c in range(0, len(prefixes), per):
        t0 = time.perf_counter()
        blocks = 0
        for i in range(c, min(c + per, len(prefixes))):
            base = prefixes[i] * 8 * T
            own = (1 << 24) + i * 8 * T
            prompt = array("I", [*range(base, base + 8 * T), *range(own, own + 8 * T)])
            kv = m.create_kv_cache(input_tokens=prompt[:-1])
            matched += kv.history_length
            if kv.resume() and kv.resize(len(prompt)):
                kv.commit(prompt[kv.history_length :])
            kv.close()
            blocks += 16
            total += len(prompt)
        samples.append((time.perf_counter() - t0) / blocks * 1e6)
    m.clear_reusable_blocks()
    m.shutdown()
    return {"unit": "us/block", "samples": samples, "hit_rate": matched / total}


def _with_policy(name: str, p: dict[str, Any]) -> dict[str, Any]:
    bench_common.MANAGER_CONFIG["eviction_policy"] = p["policy"]
    try:
        return bench.scenario(name)(dict(bench.DEFAULTS if not p["quick"] else bench.QUICK))
    finally:
        bench_common.MANAGER_CONFIG.clear()


def scenario_decode(p: dict[str, Any]) -> dict[str, Any]:
    return _with_policy("decode", p)


def scenario_admission(p: dict[str, Any]) -> dict[str, Any]:
    return _with_policy("admission", p)


def worker(name: str, params: dict[str, Any]) -> dict[str, Any]:
    import kv_cache_manager_v2

    out: dict[str, Any] = globals()[f"scenario_{name}"](params)
    out["compiled"] = kv_cache_manager_v2.compiled
    return out


def run_child(mode: str, name: str, params: dict[str, Any]) -> dict[str, Any]:
    return bench.run_child(mode, name, params, os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, default=SCENARIOS)
    ap.add_argument("--modes", nargs="*", choices=["fast", "compiled"], default=["fast", "compiled"])
    ap.add_argument("--repeats", type=int, default=2, help="runs per scenario, policy and mode; the best is reported")
    ap.add_argument("--out", default=os.path.join(bench.ROOT, "bench_results", "eviction_cost.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.params))))
        return
    sizes: dict[str, Any] = dict(QUICK if args.quick else DEFAULTS, quick=args.quick)
    bench.prepare_modes(args.modes)
    results = []
    print(f"{'scenario':<11}{'policy':<11}" + "".join(f"{mode:>22}" for mode in args.modes))
    for name in args.only:
        for policy in POLICIES:
            params = dict(sizes, policy=policy)
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
            for _ in range(args.repeats):  # modes alternate, so a noisy stretch hits both
                for mode in args.modes:
                    r = run_child(mode, name, params)
                    r["median"] = statistics.median(r.pop("samples"))
                    runs[mode].append(r)
            row = f"{name:<11}{policy:<11}"
            for mode in args.modes:
                higher_is_better = runs[mode][0]["unit"].endswith("/s")
                best = dict((max if higher_is_better else min)(runs[mode], key=lambda x: float(x["median"])))
                best.update(
                    scenario=name, policy=policy, mode=mode, medians_of_repeats=[x["median"] for x in runs[mode]]
                )
                results.append(best)
                row += f"{best['median']:>12.3f} {best['unit']:<9}"
            print(row, flush=True)
    doc = {
        "sizes": sizes,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "results": results,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
