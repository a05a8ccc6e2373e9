"""A seeded random walk over background loads and write admission together: prefetches (by
tokens, a suspended cache's, the prefetch directive), cancels, suspends, resumes, closes,
demotions, retention, tier resizes, disk errors and loads landing in random order, on a tiny host
and a slow disk link whose writes are declined beyond a 30 ms backlog, the clock moving. Every
step keeps the invariants; every resume and every reuse reads exact KV data (the fake engine);
every page declined is one dropped."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import Clock, kv_layers, shut_down
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, loader, seq

from kv_cache_manager_v2 import (
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    Prefetch,
)

HOST, DISK = CacheLevel(1), CacheLevel(2)


def manager(backend: str, path: str, clock: Clock) -> KVCacheManager:
    """GPU 6 slots, host 2, disk 16 (25 ms a page written, 30 ms backlog bound); loads landing
    when the walk says."""
    config = KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[
            GpuCacheTierConfig(6 * SLOT),
            HostCacheTierConfig(2 * SLOT, write_bytes_per_s=SLOT * 1000.0),
            DiskCacheTierConfig(16 * SLOT, path, read_bytes_per_s=SLOT * 100.0, write_bytes_per_s=SLOT * 40.0),
        ],
        layers=kv_layers(2, T),
        backend=backend,  # type: ignore[arg-type]
        refine_tier_costs=False,
        max_util_for_resume=1.0,
        max_write_backlog_s=0.030,
        clock=clock,
    )
    m = KVCacheManager(config)
    loader(m).manual = True
    return m


class Walk:
    """The walk's state: the manager, its suspended caches (with their tokens) and prefetches."""

    def __init__(self, m: KVCacheManager, rng: random.Random, clock: Clock) -> None:
        self.m = m
        self.rng = rng
        self.clock = clock
        self.engine = FakeEngine(m)
        self.suspended: list[tuple[KVCache, list[int]]] = []
        self.prefetches: list[Prefetch] = []

    def doc(self) -> list[int]:
        """Tokens sharing prefixes with others: one of 4 sequences, 1 to 3 blocks and a bit."""
        rng = self.rng
        return seq(rng.randrange(4), rng.randrange(1, 4) * T + rng.randrange(T))

    def serve(self, toks: list[int]) -> KVCache | None:
        """A new request for ``toks``: resumed, its reused prefix checked, computed; None when
        the GPU has no room (closed)."""
        kv = self.m.create_kv_cache(None, toks)
        if not kv.resume():
            kv.close()
            return None
        self.engine.check_all(kv, toks, kv.history_length)
        if not kv.resize(len(toks)):
            kv.close()
            return None
        compute(self.engine, kv, toks, len(toks))
        return kv

    def step(self) -> str:
        rng, m = self.rng, self.m
        op = rng.choice(
            ["publish", "suspend", "resume", "close", "kv_prefetch", "cancel", "prefetch", "drop_prefetch",
             "directive", "demote", "land", "clock", "retain", "resize", "errors"]
        )  # fmt: skip
        if op == "publish":
            kv = self.serve(self.doc())
            if kv is not None:
                kv.close()
        elif op == "suspend" and len(self.suspended) < 3:
            toks = self.doc()
            kv = self.serve(toks)
            if kv is not None:
                kv.suspend()
                self.suspended.append((kv, toks))
        elif op in ("resume", "close", "kv_prefetch", "cancel") and self.suspended:
            k = rng.randrange(len(self.suspended))
            kv, toks = self.suspended[k]
            if op == "resume":
                if kv.resume():
                    self.engine.check_all(kv, toks, kv.history_length)
                    if kv.resize(len(toks)):
                        compute(self.engine, kv, toks, len(toks))
                    kv.suspend()
            elif op == "close":
                del self.suspended[k]
                kv.close()
            elif op == "kv_prefetch":
                kv.prefetch(CacheLevel(rng.randrange(2)))
            else:
                kv.cancel_prefetch()
        elif op == "prefetch":
            self.prefetches.append(m.prefetch(self.doc(), CacheLevel(rng.randrange(2))))
        elif op == "drop_prefetch" and self.prefetches:
            self.prefetches.pop(rng.randrange(len(self.prefetches))).cancel()
        elif op == "directive":
            m.directives.prefetch(self.doc(), HOST)
        elif op == "demote":
            m.directives.demote(self.doc(), rng.choice([HOST, DISK]))
        elif op == "land":
            q = loader(m)
            for _ in range(rng.randrange(1, 4)):
                if q.queued:
                    q.run_queued(rng.randrange(len(q.queued)))
            m.poll_loads()
        elif op == "retain":
            m.directives.retain(self.doc(), rng.choice([20, 80]), rng.choice([None, 0.02, 0.1]))
        elif op == "resize":
            if rng.random() < 0.5:
                m.resize(HOST, rng.choice([1, 2, 4, 8]) * SLOT)
            else:
                m.resize(DISK, rng.choice([2, 4, 16]) * SLOT)
        elif op == "errors":  # the disk fails a third of its reads and writes from now, or no more
            disk = m._storage.levels.items[DISK].items[0].pools[0]
            failing = random.Random(rng.random())
            disk.error_hook = (lambda op, offset, n: failing.random() < 0.3) if disk.error_hook is None else None  # type: ignore[attr-defined]
        elif op == "clock":
            self.clock.now += rng.choice([0.001, 0.01, 0.05])
            if rng.random() < 0.3:
                m.set_tier_wait(2, rng.choice([0.0, 0.02, 0.1]))
        return op

    def finish(self) -> None:
        """Land everything, resume and check every suspended cache, close it."""
        self.m._storage.levels.items[DISK].items[0].pools[0].error_hook = None  # type: ignore[attr-defined]
        q = loader(self.m)
        while q.queued:
            q.run_queued(0)
        self.m.poll_loads()
        for kv, toks in self.suspended:
            if kv.resume():
                self.engine.check_all(kv, toks, kv.history_length)
            kv.close()
        self.suspended = []
        self.m.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_a_random_walk_of_background_loads_under_write_admission(backend: str, tmp_path: Any, seed: int) -> None:
    clock = Clock()
    m = manager(backend, str(tmp_path), clock)
    try:
        walk = Walk(m, random.Random(seed), clock)
        ops: list[str] = []
        before = (0, 0)
        for _ in range(250):
            ops.append(walk.step())
            m.check_invariants()
            stats = [m.get_tier_statistics(CacheLevel(level)) for level in range(3)]
            now = (sum(t.declined_pages for t in stats), sum(t.dropped_pages for t in stats))
            assert now[0] - before[0] <= now[1] - before[1], ops[-1]  # a declined page is a dropped one
            assert all(t.declined_bytes == t.declined_pages * SLOT for t in stats)
            before = now
        walk.finish()
        declined = m.get_tier_statistics(DISK).declined_pages + m.get_tier_statistics(HOST).declined_pages
        assert declined > 0 and m._ctx.reads is not None and m._ctx.reads.num_installed > 0, ops[-20:]
    finally:
        shut_down([m])
