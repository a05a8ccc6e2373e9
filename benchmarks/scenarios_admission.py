"""Admission scenarios of ``benchmarks/run.py``: admission (probe, create, resume, resize, commit)
in its variants, admission with many cached conversations or the cyclic GC on, warm rematch,
close, and the reuse keys' hashing."""

from __future__ import annotations

import hashlib
import statistics
import time
from array import array
from typing import Any

from bench_common import (
    _admit,
    _commit_prompt,
    _hybrid_sizing,
    _manager,
    _wire_us_per_event,
)


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
        # new lists each round (as at admission, without the last token): the manager knows the
        # tokens only from its earlier probes of equal ones (their keys and walk are kept)
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
        "first_probe_median": statistics.median(samples[:n_req]),
        "later_probes_median": statistics.median(samples[n_req:]) if len(samples) > n_req else None,
        "matched_tokens_per_probe": matched / len(samples),
        "probe_tokens": prompt_len - 1,
        "note": f"probe_reuse of a cached prompt (first probe, then probes of equal tokens); {kinds[window_every]}",
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
