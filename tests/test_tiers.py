"""Host and disk tiers through the fake engine: the eviction cascade (through a host tier smaller
than a request too), onboarding, suspended requests spilling down and coming back, the resume
gate, prefetch, tier resizing, disk errors, statistics."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import REC, MakeManager, kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, computed, publish, seq, tree_pages, wait_loaded

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    CacheLevel,
    CacheTier,
    KVCache,
    KVCacheManager,
    KVCacheStatus,
    LayerGroupId,
    LogicError,
    PageStatus,
    Priority,
)
from kv_cache_manager_v2._common import SlotId
from kv_cache_manager_v2._storage._disk import DiskPool
from kv_cache_manager_v2._storage._slot_allocator import SlotAllocator

LG0 = LayerGroupId(0)
GPU, HOST, DISK = CacheLevel(0), CacheLevel(1), CacheLevel(2)


def tiered(
    make_manager: MakeManager, tmp_path: object, gpu: int, host: int, disk: int | None, **kw: object
) -> KVCacheManager:
    """A manager with ``gpu`` / ``host`` / ``disk`` slots per tier (disk None: no disk tier). With
    so few slots ``max_util_for_resume`` is 1 unless asked (one block is a large share of the GPU)."""
    kw.setdefault("max_util_for_resume", 1.0)
    if disk is not None:
        kw.update(disk_quota=disk * SLOT, disk_path=str(tmp_path))
    return make_manager(kv_layers(2, T), T, gpu * SLOT, host_quota=host * SLOT, **kw)


def tree_levels(m: KVCacheManager, toks: list[int]) -> list[int]:
    """Cache level of each reusable block of ``toks`` (layer group 0), in order."""
    return [p.level for p in tree_pages(m, toks)]


def levels_of(kv: KVCache) -> list[int]:
    return [p.level for p in kv.block_table.pages[0] if p is not None]


def used(m: KVCacheManager) -> list[int]:
    return [
        m.get_storage_statistics(CacheLevel(level))[0].total - m.get_storage_statistics(CacheLevel(level))[0].free
        for level in range(len(m.cache_tier_list))
    ]


def test_reusable_blocks_fall_to_host_then_disk_and_come_back_intact(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = tiered(make_manager, tmp_path, gpu=4, host=4, disk=8)
    assert m.cache_tier_list == [CacheTier.GPU_MEM, CacheTier.HOST_MEM, CacheTier.DISK]
    engine = FakeEngine(m)
    seqs = [seq(r, 3 * T) for r in range(4)]
    for s in seqs:
        publish(m, engine=engine, toks=s)
    # LRU spans the levels: the oldest request's blocks are deepest
    assert tree_levels(m, seqs[0]) == [2, 2, 2]
    assert tree_levels(m, seqs[3]) == [0, 0, 0]
    assert sorted(tree_levels(m, seqs[1]) + tree_levels(m, seqs[2])) == [0, 1, 1, 1, 1, 2]
    assert used(m) == [4, 4, 4]
    off = [m.get_tier_statistics(CacheLevel(level)).offloaded_pages for level in range(3)]
    assert off[0] == 0 and off[1] == 8 and off[2] == 4
    for s in reversed(seqs):  # every block comes back, from wherever it is, with the right data
        kv = m.create_kv_cache(input_tokens=s + [7])
        assert kv.history_length == 3 * T
        assert kv.resume()
        assert levels_of(kv) == [0, 0, 0]
        engine.check_all(kv, s, 3 * T)
        kv.close()
    on = [m.get_tier_statistics(CacheLevel(level)) for level in range(3)]
    assert on[1].onboarded_pages > 0 and on[2].onboarded_pages > 0
    assert on[2].onboarded_bytes == on[2].onboarded_pages * SLOT
    assert sum(x.dropped_pages for x in on) == 0  # 12 blocks fit in 16 slots: nothing was lost
    m.clear_reusable_blocks()
    assert used(m) == [0, 0, 0]


def test_last_level_drops_the_oldest_and_keeps_the_rest(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=None)
    engine = FakeEngine(m)
    seqs = [seq(r, 2 * T) for r in range(3)]
    for s in seqs:
        publish(m, engine=engine, toks=s)
    assert m.probe_reuse(None, seqs[0]) == 0  # dropped at the host level (the last)
    assert m.get_tier_statistics(HOST).dropped_pages == 2
    assert tree_levels(m, seqs[1]) == [1, 1] and tree_levels(m, seqs[2]) == [0, 0]
    kv = m.create_kv_cache(input_tokens=seqs[1])
    assert kv.history_length == 2 * T and kv.resume()
    engine.check_all(kv, seqs[1], 2 * T)
    kv.close()
    # No swapping: the GPU's blocks could not move into the host slots seqs[1] was leaving, so
    # they were dropped; room below is only what exists before anything moves up.
    assert m.probe_reuse(None, seqs[2]) == 0 and tree_levels(m, seqs[1]) == [0, 0]


def test_suspended_request_survives_others_using_the_whole_gpu(make_manager: MakeManager, tmp_path: object) -> None:
    """Its pages pass through host and disk and come back intact; HELD pages are never dropped."""
    m = tiered(make_manager, tmp_path, gpu=4, host=4, disk=4)
    engine = FakeEngine(m)
    a_toks, h1_toks, h2_toks = seq(1, 4 * T), seq(2, 4 * T), seq(3, 4 * T)
    a = m.create_kv_cache()
    assert a.resume()
    compute(engine, a, a_toks, 3 * T + 3)  # 4 blocks, the last one partial
    a.suspend()
    assert set(a.get_base_page_indices(LG0)) == {BAD_PAGE_INDEX}  # no live indices while suspended
    hog1 = m.create_kv_cache()
    assert hog1.resume()
    compute(engine, hog1, h1_toks, 4 * T)  # the whole GPU: a's pages go to host
    assert levels_of(a) == [1, 1, 1, 1]
    hog1.suspend()
    hog2 = m.create_kv_cache()
    assert hog2.resume()
    compute(engine, hog2, h2_toks, 4 * T)  # the whole GPU again: hog1 -> host, a -> disk
    assert levels_of(a) == [2, 2, 2, 2] and levels_of(hog1) == [1, 1, 1, 1]
    assert all(p.status is PageStatus.HELD for p in a.block_table.all_pages())
    # every slot of every level is held now: more memory cannot be found, and nothing moves
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    assert not hog2.resize(5 * T)
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    assert not a.resume()  # no room for its 4 pages: stays suspended, nothing changed
    assert a.status is KVCacheStatus.SUSPENDED and levels_of(a) == [2, 2, 2, 2]
    hog2.close()  # its committed blocks are reusable now: they make way
    assert a.resume()
    assert levels_of(a) == [0, 0, 0, 0] and a.history_length == 3 * T + 3
    engine.check_all(a, a_toks, 3 * T + 3)
    for n in range(3 * T + 4, 4 * T + 1):
        compute(engine, a, a_toks, n)
    a.close()
    assert hog1.resume()
    engine.check_all(hog1, h1_toks, 4 * T)
    hog1.close()


def small_host(make_manager: MakeManager, tmp_path: object, host: int, **kw: object) -> KVCacheManager:
    """GPU 16 slots, a host tier of ``host`` slots, a disk tier of 64."""
    kw.setdefault("max_util_for_resume", 1.0)
    return make_manager(
        kv_layers(2, T), T, 16 * SLOT, host_quota=host * SLOT, disk_quota=64 * SLOT, disk_path=str(tmp_path), **kw
    )


def pushed_down(m: KVCacheManager) -> tuple[FakeEngine, list[int], KVCache]:
    """8 blocks published, then a request computing on the whole GPU (returned, open): they go down."""
    engine = FakeEngine(m)
    toks = seq(1, 8 * T)
    publish(m, toks, engine=engine)
    hog = m.create_kv_cache()
    assert hog.resume()
    compute(engine, hog, seq(2, 16 * T), 16 * T)
    return engine, toks, hog


def test_gpu_victims_push_the_small_host_tier_down_to_disk(make_manager: MakeManager, tmp_path: object) -> None:
    for host in (2, 4, 8):
        m = small_host(make_manager, tmp_path, host)
        engine, toks, hog = pushed_down(m)
        assert m.probe_reuse(None, toks + [7]) == 8 * T  # nothing was dropped: the disk had room
        stats = [m.get_tier_statistics(level) for level in (GPU, HOST, DISK)]
        assert sum(s.dropped_pages for s in stats) == 0
        # the newest victims go to the host, the older rest straight on to disk
        assert stats[HOST].offloaded_pages == min(host, 8)
        assert stats[DISK].offloaded_pages == 8 - min(host, 8)
        assert stats[HOST].used_bytes == min(host, 8) * SLOT
        assert stats[DISK].used_bytes == (8 - min(host, 8)) * SLOT
        hog.close()
        b = m.create_kv_cache(input_tokens=toks + [7])
        assert b.history_length == 8 * T and b.resume()
        engine.check_all(b, toks, 8 * T)  # every record back intact, from host and disk
        b.close()
        m.shutdown()


def test_the_newest_victims_stay_in_the_small_host_tier(make_manager: MakeManager, tmp_path: object) -> None:
    m = small_host(make_manager, tmp_path, 2)
    _, toks, hog = pushed_down(m)  # released last block first: block 7 is the oldest, block 0 the newest
    b = m.create_kv_cache(input_tokens=toks + [7])
    assert levels_of(b) == [HOST, HOST] + [DISK] * 6
    b.close()
    hog.close()


def test_suspended_pages_spill_through_a_small_host_to_disk(make_manager: MakeManager, tmp_path: object) -> None:
    m = small_host(make_manager, tmp_path, 2)
    engine = FakeEngine(m)
    a_toks = seq(1, 8 * T)
    a = computed(m, engine, a_toks, 8 * T - 3)
    a.suspend()
    hog = m.create_kv_cache()
    assert hog.resume()
    assert hog.resize(16 * T, 0)  # needs the whole GPU: a's 8 pages go down through the host
    assert sorted(levels_of(a)) == [HOST] * 2 + [DISK] * 6
    assert all(p.status is PageStatus.HELD for p in a.block_table.all_pages())
    engine.step(hog, seq(2, 16 * T), 0, 16 * T)
    hog.commit(seq(2, 16 * T))
    assert not a.resume()  # the GPU is locked by hog: nothing changes
    assert a.status is KVCacheStatus.SUSPENDED
    hog.close()
    assert a.resume()
    assert levels_of(a) == [GPU] * 8 and a.history_length == 8 * T - 3
    engine.check_all(a, a_toks, 8 * T - 3)
    assert sum(m.get_tier_statistics(level).dropped_pages for level in (GPU, HOST, DISK)) == 0
    a.close()


def test_resume_refuses_above_max_util_with_lower_tiers(make_manager: MakeManager, tmp_path: object) -> None:
    """With lower tiers a suspended request's GPU pages count as available; resuming takes them."""
    m = tiered(make_manager, tmp_path, gpu=10, host=10, disk=None, max_util_for_resume=0.8)
    engine = FakeEngine(m)
    a = computed(m, engine, seq(1, 3 * T), 3 * T)
    a.suspend()
    assert m.gpu_utilization == 0.0  # its 3 GPU pages could move down
    b = m.create_kv_cache()
    assert b.resume() and b.resize(6 * T)  # 6 of 10 locked
    assert not a.resume()  # 9/10 > 0.8
    assert a.status is KVCacheStatus.SUSPENDED and levels_of(a) == [0, 0, 0]
    assert b.resize(5 * T)
    assert a.resume()
    engine.check_all(a, seq(1, 3 * T), 3 * T)
    a.close()
    b.close()


