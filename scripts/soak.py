"""Soak test (not in CI): random request layer groups on small memory for a long time, with the
fake engine checking every KV record and the invariant checker after every operation.

    .venv/bin/python scripts/soak.py --steps 200000            # both layer mixes, prints ops/s and RSS
    .venv/bin/python scripts/soak.py --steps 20000 --seed 3 --check-every 10
    .venv/bin/python scripts/soak.py --host-slots 1 --disk-slots 48   # a host tier smaller than one request, then disk

Operations: create (shared prefixes, salts, priorities, scratch on/off), resume, prefill chunks
and decode steps (with lazily committed tokens), suspend, stop_committing, close; memory is
tight, so eviction, failed resizes and failed resumes happen all the time. RSS is sampled to
catch leaks; any mismatch raises with the seed and step.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import kv_layers, make_config  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402

import kv_cache_manager_v2 as kvm  # noqa: E402
from kv_cache_manager_v2 import KVCache, KVCacheManager, KVCacheStatus, Priority, ReuseScope  # noqa: E402

T = 4


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def manager(mix: str, host_slots: int, disk_slots: int, disk_path: str) -> KVCacheManager:
    """``host_slots`` / ``disk_slots``: lower tiers of that many slots of every pool group (0: none)."""
    num_layers = 3 if mix == "full+swa" else 5
    slot = num_layers * 2 * 32 * T  # one slot of every pool group
    tiers: dict[str, object] = {"max_util_for_resume": 1.0} if host_slots or disk_slots else {}
    if host_slots:
        tiers["host_quota"] = host_slots * slot
    if disk_slots:
        tiers.update(disk_quota=disk_slots * slot, disk_path=disk_path)
    if mix == "full+swa":
        layers = kv_layers(3, T, window=9, swa_every=3, sink_tokens=2)
        return KVCacheManager(
            make_config(layers, tokens_per_block=T, quota=slot * 24, initial_pool_ratio=[0.4, 0.6], **tiers)
        )
    layers = kv_layers(5, T, window=6, swa_every=2, sink_tokens=2)
    return KVCacheManager(
        make_config(
            layers,
            tokens_per_block=T,
            quota=slot * 24,
            swa_scratch_reuse=kvm.SwaScratchReuseConfig(1),
            initial_pool_ratio=[0.5, 0.5],
            **tiers,
        )
    )


def soak(mix: str, steps: int, seed: int, check_every: int, host_slots: int = 0, disk_slots: int = 0) -> None:
    rng = random.Random(seed)
    disk_path = tempfile.mkdtemp(prefix="kvcm-soak-")
    m = manager(mix, host_slots, disk_slots, disk_path)
    engine = FakeEngine(m)
    engine.check_invariants = False  # checked below, every ``check_every`` operations
    prefixes = [[p * 1000 + i for i in range(40)] for p in range(4)]
    caches: list[tuple[KVCache, list[int]]] = []
    computed: dict[int, int] = {}
    t0 = time.perf_counter()
    rss0 = rss_mib()
    counts = {"ok": 0, "refused": 0}
    for step in range(steps):
        op = rng.random()
        active = [c for c in caches if c[0].status is KVCacheStatus.ACTIVE]
        suspended = [c for c in caches if c[0].status is KVCacheStatus.SUSPENDED]
        if op < 0.15 and len(caches) < 8:
            seq = prefixes[rng.randrange(4)][: rng.randrange(41)] + [
                rng.randrange(1 << 30) for _ in range(rng.randrange(1, 60))
            ]
            prio = rng.randrange(101)
            kv = m.create_kv_cache(
                ReuseScope(salt=rng.choice([None, 1])),
                seq[:-1],
                custom_priority_callback=lambda o, lc, p=prio: Priority(p),
            )
            if kv.enable_swa_scratch_reuse:
                kv.enable_swa_scratch_reuse = rng.random() < 0.5
            caches.append((kv, seq))
        elif op < 0.3 and suspended:
            kv, seq = rng.choice(suspended)
            if kv.resume():
                engine.check_all(kv, seq, kv.history_length)
            else:
                counts["refused"] += 1
        elif op < 0.8 and active:
            kv, seq = rng.choice(active)
            h = max(kv.history_length, computed.get(id(kv), 0))
            end = min(len(seq), h + (rng.randrange(1, 24) if rng.random() < 0.3 else 1))
            if end > h:
                if not kv.resize(end, h):
                    counts["refused"] += 1
                    continue
                kv.commit(seq[kv.num_committed_tokens : h])
                engine.step(kv, seq, h, end)
                if rng.random() < 0.3:
                    computed[id(kv)] = end
                else:
                    kv.commit(seq[h:end])
                    computed.pop(id(kv), None)
        elif op < 0.9 and active:
            kv, seq = rng.choice(active)
            kv.commit(seq[kv.num_committed_tokens : computed.pop(id(kv), 0)])
            kv.suspend()
        elif caches:
            kv, _ = caches.pop(rng.randrange(len(caches)))
            computed.pop(id(kv), None)
            if rng.random() < 0.3 and kv.status is not KVCacheStatus.CLOSED:
                kv.stop_committing()
            kv.close()
        counts["ok"] += 1
        if step % check_every == 0:
            m.check_invariants()
    for kv, _ in caches:
        kv.close()
    m.clear_reusable_blocks()
    m.check_invariants()
    assert all(s.free == s.total for s in m.get_storage_statistics())
    dt = time.perf_counter() - t0
    tiers = ""
    for level in range(1, len(m.cache_tier_list)):
        st = m.get_tier_statistics(kvm.CacheLevel(level))
        tiers += (
            f"; {st.tier.name} offloaded {st.offloaded_pages:,} onboarded {st.onboarded_pages:,} "
            f"dropped {st.dropped_pages:,}"
        )
    if tiers:
        tiers += f"; GPU dropped {m.get_tier_statistics(kvm.CacheLevel(0)).dropped_pages:,}"
    m.shutdown()
    shutil.rmtree(disk_path, ignore_errors=True)
    print(
        f"{mix:9s} compiled={kvm.compiled} seed={seed}: {steps} operations in {dt:.1f} s = {steps / dt:,.0f} ops/s; "
        f"{engine.records_written:,} records written, {engine.pages_checked:,} checked; resizes/resumes refused "
        f"{counts['refused']:,}; RSS {rss0:.0f} -> {rss_mib():.0f} MiB{tiers}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=1, help="run the invariant checker every N operations")
    ap.add_argument("--mix", choices=["full+swa", "scratch", "both"], default="both")
    ap.add_argument("--host-slots", type=int, default=0, help="a host tier of N slots of every pool group")
    ap.add_argument("--disk-slots", type=int, default=0, help="a disk tier of N slots of every pool group")
    args = ap.parse_args()
    for mix in ["full+swa", "scratch"] if args.mix == "both" else [args.mix]:
        soak(mix, args.steps, args.seed, args.check_every, args.host_slots, args.disk_slots)


if __name__ == "__main__":
    main()
