"""What the scenarios of ``benchmarks/run.py`` (and the other benchmark scripts) share: a
benchmark manager, admission with the prefill commit, the trace. Imported in the worker process,
so ``kv_cache_manager_v2`` (fast copy or compiled) is imported inside the functions."""

from __future__ import annotations

import json
import os
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the project's shared Mooncake trace when it is beside the repository (the figures in README.md
#: come from it), else the repository's own multi-turn trace (scripts/make_trace.py)
SHARED_TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
REPO_TRACE = os.path.join(ROOT, "traces", "multi_turn.jsonl")
TRACE = SHARED_TRACE if os.path.exists(SHARED_TRACE) else REPO_TRACE
TRACE_NAME = "shared/traces/synthetic_trace.jsonl" if TRACE == SHARED_TRACE else "traces/multi_turn.jsonl"
#: config fields every benchmark manager gets (``eviction_cost.py`` sets ``eviction_policy``)
MANAGER_CONFIG: dict[str, Any] = {}


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
    cfg = kvm.KVCacheManagerConfig(tokens_per_block, tiers, layers, backend="host", **{**MANAGER_CONFIG, **kw})
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


def _trace(limit: int, path: str = TRACE) -> list[dict[str, Any]]:
    """The requests of the trace at ``path`` (the first ``limit``; all of them when 0)."""
    reqs = []
    with open(path) as f:
        for line in f:
            reqs.append(json.loads(line))
            if limit and len(reqs) >= limit:
                break
    return reqs


def _trace_prompt(r: dict[str, Any]) -> list[int]:
    """A trace request's prompt: 512 tokens per hash id (equal ids, equal tokens), cut to its length."""
    return [h * 512 + i for h in r["hash_ids"] for i in range(512)][: r["input_length"]]


def callgrind_inclusive(path: str, names: set[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Calls and inclusive instructions of the functions ``names`` in a callgrind output file: the
    costs of the calls to them (the line after each ``calls=`` line), summed over their call sites."""
    ids: dict[str, str] = {}  # compressed "(n)" -> name
    calls = dict.fromkeys(names, 0)
    cost = dict.fromkeys(names, 0)
    target = None
    count = 0
    after_calls = False
    with open(path) as f:
        for line in f:
            if after_calls:
                if target in cost:
                    calls[target] += count
                    cost[target] += int(line.split()[1])
                after_calls = False
            elif line.startswith(("cfn=", "fn=")):
                ref, _, name = line.split("=", 1)[1].strip().partition(" ")
                if name:
                    ids[ref] = name
                if line.startswith("cfn="):
                    target = ids.get(ref, ref)
            elif line.startswith("calls="):
                count = int(line[6:].split()[0])
                after_calls = True
    return calls, cost
