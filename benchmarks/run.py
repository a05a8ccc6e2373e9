"""Benchmarks of the per-step CPU cost, fast (interpreted) vs production (mypyc) mode.

    python benchmarks/run.py                 # all scenarios, both modes, default sizes
    python benchmarks/run.py --quick         # seconds; what CI runs so the suite never rots
    python benchmarks/run.py --only decode admission --modes compiled

Scenarios (SPEC 9): decode (resize(+1) + commit + indices per request per step), decode_beams
(the same with 4 beams following random parents, per request), admission
(probe_reuse + create_kv_cache + resume + resize for a 1536-token prompt, 1024 tokens shared),
admission_array (the same with array('I') prompts), admission_scaling (admission with 1k, 10k
and 40k cached conversations sharing a chat-template prefix), close (stop_committing + close), hashing
(reuse keys vs plain hashlib.sha256 on the same bytes), swa (decode, alternating window-128 and
full layers), swa_prefill (gpt-oss-like 8k prompts in 2k chunks, with and without SWA scratch
reuse: us per resize and peak slots), replay (a Mooncake-format trace, metadata only: the
project's shared trace when it is beside the repository, else traces/multi_turn.jsonl), adapter (the engine adapter's prepare_resources + update_resources for a
decode batch, per request per step; requests admitted through it one by one, so later ones
reuse the shared prompt),
decode_events / admission_events (decode and admission with a KVCacheEventManager attached: the
step includes draining the queue; extra keys quote the prefill commit that publishes the blocks and
the wire cost, to_wire + msgpack, per event, which a publisher pays on its own thread).
Admission scenarios also time the prefill ``commit`` separately (``commit_us``, not in the samples).
``--only phases`` (issue 30's table; the default sizes are its workload): admission_full /
admission_hybrid (create_kv_cache + resume + resize + commit of the prompt, no probe: hash, match,
allocate, commit; full attention / alternating window-128 and full layers), rematch_full /
rematch_swa (probe_reuse of a prompt whose blocks are all cached, hashing included; full attention /
every layer window-128; ``rematch_rounds`` passes over the prompts: the first probe of a prompt
walks the tree, later ones resume the walk the manager kept), decode_batch / decode_batch_hybrid,
free / free_swa (close at the end of the decode_batch / decode_batch_swa workload). ``--instructions`` adds, for those (compiled), the instructions per unit
counted by callgrind inside the calls each one times: exact where the wall clock is noisy.
copy_bandwidth (the copy engine moving scattered slots GPU -> host on the host backend, vs one
numpy copy of the same bytes), onboard (create_kv_cache + resume of a 1024-token prefix whose
pages sit in the host tier), tier_hit_rate (the trace replayed one request at a time, prompt
blocks only, with 1M GPU tokens alone and with 3M host tokens more),
remote_onboard (create_kv_cache + resume of a 1024-token prefix that only a private loopback
redis-server holds, written by another manager: us per request and blocks/s, next to the same
prefix onboarded from the host tier; also with 64 KiB pages), remote_decode (the decode step while
every new block evicts a reusable page: no remote tier, remote tier writing the dropped pages, remote
tier with write-through, on GPU + host tiers, 4 KiB and 64 KiB pages; mean us per request per step
and the overheads). The remote scenarios
start their own redis-server (skipped with a note when none is installed).

Each scenario runs in a child process per mode: fast mode imports a copy of the package
sources from build/bench/fast (no compiled modules there); compiled mode builds the package
in place with setup_mypyc.py when needed. Results: JSON (default bench_results/bench.json)
and a table on stdout. Each scenario runs ``--repeats`` times per mode (modes alternating);
the best run's median is reported with all of them, since this class of machine is noisy.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import scenarios_admission
import scenarios_decode
import scenarios_remote
import scenarios_tiers
import scenarios_trace
from bench_common import ROOT

FAST_DIR = os.path.join(ROOT, "build", "bench", "fast")
SCENARIOS = [
    "decode",
    "decode_beams",
    "decode_batch",
    "decode_batch_swa",
    "decode_batch_hybrid",
    "decode_batch_ssm",
    "admission",
    "admission_full",
    "admission_hybrid",
    "admission_ssm",
    "rematch_full",
    "rematch_swa",
    "free",
    "free_swa",
    "admission_array",
    "admission_scaling",
    "close",
    "hashing",
    "swa",
    "swa_prefill",
    "replay",
    "replay_gc",
    "admission_gc",
    "adapter",
    "decode_events",
    "admission_events",
    "copy_bandwidth",
    "onboard",
    "tier_hit_rate",
    "remote_onboard",
    "remote_decode",
    "remote_cluster",
]
#: ``--only phases``: one scenario per phase of issue 30's table, each on its workload (256 requests,
#: 1024 shared + 512 unique prompt tokens, 32 tokens per block, 32 layers, 256 decode steps)
GROUPS = {
    "phases": [
        "admission_full",
        "admission_hybrid",
        "rematch_full",
        "rematch_swa",
        "decode_batch",
        "decode_batch_hybrid",
        "free",
        "free_swa",
    ]
}
#: ``--instructions``: the calls a scenario times, as globs over mypyc's entry points (callgrind's
#: ``--toggle-collect``): instructions are counted inside them only (compiled mode)
_ADMIT_CALLS = [f"CPyPy_*___{c}" for c in ("KVCacheManager___create_kv_cache", "KVCache___resume", "KVCache___resize")]
_PROBE_CALLS = ["CPyPy_*___KVCacheManager___probe_reuse"]
COUNTED_CALLS = {
    "admission": _PROBE_CALLS + _ADMIT_CALLS,
    "admission_full": [*_ADMIT_CALLS, "CPyPy_*___KVCache___commit"],
    "admission_hybrid": [*_ADMIT_CALLS, "CPyPy_*___KVCache___commit"],
    "admission_ssm": [*_ADMIT_CALLS, "CPyPy_*___KVCache___commit"],
    "rematch_full": _PROBE_CALLS,
    "rematch_swa": _PROBE_CALLS,
    "decode_batch": ["CPyPy_*___KVCacheManager___resize_batch", "CPyPy_*___KVCacheManager___commit_batch"],
    "decode_batch_hybrid": ["CPyPy_*___KVCacheManager___resize_batch", "CPyPy_*___KVCacheManager___commit_batch"],
    "decode_batch_ssm": ["CPyPy_*___KVCacheManager___resize_batch", "CPyPy_*___KVCacheManager___commit_batch"],
    "free": ["CPyPy_*___KVCache___close"],
    "free_swa": ["CPyPy_*___KVCache___close"],
}
#: deterministic results (a hit rate): one run per mode whatever --repeats says
RUN_ONCE = {"tier_hit_rate"}
#: the scenario modules, one per family: each ``scenario_<name>(params)`` in them is scenario ``<name>``
FAMILIES: list[ModuleType] = [scenarios_decode, scenarios_admission, scenarios_trace, scenarios_tiers, scenarios_remote]


def scenario(name: str) -> Callable[[dict[str, int]], dict[str, Any]]:
    """The function of scenario ``name`` (from its family's module)."""
    found = [getattr(family, f"scenario_{name}") for family in FAMILIES if hasattr(family, f"scenario_{name}")]
    if len(found) != 1:
        raise SystemExit(f"scenario {name!r} is defined in {len(found)} scenario modules, not one")
    fn: Callable[[dict[str, int]], dict[str, Any]] = found[0]
    return fn


def worker(name: str, params: dict[str, int]) -> dict[str, Any]:
    import kv_cache_manager_v2

    out = scenario(name)(params)
    out["compiled"] = kv_cache_manager_v2.compiled
    return out


# ---------------------------------------------------------------- driver side
DEFAULTS = dict(
    requests=256,
    layers=32,
    tokens_per_block=32,
    shared=1024,
    unique=512,
    steps=256,
    rematch_rounds=3,
    hash_blocks=20_000,
    trace_requests=400,
    cache_tokens=3_000_000,
    beam_requests=64,
    prefill_requests=32,
    prefill_tokens=8192,
    prefill_chunk=2048,
    scaling_small=1_000,
    scaling_mid=10_000,
    scaling_large=40_000,
    copy_slots=512,
    copy_slot_bytes=256 << 10,
    onboard_requests=200,
    onboard_buffer_bytes=64,
    remote_big_buffer_bytes=1024,
    remote_requests=64,
    remote_step_gap_us=2000,
    remote_write_prompts=64,
    hit_rate_requests=0,  # 0: the whole trace
    trace_gpu_tokens=1_000_000,
    trace_host_tokens=3_000_000,
    replay_gc_requests=0,  # 0: the whole trace
    gc_blocks=300_000,
)
QUICK = dict(
    requests=16,
    layers=4,
    tokens_per_block=32,
    shared=256,
    unique=128,
    steps=16,
    rematch_rounds=1,
    hash_blocks=500,
    trace_requests=20,
    cache_tokens=200_000,
    beam_requests=4,
    prefill_requests=2,
    prefill_tokens=2048,
    prefill_chunk=512,
    scaling_small=100,
    scaling_mid=1_000,
    scaling_large=4_000,
    copy_slots=64,
    copy_slot_bytes=64 << 10,
    onboard_requests=10,
    onboard_buffer_bytes=64,
    remote_big_buffer_bytes=256,
    remote_requests=8,
    remote_step_gap_us=500,
    remote_write_prompts=4,
    hit_rate_requests=30,
    trace_gpu_tokens=100_000,
    trace_host_tokens=300_000,
    replay_gc_requests=30,
    gc_blocks=2_000,
)


def prepare_fast() -> None:
    shutil.rmtree(FAST_DIR, ignore_errors=True)
    shutil.copytree(
        os.path.join(ROOT, "kv_cache_manager_v2"),
        os.path.join(FAST_DIR, "kv_cache_manager_v2"),
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"),
    )


def prepare_modes(modes: list[str], instructions: bool = False) -> None:
    """Set up each mode a run uses (fast: sources copied without compiled modules; compiled: a current
    build); with ``instructions`` (callgrind counts), first check that valgrind is installed."""
    if instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    if "fast" in modes:
        prepare_fast()
    if "compiled" in modes:
        prepare_compiled()


def prepare_compiled() -> None:
    """Build production mode in place unless a build at ``$KVCM_MYPYC_OPT`` (default: gcc -O3) is
    there and newer than every package source (``scripts/test.sh`` builds at -O1 for its tests)."""
    sys.path.insert(0, ROOT)
    from setup_mypyc import built_level, compiled_artifacts, opt_level

    sources = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(ROOT, "kv_cache_manager_v2"))
        for f in fs
        if f.endswith(".py")
    ]
    arts = compiled_artifacts()
    stale = not arts or max(map(os.path.getmtime, sources)) > max(map(os.path.getmtime, arts))
    if stale or built_level() != opt_level():
        print(f"building production mode (mypyc, gcc -O{opt_level()})...", flush=True)
        subprocess.run(
            [sys.executable, "setup_mypyc.py", "build_ext", "--inplace", "-j", "2"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def run_child(
    mode: str, name: str, params: dict[str, Any], script: str = os.path.abspath(__file__), wrap: list[str] | None = None
) -> dict[str, Any]:
    """Run scenario ``name`` of ``script`` (``--worker``) in a child process in ``mode`` (under the
    command ``wrap`` when given, e.g. valgrind)."""
    env = dict(os.environ)
    if mode == "fast":
        env["PYTHONPATH"] = FAST_DIR + os.pathsep + ROOT
    else:
        env["PYTHONPATH"] = ROOT
    cmd = [*(wrap or []), sys.executable, script, "--worker", name, "--params", json.dumps(params)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{name} ({mode}, {params}) failed:\n{res.stderr}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    if out["compiled"] != (mode == "compiled"):
        raise SystemExit(f"{name}: asked for {mode} mode but the package imported compiled={out['compiled']}")
    return out


def count_instructions(name: str, params: dict[str, Any]) -> float:
    """Instructions per unit of scenario ``name`` (compiled), counted by callgrind inside the calls
    the scenario times: exact where wall clocks on a shared machine are not (SHA-256 runs without
    the CPU's SHA extensions under valgrind, so hashing weighs more than in wall time; valgrind's
    presence is checked by ``prepare_modes``)."""
    import fnmatch
    import glob

    # callgrind (3.19) applied only the first of several wildcard patterns: pass exact names from the symbol table
    symbols: set[str] = set()
    for lib in glob.glob(os.path.join(ROOT, "*__mypyc*.so")):
        nm = subprocess.run(["nm", "--defined-only", lib], capture_output=True, text=True, check=True)
        symbols.update(line.split()[-1] for line in nm.stdout.splitlines() if line.strip())
    calls = []
    for pattern in COUNTED_CALLS[name]:
        found = fnmatch.filter(symbols, pattern)
        if len(found) != 1:
            raise SystemExit(f"--instructions: {pattern!r} names {len(found)} compiled functions, not one: {found}")
        calls.append(found[0])
    out_file = os.path.join(ROOT, "build", "bench", f"callgrind.{name}.out")
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}"]
    wrap += [f"--toggle-collect={call}" for call in calls]
    r = run_child("compiled", name, params, wrap=wrap)
    with open(out_file) as f:
        total = max(int(line.split()[1]) for line in f if line.startswith(("summary:", "totals:")))
    units = len(r["samples"]) * (params["requests"] if r["unit"].endswith("/step") else 1)
    return total / units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument(
        "--only", nargs="*", choices=SCENARIOS + list(GROUPS), default=SCENARIOS, help=f"scenarios or groups: {GROUPS}"
    )
    ap.add_argument("--modes", nargs="*", choices=["fast", "compiled"], default=["fast", "compiled"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help=f"override sizes: {sorted(DEFAULTS)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per scenario and mode; the best is reported")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "bench.json"))
    ap.add_argument(
        "--instructions",
        action="store_true",
        help=f"also count instructions per unit under callgrind (compiled; scenarios {sorted(COUNTED_CALLS)})",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.params))))
        return
    args.only = [name for group in args.only for name in GROUPS.get(group, [group])]
    params = dict(QUICK if args.quick else DEFAULTS)
    for kv in args.set:
        k, _, v = kv.partition("=")
        if k not in params:
            raise SystemExit(f"unknown size {k!r}; known: {sorted(params)}")
        params[k] = int(v)
    prepare_modes(args.modes, args.instructions)
    results = []
    for name in args.only:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        repeats = 1 if name in RUN_ONCE else args.repeats
        for _ in range(repeats):  # modes alternate, so a noisy stretch hits both
            for mode in args.modes:
                r = run_child(mode, name, params)
                if "skipped" in r:  # data or a tool missing: say so, never a 0.000 result
                    r.update(scenario=name, mode=mode)
                    runs[mode].append(r)
                    continue
                s = r.pop("samples")
                s_sorted = sorted(s)
                r.update(
                    scenario=name,
                    mode=mode,
                    runs=len(s),
                    median=statistics.median(s),
                    mean=statistics.fmean(s),  # (decode: includes the 1-in-T steps that cross a block)
                    p90=s_sorted[min(len(s) - 1, int(0.9 * len(s)))],
                )
                runs[mode].append(r)
        for mode in args.modes:
            if "skipped" in runs[mode][0]:
                results.append(runs[mode][0])
                print(f"{name:16s} {mode:9s} skipped: {runs[mode][0]['skipped']}", flush=True)
                continue
            higher_is_better = runs[mode][0]["unit"].endswith("/s")
            best = (max if higher_is_better else min)(runs[mode], key=lambda x: float(x["median"]))
            best["medians_of_repeats"] = [x["median"] for x in runs[mode]]
            counted = ""
            if args.instructions and mode == "compiled" and name in COUNTED_CALLS:
                best["instructions_per_unit"] = count_instructions(name, params)
                counted = f"   instructions {best['instructions_per_unit']:,.0f}"
            results.append(best)
            print(
                f"{name:16s} {mode:9s} median {best['median']:>14.3f} {best['unit']:16s} mean {best['mean']:>12.3f}"
                f" p90 {best['p90']:>12.3f}"
                f"   (repeats: {', '.join(f'{m:.2f}' for m in best['medians_of_repeats'])}){counted}",
                flush=True,
            )
    speedups = {}
    for name in args.only:
        by = {r["mode"]: r for r in results if r["scenario"] == name}
        if (
            len(by) == 2
            and by["fast"]["unit"] != "hit rate"
            and by["fast"].get("median")
            and by["compiled"].get("median")
        ):
            f, c = by["fast"]["median"], by["compiled"]["median"]
            speedups[name] = (c / f) if by["fast"]["unit"].endswith("/s") else (f / c)
    for name, x in speedups.items():
        print(f"{name:16s} compiled speedup x{x:.2f}")
    write_results(args.out, params, results, compiled_speedup=speedups)


def _built_level() -> str | None:
    sys.path.insert(0, ROOT)
    from setup_mypyc import built_level

    return built_level()


def write_results(path: str, params: dict[str, Any], results: list[dict[str, Any]], **extra: Any) -> None:
    """The JSON every benchmark script writes: its parameters, this machine, the results, a time stamp."""
    machine = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        "mypyc_opt_level": _built_level(),  # gcc's level of the compiled build (None: none built)
    }
    doc = {"params": params, "machine": machine, "results": results, **extra}
    doc["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