def test_gpu_only_resume_of_a_request_already_in_gpu_memory_is_gated_too(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), T, 10 * SLOT, max_util_for_resume=0.5)
    a = m.create_kv_cache()
    assert a.resume() and a.resize(3 * T)
    a.suspend()
    b = m.create_kv_cache()
    assert b.resume() and b.resize(7 * T)  # 10/10 unavailable
    assert not a.resume()  # its pages are placed already, but the GPU is above the limit
    assert a.status is KVCacheStatus.SUSPENDED
    assert b.resize(2 * T)  # 5/10 with a's pages
    assert a.resume()
    a.close()
    b.close()


def test_resume_of_an_empty_cache_respects_max_util(make_manager: MakeManager, tmp_path: object) -> None:
    for tiers in (False, True):
        kw: dict[str, object] = {"max_util_for_resume": 0.5}
        if tiers:
            kw.update(host_quota=4 * SLOT, disk_quota=4 * SLOT, disk_path=str(tmp_path))
        m = make_manager(kv_layers(2, T), T, 10 * SLOT, **kw)
        a = m.create_kv_cache()
        assert a.resume() and a.resize(8 * T)  # 80 % of the slots locked
        b = m.create_kv_cache()
        assert not b.resume()  # nothing to place, but the GPU is above the limit
        assert b.status is KVCacheStatus.SUSPENDED
        assert a.resize(5 * T)  # 50 %: at the limit, not above it
        assert b.resume()
        assert m.gpu_utilization <= 0.5
        b.close()
        a.close()
        m.shutdown()


