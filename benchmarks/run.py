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
every layer window-128), decode_batch / decode_batch_hybrid, free (close at the end of the
decode_batch workload). ``--instructions`` adds, for those (compiled), the instructions per unit
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
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
}
#: the project's shared Mooncake trace when it is beside the repository (the figures in README.md
#: come from it), else the repository's own multi-turn trace (scripts/make_trace.py)
SHARED_TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
REPO_TRACE = os.path.join(ROOT, "traces", "multi_turn.jsonl")
TRACE = SHARED_TRACE if os.path.exists(SHARED_TRACE) else REPO_TRACE
TRACE_NAME = "shared/traces/synthetic_trace.jsonl" if TRACE == SHARED_TRACE else "traces/multi_turn.jsonl"
#: deterministic results (a hit rate): one run per mode whatever --repeats says
RUN_ONCE = {"tier_hit_rate"}


# ---------------------------------------------------------------- worker side
def _manager(
    num_layers: int,
    tokens_per_block: int,
    num_slots: int,
    window_every: int = 0,
    window: int = 128,
    host_slots: int = 0,
    size: int = 64,
    events: bool = False,
    remote: Any = None,
    ssm_every: int = 0,
    **kw: Any,
) -> Any:
    import kv_cache_manager_v2 as kvm

    # size: bytes per buffer page (64 by default: most benchmarks never touch KV memory)
    layers: list[Any] = [
        kvm.AttentionLayerConfig(
            kvm.LayerId(i),
            [kvm.BufferConfig("key", size), kvm.BufferConfig("value", size)],
            sliding_window_size=window if window_every and i % window_every == 0 else None,
        )
        for i in range(num_layers)
    ]
    if ssm_every:  # every ssm_every-th layer keeps attention, the others are recurrent (Qwen3-Next: 4)
        layers = [
            layer
            if i % ssm_every == ssm_every - 1
            else kvm.SsmLayerConfig(
                kvm.LayerId(i), [kvm.BufferConfig("conv_state", size), kvm.BufferConfig("ssm_state", size)]
            )
            for i, layer in enumerate(layers)
        ]
    slot = num_layers * 2 * size
    tiers: list[Any] = [kvm.GpuCacheTierConfig(num_slots * slot)]
    if host_slots:
        tiers.append(kvm.HostCacheTierConfig(host_slots * slot))
    if remote is not None:
        tiers.append(remote)
    cfg = kvm.KVCacheManagerConfig(tokens_per_block, tiers, layers, backend="host", **kw)
    if events:
        return kvm.KVCacheManager(cfg, kvm.KVCacheEventManager(max_events=1 << 20))
    return kvm.KVCacheManager(cfg)


def _hybrid_sizing(ssm_every: int, num_requests: int, capacity: int, shared: int) -> dict[str, Any]:
    """A hybrid manager's ``typical_step``: the benchmark's own batch (its live states and one
    snapshot per request; the default step of one long request leaves too few state slots)."""
    if not ssm_every:
        return {}
    import kv_cache_manager_v2 as kvm

    desc = kvm.KVCacheDesc(capacity=capacity, history_length=capacity - 1)
    return {"typical_step": kvm.BatchDesc([desc] * num_requests, system_prompt_length=shared)}


def _wire_us_per_event(events: list[Any]) -> float | None:
    """to_wire + msgpack encoding per event (what a publisher pays on its thread); None without msgspec."""
    try:
        from kv_cache_manager_v2.events import KVEventBatch, encode_batch, to_wire
    except ImportError:
        return None
    if not events:
        return None
    t0 = time.perf_counter()
    encode_batch(KVEventBatch(time.time(), to_wire(events)))
    return (time.perf_counter() - t0) / len(events) * 1e6


def _admit(m: Any, prompt: list[int]) -> Any:
    kv = m.create_kv_cache(input_tokens=prompt[:-1])
    assert kv.resume()
    h = kv.history_length
    assert kv.resize(len(prompt))
    _commit_prompt(kv, prompt, h)
    return kv


def _commit_prompt(kv: Any, prompt: Any, h: int) -> None:
    """Commit the prompt from ``h``; a hybrid model's in chunks cut at its snapshot positions."""
    nxt = kv.next_snapshot_position(h)
    if nxt is None:
        kv.commit(prompt[h:])
        return
    while h < len(prompt):
        end = min(len(prompt), nxt)
        kv.commit(prompt[h:end])
        h = end
        nxt = kv.next_snapshot_position(h)


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


