"""A persistent disk tier (``DiskCacheTierConfig(persistent=True)``) through the fake engine: a new
manager (in a new process) adopts the published blocks a previous one left; events announce them;
other layouts, versions and namespaces are ignored once with a warning; a kill -9 mid-writes leaves
nothing torn that is served; a second opener is refused; suspended requests' private pages and
cleared blocks are not adopted; a disk too small for the quota is a clear error."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, publish, run_worker, seq, tree_pages

from kv_cache_manager_v2 import (
    DEFAULT_PRIORITY,
    BlockStoredEvent,
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    LogicError,
    OutOfMemoryError,
    Retention,
    ReuseScope,
)
from kv_cache_manager_v2._config import CacheTierConfig
from kv_cache_manager_v2._storage._persist import FILE_HEADER, HEADER_BYTES

DISK = CacheLevel(1)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_worker.py")


def config(path: str, gpu: int = 4, disk: int = 32, host: int = 0, **kw: Any) -> KVCacheManagerConfig:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu * SLOT)]
    if host:
        tiers.append(HostCacheTierConfig(host * SLOT))
    tiers.append(DiskCacheTierConfig(disk * SLOT, path, persistent=True, namespace=kw.pop("namespace", "")))
    layers = kw.pop("layers", None) or kv_layers(2, T)
    return KVCacheManagerConfig(T, tiers, layers, backend="host", max_util_for_resume=1.0, **kw)


def reused(m: KVCacheManager, toks: list[int], scope: ReuseScope | None = None) -> int:
    """The reused length of ``toks``, every record of it checked through ``m``'s addresses."""
    kv = m.create_kv_cache(scope, toks + [1])
    assert kv.resume()
    h = kv.history_length
    FakeEngine(m).check_all(kv, toks, h)
    kv.close()
    m.check_invariants()
    return h


def leaf_slot(m: KVCacheManager, toks: list[int]) -> int:
    """The disk slot of the last block of ``toks`` (published)."""
    page = tree_pages(m, toks)[-1]
    assert page.level == DISK
    return int(page.slot)