@pytest.mark.parametrize("load_workers", [0, 2])
def test_prefetch_moves_a_suspended_request_up_ahead_of_resume(
    make_manager: MakeManager, tmp_path: object, load_workers: int
) -> None:
    """Synchronously (``load_workers=0``) or with the disk reads in the background."""
    m = tiered(make_manager, tmp_path, gpu=3, host=6, disk=9, load_workers=load_workers)
    engine = FakeEngine(m)
    toks = seq(1, 3 * T)
    a = m.create_kv_cache()
    assert a.resume()
    compute(engine, a, toks, 3 * T)
    with pytest.raises(LogicError, match="SUSPENDED"):
        a.prefetch(CacheLevel(0))
    a.suspend()
    for r in (2, 3, 4):  # three requests push a down to disk
        h = computed(m, engine, seq(r, 3 * T), 3 * T)
        h.suspend()
    assert levels_of(a) == [2, 2, 2]
    with pytest.raises(ValueError, match="target_level"):
        a.prefetch(CacheLevel(3))
    with pytest.raises(TypeError):
        a.prefetch("host")  # type: ignore[arg-type]
    assert not a.loading and not a.ready  # its pages are on disk
    assert a.prefetch(HOST)
    if load_workers:
        wait_loaded(lambda: a.loading)
    assert levels_of(a) == [1, 1, 1] and a.ready and not a.loading
    assert a.prefetch(HOST)  # nothing left below: a no-op
    onboarded = m.get_tier_statistics(HOST).onboarded_pages
    assert a.prefetch(CacheLevel(0))
    assert levels_of(a) == [0, 0, 0] and a.status is KVCacheStatus.SUSPENDED
    assert m.get_tier_statistics(HOST).onboarded_pages == onboarded + 3
    assert a.resume()
    assert m.get_tier_statistics(HOST).onboarded_pages == onboarded + 3  # resume had nothing to move
    engine.check_all(a, toks, 3 * T)
    a.close()
    for kv in m.open_caches():
        kv.close()