def scenario_free(p: dict[str, int]) -> dict[str, Any]:
    """``close`` of each request at the end of the ``decode_batch`` workload (prompt + every decode
    step committed, so nothing is left to publish): the pages go back or stay reusable."""
    out = _decode_batch(p, 0)
    decode = out["samples"]
    return {
        "unit": "us/request",
        "samples": out["close_samples"],
        "note": "close after the batched decode steps, full attention",
        "decode_us": statistics.median(decode),
    }


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


def scenario_admission_scaling(p: dict[str, int]) -> dict[str, Any]:
    """Admission (probe + create + resume + resize) of a new conversation when 1k, 10k and 40k
    cached conversations share its chat-template prefix: the partial match at the first miss
    must not scan every sibling (they all start with the same user-turn token)."""
    t = p["tokens_per_block"]
    template = list(range(10_000, 10_000 + 2 * t))
    user = 7
    out: dict[str, Any] = {"unit": "us/request", "note": "admission with N cached conversations sharing a template"}
    medians = []
    for n_cached in (p["scaling_small"], p["scaling_mid"], p["scaling_large"]):
        m = _manager(1, t, n_cached + 4 * p["requests"] + 64)
        for c in range(n_cached):
            toks = [*template, user, *[c * 7919 + i for i in range(t - 1)]]
            kv = m.create_kv_cache()
            kv.resume()
            kv.resize(len(toks))
            kv.commit(toks)
            kv.close()
        samples = []
        for r in range(p["requests"]):
            prompt = [*template, user, *[(r + 1) * 1_000_003 + i for i in range(2 * t)]]
            t0 = time.perf_counter()
            m.probe_reuse(None, prompt[:-1])
            kv = m.create_kv_cache(input_tokens=prompt[:-1])
            kv.resume()
            kv.resize(len(prompt))
            samples.append((time.perf_counter() - t0) * 1e6)
            kv.close()
        m.clear_reusable_blocks()
        m.shutdown()
        out[f"us_with_{n_cached}_cached"] = statistics.median(samples)
        medians.append(statistics.median(samples))
        out["samples"] = samples
    out["largest_over_smallest"] = medians[-1] / medians[0]
    return out


def scenario_admission(p: dict[str, int]) -> dict[str, Any]:
    return _admission(p, as_array=False)


def scenario_admission_full(p: dict[str, int]) -> dict[str, Any]:
    out = _admission(p, as_array=False, probe=False, timed_commit=True)
    out["note"] = "create_kv_cache (hash + match) + resume + resize (allocate) + commit of the prompt"
    return out


def scenario_admission_ssm(p: dict[str, int]) -> dict[str, Any]:
    out = _admission(p, as_array=False, probe=False, timed_commit=True, ssm_every=4)
    out["note"] = (
        "admission_full with 3 recurrent : 1 full-attention layers (prompt committed in chunks cut at snapshots)"
    )
    return out


def scenario_admission_hybrid(p: dict[str, int]) -> dict[str, Any]:
    out = _admission(p, as_array=False, probe=False, timed_commit=True, window_every=2)
    out["note"] = "admission_full with alternating window-128 / full layers"
    return out


def scenario_admission_events(p: dict[str, int]) -> dict[str, Any]:
    out = _admission(p, as_array=False, events=True)
    out["note"] = "admission with a KVCacheEventManager (blocks are published by the prefill commit: commit_us)"
    return out


def scenario_admission_array(p: dict[str, int]) -> dict[str, Any]:
    out = _admission(p, as_array=True)
    out["note"] = "prompts passed as array('I'): token encoding is a memory copy"
    return out


