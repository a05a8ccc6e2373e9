"""Cache-tier scenarios of ``benchmarks/run.py``: the copy engine's bandwidth, onboarding a prefix
from the host tier, the trace's hit rate with and without a host tier."""

from __future__ import annotations

import os
import statistics
import time
from array import array
from typing import Any

from bench_common import (
    TRACE,
    TRACE_NAME,
    _admit,
    _manager,
    _trace,
    _trace_prompt,
)


def scenario_copy_bandwidth(p: dict[str, int]) -> dict[str, Any]:
    """GB/s of one batched copy of scattered slots from a GPU pool to a host-tier pool (host backend)."""
    import random

    import numpy as np

    from kv_cache_manager_v2._storage._copy_engine import CopyEngine
    from kv_cache_manager_v2._storage._host_backend import HostBackend

    n, size = p["copy_slots"], p["copy_slot_bytes"]
    backend = HostBackend()
    engine = CopyEngine(backend)
    src, dst = backend.reserve_pool(n * size), backend.reserve_host_pool(n * size)
    for pool in (src, dst):
        pool.ensure_mapped(n * size)
        assert pool.host_view is not None
        pool.host_view[:] = b"\x01" * (n * size)  # touch every page first: no page faults in the timing
    rng = random.Random(0)
    dst_slots = list(range(n))
    rng.shuffle(dst_slots)
    scattered = list(zip(range(n), dst_slots))  # no two neighbours stay neighbours: one copy per slot
    contiguous = [(i, i) for i in range(n)]
    a = np.ones(n * size, dtype=np.uint8)
    b = np.zeros(n * size, dtype=np.uint8)
    gbs, gbs_contig, gbs_numpy = [], [], []
    for _ in range(15):  # interleaved, so a noisy stretch hits all three
        t0 = time.perf_counter()
        engine.copy([src], [dst], [size], scattered)
        gbs.append(n * size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        engine.copy([src], [dst], [size], contiguous)
        gbs_contig.append(n * size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        np.copyto(b, a)
        gbs_numpy.append(n * size / (time.perf_counter() - t0) / 1e9)
    src.release()
    dst.release()
    return {
        "unit": "GB/s",
        "samples": gbs,
        "slot_bytes": size,
        "slots": n,
        "numpy_copy_gb_per_s": statistics.median(gbs_numpy),
        "ratio_vs_numpy": statistics.median(gbs) / statistics.median(gbs_numpy),
        "best_ratio_vs_numpy": max(gbs) / max(gbs_numpy),
        "contiguous_gb_per_s": statistics.median(gbs_contig),
        "note": "scattered slots (one memcpy each) vs one numpy copy of the same bytes; medians of 15 interleaved rounds",
    }


def scenario_onboard(p: dict[str, int]) -> dict[str, Any]:
    """create_kv_cache + resume of a request whose 1024-token prefix sits in the host tier."""
    t = p["tokens_per_block"]
    prefix_blocks = p["shared"] // t
    gpu_slots = prefix_blocks + 8
    m = _manager(p["layers"], t, gpu_slots, host_slots=4 * gpu_slots, size=p["onboard_buffer_bytes"])
    prefix = list(range(10_000, 10_000 + p["shared"]))
    first = _admit(m, prefix + [1])
    first.close()

    def push_down() -> None:
        filler = m.create_kv_cache()
        assert filler.resume() and filler.resize(gpu_slots * t)  # the whole GPU: the prefix moves to host
        filler.close()

    samples, gpu_samples = [], []
    for r in range(p["onboard_requests"]):
        push_down()
        prompt = prefix + [1_000_000 + r]
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        samples.append((time.perf_counter() - t0) * 1e6)
        assert kv.history_length == p["shared"]
        kv.close()
        t0 = time.perf_counter()  # the same with the prefix already in GPU memory
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        gpu_samples.append((time.perf_counter() - t0) * 1e6)
        kv.close()
    host = m.get_tier_statistics(1)
    m.clear_reusable_blocks()
    m.shutdown()
    return {
        "unit": "us/request",
        "samples": samples,
        "prefix_tokens": p["shared"],
        "pages_onboarded_per_request": host.onboarded_pages // p["onboard_requests"],
        "page_bytes": p["layers"] * 2 * p["onboard_buffer_bytes"],
        "same_prefix_in_gpu_us": statistics.median(gpu_samples),
    }


def _trace_hit_rate(reqs: list[dict[str, Any]], t: int, gpu_tokens: int, host_tokens: int) -> tuple[float, float, Any]:
    m = _manager(1, t, gpu_tokens // t, host_slots=host_tokens // t)
    t0 = time.perf_counter()
    for r in reqs:
        n = r["input_length"]
        prompt = array("I", _trace_prompt(r))
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(n):
            kv.commit(prompt[kv.history_length :])
        kv.close()
    dt = time.perf_counter() - t0
    st = m.reuse_statistics
    tiers = [m.get_tier_statistics(level) for level in range(len(m.cache_tier_list))]
    m.clear_reusable_blocks()
    m.shutdown()
    return st.hit_rate, dt, tiers


def scenario_tier_hit_rate(p: dict[str, int]) -> dict[str, Any]:
    """Prefix-reuse hit rate on the trace: 1M GPU tokens alone vs. 1M GPU + 3M host tokens."""
    t = p["tokens_per_block"]
    if not os.path.exists(TRACE):
        return {"unit": "hit rate", "skipped": f"no trace at {TRACE}"}
    reqs = _trace(p["hit_rate_requests"])
    gpu_only, dt_gpu, _ = _trace_hit_rate(reqs, t, p["trace_gpu_tokens"], 0)
    tiered, dt_tiered, tiers = _trace_hit_rate(reqs, t, p["trace_gpu_tokens"], p["trace_host_tokens"])
    return {
        "unit": "hit rate",
        "samples": [tiered],
        "trace": TRACE_NAME,
        "requests": len(reqs),
        "gpu_tokens": p["trace_gpu_tokens"],
        "host_tokens": p["trace_host_tokens"],
        "gpu_only_hit_rate": gpu_only,
        "host_tier_hit_rate": tiered,
        "gain": tiered - gpu_only,
        "gpu_only_seconds": dt_gpu,
        "host_tier_seconds": dt_tiered,
        "host_onboarded_pages": tiers[1].onboarded_pages,
        "host_offloaded_pages": tiers[1].offloaded_pages,
        "host_dropped_pages": tiers[1].dropped_pages,
        "note": "one request at a time; blocks of tokens_per_block tokens; prompt[:-1] matched, prompt committed",
    }