def test_prefetch_without_room_changes_nothing(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=2)
    engine = FakeEngine(m)
    caches = []
    for r in range(3):  # 6 held pages fill every level
        kv = computed(m, engine, seq(r, 2 * T), 2 * T)
        kv.suspend()
        caches.append(kv)
    assert levels_of(caches[0]) == [2, 2]
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    assert not caches[0].prefetch(HOST)  # host is full of HELD pages that cannot go down
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    for kv in caches:
        kv.close()


def test_dedup_onto_a_tree_page_in_a_lower_tier_keeps_the_gpu_page(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=3, host=4, disk=None)
    engine = FakeEngine(m)
    toks = seq(1, 2 * T)
    publish(m, engine=engine, toks=toks)
    publish(m, engine=engine, toks=seq(2, 3 * T))  # pushes toks' blocks to host
    assert tree_levels(m, toks) == [1, 1]
    b = m.create_kv_cache()  # computes the same tokens without matching them
    assert b.resume()
    compute(engine, b, toks, 2 * T)  # commit dedups onto the tree's pages, which take b's GPU slots
    assert tree_levels(m, toks) == [0, 0]
    pages = b.block_table.pages[0]
    assert all(p is not None and p.node is not None and p.level == 0 for p in pages)
    engine.check_all(b, toks, 2 * T)
    b.close()
    c = m.create_kv_cache(input_tokens=toks)
    assert c.history_length == 2 * T and c.resume()
    engine.check_all(c, toks, 2 * T)
    c.close()


def test_copy_on_partial_from_a_lower_tier(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=3, host=3, disk=3)
    engine = FakeEngine(m)
    writer = seq(1, 2 * T)
    publish(m, engine=engine, toks=writer)
    publish(m, engine=engine, toks=seq(2, 3 * T))
    publish(m, engine=engine, toks=seq(3, 3 * T))
    assert tree_levels(m, writer) == [2, 2]
    b = m.create_kv_cache(input_tokens=writer[: T + 5] + [1, 2])
    assert b.history_length == T + 5
    assert b.resume()  # block 0 onboarded, block 1 copied from disk into a private GPU page
    engine.check_all(b, writer, T + 5)
    compute(engine, b, writer[: T + 5] + [1, 2], T + 7)
    b.close()
    assert tree_levels(m, writer)[1] == 2  # the source stays where it was


def test_resize_tiers_keeps_suspended_data(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=6, host=6, disk=6)
    engine = FakeEngine(m)
    assert [m.get_quota(CacheLevel(level)) for level in range(3)] == [6 * SLOT] * 3
    caches = []
    for r in range(4):
        kv = computed(m, engine, seq(r, 3 * T), 3 * T)
        kv.suspend()
        caches.append(kv)
    publish(m, engine=engine, toks=seq(9, 2 * T))  # reusable blocks too
    with pytest.raises(ValueError, match="quota"):
        m.resize(GPU, 0)
    with pytest.raises(ValueError, match="cache level"):
        m.resize(CacheLevel(3), SLOT)
    with pytest.raises(ValueError, match="4x"):
        m.resize(HOST, 100 * SLOT)
    active = m.create_kv_cache()
    assert active.resume()
    with pytest.raises(LogicError, match="suspended"):
        m.resize(HOST, 8 * SLOT)
    active.close()
    assert levels_of(caches[0]) == [2, 2, 1]
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    assert not m.resize(DISK, SLOT)  # disk holds 2 held pages, which cannot go anywhere
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    assert m.get_quota(DISK) == 6 * SLOT
    # pages only move down: shrinking a level needs room below it
    for level, quota in ((DISK, 10), (GPU, 2), (HOST, 4), (GPU, 3), (HOST, 9), (HOST, 3), (GPU, 8)):
        assert m.resize(level, quota * SLOT), (level, quota)
        assert m.get_quota(level) == quota * SLOT
        assert m.get_storage_statistics(level)[0].total == quota
        m.check_invariants()
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    assert not m.resize(DISK, 6 * SLOT)  # it holds 9 held pages now
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    assert m.get_page_index_upper_bound(0, "key") == 8 * 2 * 2  # type: ignore[arg-type]
    engine = FakeEngine(m)  # kernels re-read the layout after a GPU resize (the bound changed)
    for r, kv in enumerate(caches):
        assert kv.resume()
        engine.check_all(kv, seq(r, 3 * T), 3 * T)
        compute(engine, kv, seq(r, 4 * T), 3 * T + 2)
        kv.suspend()
    for kv in caches:
        kv.close()


