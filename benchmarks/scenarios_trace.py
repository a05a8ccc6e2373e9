"""Trace scenarios of ``benchmarks/run.py``: the Mooncake trace replayed one request at a time
(blocks/s; requests/s with the cyclic GC on and off)."""

from __future__ import annotations

import os
import time
from array import array
from typing import Any

from bench_common import (
    TRACE,
    TRACE_NAME,
    _manager,
    _trace,
    _trace_prompt,
)


def scenario_replay(p: dict[str, int]) -> dict[str, Any]:
    t = p["tokens_per_block"]
    if os.path.exists(TRACE):
        reqs = _trace(p["trace_requests"])
        source = TRACE_NAME
    else:  # built-in generator: a few shared prefixes of random depth
        import random

        reqs = []
        rng = random.Random(0)
        for r in range(p["trace_requests"]):
            base = rng.randrange(8) * 1000
            ids = [base + i for i in range(rng.randrange(1, 20))] + [
                100_000 + r * 50 + i for i in range(rng.randrange(1, 10))
            ]
            reqs.append({"input_length": len(ids) * 512, "output_length": 16, "hash_ids": ids})
        source = "built-in generator"
    m = _manager(1, t, p["cache_tokens"] // t)
    blocks = 0
    t0 = time.perf_counter()
    for r in reqs:
        n = r["input_length"]
        prompt = _trace_prompt(r)
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(n):
            kv.commit(prompt[kv.history_length :])
        kv.close()
        blocks += (n + t - 1) // t
    dt = time.perf_counter() - t0
    st = m.reuse_statistics
    m.clear_reusable_blocks()
    m.shutdown()
    return {
        "unit": "blocks/s",
        "samples": [blocks / dt],
        "requests": len(reqs),
        "hit_rate": st.hit_rate,
        "source": source,
    }


def _replay_requests_per_s(
    reqs: list[dict[str, Any]], t: int, cache_tokens: int, gc_on: bool
) -> tuple[float, float, float]:
    """Requests/s, hit rate and the share of the timed calls spent in GC collections, of a
    one-at-a-time replay (create, resume, resize, commit, close) of ``array('I')`` prompts, built
    outside the timed calls."""
    import gc

    m = _manager(1, t, cache_tokens // t)
    gc.collect()
    if not gc_on:
        gc.disable()
    spent = gc_spent = gc_start = 0.0
    timing = False  # collections count only inside the timed calls

    def on_gc(phase: str, info: dict[str, int]) -> None:
        nonlocal gc_spent, gc_start
        if phase == "start":
            gc_start = time.perf_counter()
        elif timing:
            gc_spent += time.perf_counter() - gc_start

    gc.callbacks.append(on_gc)
    for r in reqs:
        n = r["input_length"]
        prompt = array("I", _trace_prompt(r))
        timing = True
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(n):
            kv.commit(prompt[kv.history_length :])
        kv.close()
        spent += time.perf_counter() - t0
        timing = False
    gc.callbacks.remove(on_gc)
    gc.enable()
    hit_rate = m.reuse_statistics.hit_rate
    m.clear_reusable_blocks()
    m.shutdown()
    return len(reqs) / spent, hit_rate, gc_spent / spent


def scenario_replay_gc(p: dict[str, int]) -> dict[str, Any]:
    """The trace replayed one request at a time (prompt blocks only) on a 3M-token cache, in
    requests/s: with the cyclic GC enabled (the samples) and disabled, on fresh managers (two
    alternating passes each, the best of each)."""
    if not os.path.exists(TRACE):
        return {"unit": "requests/s", "skipped": f"no trace at {TRACE}"}
    reqs = _trace(p["replay_gc_requests"])
    on, off, hit_rate, gc_share = 0.0, 0.0, 0.0, 1.0
    for _ in range(2):  # alternating, the best of each: a noisy stretch should not decide the ratio
        r, hit_rate, share = _replay_requests_per_s(reqs, p["tokens_per_block"], p["cache_tokens"], gc_on=True)
        on, gc_share = max(on, r), min(gc_share, share)
        off = max(off, _replay_requests_per_s(reqs, p["tokens_per_block"], p["cache_tokens"], gc_on=False)[0])
    return {
        "unit": "requests/s",
        "samples": [on],
        "trace": TRACE_NAME,
        "gc_off_requests_per_s": off,
        "gc_on_vs_off": on / off,
        "gc_share": gc_share,  # time in collections / time in the calls (GC on): noise-free
        "requests": len(reqs),
        "hit_rate": hit_rate,
    }
