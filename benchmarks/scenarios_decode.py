"""Decode-step scenarios of ``benchmarks/run.py``: per request, beams, batched (full attention,
sliding window, hybrids), ``free`` / ``free_swa`` after the batch, chunked SWA prefill, the engine adapter's step."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench_common import (
    _admit,
    _hybrid_sizing,
    _manager,
)


def _decode(p: dict[str, int], window_every: int, events: bool = False) -> tuple[list[float], int]:
    """Per-step samples and, with events, how many events the steps recorded."""
    t, n_req = p["tokens_per_block"], p["requests"]
    m = _manager(
        p["layers"], t, n_req * (p["shared"] + p["unique"] + p["steps"]) // t + 64, window_every, events=events
    )
    system = list(range(10_000, 10_000 + p["shared"]))
    caches = [_admit(m, system + [r * 100_003 + i for i in range(p["unique"])]) for r in range(n_req)]
    m.get_latest_events()
    lg = 0
    samples = []
    num_events = 0
    for step in range(p["steps"]):
        t0 = time.perf_counter()
        for kv in caches:
            kv.resize(kv.capacity + 1)
            kv.commit([step])
            kv.get_base_page_indices(lg)
        if events:
            num_events += len(m.get_latest_events())  # the engine drains once per step
        samples.append((time.perf_counter() - t0) / n_req * 1e6)
    for kv in caches:
        kv.close()
    m.clear_reusable_blocks()
    m.shutdown()
    return samples, num_events


def scenario_decode(p: dict[str, int]) -> dict[str, Any]:
    s, _ = _decode(p, 0)
    return {"unit": "us/request/step", "samples": s}


def scenario_decode_events(p: dict[str, int]) -> dict[str, Any]:
    s, n = _decode(p, 0, events=True)
    return {
        "unit": "us/request/step",
        "samples": s,
        "events_per_step": n / p["steps"],
        "note": "decode with a KVCacheEventManager; the step includes draining the queue",
    }


def scenario_decode_beams(p: dict[str, int]) -> dict[str, Any]:
    """Decode with beam search, B = 4: resize(+1) + commit of every beam's token with random
    parents (the partial tail copied on write when beams share a parent) + every beam's indices,
    per request per step. The B = 1 figure is the ``decode`` scenario."""
    import random

    width = 4
    t, n_req, steps = p["tokens_per_block"], p["beam_requests"], p["steps"]
    prompt_len = p["shared"] + p["unique"]
    m = _manager(p["layers"], t, n_req * width * (prompt_len + steps) // t + 64 * width)
    system = list(range(10_000, 10_000 + p["shared"]))
    rng = random.Random(0)
    caches = []
    for r in range(n_req):
        prompt = system + [r * 100_003 + i for i in range(p["unique"])]
        kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=width)
        assert kv.resume()
        h = kv.history_length
        assert kv.resize(len(prompt))
        kv.commit([prompt[h:]] * width, [0] * width)
        caches.append(kv)
    parents = [[rng.randrange(width) for _ in range(width)] for _ in range(steps)]
    tokens = [[[step * width + b] for b in range(width)] for step in range(steps)]
    samples = []
    for step in range(steps):
        par, toks = parents[step], tokens[step]
        t0 = time.perf_counter()
        for kv in caches:
            kv.resize(kv.capacity + 1)
            kv.commit(toks, par)
            for b in range(width):
                kv.get_base_page_indices(0, b)
        samples.append((time.perf_counter() - t0) / n_req * 1e6)
    for kv in caches:
        kv.close()
    m.clear_reusable_blocks()
    m.shutdown()
    return {"unit": "us/request/step", "samples": samples, "beam_width": width, "note": "per request (4 beams)"}


def scenario_swa(p: dict[str, int]) -> dict[str, Any]:
    s, _ = _decode(p, 2)
    return {"unit": "us/request/step", "samples": s, "note": "alternating window-128 / full layers"}


def _decode_batch(p: dict[str, int], window_every: int, ssm_every: int = 0) -> dict[str, Any]:
    """The decode step through the batch calls: ``resize_batch(caches)`` before the forward pass,
    ``commit_batch(caches, tokens)`` after it, every request's indices mirrored into an engine
    buffer (a row of one int32 table per layer group, as an engine keeps them)."""
    import numpy as np

    t, n_req = p["tokens_per_block"], p["requests"]
    prompt_len = p["shared"] + p["unique"]
    m = _manager(
        p["layers"],
        t,
        n_req * (prompt_len + p["steps"]) // t + 64,
        window_every,
        ssm_every=ssm_every,
        **_hybrid_sizing(ssm_every, n_req, prompt_len + p["steps"], p["shared"]),
    )
    system = list(range(10_000, 10_000 + p["shared"]))
    caches = [_admit(m, system + [r * 100_003 + i for i in range(p["unique"])]) for r in range(n_req)]
    max_blocks = (prompt_len + p["steps"]) // t + 2
    tables = [np.full((n_req, max_blocks), -1, dtype=np.int32) for _ in range(m.num_layer_groups)]
    for r, kv in enumerate(caches):
        for lg, table in enumerate(tables):
            kv.set_base_page_index_buf(0, lg, memoryview(table[r]))
    samples = []
    for step in range(p["steps"]):
        tokens = [step] * n_req
        t0 = time.perf_counter()
        failed = m.resize_batch(caches)
        m.commit_batch(caches, tokens)
        samples.append((time.perf_counter() - t0) / n_req * 1e6)
        assert not failed
    close_samples = []
    for kv in caches:  # the requests finish: each close releases its pages (published ones stay reusable)
        t0 = time.perf_counter()
        kv.close()
        close_samples.append((time.perf_counter() - t0) * 1e6)
    m.clear_reusable_blocks()
    m.shutdown()
    kinds = {0: "full attention", 1: "every layer window-128", 2: "alternating window-128 / full layers"}
    kind = kinds[window_every] if not ssm_every else f"{ssm_every - 1} recurrent : 1 full-attention layers"
    return {
        "unit": "us/request/step",
        "samples": samples,
        "note": f"batched, engine-owned index buffers; {kind}",
        "close_samples": close_samples,
    }


def _decode_batch_scenario(p: dict[str, int], window_every: int) -> dict[str, Any]:
    out = _decode_batch(p, window_every)
    out["close_us"] = statistics.median(out.pop("close_samples"))
    return out


def scenario_decode_batch(p: dict[str, int]) -> dict[str, Any]:
    return _decode_batch_scenario(p, 0)


def scenario_decode_batch_swa(p: dict[str, int]) -> dict[str, Any]:
    return _decode_batch_scenario(p, 1)


def scenario_decode_batch_hybrid(p: dict[str, int]) -> dict[str, Any]:
    return _decode_batch_scenario(p, 2)


def scenario_decode_batch_ssm(p: dict[str, int]) -> dict[str, Any]:
    out = _decode_batch(p, 0, ssm_every=4)
    out["close_us"] = statistics.median(out.pop("close_samples"))
    return out


def _free(p: dict[str, int], window_every: int) -> dict[str, Any]:
    """``close`` of each request at the end of the ``decode_batch`` workload (prompt + every decode
    step committed, so only the partial tail is left to publish): the pages go back or stay reusable."""
    out = _decode_batch(p, window_every)
    decode = out["samples"]
    return {
        "unit": "us/request",
        "samples": out["close_samples"],
        "note": "close after the batched decode steps, " + out["note"].partition("; ")[2],
        "decode_us": statistics.median(decode),
    }


def scenario_free(p: dict[str, int]) -> dict[str, Any]:
    return _free(p, 0)


def scenario_free_swa(p: dict[str, int]) -> dict[str, Any]:
    return _free(p, 1)


def scenario_swa_prefill(p: dict[str, int]) -> dict[str, Any]:
    """gpt-oss-like shape (alternating window-128 / full layers): long prompts prefilled in chunks,
    with and without SWA scratch reuse. Reports us per resize and the peak slots per request."""
    import kv_cache_manager_v2 as kvm

    t, n_req, prompt, chunk = p["tokens_per_block"], p["prefill_requests"], p["prefill_tokens"], p["prefill_chunk"]
    out: dict[str, Any] = {"unit": "us/resize", "note": "gpt-oss-like: alternating window-128 / full layers"}
    for scratch in (False, True):
        cfg = kvm.SwaScratchReuseConfig() if scratch else None
        m = _manager(p["layers"], t, 2 * n_req * (prompt // t + 8), 2, swa_scratch_reuse=cfg)
        times, peak = [], 0
        for r in range(n_req):
            kv = m.create_kv_cache()
            kv.resume()
            h = 0
            while h < prompt:
                c = min(chunk, prompt - h)
                t0 = time.perf_counter()
                assert kv.resize(h + c, h)
                times.append((time.perf_counter() - t0) * 1e6)
                st = m.get_storage_statistics()[0]
                peak = max(peak, st.total - st.free)
                kv.commit([r * 1_000_003 + i for i in range(h, h + c)])
                h += c
            kv.close()
            m.clear_reusable_blocks()
        m.shutdown()
        key = "scratch" if scratch else "no_scratch"
        out[f"peak_slots_{key}"] = peak
        out[f"us_per_resize_{key}"] = statistics.median(times)
        if scratch:
            out["samples"] = times
    out["peak_slot_saving"] = 1 - out["peak_slots_scratch"] / out["peak_slots_no_scratch"]
    return out


def scenario_adapter(p: dict[str, int]) -> dict[str, Any]:
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

    t, n_req, steps = p["tokens_per_block"], p["requests"], p["steps"]
    size = 64
    layers = [
        kvm.AttentionLayerConfig(kvm.LayerId(i), [kvm.BufferConfig("key", size), kvm.BufferConfig("value", size)])
        for i in range(p["layers"])
    ]
    num_slots = n_req * (p["shared"] + p["unique"] + steps) // t + 64
    cfg = kvm.KVCacheManagerConfig(
        t, [kvm.GpuCacheTierConfig(num_slots * p["layers"] * 2 * size)], layers, backend="host"
    )
    a = KVCacheResourceManager(cfg)
    system = list(range(10_000, 10_000 + p["shared"]))
    reqs = [EngineRequest(r, system + [r * 100_003 + i for i in range(p["unique"])], steps + 2) for r in range(n_req)]
    admit = []
    for r in reqs:  # one by one: each prompt is committed before the next arrives
        t0 = time.perf_counter()
        assert a.prepare_resources([r]) == []
        r.generated_tokens.append(kvm.TokenId(1))
        a.update_resources([r])
        admit.append((time.perf_counter() - t0) * 1e6)
    reuse_share = sum(r.num_reused_tokens for r in reqs) / sum(len(r.prompt_tokens) for r in reqs)
    samples, prep, upd = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        unserved = a.prepare_resources(reqs)
        t1 = time.perf_counter()
        for r in reqs:  # the engine's sampling: not timed
            r.generated_tokens.append(kvm.TokenId(step))
        t2 = time.perf_counter()
        a.update_resources(reqs)
        t3 = time.perf_counter()
        assert not unserved
        prep.append((t1 - t0) / n_req * 1e6)
        upd.append((t3 - t2) / n_req * 1e6)
        samples.append(prep[-1] + upd[-1])
    # the same decode step as raw manager calls on the same caches, for the adapter's share
    caches = [a.get_kv_cache(r) for r in reqs]
    raw = []
    for step in range(steps):
        t0 = time.perf_counter()
        for kv in caches:
            kv.resize(kv.capacity + 1)
            kv.commit([step])
        raw.append((time.perf_counter() - t0) / n_req * 1e6)
    for r in reqs:
        a.free_resources(r)
    a.shutdown()
    return {
        "unit": "us/request/step",
        "samples": samples,
        "prepare_us": statistics.median(prep),
        "update_us": statistics.median(upd),
        "raw_resize_commit_us": statistics.median(raw),
        "admission_us_per_request": statistics.median(admit),
        "prompt_reuse_share": reuse_share,
    }