GPU = CacheLevel(0)


def test_shrinking_moves_pages_out_of_the_cut_range(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=8, host=8, disk=None)
    engine = FakeEngine(m)
    keep = m.create_kv_cache()
    assert keep.resume()
    gap = m.create_kv_cache()
    assert gap.resume()
    assert gap.resize(4 * T)  # slots 0..3
    compute(engine, keep, seq(1, 3 * T), 3 * T)  # slots 4..6
    gap.close()
    keep.suspend()
    assert m.resize(GPU, 3 * SLOT)  # keep's pages move down into slots 0..2 of the GPU
    assert levels_of(keep) == [0, 0, 0]
    assert sorted(p.slot for p in keep.block_table.all_pages()) == [0, 1, 2]
    assert m.resize(HOST, 2 * SLOT)
    assert keep.resume()
    engine.check_all(keep, seq(1, 3 * T), 3 * T)
    keep.close()


def test_disk_files_are_private_and_preallocated(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=5)
    assert os.listdir(str(tmp_path)) == []  # unlinked right after creation
    pool = m._storage.levels[DISK].items[0].pools[0]
    assert isinstance(pool, DiskPool)
    st = os.fstat(pool.fd)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 5 * SLOT
    m.shutdown()
    assert pool.fd == -1


def disk_pool(m: KVCacheManager) -> DiskPool:
    pool = m._storage.levels[DISK].items[0].pools[0]
    assert isinstance(pool, DiskPool)
    return pool


def test_failed_disk_write_turns_reusable_blocks_into_misses(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=8)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    seqs = [seq(r, T) for r in range(6)]
    for s in seqs[:4]:
        publish(m, engine=engine, toks=s)
    assert tree_levels(m, seqs[0]) == [1]
    pool.error_hook = lambda op, off, n: op == "write"
    publish(m, engine=engine, toks=seqs[4])  # seqs[0] goes to disk: the write fails
    pool.error_hook = None
    assert m.probe_reuse(None, seqs[0]) == 0  # a miss now
    assert m.get_tier_statistics(DISK).io_errors == 1 and pool.num_errors == 1
    assert m.get_tier_statistics(HOST).dropped_pages == 1  # dropped from where it was
    publish(m, engine=engine, toks=seqs[5])  # seqs[1] goes to disk normally
    assert tree_levels(m, seqs[1]) == [2]
    for s in seqs[1:]:
        kv = m.create_kv_cache(input_tokens=s)
        assert kv.history_length == T and kv.resume()
        engine.check_all(kv, s, T)
        kv.close()


def test_a_failed_run_is_retried_slot_by_slot(make_manager: MakeManager, tmp_path: object) -> None:
    """Only the block whose slot fails is lost, not the whole batch it was written with."""
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=8)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    two = [seq(r, 2 * T) for r in range(3)]
    for s in two[:2]:
        publish(m, engine=engine, toks=s)
    pool.error_hook = lambda op, off, n: op == "write" and off <= SLOT < off + n  # file slot 1 only
    publish(m, engine=engine, toks=two[2])  # two[0]'s two blocks go to disk slots 0 and 1 in one run
    pool.error_hook = None
    assert pool.num_errors == 2  # the run, then slot 1 alone (slot 0 succeeded)
    assert m.get_tier_statistics(DISK).io_errors == 1
    kept = m.probe_reuse(None, two[0])
    assert kept in (0, T)  # which block got slot 1 is the allocator's business
    if kept:
        kv = m.create_kv_cache(input_tokens=two[0])
        assert kv.resume()
        engine.check_all(kv, two[0], T)
        kv.close()


