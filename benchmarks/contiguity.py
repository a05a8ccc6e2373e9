"""Pages per copy run for a 100-block offload and onboard in a steady-state fragmented pool, and
host -> host offload bandwidth against a plain memcpy of the same bytes.

    python benchmarks/contiguity.py            # JSON to benchmarks/contiguity_results.json
    python benchmarks/contiguity.py --quick
    python benchmarks/contiguity.py --quick --only free --requests 3000 --trials 10   # a longer mix

A long random mix of requests (shared prefixes, prompts of 8-96 blocks, up to 16 running, one
block of decode per step up to 8 each, some suspended and resumed later) runs on a GPU pool and a
host tier, in two regimes: ``cached`` (every block committed: the tiers fill with reusable pages
and every allocation evicts, so new pages take exactly the victims' slots) and ``free`` (nothing
committed: a closed request frees its slots and the free space is what the mix left). Then a
100-block request (a 96-block prompt and 4 blocks of decode while the others keep decoding) is
suspended, its pages go down to the host tier through the eviction cascade's own path
(``_place``: room made there, targets allocated, one batch of copies), and come back with
``resume``. The copy engine's ``num_runs`` counts the copies issued (one per run of consecutive
slots per pool): pages per run is pages x pools / copies (1 = nothing merged). The host backend
stands in for the GPU (both tiers in host memory), so the offload is a host -> host copy; it is
timed again on the same slot pairs, alternating with one plain memcpy (``ctypes.memmove``) of as many
bytes: the best of ``bandwidth_reps`` repetitions of each, and the spread of the per-repetition
ratios (10th, 50th, 90th percentile).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import write_results

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2._common import CacheLevel, PoolGroupIndex

DEFAULTS = {
    "layers": 8,
    "buffer_bytes": 4096,  # per layer, key and value: 64 KiB slots
    "tokens_per_block": 16,
    "gpu_slots": 2048,
    "host_slots": 4096,
    "requests": 1500,
    "running": 16,
    "min_prompt_blocks": 8,
    "max_prompt_blocks": 96,
    "max_decode_blocks": 8,
    "trial_prompt_blocks": 96,
    "trials": 5,
    "seed": 1,
    "bandwidth_reps": 60,
}
QUICK = {**DEFAULTS, "gpu_slots": 1024, "host_slots": 2048, "requests": 400, "trials": 2}
BLOCKS = 100


def make_manager(p: dict[str, int]) -> Any:
    layers = [
        kvm.AttentionLayerConfig(
            kvm.LayerId(i), [kvm.BufferConfig("key", p["buffer_bytes"]), kvm.BufferConfig("value", p["buffer_bytes"])]
        )
        for i in range(p["layers"])
    ]
    slot = p["layers"] * 2 * p["buffer_bytes"]
    tiers = [kvm.GpuCacheTierConfig(p["gpu_slots"] * slot), kvm.HostCacheTierConfig(p["host_slots"] * slot)]
    cfg = kvm.KVCacheManagerConfig(p["tokens_per_block"], tiers, layers, backend="host", max_util_for_resume=1.0)
    return kvm.KVCacheManager(cfg)


class Mix:
    """The random mix: requests admitted, decoded, suspended, resumed and closed."""

    def __init__(self, m: Any, p: dict[str, int], rng: random.Random) -> None:
        self.m, self.p, self.rng = m, p, rng
        self.t = p["tokens_per_block"]
        self.running: list[tuple[Any, list[int], int]] = []  # cache, tokens, decode blocks left
        self.suspended: list[tuple[Any, list[int], int]] = []
        self.serial = 0
        self.reuse = p["reuse"]

    def tokens(self, blocks: int) -> list[int]:
        self.serial += 1
        return [self.serial * 10_000 + i for i in range(blocks * self.t + self.rng.randrange(self.t))]

    def admit(self, toks: list[int]) -> Any:
        kv = self.m.create_kv_cache(None, toks if self.reuse else None)
        if not kv.resume() or not kv.resize(len(toks) + 1, kv.history_length):
            kv.close()
            return None
        self.commit(kv, toks[kv.history_length :])
        return kv

    def commit(self, kv: Any, toks: list[int]) -> None:
        """Commit (the blocks become reusable at close), or not: the slots are freed at close."""
        if self.reuse:
            kv.commit(toks)

    def step(self) -> None:
        """One scheduler step: admit up to ``running``, one block of decode each, finish some."""
        rng, t = self.rng, self.t
        if self.suspended and rng.random() < 0.2:
            kv, toks, left = self.suspended.pop(0)
            if kv.resume():
                self.running.append((kv, toks, left))
            else:
                self.suspended.append((kv, toks, left))
        while len(self.running) < self.p["running"]:
            prefix = [3_000_000_000 + k * 1000 + i for k in [rng.randrange(20)] for i in range(rng.randrange(9) * t)]
            toks = prefix + self.tokens(rng.randint(self.p["min_prompt_blocks"], self.p["max_prompt_blocks"]))
            kv = self.admit(toks)
            if kv is None:
                break
            self.running.append((kv, toks, rng.randint(0, self.p["max_decode_blocks"])))
        kept = []
        for kv, toks, left in self.running:
            if left <= 0:
                kv.close()
                continue
            grow = [toks[-1] + 1 + i for i in range(t)]
            if not kv.resize(len(toks) + t + 1, kv.history_length):
                kv.close()  # no room: it finishes early
                continue
            self.commit(kv, grow)
            toks.extend(grow)
            if rng.random() < 0.02 and len(self.suspended) < 4:
                kv.suspend()
                self.suspended.append((kv, toks, left - 1))
            else:
                kept.append((kv, toks, left - 1))
        self.running = kept

    def close_all(self) -> None:
        for kv, _, _ in self.running + self.suspended:
            kv.close()
        self.running, self.suspended = [], []


def runs_of(slots: list[int]) -> int:
    s = sorted(slots)
    return sum(1 for i, x in enumerate(s) if i == 0 or x != s[i - 1] + 1)


def bandwidth(copy: Callable[[], object], nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    """GB/s of ``copy`` (``nbytes`` moved) and of one plain memcpy of as many bytes, ``reps``
    times each, alternating which goes first (a noisy stretch hits both, neither always goes second)."""
    import numpy as np

    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    src, dst = a.ctypes.data, b.ctypes.data
    ours, plain = [], []
    for k in range(reps):
        for which in (0, 1) if k % 2 else (1, 0):
            t0 = time.perf_counter()
            if which:
                copy()
            else:
                ctypes.memmove(dst, src, nbytes)  # one libc memcpy of every byte
            (ours if which else plain).append(nbytes / (time.perf_counter() - t0) / 1e9)
    return ours, plain


def spread(ratios: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ratios, n=10)
    return {"ratio_p10": q[0], "ratio_p50": statistics.median(ratios), "ratio_p90": q[-1]}


def trial(m: Any, mix: Mix) -> dict[str, Any]:
    """One 100-block request among the mix: offload it and onboard it again, counting copies."""
    reps = mix.p["bandwidth_reps"]
    t = mix.t
    toks = mix.tokens(mix.p["trial_prompt_blocks"])
    kv = mix.admit(toks)
    while kv is None:  # no room while the others hold it: the oldest finish first
        assert mix.running, "the 100-block request does not fit in the GPU tier"
        mix.running.pop(0)[0].close()
        kv = mix.admit(toks)
    prompt_slots = [p.slot for p in kv.block_table.pages[0] if p is not None]
    for _ in range(BLOCKS - mix.p["trial_prompt_blocks"]):
        mix.step()  # the others decode meanwhile
        grow = [toks[-1] + 1 + i for i in range(t)]
        while not kv.resize(len(toks) + t + 1, kv.history_length):
            assert mix.running, "the 100-block request does not fit in the GPU tier"
            mix.running.pop(0)[0].close()  # no room: the oldest finishes first
        mix.commit(kv, grow)
        toks.extend(grow)
    pages = [p for p in kv.block_table.pages[0] if p is not None][:BLOCKS]
    kv.suspend()
    storage = m._storage
    gpu = storage.levels[0][0]
    pools = len(gpu.pools)
    gpu_slots = [p.slot for p in pages]
    for p in pages:
        gpu.evictor.remove(p)
    copier = storage.copier
    before = copier.num_runs
    storage._place(pages[::-1], CacheLevel(1), PoolGroupIndex(0))  # eviction order: last block first
    offload_runs = copier.num_runs - before
    assert all(p.level == 1 for p in pages)
    host_slots = [p.slot for p in pages]
    host = storage.levels[1][0]
    pairs = list(zip(gpu_slots, host_slots))
    nbytes = BLOCKS * sum(gpu.layout.slot_sizes)
    ours, plain = bandwidth(lambda: copier.copy(gpu.pools, host.pools, gpu.layout.slot_sizes, pairs), nbytes, reps)
    before = copier.num_runs
    while not kv.resume():
        assert mix.running, "the 100-block request does not fit in the GPU tier"
        mix.running.pop(0)[0].close()
        before = copier.num_runs
    onboard_runs = copier.num_runs - before
    out = {
        "gpu_slot_runs": runs_of(gpu_slots),
        # of those: the prompt's (allocated at once, from the free runs there were) and the later
        # blocks (one at a time) that did not land right after the request's previous block
        "prompt_slot_runs": runs_of(prompt_slots),
        "decode_new_runs": sum(
            1 for a, b in zip(gpu_slots[len(prompt_slots) - 1 :], gpu_slots[len(prompt_slots) :]) if b != a + 1
        ),
        "host_slot_runs": runs_of(host_slots),
        "offload_copies": offload_runs,
        "offload_pages_per_run": BLOCKS * pools / offload_runs,
        "onboard_copies": onboard_runs,
        "onboard_pages_per_run": BLOCKS * pools / onboard_runs,
        # best of the repetitions: on a loaded machine the fastest run is the one least disturbed
        "offload_gb_per_s": max(ours),
        "memcpy_gb_per_s": max(plain),
        "offload_vs_memcpy": max(ours) / max(plain),
        # the spread: each repetition's ratio (ours / the memcpy right next to it), 10th / 50th / 90th percentile
        **spread([o / q for o, q in zip(ours, plain)]),
        "bytes": nbytes,
    }
    kv.close()
    return out


def regime(p: dict[str, int]) -> dict[str, Any]:
    """The mix, then ``trials`` 100-block requests offloaded and onboarded (50 steps apart)."""
    m = make_manager(p)
    mix = Mix(m, p, random.Random(p["seed"]))
    t0 = time.perf_counter()
    while mix.serial < p["requests"]:
        mix.step()
    warm_s = time.perf_counter() - t0
    trials = []
    for _ in range(p["trials"]):
        trials.append(trial(m, mix))
        for _ in range(50):
            mix.step()
    mix.close_all()
    m.shutdown()
    keys = [k for k in trials[0] if k != "bytes"]
    mean = {k: statistics.mean(float(x[k]) for x in trials) for k in keys}
    return {"mean": mean, "trials": trials, "warm_up_s": warm_s}


REGIMES = {
    "cached": "every block committed: the tiers fill with reusable pages and every allocation evicts",
    "free": "nothing committed: closed requests free their slots, the free space is what the mix left",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "contiguity_results.json")
    )
    ap.add_argument("--label", default="", help="a note stored with the results (e.g. the commit measured)")
    ap.add_argument("--requests", type=int, help="requests in the mix before the trials (a longer mix: more)")
    ap.add_argument("--trials", type=int, help="100-block requests offloaded and onboarded")
    ap.add_argument("--seed", type=int, help="the mix's random seed")
    ap.add_argument("--only", choices=sorted(REGIMES), help="one regime")
    args = ap.parse_args()
    p = dict(QUICK if args.quick else DEFAULTS)
    p.update({k: v for k in ("requests", "trials", "seed") if (v := getattr(args, k)) is not None})
    results = []
    for name, note in REGIMES.items():
        if args.only and name != args.only:
            continue
        r = regime({**p, "reuse": int(name == "cached")})
        results.append({"scenario": name, "note": note, **r})
        print(name)
        for k, v in r["mean"].items():
            print(f"  {k:24} {v:10.2f}")
    write_results(args.out, p, results, label=args.label, compiled=kvm.compiled)


if __name__ == "__main__":
    main()