def worker(spec: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    return run_worker("disk_worker.py", spec, timeout)


def test_a_new_process_adopts_the_published_blocks(tmp_path: Any) -> None:
    path = str(tmp_path)
    prompts = [seq(r, 3 * T) for r in range(6)]
    m = KVCacheManager(config(path))
    for toks in prompts:
        publish(m, toks)
    scoped = seq(90, 2 * T)
    publish(m, scoped, ReuseScope(lora_id=3, salt=7))
    m.shutdown()  # the GPU tier's blocks are written back to the disk tier
    assert sorted(os.listdir(path)) == ["kvcm-disk.lock", "kvcm-g0-p0.pool", "kvcm-g0.slots"]
    got = worker({"mode": "read", "path": path, "prompts": prompts})
    assert got["adopted"] == 6 * 3 + 2
    assert got["history"] == [3 * T] * 6  # every record checked in the new process
    assert got["checked"] > 0 and got["io_errors"] == 0
    m2 = KVCacheManager(config(path))
    try:
        assert m2.probe_reuse(None, scoped + [1]) == 0  # another scope
        assert reused(m2, scoped, ReuseScope(lora_id=3, salt=7)) == 2 * T
        assert m2.get_tier_statistics(DISK).onboarded_pages >= 2
    finally:
        m2.shutdown()


def test_retention_outlives_the_process_with_the_time_it_has_left(tmp_path: Any) -> None:
    """A record keeps its block's retention (wall-clock expiry): the next manager gives the adopted
    page the same priority for the time left (within a second), a hint until reused, and its base
    priority once the time has run out; pins end with the process."""
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    engine = FakeEngine(m)
    long, hint, short, plain = seq(1, 2 * T), seq(2, 2 * T), seq(3, 2 * T), seq(4, 2 * T)
    for toks, retain in ((long, Retention(99, 3600.0)), (hint, Retention(90)), (short, Retention(95, 0.3))):
        kv = m.create_kv_cache(None, toks)
        assert kv.resume()
        compute(engine, kv, toks, len(toks))
        kv.close(retain=retain)
    publish(m, plain)
    assert [p.priority for p in tree_pages(m, long)] == [99, 99]
    time.sleep(0.4)  # short's time runs out while the process is down
    m.shutdown()
    m2 = KVCacheManager(config(path))
    try:
        now = m2._storage.expiries.now()
        pages = tree_pages(m2, long)
        assert [p.priority for p in pages] == [99, 99]
        assert all(3600.0 - 1.0 <= p.expires - now <= 3600.0 for p in pages)  # the time left, within a second
        assert all(p.retain_s == 3600.0 and p.base_priority == DEFAULT_PRIORITY for p in pages)
        assert [p.priority for p in tree_pages(m2, hint)] == [90, 90]
        assert [p.priority for p in tree_pages(m2, short)] == [DEFAULT_PRIORITY] * 2  # ran out: its base
        assert [p.priority for p in tree_pages(m2, plain)] == [DEFAULT_PRIORITY] * 2
        assert m2.get_storage_statistics(DISK)[0].retained == 4
        m2.check_invariants()
        assert reused(m2, hint) == 2 * T  # the conversation went on: its hint ends
        assert [p.priority for p in tree_pages(m2, hint)] == [DEFAULT_PRIORITY] * 2
        assert reused(m2, long) == 2 * T
    finally:
        m2.shutdown()


def test_retention_moves_with_a_block_to_each_tier_and_into_its_record(tmp_path: Any) -> None:
    """A session's retention (``directives.retain``) stays with its pages down through the host to
    the persistent disk (priority, and the time left within a second); a retain of pages already
    there rewrites their records; the next manager adopts them with it."""
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=4, host=4, disk=16))
    toks = seq(1, 2 * T)
    kv = m.create_kv_cache(None, toks, session_id="chat")
    assert kv.resume()
    compute(FakeEngine(m), kv, toks, len(toks))
    kv.close()
    d = m.directives
    assert d.retain("chat", 80, 100.0).num_blocks == 2

    def check(level: int, priority: int, left: float, mgr: KVCacheManager = m) -> None:
        now = mgr._storage.expiries.now()
        pages = tree_pages(mgr, toks)
        assert [(p.level, p.priority) for p in pages] == [(level, priority)] * 2
        assert all(left - 1.0 <= p.expires - now <= left for p in pages), [p.expires - now for p in pages]

    check(0, 80, 100.0)
    assert d.demote("chat", 1).num_blocks == 2
    check(1, 80, 100.0)
    assert d.demote("chat", 2).num_blocks == 2  # the persistent disk: its records keep it
    check(2, 80, 100.0)
    assert d.retain("chat", 85, 200.0).num_blocks == 2  # on the disk already: the records are written again
    m.shutdown()
    m2 = KVCacheManager(config(path, gpu=4, host=4, disk=16))
    try:
        check(2, 85, 200.0, m2)
        assert reused(m2, toks) == 2 * T
    finally:
        m2.shutdown()