def test_failed_disk_read_shortens_the_match_and_leaves_the_rest_intact(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = tiered(make_manager, tmp_path, gpu=3, host=3, disk=9)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    seqs = [seq(r, 3 * T) for r in range(4)]
    for s in seqs:
        publish(m, engine=engine, toks=s)
    assert tree_levels(m, seqs[0]) == [2, 2, 2]
    b = m.create_kv_cache(input_tokens=seqs[0] + [5])
    assert b.history_length == 3 * T
    pool.error_hook = lambda op, off, n: op == "read"  # every read fails
    assert b.resume()
    pool.error_hook = None
    assert b.history_length == b.capacity == b.num_committed_tokens == 0  # block 0 was lost: nothing intact
    assert m.probe_reuse(None, seqs[0]) == 0
    compute(engine, b, seqs[0], 3 * T)  # the engine recomputes; the blocks are published again
    b.close()
    for s in seqs:
        kv = m.create_kv_cache(input_tokens=s)
        assert kv.history_length == 3 * T and kv.resume()
        engine.check_all(kv, s, 3 * T)
        kv.close()


def test_failed_read_of_a_later_block_keeps_the_blocks_before_it(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=3, host=3, disk=9)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    a = m.create_kv_cache()
    assert a.resume()
    toks = seq(1, 3 * T)
    compute(engine, a, toks, 3 * T)
    a.suspend()
    for r in (2, 3):
        h = computed(m, engine, seq(r, 3 * T), 3 * T)
        h.suspend()
    assert levels_of(a) == [2, 2, 2]
    third = a.block_table.pages[0][2]
    assert third is not None
    bad = third.slot * SLOT
    pool.error_hook = lambda op, off, n: op == "read" and off <= bad < off + n
    for kv in m.open_caches():
        if kv is not a:
            kv.close()
    assert a.resume()
    pool.error_hook = None
    assert a.history_length == 2 * T and a.num_committed_tokens == 2 * T
    assert m.get_tier_statistics(DISK).io_errors == 1
    engine.check_all(a, toks, 2 * T)
    compute(engine, a, toks, 3 * T)
    a.close()
    kv = m.create_kv_cache(input_tokens=toks)
    assert kv.history_length == 3 * T and kv.resume()
    engine.check_all(kv, toks, 3 * T)
    kv.close()


def test_failed_write_of_a_held_page_loses_it_for_its_owner_only(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=8)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    a = m.create_kv_cache()
    assert a.resume()
    toks = seq(1, 3 * T)
    compute(engine, a, toks, 2 * T)
    a.suspend()
    pool.error_hook = lambda op, off, n: op == "write"
    hogs = []
    for r in (2, 3):
        h = computed(m, engine, seq(r, 2 * T), 2 * T)
        h.suspend()
        hogs.append(h)
    pool.error_hook = None
    assert all(p.lost for p in a.block_table.all_pages())
    assert m.probe_reuse(None, toks) == 0
    m.check_invariants()
    assert a.resume()
    assert a.history_length == 0  # everything must be recomputed
    compute(engine, a, toks, 2 * T)
    a.close()
    for h, r in zip(hogs, (2, 3)):
        assert h.resume()
        engine.check_all(h, seq(r, 2 * T), 2 * T)
        h.close()


def test_lost_pages_of_a_suspended_request_are_not_published_on_close(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=2, disk=8)
    engine = FakeEngine(m)
    pool = disk_pool(m)
    a = m.create_kv_cache()
    assert a.resume()
    toks = seq(1, 2 * T)
    compute(engine, a, toks, 2 * T - 3)  # a partial tail that close() would publish
    a.suspend()
    pool.error_hook = lambda op, off, n: op == "write"
    for r in (2, 3):
        h = computed(m, engine, seq(r, 2 * T), 2 * T)
        h.suspend()
    pool.error_hook = None
    a.close()
    assert m.probe_reuse(None, toks) == 0
    m.check_invariants()
    for kv in m.open_caches():
        kv.close()


def test_iteration_statistics_reset_on_take(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path, gpu=2, host=4, disk=None)
    engine = FakeEngine(m)
    first = m.take_iteration_stats()
    assert [s.level for s in first] == [0, 1] and all(s.offloaded_pages == 0 for s in first)
    for r in range(3):
        publish(m, engine=engine, toks=seq(r, 2 * T))
    it = m.take_iteration_stats()
    assert it[1].offloaded_pages == 4 and it[1].offloaded_bytes == 4 * SLOT
    assert it[0].peak_used_bytes == 2 * SLOT and it[1].peak_used_bytes == 4 * SLOT
    again = m.take_iteration_stats()
    assert again[1].offloaded_pages == 0 and again[1].peak_used_bytes == 4 * SLOT  # still in use
    kv = m.create_kv_cache(input_tokens=seq(0, 2 * T))
    assert kv.resume()
    it = m.take_iteration_stats()
    # seq 0 came up; the GPU's blocks went down in its place, pushing the oldest (seq 1) out
    assert it[1].onboarded_pages == 2 and it[1].offloaded_pages == 2 and it[1].dropped_pages == 2
    assert it[0].dropped_pages == 0 and m.probe_reuse(None, seq(1, 2 * T)) == 0
    total = m.get_tier_statistics(HOST)
    assert total.offloaded_pages == 6 and total.onboarded_pages == 2 and total.total_bytes == 4 * SLOT
    kv.close()


def test_host_tier_priorities_span_levels(make_manager: MakeManager, tmp_path: object) -> None:
    """A low-priority block goes down (and out) before a high-priority one, whatever their age."""
    m = tiered(make_manager, tmp_path, gpu=4, host=2, disk=None)
    engine = FakeEngine(m)
    hi, lo = seq(1, 2 * T), seq(2, 2 * T)
    for toks, prio in ((hi, 90), (lo, 10)):
        kv = m.create_kv_cache(custom_priority_callback=lambda o, lc, p=prio: Priority(p))
        assert kv.resume()
        compute(engine, kv, toks, 2 * T)
        kv.close()
    publish(m, engine=engine, toks=seq(3, 2 * T))  # the low-priority blocks move down, the high-priority ones stay
    assert tree_levels(m, hi) == [0, 0] and tree_levels(m, lo) == [1, 1]
    publish(m, engine=engine, toks=seq(4, 2 * T))  # seq 3 moves down, the low-priority blocks are dropped
    assert m.probe_reuse(None, lo) == 0 and tree_levels(m, hi) == [0, 0] and tree_levels(m, seq(3, 2 * T)) == [1, 1]


@pytest.fixture(params=[True, False], ids=["batched", "per-copy"])
def fake_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> object:
    """The CUDA backend on an emulated driver (with or without cuMemcpyBatchAsync)."""
    import cuda.bindings
    from fake_cuda_driver import FakeDriver

    drv = FakeDriver(batch=bool(request.param))
    monkeypatch.setattr(cuda.bindings, "driver", drv)
    return drv


@pytest.mark.parametrize("host", [True, False], ids=["gpu-host-disk", "gpu-disk"])
def test_cuda_backend_tiers_on_an_emulated_driver(fake_cuda: object, tmp_path: object, host: bool) -> None:
    """Pinned host pools, async host<->GPU copies (batched when the driver can), disk<->GPU through
    the pinned staging buffer; data intact, everything given back at shutdown."""
    from conftest import make_config
    from fake_cuda_driver import FakeDriver

    drv = fake_cuda
    assert isinstance(drv, FakeDriver)
    slot = 2 * 2 * REC * T
    cfg = make_config(
        kv_layers(2, T),
        T,
        3 * slot,
        host_quota=3 * slot if host else None,
        disk_quota=12 * slot,
        disk_path=str(tmp_path),
        backend="cuda",
        max_util_for_resume=1.0,
    )
    m = KVCacheManager(cfg)
    assert m.backend_name == "cuda"
    assert drv.registered if host else not drv.registered  # host pools are page-locked up front
    engine = FakeEngine(m, driver=drv)  # records: kernels on the request's stream, checked against copies
    seqs = [seq(r, 3 * T) for r in range(4)]
    for s in seqs:
        publish(m, engine=engine, toks=s)
    last = len(m.cache_tier_list) - 1
    assert tree_levels(m, seqs[0]) == [last] * 3
    for s in seqs:
        kv = m.create_kv_cache(input_tokens=s)
        assert kv.history_length == 3 * T and kv.resume()
        engine.check_all(kv, s, 3 * T)
        kv.close()
    a = m.create_kv_cache()  # a suspended request spills down and comes back
    assert a.resume()
    compute(engine, a, seqs[0][: 2 * T], 2 * T)
    a.suspend()
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(3 * T)
    assert levels_of(a) == [1, 1]
    hog.close()
    assert a.resume()
    engine.check_all(a, seqs[0], 2 * T)
    a.close()
    # host tier: pinned pools; no host tier: disk <-> GPU through the pinned staging buffer
    assert drv.bytes_copied["DtoH"] > 0 and drv.bytes_copied["HtoD"] > 0
    gpu, below = m._storage.levels[0][0], m._storage.levels[1][0]
    # pages land in consecutive slots, so the batches above may be single copies: two that cannot merge
    m._storage.copier.copy(gpu.pools, below.pools, gpu.layout.slot_sizes, [(0, 1), (1, 0)])
    assert ("cuMemcpyBatchAsync" in drv.calls) == hasattr(drv, "cuMemcpyBatchAsync")
    assert "cuCtxSynchronize" not in drv.calls  # copies wait for the engine's stream's events instead
    m.clear_reusable_blocks()
    m.shutdown()
    assert not drv.mapped and not drv.handles and not drv.reservations and not drv.registered and not drv.events


def test_cuda_host_pool_registration_failure_changes_nothing(fake_cuda: object, tmp_path: object) -> None:
    from conftest import make_config
    from fake_cuda_driver import FakeDriver

    from kv_cache_manager_v2 import CuError

    drv = fake_cuda
    assert isinstance(drv, FakeDriver)
    slot = 2 * 2 * REC * T
    drv.fail_next["cuMemHostRegister"] = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CuError, match="cuMemHostRegister"):
        KVCacheManager(make_config(kv_layers(2, T), T, 3 * slot, host_quota=3 * slot, backend="cuda"))
    assert not drv.mapped and not drv.registered and not drv.reservations
    m = KVCacheManager(make_config(kv_layers(2, T), T, 3 * slot, host_quota=3 * slot, backend="cuda"))
    drv.fail_next["cuMemHostRegister"] = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    registered = dict(drv.registered)
    with pytest.raises(CuError):
        m.resize(HOST, 12 * slot)  # growing registers more page-locked memory
    assert drv.registered == registered and m.get_quota(HOST) == 3 * slot
    assert m.resize(HOST, 12 * slot) and len(drv.registered) == 2
    assert m.resize(HOST, slot) and len(drv.registered) == 1  # the chunk beyond is given back
    m.shutdown()
    assert not drv.registered