def _admission(
    p: dict[str, int],
    as_array: bool,
    events: bool = False,
    probe: bool = True,
    timed_commit: bool = False,
    window_every: int = 0,
    ssm_every: int = 0,
) -> dict[str, Any]:
    """Admission of ``requests`` prompts (``shared`` tokens cached by an earlier request, then
    ``unique`` ones): [probe_reuse +] create_kv_cache + resume + resize per sample; with
    ``timed_commit`` the prefill commit right after is in the sample, else the commits follow
    every admission (so the samples see the same tree as before that phase existed)."""
    from kv_cache_manager_v2 import ReuseScope
    from kv_cache_manager_v2._reuse._keys import BlockHasher, scope_key

    t, n_req = p["tokens_per_block"], p["requests"]
    prompt_len = p["shared"] + p["unique"]
    m = _manager(
        p["layers"],
        t,
        (n_req + 1) * prompt_len // t + 64,
        window_every,
        events=events,
        ssm_every=ssm_every,
        **_hybrid_sizing(ssm_every, n_req + 1, prompt_len, p["shared"]),
    )
    system = list(range(10_000, 10_000 + p["shared"]))
    first = _admit(m, system + list(range(5_000_000, 5_000_000 + p["unique"])))
    first.close()
    m.get_latest_events()
    prompts: list[Any] = [system + [r * 100_003 + i for i in range(p["unique"])] for r in range(n_req)]
    if as_array:
        prompts = [array("I", prompt) for prompt in prompts]
    samples, caches, commit_us, reused = [], [], [], 0
    for prompt in prompts:
        t0 = time.perf_counter()
        if probe:
            m.probe_reuse(None, prompt[:-1])
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        kv.resume()
        kv.resize(len(prompt))
        if timed_commit:
            h = kv.history_length
            t1 = time.perf_counter()
            if ssm_every:
                _commit_prompt(kv, prompt, h)
            else:
                kv.commit(prompt[h:])
            commit_us.append((time.perf_counter() - t1) * 1e6)
            reused += h
        samples.append((time.perf_counter() - t0) * 1e6)
        caches.append(kv)
    for kv, prompt in zip(caches, prompts) if not timed_commit else ():
        h = kv.history_length
        reused += h
        t0 = time.perf_counter()
        kv.commit(prompt[h:])
        commit_us.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    drained = m.get_latest_events()
    drain_us = (time.perf_counter() - t0) / n_req * 1e6
    # hashing share: the keys admission computes (matched blocks + the first miss, each once), timed alone
    root = scope_key(ReuseScope())
    hashed = p["shared"] // t + 1
    t0 = time.perf_counter()
    for prompt in prompts:
        hasher = BlockHasher(prompt[:-1], t, "prompt")
        key = root
        for o in range(hashed):
            key = hasher.key(key, o)
    hash_us = (time.perf_counter() - t0) / n_req * 1e6
    for kv in caches:
        kv.close()
    m.shutdown()
    out: dict[str, Any] = {
        "unit": "us/request",
        "samples": samples,
        "hashing_us": hash_us,
        "hashing_share": hash_us / statistics.median(samples),
        "commit_us": statistics.median(commit_us),
        "reused_tokens_per_request": reused / n_req,
    }
    if events:
        out.update(
            events_per_request=len(drained) / n_req,
            drain_us_per_request=drain_us,
            wire_us_per_event=_wire_us_per_event(drained),
        )
    return out


