"""Object lifetime: tree nodes and pages are invisible to the cyclic GC, so the manager must break
their cycles itself (shutdown, or a manager dropped without it) and nothing may leak."""

from __future__ import annotations

import gc
import random
import sys
from array import array

import pytest
from conftest import kv_layers, make_config

from kv_cache_manager_v2 import KVCache, KVCacheManager

GIB = 1 << 30


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _workload(m: KVCacheManager, rng: random.Random, steps: int = 60) -> list[KVCache]:
    """Prompts sharing prefixes, decode, suspend/resume, eviction; returns caches left open."""
    open_caches: list[KVCache] = []
    for i in range(steps):
        prompt = [rng.randrange(4) * 1000 + j for j in range(rng.randrange(8, 120))]
        kv = m.create_kv_cache(input_tokens=prompt)
        if not kv.resume():
            kv.close()
            continue
        h = kv.history_length
        if kv.resize(len(prompt) + 4):
            kv.commit(prompt[h:] if i % 2 else array("I", prompt[h:]))  # blocks: tuples or array slices
            for t in range(rng.randrange(4)):
                kv.commit([5000 + t])
        if i % 3 == 0:
            kv.suspend()
        if i % 5 == 0:
            open_caches.append(kv)
        else:
            kv.close()
        while len(open_caches) > 3:
            open_caches.pop(0).close()
    return open_caches


def _config(hybrid: bool) -> object:
    layers = kv_layers(4, window=32, swa_every=2) if hybrid else kv_layers(2)
    return make_config(layers, quota=1 << 20, host_quota=1 << 20)


def test_tree_nodes_and_pages_are_not_gc_tracked() -> None:
    m = KVCacheManager(make_config(kv_layers(2), quota=1 << 20))  # type: ignore[arg-type]
    for c in _workload(m, random.Random(0)):
        c.close()
    nodes = m._tree.nodes()
    assert len(nodes) > 20
    tracked = {id(o) for o in gc.get_objects()}
    for n in nodes:
        assert id(n) not in tracked and id(n.pages) not in tracked and id(n.tokens) not in tracked
        if n.has_children:
            assert id(n._children) not in tracked
        for lc in range(len(n.pages)):
            p = n.page(lc)
            if p is not None:
                assert id(p) not in tracked
    m.shutdown()


@pytest.mark.parametrize("hybrid", [False, True])
def test_no_leak_whether_shut_down_or_dropped(hybrid: bool) -> None:
    """Rounds of a workload; the manager is shut down, dropped, or dropped while a cache is
    open (released when that cache closes): allocated memory blocks do not grow."""
    rng = random.Random(1)

    def one_round(r: int) -> None:
        m = KVCacheManager(_config(hybrid))  # type: ignore[arg-type]
        left = _workload(m, rng)
        kept = left.pop() if left and r % 3 == 2 else None
        for c in left:
            c.close()
        if r % 3 == 0:
            m.shutdown()
        del m
        if kept is not None:
            kept.close()  # the dropped manager's last cache: its memory goes now
        gc.collect()

    for r in range(3):
        one_round(r)
    before = sys.getallocatedblocks()
    for r in range(9):
        one_round(r)
    grown = sys.getallocatedblocks() - before
    # one leaked round would leave hundreds of nodes and pages (several blocks each)
    assert grown < 300, f"{grown} memory blocks more after 9 rounds"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_dropped_manager_gives_pools_back() -> None:
    def manager() -> KVCacheManager:
        m = KVCacheManager(make_config(kv_layers(2), quota=4 * GIB))  # type: ignore[arg-type]
        for c in _workload(m, random.Random(2), steps=20):
            c.close()
        return m

    base = _vm_size()
    m = manager()
    assert _vm_size() - base >= 4 * GIB
    del m
    gc.collect()
    assert _vm_size() - base < GIB

    m = manager()
    kv = m.create_kv_cache(input_tokens=[1, 2, 3])
    assert kv.resume()
    del m
    gc.collect()
    assert _vm_size() - base >= 4 * GIB  # an open cache still uses the pools
    assert kv.resize(64)
    kv.commit(list(range(40)))
    kv.close()
    assert _vm_size() - base < GIB