def test_cuda_copy_failure_during_eviction_leaves_a_consistent_state(fake_cuda: object, tmp_path: object) -> None:
    from conftest import make_config
    from fake_cuda_driver import FakeDriver

    from kv_cache_manager_v2 import CuError

    drv = fake_cuda
    assert isinstance(drv, FakeDriver)
    m = KVCacheManager(
        make_config(kv_layers(2, T), T, 2 * SLOT, host_quota=4 * SLOT, backend="cuda", max_util_for_resume=1.0)
    )
    engine = FakeEngine(m)
    toks = seq(1, 2 * T)
    publish(m, engine=engine, toks=toks)  # the GPU is full of reusable blocks
    kv = m.create_kv_cache()
    assert kv.resume()
    for name in ("cuMemcpyBatchAsync", "cuMemcpyDtoHAsync"):
        drv.fail_next[name] = drv.CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(CuError):
        kv.resize(2 * T)  # evicting them to host fails in the driver
    drv.fail_next.clear()
    m.check_invariants()
    assert kv.capacity == 0 and tree_levels(m, toks) == [0, 0]
    assert kv.resize(2 * T)  # the next attempt moves them
    assert tree_levels(m, toks) == [1, 1]
    kv.close()
    b = m.create_kv_cache(input_tokens=toks)
    assert b.resume()
    engine.check_all(b, toks, 2 * T)
    b.close()
    m.clear_reusable_blocks()
    m.shutdown()


