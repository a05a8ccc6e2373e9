"""A serving-like workload through ``KVCacheResourceManager`` (issue 39.3): what an engine's step
loop pays the manager per prompt block, per decode step and per evicted block.

    .venv/bin/python benchmarks/serving.py                    # both modes, JSON
    .venv/bin/python benchmarks/serving.py --modes fast --quick
    .venv/bin/python benchmarks/serving.py --instructions     # + callgrind instruction counts

Workload (seeded): prompts of 8k-32k tokens built from one of a few shared system prompts, one of a
few shared documents and a unique question; at most ``running`` requests at a time; each step has a
token budget (8,192): every running decode request gets one token, the rest of the budget goes to
prefill chunks (``context_chunk_size``), oldest request first; each request decodes
``decode_steps`` tokens, then is freed. Before the timed part the GPU tier is filled with
reusable blocks of unrelated prompts (more than the workload ever allocates), so every admission
evicts; the same run on a GPU tier with room for everything (no eviction; the same reuse, checked)
gives the cost of eviction by difference. Variants: ``full`` (pure attention), ``hybrid``
(qwen3-next shape: 3 recurrent layers to 1 attention layer; chunks end at snapshot positions),
``host`` (pure attention with a host tier under the GPU: evictions become offloads).

Per variant and mode: us per prompt block (admission, prefill chunks and free of the context
requests, over all prompt blocks, reused ones included, as the replay benchmark of
``benchmarks/run.py`` counts them), us per decode step per request, us per evicted block. The
engine calls go through C callables of CPython (``functools.partial`` for prefill,
``operator.methodcaller`` for decode, ``map`` for free), so ``--instructions`` counts each phase's
instructions under callgrind (inclusive cost of those functions), interpreted and compiled alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import run as bench
from bench_common import REPO_TRACE, _hybrid_sizing, _manager, _trace, _trace_prompt, callgrind_inclusive

VARIANTS = ["full", "hybrid", "host"]
DEFAULTS = dict(
    requests=32,
    running=8,
    budget=8192,
    decode_steps=256,
    layers=32,
    hybrid_layers=48,
    tokens_per_block=32,
    min_prompt=8192,
    max_prompt=32768,
    seed=0,
    replay_requests=400,  # the replay comparison: benchmarks/run.py's defaults
    replay_cache_tokens=3_000_000,
)
QUICK = dict(DEFAULTS, requests=8, running=4, decode_steps=32, layers=4, hybrid_layers=8, replay_requests=60)
#: the C function each phase's engine calls go through (``--instructions``: their inclusive cost)
MARKERS = {"prefill": "partial_vectorcall", "decode": "methodcaller_call", "free": "map_next"}


def _prompts(p: dict[str, Any]) -> list[list[int]]:
    """``requests`` prompts: a system prompt (1 of 4, 2,048 tokens), a document (1 of 8, 2k-12k
    tokens) and a unique question, cut or padded to a length in ``[min_prompt, max_prompt]``."""
    rng = random.Random(p["seed"])
    systems = [[1_000_000 + s * 10_000 + i for i in range(2048)] for s in range(4)]
    docs = [[2_000_000 + d * 100_000 + i for i in range(rng.randrange(2048, 12288))] for d in range(8)]
    out = []
    for r in range(p["requests"]):
        length = rng.randrange(p["min_prompt"], p["max_prompt"] + 1)
        head = rng.choice(systems) + rng.choice(docs)
        unique = [10_000_000 + r * 100_000 + i for i in range(max(1, length - len(head)))]
        out.append((head + unique)[:length])
    return out


def _fill(m: Any, blocks: int, t: int) -> None:
    """Publish ``blocks`` reusable blocks of unrelated 8k-token prompts (then closed: all evictable)."""
    base = 50_000_000
    while blocks > 0:
        n = min(blocks, 256) * t
        prompt = list(range(base, base + n))
        base += n
        kv = m.create_kv_cache(input_tokens=None)
        assert kv.resume() and kv.resize(n)
        h = 0
        while h < n:  # (a hybrid model takes snapshots at its snapshot positions only)
            nxt = kv.next_snapshot_position(h)
            end = n if nxt is None else min(n, nxt)
            kv.commit(prompt[h:end])
            h = end
        kv.close()
        blocks -= n // t


def _serve(rm: Any, prompts: list[list[int]], p: dict[str, Any]) -> dict[str, Any]:
    """The step loop; wall time and counts per phase."""
    import functools
    import operator

    from kv_cache_manager_v2.engine import EngineRequest, RequestState

    budget = p["budget"]
    waiting = [EngineRequest(i, pr, p["decode_steps"]) for i, pr in enumerate(prompts)]
    waiting.reverse()
    running: list[Any] = []
    spent = {"prefill": 0.0, "decode": 0.0, "free": 0.0}
    decode_units = steps = 0
    clock = time.perf_counter
    while waiting or running:
        while waiting and len(running) < p["running"]:
            running.append(waiting.pop())
        steps += 1
        decode = [r for r in running if r.state is RequestState.GENERATION]
        left = budget - len(decode)
        prefill = []
        for r in running:
            if r.state is RequestState.CONTEXT and left > 0:
                r.context_chunk_size = left
                prefill.append(r)
                left -= min(left, len(r.prompt_tokens) - r.num_cached_tokens)
        t0 = clock()
        if prefill:
            unserved = functools.partial(rm.prepare_resources, prefill)()
            assert not unserved, "the GPU tier must hold the running requests"
        t1 = clock()
        if decode:
            assert not operator.methodcaller("prepare_resources", decode)(rm)
        t2 = clock()
        for r in prefill + decode:  # the model's forward step: sample where the step ends a prompt
            if r.samples_this_step:
                r.generated_tokens.append(len(r.generated_tokens))
        t3 = clock()
        if prefill:
            functools.partial(rm.update_resources, prefill)()
        t4 = clock()
        if decode:
            operator.methodcaller("update_resources", decode)(rm)
        t5 = clock()
        finished = [r for r in decode if len(r.generated_tokens) >= r.max_new_tokens]
        for r in finished:
            r.state = RequestState.FINISHED
            running.remove(r)
        t6 = clock()
        list(map(rm.free_resources, finished))
        t7 = clock()
        spent["prefill"] += (t1 - t0) + (t4 - t3)
        spent["decode"] += (t2 - t1) + (t5 - t4)
        spent["free"] += t7 - t6
        decode_units += len(decode)
    return {"spent": spent, "decode_units": decode_units, "steps": steps}


def replay(p: dict[str, Any]) -> dict[str, Any]:
    """``benchmarks/run.py``'s replay scenario (the trace one request at a time: create, resume,
    resize, commit, close; one layer, a cache that never evicts), its calls through the prefill
    marker and the prompts built outside them: its cost per prompt block, counted the same way."""
    import functools

    import kv_cache_manager_v2 as kvm

    t = p["tokens_per_block"]
    m = _manager(1, t, p["replay_cache_tokens"] // t)
    blocks = 0
    spent = 0.0

    def one(prompt: list[int]) -> None:
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(len(prompt)):
            kv.commit(prompt[kv.history_length :])
        kv.close()

    for r in _trace(p["replay_requests"], REPO_TRACE):  # (the repository's trace: the same everywhere)
        prompt = _trace_prompt(r)
        t0 = time.perf_counter()
        functools.partial(one, prompt)()
        spent += time.perf_counter() - t0
        blocks += (len(prompt) + t - 1) // t
    hit_rate = m.reuse_statistics.hit_rate
    m.clear_reusable_blocks()
    m.shutdown()
    return {
        "variant": "replay",
        "compiled": kvm.compiled,
        "prompt_blocks": blocks,
        "decode_units": 0,
        "hit_rate": hit_rate,
        "us_per_prompt_block": spent / blocks * 1e6,
        "seconds": {"prefill": spent},
    }


def scenario(p: dict[str, Any]) -> dict[str, Any]:
    if p["variant"] == "replay":
        return replay(p)
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.engine import KVCacheResourceManager

    t = p["tokens_per_block"]
    prompts = _prompts(p)
    variant = p["variant"]
    ssm_every = 4 if variant == "hybrid" else 0
    layers = p["hybrid_layers"] if ssm_every else p["layers"]
    prompt_blocks = sum((len(x) + t - 1) // t for x in prompts)
    working = p["running"] * (p["max_prompt"] + p["decode_steps"]) // t + p["running"]
    slots = working + prompt_blocks + p["requests"] * (p["decode_steps"] // t + 2)  # > what the run allocates
    kw = _hybrid_sizing(ssm_every, p["running"], p["max_prompt"] + p["decode_steps"], 2048)
    host = 2 * slots if variant == "host" else 0

    def build(num_slots: int) -> Any:
        return _manager(layers, t, num_slots, host_slots=host, ssm_every=ssm_every, **kw)

    m = build(slots)
    fill = max(s.free for s in m.get_storage_statistics())  # the largest pool group's slots
    if p["roomy"]:  # the same fill, on a GPU tier with room for it and the whole run
        m.shutdown()
        m = build(4 * slots)
    _fill(m, fill, t)
    m.take_iteration_stats()
    rm = KVCacheResourceManager(manager=m)
    out = _serve(rm, prompts, p)
    st = m.reuse_statistics
    tiers = m.take_iteration_stats()  # GPU pages evicted: dropped there, or offloaded to the host tier
    evicted = tiers[0].dropped_pages + (tiers[1].offloaded_pages if len(tiers) > 1 else 0)
    rm.shutdown()
    m.clear_reusable_blocks()
    m.shutdown()
    spent = out["spent"]
    return {
        "variant": variant,
        "roomy": p["roomy"],
        "compiled": kvm.compiled,
        "prompt_blocks": prompt_blocks,
        "decode_units": out["decode_units"],
        "steps": out["steps"],
        "hit_rate": st.hit_rate,
        "reused_tokens": rm.reused_tokens_per_level,
        "evicted_blocks": evicted,
        "us_per_prompt_block": (spent["prefill"] + spent["free"]) / prompt_blocks * 1e6,
        "us_per_decode_step_per_request": spent["decode"] / max(1, out["decode_units"]) * 1e6,
        "seconds": spent,
    }


def _instructions(mode: str, params: dict[str, Any]) -> dict[str, int]:
    """Inclusive instructions of each phase's marker function in one run under callgrind."""
    tag = f"{params['variant']}.{params['roomy']}.{mode}"
    out_file = os.path.join(bench.ROOT, "build", "bench", f"callgrind.serving.{tag}.out")
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}"]
    bench.run_child(mode, "serving", params, os.path.abspath(__file__), wrap=wrap)
    return _phase_instructions(out_file)