def test_adopted_blocks_are_announced_at_the_disk_medium(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    publish(m, seq(1, 2 * T))
    m.shutdown()
    events = KVCacheEventManager()
    m2 = KVCacheManager(config(path), events)
    try:
        stored = events.get_latest_events()
        assert [type(e) for e in stored] == [BlockStoredEvent] * 2
        assert all(isinstance(e, BlockStoredEvent) and e.medium == "DISK" for e in stored)
        assert [list(e.tokens) for e in stored if isinstance(e, BlockStoredEvent)] == [seq(1, T), seq(1, 2 * T)[T:]]
    finally:
        m2.shutdown()


def test_other_layouts_versions_and_namespaces_are_ignored_once_and_reclaimed(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    publish(m, seq(1, 3 * T))
    m.shutdown()
    for other in ({"namespace": "other-model"}, {"layers": kv_layers(3, T)}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
            m2 = KVCacheManager(config(path, **other))
        warnings = [r for r in caplog.records if "ignored" in r.getMessage()]
        assert len(warnings) == 1 and "another layout" in warnings[0].getMessage()
        assert m2.num_adopted_pages == 0
        assert m2.probe_reuse(None, seq(1, 3 * T)) == 0
        m2.shutdown()
    m3 = KVCacheManager(config(path))  # the space was reclaimed: nothing of the first comes back
    assert m3.num_adopted_pages == 0
    publish(m3, seq(2, 3 * T))
    m3.shutdown()
    # version skew: a file written by another format version is ignored the same way
    with open(os.path.join(path, "kvcm-g0.slots"), "r+b") as f:
        head = bytearray(f.read(FILE_HEADER.size))
        head[8] += 1  # the format version field
        f.seek(0)
        f.write(head)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m4 = KVCacheManager(config(path))
    assert m4.num_adopted_pages == 0 and any("ignored 1 file" in r.getMessage() for r in caplog.records)
    m4.shutdown()
    assert os.path.getsize(os.path.join(path, "kvcm-g0-p0.pool")) <= 32 * SLOT


def test_a_smaller_quota_adopts_what_fits_and_a_larger_one_everything(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, disk=32))
    prompts = [seq(r, 2 * T) for r in range(12)]
    for toks in prompts:
        publish(m, toks)
    m.shutdown()
    small = KVCacheManager(config(path, disk=8))
    try:
        assert 0 < small.num_adopted_pages <= 8
        assert sum(reused(small, toks) for toks in prompts) % T == 0
    finally:
        small.shutdown()
    assert os.path.getsize(os.path.join(path, "kvcm-g0-p0.pool")) == 8 * SLOT


def test_a_tier_shrunk_at_run_time_adopts_only_slots_with_bytes(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, disk=32))
    prompts = [seq(r, 2 * T) for r in range(12)]
    for toks in prompts:
        publish(m, toks)
    assert m.resize(DISK, 8 * SLOT)  # the file is cut; records of the cut slots stay behind
    m.shutdown()
    m2 = KVCacheManager(config(path, disk=32))
    try:
        assert 0 < m2.num_adopted_pages <= 8
        assert sum(reused(m2, toks) for toks in prompts) <= 8 * T
        assert m2.get_tier_statistics(DISK).io_errors == 0  # nothing adopted without its bytes
    finally:
        m2.shutdown()


def test_a_second_opener_is_refused_in_this_process_and_another(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    try:
        with pytest.raises(LogicError, match="in use by another KV-cache manager"):
            KVCacheManager(config(path))
        out = subprocess.run(
            [sys.executable, WORKER, json.dumps({"mode": "read", "path": path})],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode != 0 and "in use by another KV-cache manager" in out.stderr
        publish(m, seq(1, 2 * T))  # the refused openers changed nothing
        assert reused(m, seq(1, 2 * T)) == 2 * T
    finally:
        m.shutdown()
    holder = subprocess.Popen(
        [sys.executable, WORKER, json.dumps({"mode": "hold", "path": path})], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(LogicError, match=f"process {holder.pid}"):
            KVCacheManager(config(path))
    finally:
        holder.kill()
        holder.wait()
    KVCacheManager(config(path)).shutdown()  # the lock died with its holder


def test_kill_9_mid_writes_leaves_every_entry_valid_or_absent(tmp_path: Any) -> None:
    path = str(tmp_path)
    for delay in (0.05, 0.2, 0.5):
        child = subprocess.Popen(
            [sys.executable, WORKER, json.dumps({"mode": "churn", "path": path, "gpu": 4, "disk": 24})],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        m = KVCacheManager(config(path, gpu=4, disk=24))
        try:
            assert m.num_adopted_pages > 0
            engine = FakeEngine(m)
            served = 0
            for r in range(4000):  # every prompt the child may have published
                toks = [(1000 + r) * 1000 + i for i in range(3 * T)]
                if m.probe_reuse(None, toks + [1]) == 0:
                    continue
                kv = m.create_kv_cache(input_tokens=toks + [1])
                assert kv.resume()
                engine.check_all(kv, toks, kv.history_length)  # what is served is exactly what was written
                served += kv.history_length // T
                kv.close()
            assert served > 0
            m.check_invariants()
        finally:
            m.shutdown()


def published_directory(path: str) -> list[list[int]]:
    """Four prompts of two blocks published by a manager on ``path``, then shut down: its records."""
    prompts = [seq(r, 2 * T) for r in range(4)]
    m = KVCacheManager(config(path))
    for toks in prompts:
        publish(m, toks)
    m.shutdown()
    return prompts


def test_torn_data_and_torn_records_are_never_served(tmp_path: Any) -> None:
    """The states a crash between the two writes of a slot can leave: new bytes under an old record
    (a miss when read, counted), and a half-written record (not adopted)."""
    path = str(tmp_path)
    prompts = published_directory(path)
    m1 = KVCacheManager(config(path))  # where the leaves of prompts 0 and 1 are (nothing moves)
    leaves = [leaf_slot(m1, prompts[0]), leaf_slot(m1, prompts[1])]
    m1.shutdown()
    record = (os.path.getsize(os.path.join(path, "kvcm-g0.slots")) - HEADER_BYTES) // 32
    pool = os.path.join(path, "kvcm-g0-p0.pool")
    slots = os.path.join(path, "kvcm-g0.slots")
    other = (leaves[0] + 1) % 8
    with open(pool, "r+b") as f:  # prompt 0's leaf: new bytes (another slot's), its record not yet rewritten
        f.seek(other * SLOT)
        data = f.read(SLOT)
        f.seek(leaves[0] * SLOT)
        f.write(data)
    other = (leaves[1] + 1) % 8
    with open(slots, "r+b") as f:  # prompt 1's leaf: the record's second half from another record
        f.seek(HEADER_BYTES + other * record + record // 2)
        tail = f.read(record - record // 2)
        f.seek(HEADER_BYTES + leaves[1] * record + record // 2)
        f.write(tail)
    m2 = KVCacheManager(config(path))
    try:
        assert m2.num_adopted_pages == 8 - 1
        assert [reused(m2, toks) for toks in prompts] == [T, T, 2 * T, 2 * T]  # every record served checked
        assert m2.get_tier_statistics(DISK).io_errors == 1  # prompt 0's leaf, found out when read
    finally:
        m2.shutdown()


def test_private_pages_of_suspended_requests_and_cleared_blocks_are_not_adopted(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=4, disk=32))
    engine = FakeEngine(m)
    publish(m, seq(1, 2 * T))
    a = m.create_kv_cache()
    assert a.resume()
    assert a.resize(4 * T, 0)
    engine.step(a, seq(2, 4 * T), 0, 4 * T)  # computed, not committed: private pages
    a.suspend()
    b = m.create_kv_cache()
    assert b.resume() and b.resize(4 * T, 0)  # a's pages spill to the disk tier
    assert all(p is not None and p.level == DISK for p in a.block_table.pages[0])
    b.close()
    a.close()
    m.shutdown()
    m2 = KVCacheManager(config(path, gpu=4, disk=32))
    assert m2.num_adopted_pages == 2  # the published blocks only
    assert reused(m2, seq(1, 2 * T)) == 2 * T
    m2.clear_reusable_blocks()
    m2.shutdown()
    m3 = KVCacheManager(config(path, gpu=4, disk=32))
    assert m3.num_adopted_pages == 0
    m3.shutdown()


def test_a_slot_reused_by_a_private_page_loses_its_old_record(tmp_path: Any) -> None:
    """A published block's disk slot, freed when the block is onboarded and then taken by a
    suspended request's private page: the old record must not be adopted after a restart (its
    bytes are gone: it would be announced, then fail its checksum)."""
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=4, disk=4))
    engine = FakeEngine(m)
    old = seq(1, 4 * T)
    publish(m, old)
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(4 * T, 0)  # the published blocks go down to the disk
    hog.close()
    assert reused(m, old) == 4 * T  # onboarded: their disk slots are free, their records stay
    m.clear_reusable_blocks()  # nothing else for the next steps to evict
    publish(m, old)  # published again on the GPU: no record written yet
    a = m.create_kv_cache()
    assert a.resume() and a.resize(4 * T, 0)  # takes the GPU: the republished blocks are dropped
    engine.step(a, seq(2, 4 * T), 0, 4 * T)  # computed, not committed: private pages
    a.suspend()
    b = m.create_kv_cache()
    assert b.resume() and b.resize(4 * T, 0)  # a's pages spill into the disk slots the old blocks had
    assert sorted(int(p.slot) for p in a.block_table.pages[0] if p is not None and p.level == DISK) == [0, 1, 2, 3]
    b.close()
    a.close()
    m.shutdown()
    m2 = KVCacheManager(config(path, gpu=4, disk=4))
    try:
        assert m2.num_adopted_pages == 0
        assert m2.probe_reuse(None, old + [1]) == 0
        assert m2.get_tier_statistics(DISK).io_errors == 0
    finally:
        m2.shutdown()


def test_host_tier_blocks_are_written_back_at_shutdown(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=4, host=4, disk=16))
    prompts = [seq(r, 2 * T) for r in range(5)]
    for toks in prompts:
        publish(m, toks)
    assert sum(s.used_bytes for s in (m.get_tier_statistics(CacheLevel(level)) for level in (0, 1))) > 0
    m.shutdown()
    m2 = KVCacheManager(config(path, gpu=4, host=4, disk=16))
    try:
        assert m2.num_adopted_pages == 10
        assert [reused(m2, toks) for toks in prompts] == [2 * T] * 5
    finally:
        m2.shutdown()


@pytest.mark.parametrize("disk", [16, 3])
def test_pinned_blocks_are_written_back_at_shutdown_first_and_come_back_unpinned(tmp_path: Any, disk: int) -> None:
    """Pinned pages are in no evictor: the write-back takes them too (with the blocks after them,
    whose records need theirs), before unpinned ones when the disk tier has no room for all."""
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=8, disk=disk, max_pinned_share=0.5))
    system, other = seq(1, 2 * T), seq(2, 2 * T)
    publish(m, system)
    publish(m, other)
    assert m.pin(system) == 2 * T
    turn = system + seq(3, T)
    publish(m, turn)  # a block after the pinned prefix
    m.shutdown()
    m2 = KVCacheManager(config(path, gpu=8, disk=disk, max_pinned_share=0.5))
    try:
        assert m2.num_adopted_pages == min(disk, 5)
        assert m2.get_storage_statistics(DISK)[0].pinned == 0  # pins end with the process
        assert not m2.unpin(system)
        assert reused(m2, turn) == (3 if disk > 3 else 2) * T
        assert reused(m2, other) == (2 if disk > 3 else 1) * T  # the pinned blocks went first
    finally:
        m2.shutdown()


def test_a_disk_too_small_for_the_quota_is_a_clear_error(tmp_path: Any) -> None:
    huge = 1 << 60
    for persistent in (False, True):
        cfg = config(str(tmp_path))
        tiers = list(cfg.cache_tiers)
        tiers[-1] = DiskCacheTierConfig(huge, str(tmp_path), persistent=persistent)
        with pytest.raises(OutOfMemoryError, match=r"disk tier could not allocate \d+ bytes .* available") as info:
            KVCacheManager(dataclasses.replace(cfg, cache_tiers=tiers))
        assert str(tmp_path) in str(info.value)
    KVCacheManager(config(str(tmp_path))).shutdown()  # the lock was given back


def test_config_validation(tmp_path: Any) -> None:
    # (compiled, mypyc's own TypeError for annotated fields does not name the field)
    with pytest.raises(TypeError):
        DiskCacheTierConfig(SLOT, str(tmp_path), persistent=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DiskCacheTierConfig(SLOT, str(tmp_path), namespace=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        DiskCacheTierConfig(SLOT, str(tmp_path), namespace="a\nb")