def _rematch(p: dict[str, int], window_every: int) -> dict[str, Any]:
    """Warm rematch: ``probe_reuse`` (hashing included) of prompts whose every block is cached
    (admitted, committed and closed before), ``rematch_rounds`` passes over the requests."""
    t, n_req = p["tokens_per_block"], p["requests"]
    prompt_len = p["shared"] + p["unique"]
    m = _manager(p["layers"], t, (n_req + 1) * prompt_len // t + 64, window_every)
    system = list(range(10_000, 10_000 + p["shared"]))
    prompts = [system + [r * 100_003 + i for i in range(p["unique"])] for r in range(n_req)]
    for prompt in prompts:
        _admit(m, prompt).close()
    samples, matched = [], 0
    for _ in range(p["rematch_rounds"]):
        # new lists each round (as at admission, without the last token): nothing hashed before is known
        queries = [prompt[:-1] for prompt in prompts]
        for query in queries:
            t0 = time.perf_counter()
            n = m.probe_reuse(None, query)
            samples.append((time.perf_counter() - t0) * 1e6)
            matched += n
    m.clear_reusable_blocks()
    m.shutdown()
    kinds = {0: "full attention", 1: "every layer window-128"}
    return {
        "unit": "us/request",
        "samples": samples,
        "matched_tokens_per_probe": matched / len(samples),
        "probe_tokens": prompt_len - 1,
        "note": f"probe_reuse of a cached prompt; {kinds[window_every]}",
    }


def scenario_rematch_full(p: dict[str, int]) -> dict[str, Any]:
    return _rematch(p, 0)


def scenario_rematch_swa(p: dict[str, int]) -> dict[str, Any]:
    return _rematch(p, 1)


def scenario_close(p: dict[str, int]) -> dict[str, Any]:
    t, n_req = p["tokens_per_block"], p["requests"]
    m = _manager(p["layers"], t, 2 * n_req * (p["shared"] + p["unique"]) // t + 64)
    system = list(range(10_000, 10_000 + p["shared"]))
    caches = []
    for r in range(n_req):
        kv = _admit(m, system + [r * 100_003 + i for i in range(p["unique"])])
        kv.resize(kv.capacity + 5)
        kv.commit([1, 2, 3, 4, 5])  # a partial tail to publish
        caches.append(kv)
    samples = []
    for kv in caches:
        t0 = time.perf_counter()
        kv.stop_committing()
        kv.close()
        samples.append((time.perf_counter() - t0) * 1e6)
    m.clear_reusable_blocks()
    m.shutdown()
    return {"unit": "us/request", "samples": samples}


def scenario_hashing(p: dict[str, int]) -> dict[str, Any]:
    from kv_cache_manager_v2 import ReuseScope
    from kv_cache_manager_v2._reuse._keys import BlockHasher, scope_key

    t = p["tokens_per_block"]
    n_blocks = p["hash_blocks"]
    tokens = [(i * 2654435761) & 0xFFFFFFFF for i in range(n_blocks * t)]
    blocks = [tokens[o * t : (o + 1) * t] for o in range(n_blocks)]
    raw = [array("I", b).tobytes() for b in blocks]
    ids = array("I", tokens)
    ours, ours_array, plain = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        BlockHasher(tokens, t, "tokens").chain(scope_key(ReuseScope()))  # list[int]: encoding is part of the cost
        ours.append(n_blocks * t / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        BlockHasher(ids, t, "tokens").chain(scope_key(ReuseScope()))  # array('I'): encoding is a memcpy
        ours_array.append(n_blocks * t / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        key = b"\0" * 32
        for r in raw:
            key = hashlib.sha256(key + r).digest()
        plain.append(n_blocks * t / (time.perf_counter() - t0))
    return {
        "unit": "tokens/s",
        "samples": ours,
        "plain_sha256_tokens_per_s": statistics.median(plain),
        "ratio_vs_plain": statistics.median(ours) / statistics.median(plain),
        "array_input_tokens_per_s": statistics.median(ours_array),
        "array_input_ratio_vs_plain": statistics.median(ours_array) / statistics.median(plain),
    }


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


def _trace(limit: int) -> list[dict[str, Any]]:
    """The trace's requests (the first ``limit``; all of them when 0)."""
    reqs = []
    with open(TRACE) as f:
        for line in f:
            reqs.append(json.loads(line))
            if limit and len(reqs) >= limit:
                break
    return reqs


def _trace_prompt(r: dict[str, Any]) -> list[int]:
    """A trace request's prompt: 512 tokens per hash id (equal ids, equal tokens), cut to its length."""
    return [h * 512 + i for h in r["hash_ids"] for i in range(512)][: r["input_length"]]


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


def scenario_admission_gc(p: dict[str, int]) -> dict[str, Any]:
    """Admission including the prefill commit (then close) on a manager already holding
    ``gc_blocks`` cached blocks, with the cyclic GC enabled (the samples) and disabled, in
    alternating rounds (16 in all)."""
    import gc

    t, unique = p["tokens_per_block"], p["unique"]
    prompt_len = p["shared"] + unique
    m = _manager(1, t, p["gc_blocks"] + 4 * p["requests"] * prompt_len // t + 64)
    system = list(range(10_000, 10_000 + p["shared"]))
    fill_len = 32 * t  # 32 unique blocks per filler request
    for r in range(p["gc_blocks"] // 32):
        _admit(m, system[:t] + [1 << 30 | r * fill_len + i for i in range(fill_len)]).close()
    gc.collect()
    on: list[float] = []
    off: list[float] = []
    rounds = max(1, p["requests"] // 16)
    for r in range(p["requests"]):
        gc_on = r // rounds % 2 == 0
        if not gc_on:
            gc.disable()
        prompt = system + [r * 100_003 + i for i in range(unique)]
        t0 = time.perf_counter()
        m.probe_reuse(None, prompt[:-1])
        kv = _admit(m, prompt)
        (on if gc_on else off).append((time.perf_counter() - t0) * 1e6)
        gc.enable()
        kv.close()
    m.clear_reusable_blocks()
    m.shutdown()
    return {
        "unit": "us/request",
        "samples": on,
        "gc_off_median": statistics.median(off),
        "gc_on_vs_off": statistics.median(on) / statistics.median(off),
        "cached_blocks": p["gc_blocks"],
    }


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


def _redis() -> Any:
    """A private redis-server on a loopback port, or None when no binary is installed."""
    from kv_cache_manager_v2.redis_server import LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        return None
    server = LocalRedisServer()
    server.start()
    return server


def _remote_onboard_once(p: dict[str, int], url: str, size: int, requests: int) -> dict[str, Any]:
    import kv_cache_manager_v2 as kvm

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    gpu_slots = blocks + 8
    remote = kvm.RemoteCacheTierConfig(url, f"bench-{size}", write_through=True, timeout_ms=1000)
    writer = _manager(p["layers"], t, gpu_slots, size=size, remote=remote)
    prefix = list(range(10_000, 10_000 + p["shared"]))
    _admit(writer, prefix + [1]).close()
    assert writer.flush_remote_writes()
    writer.shutdown()
    m = _manager(p["layers"], t, gpu_slots, host_slots=4 * gpu_slots, size=size, remote=remote)
    samples, host_samples = [], []
    for r in range(requests):
        m.clear_reusable_blocks()  # this replica forgets the prefix: only Redis has it
        prompt = prefix + [1_000_000 + r]
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        samples.append((time.perf_counter() - t0) * 1e6)
        assert kv.history_length == p["shared"], kv.history_length
        kv.close()
        filler = m.create_kv_cache()  # the whole GPU: the prefix moves to the host tier
        assert filler.resume() and filler.resize(gpu_slots * t)
        filler.close()
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        host_samples.append((time.perf_counter() - t0) * 1e6)
        assert kv.history_length == p["shared"]
        kv.close()
    st = m.remote_statistics
    m.shutdown()
    us = statistics.median(samples)
    host_us = statistics.median(host_samples)
    return {
        "samples": samples,
        "page_bytes": p["layers"] * 2 * size,
        "blocks_per_request": blocks,
        "remote_blocks_per_s": blocks / (us / 1e6),
        "remote_mb_per_s": blocks * p["layers"] * 2 * size / us,
        "host_onboard_us": host_us,
        "host_blocks_per_s": blocks / (host_us / 1e6),
        "remote_vs_host": us / host_us,
        "fetched_pages": st.fetched_pages if st else 0,
    }


def scenario_remote_onboard(p: dict[str, int]) -> dict[str, Any]:
    """create_kv_cache + resume of a prefix only Redis holds (one lookup + one MGET, placed in the host
    tier, onboarded), vs. the same prefix onboarded from the host tier; small and 64 KiB pages."""
    server = _redis()
    if server is None:
        return {"unit": "us/request", "skipped": "no redis-server binary"}
    try:
        small = _remote_onboard_once(p, server.url, p["onboard_buffer_bytes"], p["onboard_requests"])
        big = _remote_onboard_once(p, server.url, p["remote_big_buffer_bytes"], max(5, p["onboard_requests"] // 4))
    finally:
        server.close()
    big.pop("samples")
    big["us_per_request"] = big["host_onboard_us"] * big["remote_vs_host"]
    small["prefix_tokens"] = p["shared"]
    small["big_pages"] = big
    small["unit"] = "us/request"
    small["note"] = (
        "loopback redis-server on this machine; a fresh local cache per request (clear_reusable_blocks), "
        "so every block comes from Redis; host_onboard_us: the same prefix from the host tier"
    )
    return small


def _touch(m: Any) -> None:
    """Write every GPU slot once, as kernels would have (untouched memory reads as a page fault)."""
    for g in m.pool_group_descs:
        for pool in g.pools:
            n = g.num_slots * pool.slot_bytes
            for off in range(0, n, 1 << 20):
                m.backend.write(pool.base_address + off, b"\x01" * min(1 << 20, n - off))


class _EvictingDecode:
    """Decode steps of GPU + host (+ remote) while every new block evicts: a GPU page moves to the
    host tier, whose oldest page is dropped (written to the remote tier when there is one)."""

    def __init__(self, p: dict[str, int], remote: Any, size: int) -> None:
        t, n_req, steps = p["tokens_per_block"], p["remote_requests"], p["steps"]
        live = n_req * (p["shared"] // t + p["unique"] // t + 2 + steps // t + 1)
        gpu_slots = live + n_req * (steps // t + 1) + 64
        m = self.m = _manager(p["layers"], t, gpu_slots, host_slots=gpu_slots, size=size, remote=remote)
        _touch(m)
        system = list(range(10_000, 10_000 + p["shared"]))
        # staggered lengths: block boundaries (the steps that allocate, evict and write) spread over steps
        self.caches = [_admit(m, system + [r * 100_003 + i for i in range(p["unique"] + r % t)]) for r in range(n_req)]
        r = 0
        while m.get_storage_statistics(0)[0].free or m.get_storage_statistics(1)[0].free:
            r += 1  # reusable pages fill the rest of GPU memory, then push down until the host tier is full
            free = m.get_storage_statistics(0)[0].free or 16
            _admit(m, [7_000_000 + r * 1000 + i for i in range(min(free, 16) * t)]).close()
        m.flush_remote_writes()
        self.step = 0
        self.samples: list[float] = []
        self.total = 0.0

    def run(self, steps: int, gap_us: int) -> None:
        """``steps`` decode steps; ``gap_us``: the model's forward pass after each (a sleep, not timed)."""
        caches = self.caches
        for _ in range(steps):
            t0 = time.perf_counter()
            for kv in caches:
                kv.resize(kv.capacity + 1)
                kv.commit([self.step])
                kv.get_base_page_indices(0)
            dt = time.perf_counter() - t0
            self.total += dt
            self.samples.append(dt / len(caches) * 1e6)
            self.step += 1
            if gap_us:
                time.sleep(gap_us / 1e6)

    def close(self) -> Any:
        for kv in self.caches:
            kv.close()
        self.m.flush_remote_writes()
        st = self.m.remote_statistics
        self.m.shutdown()
        return st


def scenario_remote_decode(p: dict[str, int]) -> dict[str, Any]:
    """The write path's cost on the decode step (GPU + host tiers, every new block evicts): no remote
    tier, a remote tier (host pages dropped are handed to the writer), and write-through; 4 KiB and
    larger pages; with a model step between decode steps and back to back. The three run side by
    side, alternating blocks of 16 steps (each writer drained before a block), so a noisy stretch of
    the machine hits all of them."""
    import kv_cache_manager_v2 as kvm

    server = _redis()
    if server is None:
        return {"unit": "us/request/step", "skipped": "no redis-server binary"}
    out: dict[str, Any] = {"unit": "us/request/step"}
    names = ("none", "remote", "write_through")
    try:
        for size in (64, p["remote_big_buffer_bytes"]):
            for gap in (p["remote_step_gap_us"], 0):
                runs: dict[str, _EvictingDecode] = {}
                for name in names:
                    remote = None
                    if name != "none":
                        remote = kvm.RemoteCacheTierConfig(
                            server.url, f"bench-{name}-{size}-{gap}", write_through=name == "write_through"
                        )
                    runs[name] = _EvictingDecode(p, remote, size)
                block = 16
                for b in range(0, p["steps"], block):
                    order = names[b // block % 3 :] + names[: b // block % 3]
                    for name in order:
                        for other in runs.values():
                            other.m.flush_remote_writes()
                        runs[name].run(min(block, p["steps"] - b), gap)
                n = p["remote_requests"] * p["steps"]
                row: dict[str, Any] = {"page_bytes": p["layers"] * 2 * size, "model_step_us": gap}
                for name, run in runs.items():
                    row[f"{name}_mean_us"] = run.total / n * 1e6
                    row[f"{name}_median_us"] = statistics.median(run.samples)
                    samples = run.samples
                    st = run.close()
                    if st is not None:
                        row[f"{name}_written_pages"] = st.written_pages
                        row[f"{name}_dropped_writes"] = st.dropped_writes
                    if size == 64 and gap and name == "remote":
                        out["samples"] = samples
                base = row["none_mean_us"]
                row["remote_overhead"] = row["remote_mean_us"] / base - 1.0
                row["write_through_overhead"] = row["write_through_mean_us"] / base - 1.0
                label = f"{'small' if size == 64 else 'big'}_pages_{'model_step' if gap else 'back_to_back'}"
                out[label] = row
                if size == 64 and gap:
                    out["remote_overhead"] = row["remote_overhead"]
                    out["write_through_overhead"] = row["write_through_overhead"]
    finally:
        server.close()
    out["note"] = (
        "GPU + host tiers, every new block evicts (GPU -> host, host drops its oldest page); the manager's calls "
        "per request per step (mean); the three configurations alternate blocks of 16 steps; model_step: a "
        "sleep of model_step_us after each step (the forward pass: the writer thread and redis-server work "
        "meanwhile), back_to_back: none (on 2 cores the writer and redis-server then compete for the CPU)"
    )
    return out


def _remote_write_once(p: dict[str, int], url: str, size: int, prompts: int, seed: int) -> dict[str, Any]:
    """Write throughput: ``prompts`` distinct prefixes published with write-through, timed from the
    first publish until the writer has sent everything (flush)."""
    import kv_cache_manager_v2 as kvm

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    remote = kvm.RemoteCacheTierConfig(
        url, f"bench-write-{size}", write_through=True, timeout_ms=2000, max_pending_bytes=256 << 20
    )
    m = _manager(p["layers"], t, blocks + 8, size=size, remote=remote)
    t0 = time.perf_counter()
    for r in range(prompts):
        prefix = [seed * 100_000_000 + r * 100_000 + i for i in range(p["shared"])]
        _admit(m, prefix + [1]).close()  # publishes (write-through); the next prompt evicts it
    assert m.flush_remote_writes(120.0)
    dt = time.perf_counter() - t0
    st = m.remote_statistics
    m.shutdown()
    assert st is not None
    return {
        "pages_per_s": st.written_pages / dt,
        "mb_per_s": st.written_bytes / dt / 1e6,
        "written_pages": st.written_pages,
        "dropped_writes": st.dropped_writes,
        "seconds": dt,
    }


def _redis_py_cluster_fetch(p: dict[str, int], url: str, size: int, rounds: int) -> dict[str, Any]:
    """The same prefix's pages read by our cluster fetch (one MGET per slot group, every master's
    pipelined at once) vs redis-py's ``RedisCluster.mget_nonatomic``; lookups by our lookup vs a
    ``RedisCluster`` pipeline of STRLEN."""
    from redis.cluster import ClusterNode, RedisCluster

    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2._config import cluster_seed_nodes
    from kv_cache_manager_v2._storage._remote._store import RemoteStore

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    remote = kvm.RemoteCacheTierConfig(url, f"bench-rp-{size}", write_through=True, timeout_ms=2000)
    m = _manager(p["layers"], t, blocks + 8, size=size, remote=remote)
    prefix = list(range(20_000, 20_000 + p["shared"]))
    _admit(m, prefix + [1]).close()
    assert m.flush_remote_writes()
    store: RemoteStore = m._remote
    keys = sorted(k for k in _cluster_keys(url) if k.startswith(store.prefix))
    assert len(keys) == blocks, len(keys)
    rc = RedisCluster(startup_nodes=[ClusterNode(h, port) for h, port in cluster_seed_nodes(url)])
    ours_fetch, theirs_fetch, ours_lookup, theirs_lookup = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = store.fetch(keys)
        ours_fetch.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        ref = rc.mget_nonatomic(keys)
        theirs_fetch.append((time.perf_counter() - t0) * 1e6)
        assert got == ref
        t0 = time.perf_counter()
        lengths = store.lookup(keys)
        ours_lookup.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        pipe = rc.pipeline()
        for k in keys:
            pipe.strlen(k)
        ref_lengths = pipe.execute()
        theirs_lookup.append((time.perf_counter() - t0) * 1e6)
        assert lengths == ref_lengths
    rc.close()
    m.shutdown()
    return {
        "keys": len(keys),
        "fetch_us": statistics.median(ours_fetch),
        "redis_py_mget_nonatomic_us": statistics.median(theirs_fetch),
        "lookup_us": statistics.median(ours_lookup),
        "redis_py_pipeline_strlen_us": statistics.median(theirs_lookup),
    }


def _cluster_keys(url: str) -> list[bytes]:
    from kv_cache_manager_v2._config import cluster_seed_nodes
    from kv_cache_manager_v2.redis_server import command

    out: list[bytes] = []
    for _, port in cluster_seed_nodes(url):
        keys = command(port, "KEYS", "kvcm:*")
        assert isinstance(keys, list)
        out.extend(k for k in keys if isinstance(k, bytes))
    return out


def scenario_remote_cluster(p: dict[str, int]) -> dict[str, Any]:
    """One redis-server vs a 3-master Redis Cluster on loopback, same run: onboarding (create_kv_cache +
    resume of a prefix only the remote tier holds) and write throughput (write-through of distinct
    prefixes until flushed), 4 KiB and 64 KiB pages; plus our cluster fetch/lookup vs redis-py's
    RedisCluster on the same keys."""
    from kv_cache_manager_v2.redis_server import LocalRedisCluster, find_redis_server

    if find_redis_server() is None:
        return {"unit": "blocks/s", "samples": [0.0], "note": "no redis-server binary: skipped"}
    server = _redis()
    cluster = LocalRedisCluster(3)
    cluster.start()
    out: dict[str, Any] = {"unit": "blocks/s"}
    try:
        for size in (p["onboard_buffer_bytes"], p["remote_big_buffer_bytes"]):
            page = p["layers"] * 2 * size
            row: dict[str, Any] = {"page_bytes": page}
            requests = (
                p["onboard_requests"] if size == p["onboard_buffer_bytes"] else max(5, p["onboard_requests"] // 4)
            )
            prompts = (
                p["remote_write_prompts"]
                if size == p["onboard_buffer_bytes"]
                else max(4, p["remote_write_prompts"] // 4)
            )
            for name, url in (("server", server.url), ("cluster", cluster.url)):
                on = _remote_onboard_once(p, url, size, requests)
                on.pop("samples")
                row[f"{name}_onboard_blocks_per_s"] = on["remote_blocks_per_s"]
                row[f"{name}_onboard_mb_per_s"] = on["remote_mb_per_s"]
            for rep in range(2):  # alternating, the better of two each
                for name, url in (("server", server.url), ("cluster", cluster.url)):
                    w = _remote_write_once(p, url, size, prompts, 1 + rep * 2 + (name == "cluster"))
                    if w["pages_per_s"] > row.get(f"{name}_write_pages_per_s", 0.0):
                        row[f"{name}_write_pages_per_s"] = w["pages_per_s"]
                        row[f"{name}_write_mb_per_s"] = w["mb_per_s"]
                        row[f"{name}_write_dropped"] = w["dropped_writes"]
            row["cluster_vs_server_onboard"] = row["cluster_onboard_blocks_per_s"] / row["server_onboard_blocks_per_s"]
            row["cluster_vs_server_write"] = row["cluster_write_pages_per_s"] / row["server_write_pages_per_s"]
            out[f"pages_{page}_bytes"] = row
        out["redis_py_cluster"] = _redis_py_cluster_fetch(p, cluster.url, p["onboard_buffer_bytes"], 50)
    finally:
        server.close()
        cluster.close()
    out["samples"] = [out[f"pages_{p['layers'] * 2 * p['onboard_buffer_bytes']}_bytes"]["cluster_onboard_blocks_per_s"]]
    out["note"] = (
        "loopback on this 2-core VM: the cluster's 3 redis-servers share the cores with the client, so "
        "this measures the client's per-node pipelining cost, not a cluster's bandwidth (which scales "
        "with machines); onboarding: blocks of a 1024-token prefix per second (one lookup + one fetch); "
        "write: pages per second from the first publish until flushed"
    )
    return out


def worker(name: str, params: dict[str, int]) -> dict[str, Any]:
    import kv_cache_manager_v2

    fn: Callable[[dict[str, int]], dict[str, Any]] = globals()[f"scenario_{name}"]
    out = fn(params)
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


def prepare_compiled() -> None:
    sys.path.insert(0, ROOT)
    from setup_mypyc import compiled_artifacts

    sources = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(ROOT, "kv_cache_manager_v2"))
        for f in fs
        if f.endswith(".py")
    ]
    arts = compiled_artifacts()
    if not arts or max(map(os.path.getmtime, sources)) > max(map(os.path.getmtime, arts)):
        print("building production mode (mypyc)...", flush=True)
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
    the CPU's SHA extensions under valgrind, so hashing weighs more than in wall time)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
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
    if "fast" in args.modes:
        prepare_fast()
    if "compiled" in args.modes:
        prepare_compiled()
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


def write_results(path: str, params: dict[str, Any], results: list[dict[str, Any]], **extra: Any) -> None:
    """The JSON every benchmark script writes: its parameters, this machine, the results, a time stamp."""
    machine = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
    }
    doc = {"params": params, "machine": machine, "results": results, **extra}
    doc["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