def _phase_instructions(path: str) -> dict[str, int]:
    """Inclusive instructions of each phase's marker function in a callgrind output file."""
    _, cost = callgrind_inclusive(path, set(MARKERS.values()))
    return {phase: cost[fn] for phase, fn in MARKERS.items()}


def _per_unit(r: dict[str, Any], counts: dict[str, int]) -> dict[str, float]:
    return {
        "per_prompt_block": (counts["prefill"] + counts["free"]) / r["prompt_blocks"],
        "per_decode_step_per_request": counts["decode"] / max(1, r["decode_units"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--only", nargs="*", choices=VARIANTS, default=VARIANTS)
    ap.add_argument("--modes", nargs="*", choices=["fast", "compiled"], default=["fast", "compiled"])
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (modes alternate; the best is kept)")
    ap.add_argument("--requests", type=int, help="override the number of requests")
    ap.add_argument("--decode-steps", type=int, help="override the decode steps per request")
    ap.add_argument("--replay", action="store_true", help="also run the replay benchmark's loop, for comparison")
    ap.add_argument("--instructions", action="store_true", help="also count instructions per unit (callgrind)")
    ap.add_argument("--out", default=os.path.join(bench.ROOT, "bench_results", "serving.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(scenario(json.loads(args.params))))
        return
    params: dict[str, Any] = dict(QUICK if args.quick else DEFAULTS)
    if args.requests:
        params["requests"] = args.requests
    if args.decode_steps:
        params["decode_steps"] = args.decode_steps
    bench.prepare_modes(args.modes, args.instructions)
    results = []
    for mode in args.modes if args.replay else []:
        r = bench.run_child(mode, "serving", {**params, "variant": "replay"}, __file__)
        r["mode"] = mode
        line = f"replay  {mode:9s} prompt block {r['us_per_prompt_block']:7.2f} us   (hit rate {r['hit_rate']:.3f})"
        if args.instructions:
            counts = _instructions(mode, {**params, "variant": "replay", "roomy": 0})
            r["instructions"] = {"per_prompt_block": counts["prefill"] / r["prompt_blocks"]}
            line += f"\n{'':18s}instructions: per_prompt_block {r['instructions']['per_prompt_block']:,.0f}"
        print(line, flush=True)
        results.append(r)
    for variant in args.only:
        for mode in args.modes:
            best: dict[str, dict[str, Any]] = {}
            for _ in range(args.repeats):
                for roomy in (0, 1):
                    r = bench.run_child(mode, "serving", {**params, "variant": variant, "roomy": roomy}, __file__)
                    key = "roomy" if roomy else "full"
                    if key not in best or r["us_per_prompt_block"] < best[key]["us_per_prompt_block"]:
                        best[key] = r
            full, room = best["full"], best["roomy"]
            # eviction by difference is exact where both runs reuse the same blocks; a hybrid model's
            # small state pool also evicts the run's own snapshots (less reuse: more prefill counted)
            same_reuse = full["reused_tokens"] == room["reused_tokens"]
            # (the roomy run may drop pages too: a hybrid model's unreachable blocks are garbage)
            evicted = full["evicted_blocks"] - room["evicted_blocks"]
            if evicted <= 0:
                raise SystemExit(f"{variant}: the full GPU tier evicted no more than the roomy one")
            res = {
                "variant": variant,
                "mode": mode,
                "hit_rate": full["hit_rate"],
                "prompt_blocks": full["prompt_blocks"],
                "decode_units": full["decode_units"],
                "evicted_blocks": evicted,
                "same_reuse": same_reuse,
                "us_per_prompt_block": full["us_per_prompt_block"],
                "us_per_decode_step_per_request": full["us_per_decode_step_per_request"],
                "us_per_evicted_block": (full["seconds"]["prefill"] - room["seconds"]["prefill"]) / evicted * 1e6,
                "runs": best,
            }
            line = (
                f"{variant:7s} {mode:9s} prompt block {res['us_per_prompt_block']:7.2f} us   decode step/request "
                f"{res['us_per_decode_step_per_request']:7.2f} us   eviction/block {res['us_per_evicted_block']:7.2f} us"
            )
            if args.instructions:
                counts = {
                    k: _instructions(mode, {**params, "variant": variant, "roomy": i}) for i, k in enumerate(best)
                }
                inst = {k: _per_unit(best[k], counts[k]) for k in counts}
                inst["full"]["per_evicted_block"] = (counts["full"]["prefill"] - counts["roomy"]["prefill"]) / evicted
                res["instructions"] = inst["full"]
                res["instructions_roomy"] = inst["roomy"]
                line += (
                    "\n" + " " * 18 + "instructions: " + "   ".join(f"{k} {v:,.0f}" for k, v in inst["full"].items())
                )
            if not same_reuse:
                line += (
                    f"\n{'':18s}(reuse differs without eviction: {full['reused_tokens']} vs {room['reused_tokens']})"
                )
            print(line, flush=True)
            results.append(res)
    bench.write_results(args.out, params, results)


if __name__ == "__main__":
    main()
