"""The decode step through ``KVCacheResourceManager`` (``prepare_resources`` + ``update_resources``,
one token per request), split into the steps that stay inside a block and those at a block
boundary (a resize that takes a new block, or a commit that completes and publishes one).

    .venv/bin/python benchmarks/adapter_decode.py --quick --instructions   # both modes, JSON

Each variant's requests (prompts of ``prompt`` tokens, unrelated, so positions are large ints as
in real runs) are admitted and prefilled, then decode ``blocks`` blocks in lockstep. In-block steps
go through ``operator.methodcaller`` and boundary steps through ``itertools.starmap`` (C callables
of CPython that nothing else calls in the worker: ``functools.partial`` also runs at import time),
so ``--instructions`` counts each kind's inclusive instructions under callgrind (the number of
calls checked).
Variants: ``full`` (pure attention), ``swa`` (every other layer a 128-token window), ``hybrid``
(qwen3-next shape: 3 recurrent layers to 1 attention layer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import operator
import os
import time
from typing import Any

import run as bench
from bench_common import _hybrid_sizing, _manager, callgrind_inclusive

VARIANTS = ["full", "swa", "hybrid"]
DEFAULTS = dict(requests=64, prompt=4097, blocks=8, layers=32, tokens_per_block=32)
QUICK = dict(DEFAULTS, requests=16, blocks=3, layers=4)


def scenario(p: dict[str, Any]) -> dict[str, Any]:
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

    t = p["tokens_per_block"]
    n = p["requests"]
    ssm_every = 4 if p["variant"] == "hybrid" else 0
    window_every = 2 if p["variant"] == "swa" else 0
    capacity = p["prompt"] + p["blocks"] * t
    slots = n * (capacity // t + 2) * 2
    kw = _hybrid_sizing(ssm_every, n, capacity, 0)
    m = _manager(p["layers"], t, slots, window_every=window_every, ssm_every=ssm_every, **kw)
    rm = KVCacheResourceManager(manager=m)
    reqs = [EngineRequest(i, list(range(i * 1_000_000, i * 1_000_000 + p["prompt"])), 1 << 20) for i in range(n)]
    while any(r.num_cached_tokens < p["prompt"] for r in reqs):  # prefill (a hybrid model's in chunks)
        assert not rm.prepare_resources(reqs)
        for r in reqs:
            if r.samples_this_step:
                r.generated_tokens.append(7)
        rm.update_resources(reqs)
    inside = operator.methodcaller("prepare_resources", reqs), operator.methodcaller("update_resources", reqs)
    spent = {"inside": 0.0, "boundary": 0.0}
    steps = {"inside": 0, "boundary": 0}
    clock = time.perf_counter
    for _ in range(p["blocks"] * t):
        h = reqs[0].num_cached_tokens  # the step computes position h (every request alike)
        kind = "boundary" if h % t in (0, t - 1) else "inside"
        t0 = clock()
        if kind == "inside":
            assert not inside[0](rm)
        else:
            assert list(itertools.starmap(rm.prepare_resources, ((reqs,),))) == [[]]
        t1 = clock()
        for r in reqs:
            r.generated_tokens.append(len(r.generated_tokens) & 0xFFFF)
        t2 = clock()
        if kind == "inside":
            inside[1](rm)
        else:
            list(itertools.starmap(rm.update_resources, ((reqs,),)))
        t3 = clock()
        spent[kind] += (t1 - t0) + (t3 - t2)
        steps[kind] += n
    rm.shutdown()
    m.clear_reusable_blocks()
    m.shutdown()
    return {
        "variant": p["variant"],
        "compiled": kvm.compiled,
        "request_steps": steps,
        "us_per_request_step": {k: spent[k] / steps[k] * 1e6 for k in spent},
    }


def _instructions(mode: str, params: dict[str, Any], steps: dict[str, int]) -> dict[str, float]:
    out_file = os.path.join(bench.ROOT, "build", "bench", f"callgrind.adapter_decode.{params['variant']}.{mode}.out")
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}"]
    bench.run_child(mode, "adapter_decode", params, os.path.abspath(__file__), wrap=wrap)
    calls, cost = callgrind_inclusive(out_file, {"methodcaller_call", "starmap_next"})
    n = params["requests"]
    # two calls per step (prepare, update); starmap_next once more per call (it ends the iteration)
    want = {"methodcaller_call": 2 * steps["inside"] // n, "starmap_next": 4 * steps["boundary"] // n}
    if calls != want:
        raise SystemExit(f"--instructions: marker calls {calls}, expected {want}")
    return {"inside": cost["methodcaller_call"] / steps["inside"], "boundary": cost["starmap_next"] / steps["boundary"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--only", nargs="*", choices=VARIANTS, default=VARIANTS)
    ap.add_argument("--modes", nargs="*", choices=["fast", "compiled"], default=["fast", "compiled"])
    ap.add_argument("--instructions", action="store_true", help="also count instructions per request-step")
    ap.add_argument("--out", default=os.path.join(bench.ROOT, "bench_results", "adapter_decode.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(scenario(json.loads(args.params))))
        return
    params: dict[str, Any] = dict(QUICK if args.quick else DEFAULTS)
    bench.prepare_modes(args.modes, args.instructions)
    results = []
    for variant in args.only:
        for mode in args.modes:
            r = bench.run_child(mode, "adapter_decode", {**params, "variant": variant}, __file__)
            r["mode"] = mode
            us = r["us_per_request_step"]
            line = f"{variant:7s} {mode:9s} us per request-step: inside a block {us['inside']:6.2f}   boundary {us['boundary']:6.2f}"
            if args.instructions:
                inst = _instructions(mode, {**params, "variant": variant}, r["request_steps"])
                r["instructions_per_request_step"] = inst
                line += (
                    f"\n{'':18s}instructions: inside a block {inst['inside']:,.0f}   boundary {inst['boundary']:,.0f}"
                )
            print(line, flush=True)
            results.append(r)
    bench.write_results(args.out, params, results)


if __name__ == "__main__":
    main()
