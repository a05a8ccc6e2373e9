"""Issue #50: how fast the router's index ingests events and answers a route.

    .venv/bin/python benchmarks/router_index.py [--quick] [--out FILE]

* ``ingest``: block events per second through ``ReplicaIndex.apply_event`` (``BlockStored`` runs of
  16 blocks, a 256-token prefill chunk; ``ingest_2048_token_chunks``: of 128 blocks; then
  ``BlockRemoved`` of the same blocks), from
  decoded wire events, and from the encoded batch through ``decode_event`` (what ``poll`` does);
* ``route``: ``PrefixRouter.route`` (policy ``prefix+load``, a load per replica) of a 10,000-token
  prompt over 16 replicas, each holding 2,000 other blocks and a prefix of the prompt of its own
  length: per route p50/p99 in microseconds, the prompt's hashing included (``p50_us``, ``p99_us``);
  the lookup alone, from the prompt's hashes (``lookup_*``: every replica's match and the pick); the
  hashing alone (``hashing_*``).

Run it once per mode: the index core is compiled with the package (``KVCM_EXPECT_COMPILED``
tells); the JSON records which mode ran (``mode``) and merges into ``--out`` by mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from typing import Any

import msgspec

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2._common import DEFAULT_REUSE_SCOPE
from kv_cache_manager_v2._events import block_hash
from kv_cache_manager_v2._reuse._keys import scope_key
from kv_cache_manager_v2._routing import ReplicaLoad
from kv_cache_manager_v2.events import BlockRemoved, BlockStored, PrefixRouter, ReplicaIndex, prompt_block_hashes
from kv_cache_manager_v2.events.schema import decode_event

HERE = os.path.dirname(os.path.abspath(__file__))
T = 16
RUN = 16  # blocks per BlockStored (a 256-token prefill chunk)


def _runs(n_runs: int, seed: int, run: int = RUN) -> list[BlockStored]:
    """``n_runs`` independent runs of ``run`` blocks (each a new prompt's first blocks)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_runs):
        toks = [rng.randrange(1 << 31) for _ in range(run * T)]
        hashes = prompt_block_hashes(toks, T)
        out.append(BlockStored(hashes, None, toks, T, None, "GPU", scope_hash=ROOT))
    return out


def bench_ingest(n_runs: int, run: int = RUN) -> dict[str, Any]:
    stored = _runs(n_runs, 1, run)
    removed = [BlockRemoved(ev.block_hashes, "GPU") for ev in stored]
    raw_stored = [msgspec.Raw(msgspec.msgpack.encode(ev)) for ev in stored]
    raw_removed = [msgspec.Raw(msgspec.msgpack.encode(ev)) for ev in removed]
    blocks = n_runs * run
    out: dict[str, Any] = {"blocks_per_event": run, "events": 2 * n_runs, "block_events": 2 * blocks}
    best = float("inf")
    for _ in range(3):
        idx = ReplicaIndex(T)
        t0 = time.perf_counter()
        for ev in stored:
            idx.apply_event(ev)
        for ev2 in removed:
            idx.apply_event(ev2)
        best = min(best, time.perf_counter() - t0)
        assert idx.num_blocks == 0
    out["decoded_block_events_per_s"] = 2 * blocks / best
    best = float("inf")
    for _ in range(3):
        idx = ReplicaIndex(T)
        t0 = time.perf_counter()
        for raw in raw_stored:
            idx.apply_event(decode_event(raw))
        for raw in raw_removed:
            idx.apply_event(decode_event(raw))
        best = min(best, time.perf_counter() - t0)
    out["raw_block_events_per_s"] = 2 * blocks / best
    return out


def bench_route(routes: int, replicas: int = 16, prompt_tokens: int = 10_000) -> dict[str, Any]:
    rng = random.Random(2)
    prompt = [rng.randrange(1 << 31) for _ in range(prompt_tokens)]
    hashes = prompt_block_hashes(prompt, T)
    n_full = prompt_tokens // T
    indexes = []
    for r in range(replicas):
        idx = ReplicaIndex(T)
        for ev in _runs(2000 // RUN, 100 + r):
            idx.apply_event(ev)
        depth = n_full * r // replicas  # replica r holds r/16 of the prompt's blocks
        if depth:
            idx.apply_event(BlockStored(hashes[:depth], None, prompt[: depth * T], T, None, "GPU", scope_hash=ROOT))
        indexes.append(idx)
    router = PrefixRouter(indexes)
    loads = [ReplicaLoad(1000 * r, r, 0.5) for r in range(replicas)]
    times = []
    hash_times = []
    lookup_times = []
    picker = router.picker
    w = router.weights
    usable = [True] * replicas
    for _ in range(routes):
        t0 = time.perf_counter()
        media = [idx.match_media(prompt, None, hashes) for idx in indexes]
        picker.pick([w.value(m) for m in media], loads, usable)
        lookup_times.append(time.perf_counter() - t0)
    for _ in range(routes):
        t0 = time.perf_counter()
        d = router.route(prompt, None, loads)
        t1 = time.perf_counter()
        prompt_block_hashes(prompt, T)
        t2 = time.perf_counter()
        times.append(t1 - t0)
        hash_times.append(t2 - t1)
    assert d.scores[-1] == n_full * (replicas - 1) // replicas * T
    times.sort()
    hash_times.sort()
    lookup_times.sort()

    def us(xs: list[float], p: int) -> float:
        return xs[-(-p * len(xs) // 100) - 1] * 1e6

    return {
        "replicas": replicas,
        "prompt_tokens": prompt_tokens,
        "tokens_per_block": T,
        "routes": routes,
        "p50_us": us(times, 50),
        "p99_us": us(times, 99),
        "lookup_p50_us": us(lookup_times, 50),
        "lookup_p99_us": us(lookup_times, 99),
        "hashing_p50_us": us(hash_times, 50),
        "hashing_p99_us": us(hash_times, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "router_index_results.json"))
    a = ap.parse_args()
    mode = "compiled" if kvm.compiled else "interpreted"
    res = {
        "ingest": bench_ingest(2000 if a.quick else 20_000),
        "ingest_2048_token_chunks": bench_ingest(250 if a.quick else 2500, 128),
        "route": bench_route(200 if a.quick else 2000),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    doc: dict[str, Any] = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc[mode] = res
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(json.dumps({mode: res}, indent=1))


ROOT = block_hash(scope_key(DEFAULT_REUSE_SCOPE))

if __name__ == "__main__":
    main()
