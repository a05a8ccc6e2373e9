"""The disk tier never serves damaged data: every slot is checksummed when written and verified when
read, so truncated, zeroed, garbage and misplaced pages are misses (counted in ``io_errors``), the
request keeps the intact prefix (records checked through the fake engine), and a damaged page is
never forwarded to the remote tier."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
from conftest import MakeManager, kv_layers, remote_keys
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, computed, publish, seq, tree_pages

from kv_cache_manager_v2 import (
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kv_cache_manager_v2._config import CacheTierConfig
from kv_cache_manager_v2._page import Page
from kv_cache_manager_v2._storage._disk import DiskPool
from kv_cache_manager_v2.redis_server import LocalRedisServer

DISK = CacheLevel(2)


def disk_file(page: Page) -> DiskPool:
    pool = page.storage.pools[0]
    assert type(pool) is DiskPool and len(page.storage.pools) == 1
    return pool


def damage(kind: str, page: Page, other: Page) -> None:
    """Change ``page``'s bytes in its file behind the manager's back (``other``: another disk page)."""
    pool = disk_file(page)
    at = page.slot * SLOT
    if kind == "zeroed":
        os.pwrite(pool.fd, bytes(SLOT), at)
    elif kind == "garbage":
        os.pwrite(pool.fd, os.urandom(SLOT), at)
    elif kind == "one_byte":
        old = os.pread(pool.fd, 1, at + SLOT // 2)
        os.pwrite(pool.fd, bytes([old[0] ^ 0x40]), at + SLOT // 2)
    elif kind == "wrong_key":  # a valid page of another block
        os.pwrite(pool.fd, os.pread(pool.fd, SLOT, other.slot * SLOT), at)
    elif kind == "truncated":  # cut there, then grown again (as later evictions would): zeros
        size = os.fstat(pool.fd).st_size
        os.ftruncate(pool.fd, at + SLOT // 3)
        os.ftruncate(pool.fd, size)
    else:
        raise AssertionError(kind)


KINDS = ["zeroed", "garbage", "one_byte", "wrong_key", "truncated"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_disk_page_is_a_miss_and_the_intact_prefix_is_served(
    make_manager: MakeManager, tmp_path: Any, kind: str
) -> None:
    m = make_manager(
        kv_layers(2, T), T, 3 * SLOT, host_quota=3 * SLOT, disk_quota=9 * SLOT, disk_path=str(tmp_path),
        max_util_for_resume=1.0,
    )  # fmt: skip
    engine = FakeEngine(m)
    seqs = [seq(r, 3 * T) for r in range(4)]
    for s in seqs:
        publish(m, s)
    pages = tree_pages(m, seqs[0])
    assert [p.level for p in pages] == [DISK] * 3
    # the second block is damaged; with truncation every slot from there on in the file is too
    victim = pages[1]
    others = [p for p in tree_pages(m, seqs[1]) if p.level == DISK]
    damage(kind, victim, others[0])
    damaged_slots = {victim.slot}
    if kind == "truncated":
        damaged_slots |= {s for s in range(9) if s > victim.slot}
    intact = 0
    while intact < 3 and pages[intact].slot not in damaged_slots:
        intact += 1
    assert intact <= 1
    kv = m.create_kv_cache(input_tokens=seqs[0] + [5])
    assert kv.history_length == 3 * T  # the match itself reads nothing
    assert kv.resume()
    assert kv.history_length == kv.num_committed_tokens == intact * T  # the intact prefix
    assert m.get_tier_statistics(DISK).io_errors >= 1
    engine.check_all(kv, seqs[0], intact * T)
    compute(engine, kv, seqs[0], 3 * T)  # the engine recomputes from the first lost block
    kv.close()
    for s in seqs:  # everything served is intact; blocks in damaged slots come back shorter
        kv = m.create_kv_cache(input_tokens=s + [5])
        assert kv.resume()
        engine.check_all(kv, s, kv.history_length)
        compute(engine, kv, s, 3 * T)
        kv.close()
    assert disk_file(victim).num_corrupt >= 1
    m.check_invariants()


def test_a_damaged_page_of_a_suspended_request_shortens_it_at_resume(make_manager: MakeManager, tmp_path: Any) -> None:
    m = make_manager(
        kv_layers(2, T), T, 3 * SLOT, host_quota=3 * SLOT, disk_quota=9 * SLOT, disk_path=str(tmp_path),
        max_util_for_resume=1.0,
    )  # fmt: skip
    engine = FakeEngine(m)
    a = m.create_kv_cache()
    assert a.resume()
    toks = seq(1, 3 * T)
    compute(engine, a, toks, 3 * T)
    a.suspend()
    for r in (2, 3):
        h = computed(m, engine, seq(r, 3 * T), 3 * T)
        h.suspend()
    own = [p for p in a.block_table.pages[0] if p is not None]
    assert [p.level for p in own] == [DISK] * 3
    damage("garbage", own[2], own[0])
    for kv in m.open_caches():
        if kv is not a:
            kv.close()
    assert a.resume()
    assert a.history_length == 2 * T and m.get_tier_statistics(DISK).io_errors == 1
    engine.check_all(a, toks, 2 * T)
    a.close()


def test_a_damaged_disk_page_is_never_sent_to_the_remote_tier(redis_server: LocalRedisServer, tmp_path: Any) -> None:
    """Pages dropped from a damaged disk tier (handed off from their slot, or copied into the write
    ring) are verified first: a damaged one is not written, and a replica sharing the Redis tier
    reuses only intact blocks (every record checked)."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(16 * SLOT),
        DiskCacheTierConfig(16 * SLOT, str(tmp_path)),
        RemoteCacheTierConfig(redis_server.url, "test-model", timeout_ms=3000, max_pending_bytes=4 * SLOT),
    ]
    cfg = KVCacheManagerConfig(T, tiers, kv_layers(2, T), backend="host", max_util_for_resume=1.0)
    a = KVCacheManager(cfg)
    b: KVCacheManager | None = None
    try:
        toks = [seq(40 + r, 4 * T) for r in range(3)]
        for t in toks:
            publish(a, t)
        # push every block to the disk tier: a suspended request fills the GPU
        first = a.create_kv_cache()
        assert first.resume() and first.resize(16 * T)
        first.suspend()
        pages = [tree_pages(a, t) for t in toks]
        assert all(p.level == 1 for ps in pages for p in ps)
        assert a._remote is not None
        damaged = []
        for ps in pages:  # the third block of each prompt is damaged
            node = ps[2].node
            assert node is not None
            damaged.append(a._remote.page_key(node.key, 0))
            damage("garbage", ps[2], ps[0])
        # then push them out of the disk tier too: every reusable page is dropped (to the remote tier)
        second = a.create_kv_cache()
        assert second.resume() and second.resize(16 * T)
        second.close()
        first.close()
        assert a.flush_remote_writes()
        a.check_invariants()
        st = a.remote_statistics
        assert st is not None
        # the queue is small: some pages are dropped unread; each damaged one read was caught
        disk_errors = a.get_tier_statistics(CacheLevel(1)).io_errors
        assert 1 <= disk_errors <= 3
        assert st.written_pages + st.dropped_writes == 12
        assert st.written_pages >= 4
        written = remote_keys(redis_server)
        assert len(written) == st.written_pages and not set(damaged) & set(written)
        b = KVCacheManager(dataclasses.replace(cfg, cache_tiers=[tiers[0], tiers[2]]))  # a replica: GPU + Redis
        engine = FakeEngine(b)
        for t in toks:
            kv = b.create_kv_cache(input_tokens=t + [1])
            assert kv.history_length <= 2 * T  # never past the damaged block
            assert kv.resume()
            engine.check_all(kv, t, kv.history_length)
            kv.close()
        b.check_invariants()
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()