def test_failed_read_of_a_partial_match_source_drops_only_that_block(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = tiered(make_manager, tmp_path, gpu=3, host=3, disk=3)
    engine = FakeEngine(m)
    writer = seq(1, 2 * T)
    for s in (writer, seq(2, 3 * T), seq(3, 3 * T)):
        publish(m, engine=engine, toks=s)
    b = m.create_kv_cache(input_tokens=writer[: T + 5] + [1, 2])
    src = b.block_table.pending_copy[0]
    assert b.history_length == T + 5 and src is not None and src.level == 2
    bad = src.slot * SLOT
    disk_pool(m).error_hook = lambda op, off, n: op == "read" and off <= bad < off + n
    assert b.resume()
    disk_pool(m).error_hook = None
    assert b.history_length == b.capacity == T  # the full block came up; the partial one is gone
    assert m.probe_reuse(None, writer) == T and m.get_tier_statistics(DISK).io_errors == 1
    engine.check_all(b, writer, T)
    compute(engine, b, writer[: T + 5] + [1, 2], T + 7)
    b.close()


def test_index_buffer_reads_bad_while_suspended(make_manager: MakeManager, tmp_path: object) -> None:
    from array import array

    m = tiered(make_manager, tmp_path, gpu=4, host=4, disk=None)
    engine = FakeEngine(m)
    kv = m.create_kv_cache()
    backing = array("i", [7] * 6)
    kv.set_base_page_index_buf(0, LG0, memoryview(backing))
    assert list(backing) == [BAD_PAGE_INDEX] * 6
    assert kv.resume()
    compute(engine, kv, seq(1, 3 * T), 3 * T)
    live = list(backing[:3])
    assert live == list(kv.get_base_page_indices(LG0)) and BAD_PAGE_INDEX not in live
    kv.suspend()
    assert list(backing) == [BAD_PAGE_INDEX] * 6
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(4 * T)  # kv's pages go to host
    hog.close()
    assert kv.resume()
    assert list(backing[:3]) == list(kv.get_base_page_indices(LG0)) and BAD_PAGE_INDEX not in backing[:3]
    engine.check_all(kv, seq(1, 3 * T), 3 * T)
    kv.close()


def test_a_slot_taken_from_the_free_list_counts_toward_the_peaks() -> None:
    """Issue 38.19: ``allocate_one`` from the free list left the peaks behind, so a tier whose
    slots were reused (after adoption's holes, or once the per-step peak was reset) read a lower
    peak than it held; pool-less allocator (its slots are only counted here)."""
    a = SlotAllocator(8, [], ())
    a.take([SlotId(0), SlotId(5)])  # what a persistent disk tier adopts: slots 1-4 are holes
    for _ in range(4):
        a.allocate_one()
    assert a.num_used == 6 and a.peak_used == 6
    b = SlotAllocator(8, [], ())
    slots = b.allocate(6)
    for s in slots[:3]:
        b.free(s)
    b.iteration_peak = b.num_used  # what take_iteration_stats() does after each step
    for _ in range(3):
        b.allocate_one()
    assert b.num_used == 6 and b.iteration_peak == 6
