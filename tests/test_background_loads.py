"""Background loads (``load_workers``): ``KVCache.prefetch`` / ``loading`` / ``ready``,
``KVCacheManager.prefetch(tokens)``, the adapter's loading state, and a remote tier behind a proxy
that delays every reply by 50 ms. Loads land in the order a test picks (the loader's manual mode)
or on real worker threads; the fake engine checks every record a request reads."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import REDIS_SERVER, Clock, MakeManager, kv_layers, make_config
from fake_engine import FakeEngine, adapter_step
from tier_helpers import SLOT, T, compute, computed, land_some, loader, seq, tiered, tree_pages, wait_loaded

from kv_cache_manager_v2 import (
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LogicError,
    Prefetch,
    RemoteCacheTierConfig,
    ReuseScope,
    compiled,
)
from kv_cache_manager_v2._storage._page_reads import ReadGroup, on_disk
from kv_cache_manager_v2.delay_proxy import DelayProxy
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState
from kv_cache_manager_v2.redis_server import LocalRedisServer

HOST = CacheLevel(1)
DISK = CacheLevel(2)


def land(m: KVCacheManager, order: list[int] | None = None) -> int:
    """Run the queued loads (in ``order``: indices into what is left, default first to last), then poll."""
    q = loader(m)
    for k in order or []:
        q.run_queued(k % len(q.queued))
    while q.queued:
        q.run_queued(0)
    return m.poll_loads()


def published_on_disk(m: KVCacheManager, docs: list[list[int]]) -> None:
    """Compute and publish ``docs`` (3 blocks each), then push them down to disk with other requests."""
    engine = FakeEngine(m)
    for toks in docs:
        kv = m.create_kv_cache(None, toks[:-1])
        assert kv.resume()
        compute(engine, kv, toks, len(toks))
        kv.close()
    for r in range(100, 104):  # 4 x 3 blocks: through the GPU and the host, pushing docs down
        computed(m, engine, seq(r, 3 * T), 3 * T).close()
    for toks in docs:
        assert all(p.level == DISK for p in tree_pages(m, toks))


def test_manager_prefetch_validates_its_arguments(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path)
    with pytest.raises(TypeError, match="input_tokens"):
        m.prefetch(b"abc")
    with pytest.raises(TypeError, match="input_tokens"):
        m.prefetch(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        m.prefetch([])
    with pytest.raises(ValueError, match="target_level"):
        m.prefetch([1, 2, 3], CacheLevel(3))
    with pytest.raises(TypeError, match="target_level"):
        m.prefetch([1, 2, 3], True)
    with pytest.raises(TypeError, match=None if compiled else "reuse_scope"):  # (compiled: mypyc's own check)
        m.prefetch([1, 2, 3], reuse_scope="a")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        m.prefetch([1, "x", 3])  # type: ignore[list-item]
    assert loader(m).in_flight == 0  # nothing started by a refused call
    handle = m.prefetch(seq(1, 20))  # nothing cached: done at once
    assert handle.done and handle.reused_tokens == 0 and handle.num_disk_pages == 0


@pytest.mark.parametrize("order", [[0, 0, 0], [2, 1, 0], [1, 0, 0]])
def test_prefetch_by_tokens_brings_the_match_up_from_disk(
    make_manager: MakeManager, tmp_path: object, order: list[int]
) -> None:
    """The loads land in any order; the create then finds every page in memory (no disk read at
    resume) and the data is exact."""
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    handle = m.prefetch(doc[:-1])
    assert isinstance(handle, Prefetch) and not handle.done and not handle.waits_for_remote
    assert handle.num_disk_pages == 3 and handle.reused_tokens == 3 * T
    assert all(p.level == DISK for p in tree_pages(m, doc))  # nothing moved before the loads land
    assert land(m, order) == 3
    assert handle.done and all(p.level == HOST for p in tree_pages(m, doc))
    onboarded = m.get_tier_statistics(DISK).onboarded_pages
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.ready and not kv.loading and kv.history_length == 3 * T
    assert kv.resume()
    assert m.get_tier_statistics(DISK).onboarded_pages == onboarded  # nothing read from disk at resume
    FakeEngine(m).check_all(kv, doc, 3 * T)
    kv.close()


def test_a_cancelled_prefetch_places_nothing_and_leaks_nothing(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    handle = m.prefetch(doc[:-1])
    handle.cancel()
    handle.cancel()  # idempotent
    assert handle.cancelled and handle.done
    reads = m._ctx.reads
    assert reads is not None
    assert land(m) == 0 and reads.num_discarded == 3  # (a worker skips a cancelled read it did not start)
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    assert all(p.level == DISK for p in tree_pages(m, doc))
    m.check_invariants()


def test_resume_of_a_loading_cache_reads_itself_and_discards_the_loads(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = tiered(make_manager, tmp_path)
    engine = FakeEngine(m)
    toks = seq(1, 3 * T)
    a = computed(m, engine, toks, 3 * T)
    a.suspend()
    for r in (2, 3, 4):  # push a down to disk
        computed(m, engine, seq(r, 3 * T), 3 * T).close()
    assert all(on_disk(p) for p in a.block_table.all_pages()) and not a.ready
    assert a.prefetch(CacheLevel(0))
    assert a.loading and not a.ready
    assert a.resume()  # not ready: reads synchronously, as without background loads
    assert a.ready and not a.loading
    engine.check_all(a, toks, 3 * T)
    reads = m._ctx.reads
    assert reads is not None
    land(m)
    assert reads.num_discarded == 3 and reads.num_installed == 0  # its pages moved: the reads are stale
    engine.check_all(a, toks, 3 * T)
    a.close()


def test_cancel_prefetch_stops_the_reads_and_changes_nothing_else(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path)
    engine = FakeEngine(m)
    toks = seq(1, 3 * T)
    a = m.create_kv_cache()
    a.cancel_prefetch()  # nothing loading: a no-op (in any state)
    assert a.resume()
    compute(engine, a, toks, 3 * T)
    a.suspend()
    for r in (2, 3, 4):  # push a down to disk
        h = m.create_kv_cache()
        assert h.resume()
        compute(engine, h, seq(r, 3 * T), 3 * T)
        h.close()
    assert a.prefetch(HOST) and a.loading
    land_some(m, 0, 1)  # one read lands and is installed; two are in flight
    assert a.loading and sum(p.level == HOST for p in a.block_table.all_pages()) == 1
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    a.cancel_prefetch()
    a.cancel_prefetch()  # idempotent
    assert not a.loading and not a.ready and a.status is KVCacheStatus.SUSPENDED
    reads = m._ctx.reads
    assert reads is not None
    installed = reads.num_installed
    land(m)
    assert reads.num_installed == installed  # the cancelled reads are discarded when they land
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    assert sum(p.level == DISK for p in a.block_table.all_pages()) == 2
    m.check_invariants()
    assert a.resume()  # reads the rest itself
    engine.check_all(a, toks, 3 * T)
    a.close()
    a.cancel_prefetch()  # closed: still a no-op
    m.check_invariants()


def test_a_cancelled_prefetch_owns_nothing_its_shared_reads_install(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """Two prefetches of one document share its three reads; the first is cancelled, the second
    lands them: they are the second's pages only (the first counts none installed)."""
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    first = m.prefetch(doc[:-1], HOST)
    second = m.prefetch(doc[:-1], HOST)
    assert first.num_disk_pages == second.num_disk_pages == 3 and len(loader(m).queued) == 3
    first.cancel()
    land(m)
    assert first.done and first.num_installed_pages == 0
    assert second.done and second.num_installed_pages == 3
    assert [p.level for p in tree_pages(m, doc)] == [HOST] * 3
    m.check_invariants()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()
    FakeEngine(m).check_all(kv, doc, 3 * T)
    kv.close()
    m.check_invariants()


@pytest.mark.parametrize("how", ["error", "corrupt"])
def test_a_failed_or_corrupt_background_read_is_a_miss(make_manager: MakeManager, tmp_path: object, how: str) -> None:
    """A read that fails, or whose bytes do not match the slot's checksum, loses the page like a
    failed synchronous read: the blocks from it on are recomputed, the rest is exact."""
    m = tiered(make_manager, tmp_path)
    engine = FakeEngine(m)
    toks = seq(1, 3 * T)
    a = computed(m, engine, toks, 3 * T)
    a.suspend()
    for r in (2, 3, 4):
        computed(m, engine, seq(r, 3 * T), 3 * T).close()
    victim = a.block_table.pages[0][1]  # block 1, layer group 0
    assert victim is not None and on_disk(victim)
    disk = victim.storage.pools[0]
    errors = m.get_tier_statistics(DISK).io_errors
    assert a.prefetch(HOST) and a.loading
    if how == "error":
        disk.error_hook = lambda op, offset, n: op == "read" and offset == victim.slot * n  # type: ignore[attr-defined]
    else:  # the file's bytes change behind the manager's back
        size = victim.storage.layout.slot_sizes[0]
        os.pwrite(disk.fd, b"\xff" * 16, victim.slot * size)  # type: ignore[attr-defined]
    land(m, [1, 0])
    disk.error_hook = None  # type: ignore[attr-defined]
    assert victim.lost and not a.loading
    assert m.get_tier_statistics(DISK).io_errors == errors + 1
    assert a.resume()
    assert a.history_length == T  # block 1 on is recomputed
    engine.check_all(a, toks, T)
    compute(engine, a, toks, 3 * T)
    engine.check_all(a, toks, 3 * T)
    a.close()


def test_a_read_of_a_slot_written_again_meanwhile_is_discarded_not_lost(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """The pages a prefetch reads move up and back into the same disk slots before the worker reads
    them, and the reads fail (as a read torn by the rewrite would): the slots' write generations
    changed, so the reads are discarded, not counted as lost pages. Every byte exact."""
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    pages = tree_pages(m, doc)
    slots = [p.slot for p in pages]
    handle = m.prefetch(doc[:-1])
    assert handle.num_disk_pages == 3
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.resume()  # up to the GPU (the prefetch still wants its reads)
    kv.close()
    assert m.directives.demote(doc[:-1], DISK).num_blocks == 3
    assert [p.level for p in pages] == [DISK] * 3 and [p.slot for p in pages] == slots  # back in the same slots
    errors = m.get_tier_statistics(DISK).io_errors
    disks = {id(p.storage.pools[0]): p.storage.pools[0] for p in pages}
    for disk in disks.values():
        disk.error_hook = lambda op, offset, n: op == "read"  # type: ignore[attr-defined]
    land(m)
    for disk in disks.values():
        disk.error_hook = None  # type: ignore[attr-defined]
    reads = m._ctx.reads
    assert reads is not None and reads.num_failed == 0 and reads.num_discarded == 3
    assert handle.done and not any(p.lost for p in pages) and [p.level for p in pages] == [DISK] * 3
    assert m.get_tier_statistics(DISK).io_errors == errors
    m.check_invariants()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()
    FakeEngine(m).check_all(kv, doc, 3 * T)
    kv.close()
    m.check_invariants()


def test_a_read_of_a_slot_dropped_by_a_shrink_and_written_again_is_discarded(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """The disk shrinks below the slots a prefetch reads and grows again, and the pages come back
    into those slots (one write each) before the reads, which fail, land: a slot mapped again
    never repeats a write generation it had, so the reads are discarded, no page is lost."""
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    pages = tree_pages(m, doc)
    slots = [p.slot for p in pages]
    handle = m.prefetch(doc[:-1])
    assert handle.num_disk_pages == 3
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.resume()
    kv.close()
    assert m.resize(DISK, SLOT) and m.resize(DISK, 32 * SLOT)  # slots beyond the first dropped, mapped again
    assert m.directives.demote(doc[:-1], DISK).num_blocks == 3
    again = [i for i, p in enumerate(pages) if p.slot == slots[i]]
    assert again and all(p.level == DISK for p in pages)  # (at least one page back at the slot it was read from)
    disk = pages[0].storage.pools[0]
    disk.error_hook = lambda op, offset, n: op == "read"  # type: ignore[attr-defined]
    land(m)
    disk.error_hook = None  # type: ignore[attr-defined]
    reads = m._ctx.reads
    assert reads is not None and reads.num_failed == 0 and reads.num_discarded == 3
    assert handle.done and not any(p.lost for p in pages) and [p.level for p in pages] == [DISK] * 3
    m.check_invariants()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()
    FakeEngine(m).check_all(kv, doc, 3 * T)
    kv.close()
    m.check_invariants()


def test_a_prefetch_outlived_by_its_manager_is_done(make_manager: MakeManager, tmp_path: object) -> None:
    m = tiered(make_manager, tmp_path)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    handle = m.prefetch(doc[:-1])
    assert not handle.done
    m.shutdown()  # the workers stop first; what they read is never installed
    assert handle.done and loader(m).closed


def test_background_loads_on_worker_threads_are_exact(make_manager: MakeManager, tmp_path: object) -> None:
    """Real workers: many prefetches and cache prefetches at once, installed as they land."""
    m = tiered(make_manager, tmp_path, manual=False, load_workers=3)
    docs = [seq(10 + i, 3 * T + 1) for i in range(4)]
    published_on_disk(m, docs)
    handles = [m.prefetch(doc[:-1], HOST) for doc in docs]
    wait_loaded(lambda: not all(h.done for h in handles))
    engine = FakeEngine(m)
    for doc in docs:  # the host holds 4 slots of 24: some were evicted again, read again at resume
        kv = m.create_kv_cache(None, doc[:-1])
        assert kv.resume()
        engine.check_all(kv, doc, kv.history_length)
        kv.close()
    m.check_invariants()


# ---------------------------------------------------------------- the adapter's loading state
@pytest.fixture
def adapters() -> Iterator[Callable[..., KVCacheResourceManager]]:
    made: list[KVCacheResourceManager] = []

    def factory(config: KVCacheManagerConfig) -> KVCacheResourceManager:
        a = KVCacheResourceManager(config)
        made.append(a)
        return a

    yield factory
    for a in made:
        a.shutdown()


def disk_adapter(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object, **kw: object
) -> tuple[KVCacheResourceManager, KVCacheManager, FakeEngine]:
    """An adapter with GPU and host of 8 slots and a disk tier of 32, its loads run by the test
    (``manual``), and a fake engine."""
    a = adapters(
        make_config(
            kv_layers(2, T),
            T,
            8 * SLOT,
            host_quota=8 * SLOT,
            disk_quota=32 * SLOT,
            disk_path=str(tmp_path),
            max_util_for_resume=1.0,
            backend="host",
            **kw,
        )
    )
    m = a.manager
    loader(m).manual = True
    return a, m, FakeEngine(m)


def serve_one_token_each(a: KVCacheResourceManager, engine: FakeEngine, ids: range, length: int) -> None:
    """Serve requests ``ids`` (``length`` prompt tokens each) one generated token each, then free
    them: they push older pages down."""
    for r in ids:
        other = EngineRequest(r, seq(r * 10, length), max_new_tokens=1)
        assert adapter_step(a, engine, [other]) == []
        other.state = RequestState.FINISHED
        a.free_resources(other)


def adapter_with_a_doc_on_disk(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object, **kw: object
) -> tuple[KVCacheResourceManager, KVCacheManager, FakeEngine, list[int]]:
    """``disk_adapter`` whose prefix ``doc`` (3 blocks) was served, then pushed to disk by four
    other requests."""
    a, m, engine = disk_adapter(adapters, tmp_path, **kw)
    doc = seq(1, 3 * T)
    first = EngineRequest(1, [*doc, 7], max_new_tokens=1)
    while len(first.generated_tokens) < 1:
        assert adapter_step(a, engine, [first]) == []
    first.state = RequestState.FINISHED
    a.free_resources(first)
    serve_one_token_each(a, engine, range(2, 6), 3 * T + 1)  # push doc's blocks to disk
    assert all(p.level == DISK for p in tree_pages(m, doc))
    return a, m, engine, doc


def test_adapter_serves_others_while_a_request_loads(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object
) -> None:
    a, m, engine, doc = adapter_with_a_doc_on_disk(adapters, tmp_path)
    loading = EngineRequest(10, [*doc, 8, 9], max_new_tokens=2)
    running = EngineRequest(11, seq(77, 2 * T), max_new_tokens=4)
    for _ in range(2):  # loading waits, unscheduled, while running is served
        assert adapter_step(a, engine, [loading, running]) == [loading]
        assert a.is_loading(loading) and not a.has_resources(loading) and a.num_loading == 1
        assert loading.num_scheduled_tokens == 0
    assert a.loading_waits == {"disk": 2, "remote": 0}
    land(m)
    assert adapter_step(a, engine, [loading, running]) == []  # admitted: its prefix from the host
    assert not a.is_loading(loading) and a.num_loading == 0
    assert loading.num_reused_tokens == 3 * T and loading.num_reused_tokens_per_level[1] == 3 * T
    while len(loading.generated_tokens) < 2:
        assert adapter_step(a, engine, [loading]) == []
    for r in (loading, running):
        r.state = RequestState.FINISHED
        a.free_resources(r)
    # freed while loading: its loads are cancelled, nothing is allocated or leaked
    serve_one_token_each(a, engine, range(20, 24), 3 * T + 1)
    gone = EngineRequest(12, [*doc, 5], max_new_tokens=1)
    assert adapter_step(a, engine, [gone]) == [gone] and a.is_loading(gone)
    before = [m.get_storage_statistics(CacheLevel(level)) for level in range(3)]
    a.free_resources(gone)
    assert not a.is_loading(gone) and a.num_loading == 0
    land(m)
    assert [m.get_storage_statistics(CacheLevel(level)) for level in range(3)] == before
    m.check_invariants()


def test_a_suspended_request_reads_to_the_host_while_the_gpu_is_full(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object
) -> None:
    """A suspended request whose pages lie on disk while a running one fills the GPU: its pages are
    read up to the host in the background (the wait overlaps the GPU's), then it resumes from
    there once the GPU has room. Every byte exact."""
    a, m, engine = disk_adapter(adapters, tmp_path)
    sus = EngineRequest(1, seq(1, 3 * T), max_new_tokens=2)
    assert adapter_step(a, engine, [sus]) == []
    a.suspend_resources(sus)
    serve_one_token_each(a, engine, range(2, 6), 7 * T)  # its held pages go down to disk
    kv = a.get_kv_cache(sus)
    assert all(p.level == DISK for p in kv.block_table.all_pages())
    big = EngineRequest(9, seq(90, 8 * T - 1), max_new_tokens=2)  # the whole GPU
    assert adapter_step(a, engine, [big, sus]) == [sus]
    assert a.is_loading(sus) and a.loading_waits["disk"] == 1
    assert land(m) == 3 and all(p.level == HOST for p in kv.block_table.all_pages())
    assert not a.is_loading(sus)
    big.state = RequestState.FINISHED
    a.free_resources(big)
    onboarded = m.get_tier_statistics(DISK).onboarded_pages
    while len(sus.generated_tokens) < 2:
        assert adapter_step(a, engine, [sus]) == []
    assert m.get_tier_statistics(DISK).onboarded_pages == onboarded  # resumed from the host
    sus.state = RequestState.FINISHED
    a.free_resources(sus)
    m.check_invariants()


def test_observe_step_tells_the_plan_the_step_time(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object
) -> None:
    """With background loads a request reading from disk joins a later step: the adapter's
    ``observe_step`` tells the manager the step time (``set_prefill_rate``'s ``step_s``), the same
    average as the prefill rate, decode steps included; a step too short to time says nothing."""
    a, m, _ = disk_adapter(adapters, tmp_path)
    a.observe_step(0.5, 0)
    assert m._planner.step_s == 0.5 and m.load_plan_statistics.prefill_tokens_per_s is None
    a.observe_step(0.25, 100)
    assert m._planner.step_s == pytest.approx(0.8 * 0.5 + 0.2 * 0.25)
    assert m.load_plan_statistics.prefill_tokens_per_s == 400.0
    a.observe_step(0.0, 100)
    a.observe_step(1e-320, 100)
    a.observe_step(1e-305, 10_000)  # (an infinite rate: the step time is left as it was too)
    assert m._planner.step_s == pytest.approx(0.45) and m.load_plan_statistics.prefill_tokens_per_s == 400.0


# ---------------------------------------------------------------- a remote tier 50 ms away
@pytest.fixture
def slow_redis() -> Iterator[tuple[LocalRedisServer, DelayProxy]]:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server")
    with LocalRedisServer(REDIS_SERVER) as server:
        proxy = DelayProxy(server.port, 0.05)
        try:
            yield server, proxy
        finally:
            proxy.close()


def remote_adapter_config(url: str, write_through: bool, load_workers: int = 2) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[
            GpuCacheTierConfig(96 * SLOT),
            HostCacheTierConfig(32 * SLOT),
            RemoteCacheTierConfig(url, "slow", timeout_ms=5000, write_through=write_through),
        ],
        layers=kv_layers(2, T),
        backend="host",
        max_util_for_resume=1.0,
        load_workers=load_workers,
    )


def serve_until_admitted(a: KVCacheResourceManager, r: EngineRequest) -> None:
    """Steps of ``r`` alone until it is admitted (it may wait in the loading state first), then to its end."""
    engine = FakeEngine(a.manager)
    deadline = time.monotonic() + 30.0
    while len(r.generated_tokens) < r.max_new_tokens:
        unserved = adapter_step(a, engine, [r])
        assert not unserved or a.is_loading(r)
        assert time.monotonic() < deadline
        time.sleep(0.001 if unserved else 0)
    r.state = RequestState.FINISHED
    a.free_resources(r)


def test_the_delay_proxy_delays_replies(slow_redis: tuple[LocalRedisServer, DelayProxy]) -> None:
    import redis

    _, proxy = slow_redis
    client = redis.Redis.from_url(proxy.url)
    try:
        assert client.set("k", b"v")
        start = time.monotonic()
        assert client.get("k") == b"v"
        assert time.monotonic() - start >= 0.05
    finally:
        client.close()


def test_requests_wait_for_a_slow_remote_tier_while_others_run(
    slow_redis: tuple[LocalRedisServer, DelayProxy], adapters: Callable[..., KVCacheResourceManager]
) -> None:
    """Behind 50 ms per reply: each new request reusing a published prefix waits in the loading
    state (its lookup and fetch in the background) while the running one is served every step;
    admitted, it reuses the prefix without asking the server again, every byte exact."""
    server, proxy = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    docs = [seq(200 + i, 4 * T) for i in range(3)]
    for i, doc in enumerate(docs):
        serve_until_admitted(peer, EngineRequest(100 + i, [*doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    a = adapters(remote_adapter_config(proxy.url, False))
    engine = FakeEngine(a.manager)
    running = EngineRequest(1, seq(5, 2 * T), max_new_tokens=1000)  # (runs through the whole test)
    new = [EngineRequest(10 + i, [*doc, 3, 4], max_new_tokens=2) for i, doc in enumerate(docs)]
    while adapter_step(a, engine, [running]):  # (its own lookup first: it has no match)
        assert a.is_loading(running)
        time.sleep(0.005)
    assert a.prefetch_resources(new) == new  # queued: their lookups and fetches start
    # (every reply takes 50 ms: still loading) prepare returns a loading request unserved, runs the rest
    assert adapter_step(a, engine, [running, new[0]]) == [new[0]] and a.is_loading(new[0])
    steps_while_loading = 1
    deadline = time.monotonic() + 30.0
    while any(a.is_loading(r) for r in new):
        assert time.monotonic() < deadline
        assert adapter_step(a, engine, [running]) == []  # the running request is served every step
        steps_while_loading += 1
        time.sleep(0.005)  # (the engine's forward pass)
    assert steps_while_loading >= 2 and a.loading_requests["remote"] == 1 + 3  # (the running one looked up first)
    remote = a.manager._remote
    assert remote is not None
    lookups, fetched = remote.lookups, remote.fetched_pages
    assert adapter_step(a, engine, [running, *new]) == []  # all admitted: their prefixes are in the host tier
    assert (remote.lookups, remote.fetched_pages) == (lookups, fetched)  # the creates asked the server nothing
    for r in new:
        assert r.num_reused_tokens == 4 * T and r.num_reused_tokens_per_level[1] == 4 * T  # (placed in the host)
    for r in new:
        while len(r.generated_tokens) < r.max_new_tokens:
            assert adapter_step(a, engine, [r]) == []
    a.manager.check_invariants()


def test_prefetch_by_tokens_fetches_from_the_remote_tier(
    slow_redis: tuple[LocalRedisServer, DelayProxy], adapters: Callable[..., KVCacheResourceManager]
) -> None:
    """Manual order: the lookup, then the fetch it asks for, land; a failed server is a miss."""
    server, proxy = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    doc = seq(300, 3 * T)
    serve_until_admitted(peer, EngineRequest(1, [*doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    m = KVCacheManager(remote_adapter_config(proxy.url, False))
    try:
        loader(m).manual = True
        scope = ReuseScope()
        handle = m.prefetch(doc, reuse_scope=scope)
        assert handle.waits_for_remote and handle.reused_tokens == 0
        land(m)  # the lookup: the fetch starts
        assert handle.waits_for_remote and handle.reused_tokens == 3 * T and handle.num_remote_pages == 3
        land(m)
        assert handle.done and not handle.waits_for_remote
        fill = m._matcher.remote_fill
        assert fill is not None and fill.placed == []  # (its group took the pages placed: the fill keeps none)
        lookups = m._remote.lookups  # type: ignore[union-attr]
        kv = m.create_kv_cache(scope, doc)
        assert kv.history_length == 3 * T and m._remote.lookups == lookups  # type: ignore[union-attr]
        assert kv.resume()
        FakeEngine(m).check_all(kv, doc, 3 * T)
        kv.close()
        other = seq(400, 3 * T)
        handle = m.prefetch(other)
        server.kill()  # the lookup fails: a miss, recomputed
        land(m)
        assert handle.done and handle.reused_tokens == 0
        kv = m.create_kv_cache(None, other)
        assert kv.history_length == 0 and kv.status is KVCacheStatus.SUSPENDED
        kv.close()
    finally:
        m.shutdown()


def test_adapter_under_load_policy_never_admits_new_requests_without_loading(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object
) -> None:
    """Under ``load_policy="never"`` a new request takes only what is in GPU memory: it never waits
    in the loading state for disk reads its create would not use (it is admitted at once and
    recomputes its prefix); a suspended request still has its own pages read in the background."""
    a, m, engine, doc = adapter_with_a_doc_on_disk(adapters, tmp_path, load_policy="never")
    new = EngineRequest(10, [*doc, 8, 9], max_new_tokens=2)
    assert a.prefetch_resources([new]) == []
    assert adapter_step(a, engine, [new]) == []  # admitted at once: nothing to wait for
    assert not a.is_loading(new) and a.loading_waits == {"disk": 0, "remote": 0}
    assert new.num_reused_tokens == 0 and loader(m).in_flight == 0
    while len(new.generated_tokens) < 2:
        assert adapter_step(a, engine, [new]) == []
    new.state = RequestState.FINISHED
    a.free_resources(new)
    m.check_invariants()


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_prefetch_reads_only_what_the_load_plan_takes(make_manager: MakeManager, tmp_path: object, policy: str) -> None:
    """A prefetch never reads what the create's load plan would recompute: under "never", or under
    "auto" when the engine recomputes faster than the disk reads (its request would otherwise wait
    in the loading state for a read slower than recomputing). With a slow prefill it reads it all."""
    m = tiered(make_manager, tmp_path, load_policy=policy, prefill_tokens_per_s=1e15)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    handle = m.prefetch(doc[:-1])
    assert handle.done and handle.num_disk_pages == 0 and handle.reused_tokens == 0
    assert loader(m).in_flight == 0 and all(p.level == DISK for p in tree_pages(m, doc))
    assert m.probe_reuse(None, doc[:-1]) == 0
    if policy == "auto":  # a slow engine: loading the disk's blocks saves time, the prefetch reads them
        m.set_prefill_rate(1.0)
        handle = m.prefetch(doc[:-1])
        assert handle.num_disk_pages == 3 and land(m) == 3 and handle.done
        kv = m.create_kv_cache(None, doc[:-1])
        assert kv.ready and kv.history_length == 3 * T and kv.resume()
        FakeEngine(m).check_all(kv, doc, 3 * T)
        kv.close()
    m.check_invariants()


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_a_remote_prefetch_fetches_only_what_the_load_plan_takes(
    slow_redis: tuple[LocalRedisServer, DelayProxy], adapters: Callable[..., KVCacheResourceManager], policy: str
) -> None:
    """With an engine that recomputes faster than the remote tier answers ("auto"), the prefetch's
    lookup lands and nothing is fetched; under "never" nothing is even looked up. The create then
    recomputes, as its plan says (the probe agrees)."""
    server, _ = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    doc = seq(500, 3 * T)
    serve_until_admitted(peer, EngineRequest(1, [*doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    config = dataclasses.replace(
        remote_adapter_config(server.url, False), load_policy=policy, prefill_tokens_per_s=1e15
    )
    m = KVCacheManager(config)
    try:
        loader(m).manual = True
        handle = m.prefetch(doc)
        assert handle.waits_for_remote == (policy == "auto")
        land(m)  # the lookup (auto): no fetch follows
        assert handle.done and handle.num_remote_pages == 0 and loader(m).in_flight == 0
        assert m.probe_reuse(None, doc) == 0
        kv = m.create_kv_cache(None, doc)
        assert kv.history_length == 0
        kv.close()
        if policy == "auto":  # a slow engine: the prefetch fetches the blocks, the create takes them
            m.set_prefill_rate(1.0)
            handle = m.prefetch(doc)
            land(m)
            land(m)
            assert handle.done and handle.num_remote_pages == 3
            kv = m.create_kv_cache(None, doc)
            assert kv.history_length == 3 * T and kv.resume()
            FakeEngine(m).check_all(kv, doc, 3 * T)
            kv.close()
        m.check_invariants()
    finally:
        m.shutdown()


def test_a_background_read_placed_where_held_pages_must_make_room_below(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """The host is full of a suspended request's pages and the disk holds only the prefetched
    pages and one free slot: the pages read are out of the disk's evictor while they are placed, so
    only as many are placed as the held pages can make room for (no OutOfPagesError from the poll);
    the rest stay on disk, read again by the create's resume. Every byte exact."""
    m = tiered(make_manager, tmp_path, disk_slots=4)
    engine = FakeEngine(m)
    doc = seq(1, 3 * T + 1)
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.resume()
    compute(engine, kv, doc, 3 * T)
    kv.close()
    held: list[tuple[object, list[int]]] = []
    for r in (2, 3):  # A (then B) takes the GPU: doc goes to the host, then A's held pages push it to disk
        toks = seq(r, 4 * T)
        kv = m.create_kv_cache()
        assert kv.resume()
        compute(engine, kv, toks, 4 * T)
        held.append((kv, toks))
        if r == 2:
            kv.suspend()
    assert all(p.level == DISK for p in tree_pages(m, doc))
    a = held[0][0]
    assert all(p.level == HOST for p in a.block_table.all_pages())  # type: ignore[attr-defined]
    handle = m.prefetch(doc[:-1], HOST)
    assert handle.num_disk_pages == 3
    land(m)  # one held page of A fits on disk: one page of doc is placed
    assert handle.done
    m.check_invariants()
    assert sum(p.level == HOST for p in tree_pages(m, doc)) == 1
    b, b_toks = held[1]
    engine.check_all(b, b_toks, 4 * T)  # type: ignore[arg-type]
    b.close()  # type: ignore[attr-defined]
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()  # the rest of doc read from disk at resume
    engine.check_all(kv, doc, 3 * T)
    kv.close()
    assert a.resume()  # type: ignore[attr-defined]
    engine.check_all(a, held[0][1], 4 * T)  # type: ignore[arg-type]
    a.close()  # type: ignore[attr-defined]
    m.check_invariants()


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("by", ["tokens", "directive"])
def test_a_prefetch_never_evicts_the_pages_it_brought(
    make_manager: MakeManager, tmp_path: object, order: int, by: str
) -> None:
    """A match of 6 pages prefetched (by tokens, or the prefetch directive) into a host of 4, the
    reads landing one poll at a time (in order or from the back): the first 4 installed stay on
    the host (placing a read never evicts a page the same prefetch brought), the other reads are
    discarded and their pages stay on disk, where the create's resume reads them. Every byte exact."""
    m = tiered(make_manager, tmp_path, gpu_slots=8)
    engine = FakeEngine(m)
    doc = seq(1, 6 * T + 1)
    computed(m, engine, doc, 6 * T).close()
    for r in (2, 3):  # through the GPU and the host: doc goes to disk
        computed(m, engine, seq(r, 8 * T), 8 * T).close()
    assert all(p.level == DISK for p in tree_pages(m, doc))
    if by == "tokens":
        handle = m.prefetch(doc[:-1], HOST)
        assert handle.num_disk_pages == 6
    else:
        assert m.directives.prefetch(doc[:-1], HOST).num_deferred == 6
    pages = tree_pages(m, doc)
    landed: list[int] = []
    q = loader(m)
    while q.queued:
        job = q.queued[-order]
        landed.append(pages.index(job.page))  # type: ignore[attr-defined]
        q.run_queued(-order % len(q.queued))
        m.poll_loads()
    assert by != "tokens" or (handle.done and handle.num_installed_pages == 4)
    assert [i for i in landed if pages[i].level == HOST] == landed[:4]
    assert all(pages[i].level == DISK for i in landed[4:])
    reads = m._ctx.reads
    assert reads is not None and reads.num_installed == 4 and reads.num_discarded == 2
    m.check_invariants()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 6 * T and kv.resume()
    engine.check_all(kv, doc, 6 * T)
    kv.close()
    m.check_invariants()


def test_placing_one_batch_of_reads_never_evicts_a_later_batchs_pages(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """One owner's reads of a 6-page match land in one poll in two batches (its first 3 pages to
    the GPU, the last 3 to the host; the GPU, the host and all but 2 disk slots full): making room
    for the first batch pushes 3 pages down to the disk, which drops its oldest unshelved page;
    the second batch's pages (the disk's oldest) stay in place until they are placed too: all 6
    installed. Every byte exact."""
    m = tiered(make_manager, tmp_path, gpu_slots=8, disk_slots=12)
    engine = FakeEngine(m)
    doc = seq(1, 6 * T + 1)
    computed(m, engine, doc, 6 * T).close()
    for r in (2, 3):  # through the GPU and the host: doc goes to disk
        computed(m, engine, seq(r, 8 * T), 8 * T).close()
    pages = tree_pages(m, doc)
    assert all(p.level == DISK for p in pages)
    reads = m._ctx.reads
    assert reads is not None
    group = ReadGroup()
    reads.read(pages[:3], CacheLevel(0), group)
    reads.read(pages[3:], HOST, group)
    assert land(m) == 6 and reads.num_discarded == 0
    assert [p.level for p in pages] == [0, 0, 0, HOST, HOST, HOST]
    m.check_invariants()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 6 * T and kv.resume()
    engine.check_all(kv, doc, 6 * T)
    kv.close()
    m.check_invariants()


def test_placing_background_reads_never_restarts_a_retention_duration(
    make_manager: MakeManager, tmp_path: object
) -> None:
    """Blocks retained for 10 s from t=0 are prefetched to the host one read a second: placing a
    read (its page and the pages the prefetch brought before) is no request using them, so their
    duration runs on to t=10 (it once restarted at every poll, keeping them retained for ever)."""
    clock = Clock()
    m = tiered(make_manager, tmp_path, gpu_slots=8, clock=clock)
    engine = FakeEngine(m)
    doc = seq(1, 6 * T + 1)
    computed(m, engine, doc[:-1], 6 * T).close()
    for r in (2, 3):  # through the GPU and the host: doc goes to disk
        computed(m, engine, seq(r, 8 * T), 8 * T).close()
    pages = tree_pages(m, doc)
    assert all(p.level == DISK for p in pages)
    assert m.directives.retain(doc[:-1], 80, 10.0).num_blocks == 6
    assert [p.expires for p in pages] == [10.0] * 6
    handle = m.prefetch(doc[:-1], HOST)
    q = loader(m)
    while q.queued:
        clock.now += 1.0
        q.run_queued(0)
        m.poll_loads()
        assert [p.expires for p in pages] == [10.0] * 6
        m.check_invariants()
    assert handle.done and handle.num_installed_pages == 4
    clock.now = 10.0
    m.check_invariants()
    assert [s.retained for s in m.get_storage_statistics(HOST)] == [0]  # (ran out on time)
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 6 * T and kv.resume()
    engine.check_all(kv, doc, 6 * T)
    kv.close()
    m.check_invariants()


def test_a_raising_batch_leaves_no_request_in_the_loading_state(
    adapters: Callable[..., KVCacheResourceManager], tmp_path: object
) -> None:
    """``prepare_resources`` rolls the whole batch back when an item raises: a new request it put
    in the loading state leaves it (its prefetch cancelled, the counters as before)."""
    a, m, engine, doc = adapter_with_a_doc_on_disk(adapters, tmp_path)
    new = EngineRequest(10, [*doc, 8, 9], max_new_tokens=2)
    finished = EngineRequest(11, seq(99, 5), max_new_tokens=2)
    finished.state = RequestState.FINISHED
    with pytest.raises(LogicError, match="FINISHED"):
        a.prepare_resources([new, finished])
    assert not a.is_loading(new) and a.num_loading == 0
    assert a.loading_requests == {"disk": 0, "remote": 0} and a.loading_waits == {"disk": 0, "remote": 0}
    assert land(m) == 0 and all(p.level == DISK for p in tree_pages(m, doc))  # its reads were cancelled
    assert adapter_step(a, engine, [new]) == [new] and a.is_loading(new)  # the batch again: it loads
    assert a.loading_requests == {"disk": 1, "remote": 0} and a.loading_waits == {"disk": 1, "remote": 0}
    land(m)
    while len(new.generated_tokens) < 2:
        assert adapter_step(a, engine, [new]) == []
    assert new.num_reused_tokens == 3 * T
    m.check_invariants()


@pytest.mark.parametrize("refine", [True, False])
def test_background_disk_reads_refine_the_disk_cost(make_manager: MakeManager, tmp_path: object, refine: bool) -> None:
    """A read on a worker is timed there (the pread and its check) and refines the disk tier's
    cost when installed, as a synchronous read does (``refine_tier_costs``)."""
    m = tiered(make_manager, tmp_path, refine_tier_costs=refine)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    costs = m._storage.costs
    assert costs is not None
    before = (costs.samples[2], costs.latency_s[2], costs.seconds_per_byte[2])
    handle = m.prefetch(doc[:-1], HOST)
    assert land(m) == 3 and handle.done
    after = (costs.samples[2], costs.latency_s[2], costs.seconds_per_byte[2])
    assert (after[0] == before[0] + 3 and after != before) if refine else after == before


def test_a_prefetchs_fetch_refines_the_remote_cost(
    slow_redis: tuple[LocalRedisServer, DelayProxy], adapters: Callable[..., KVCacheResourceManager]
) -> None:
    """The fetch round trip of a prefetch is timed on its worker and refines the remote tier's
    cost (here its latency: 50 ms a reply, against the 0.5 ms prior)."""
    server, proxy = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    doc = seq(600, 3 * T)
    serve_until_admitted(peer, EngineRequest(1, [*doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    m = KVCacheManager(remote_adapter_config(proxy.url, False))
    try:
        loader(m).manual = True
        prior = m.load_plan_statistics.read_latency_s[2]
        handle = m.prefetch(doc)
        land(m)  # the lookup (no bytes: nothing to refine)
        assert m.load_plan_statistics.read_latency_s[2] == prior
        land(m)  # the fetch
        assert handle.done and handle.num_remote_pages == 3
        assert m.load_plan_statistics.read_latency_s[2] > prior
    finally:
        m.shutdown()


def test_a_prefetch_cut_by_the_plan_reports_the_cut_after_its_lookup(
    slow_redis: tuple[LocalRedisServer, DelayProxy], adapters: Callable[..., KVCacheResourceManager]
) -> None:
    """Three blocks in the host tier, two more in the remote tier, an engine that recomputes
    faster than either loads: the prefetch reads and fetches nothing, and its ``reused_tokens``
    stays what the plan takes (none) after the remote lookup lands."""
    server, _ = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    doc = seq(700, 5 * T)
    serve_until_admitted(peer, EngineRequest(1, [*doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    base = remote_adapter_config(server.url, False)
    tiers = [GpuCacheTierConfig(4 * SLOT), HostCacheTierConfig(32 * SLOT), base.cache_tiers[2]]
    m = KVCacheManager(dataclasses.replace(base, cache_tiers=tiers, prefill_tokens_per_s=1e15))
    try:
        loader(m).manual = True
        engine = FakeEngine(m)
        for toks in (doc[: 3 * T], seq(701, 3 * T), seq(702, 3 * T)):  # doc's first 3 blocks, pushed to the host
            computed(m, engine, toks, 3 * T).close()
        assert all(p.level == HOST for p in tree_pages(m, doc[: 3 * T]))
        handle = m.prefetch(doc)
        assert handle.reused_tokens == 0 and handle.num_disk_pages == 0
        land(m)  # the lookup: nothing worth fetching
        assert handle.done and handle.num_remote_pages == 0 and handle.reused_tokens == 0
        assert m.probe_reuse(None, doc) == 0
    finally:
        m.shutdown()


def test_round_trips_land_even_when_placing_a_disk_read_raises(
    slow_redis: tuple[LocalRedisServer, DelayProxy],
    adapters: Callable[..., KVCacheResourceManager],
    tmp_path: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll whose disk reads fail to be placed (here: a CuError mapping host memory, emulated)
    raises, but the remote round trips that finished with them still land: the prefetches
    waiting for the remote tier go on (else every later one would wait forever)."""
    if compiled:
        pytest.skip("a compiled class's methods cannot be patched to inject the failure")
    server, _ = slow_redis
    peer = adapters(remote_adapter_config(server.url, True))
    remote_doc = seq(800, 3 * T)
    serve_until_admitted(peer, EngineRequest(1, [*remote_doc, 1], max_new_tokens=1))
    assert peer.manager.flush_remote_writes()
    base = remote_adapter_config(server.url, False)
    tiers = [
        GpuCacheTierConfig(4 * SLOT),
        HostCacheTierConfig(4 * SLOT),
        DiskCacheTierConfig(32 * SLOT, str(tmp_path)),
        base.cache_tiers[2],
    ]
    m = KVCacheManager(dataclasses.replace(base, cache_tiers=tiers))
    try:
        loader(m).manual = True
        doc = seq(1, 3 * T + 1)
        published_on_disk(m, [doc])
        disk_prefetch = m.prefetch(doc[:-1], HOST)
        remote_prefetch = m.prefetch(remote_doc)
        assert disk_prefetch.num_disk_pages == 3 and remote_prefetch.waits_for_remote
        reads = m._ctx.reads
        assert reads is not None

        def failing(jobs: list[object], dst: object) -> int:
            raise RuntimeError("emulated: mapping host memory failed")

        monkeypatch.setattr(reads, "_place", failing)
        with pytest.raises(RuntimeError, match="emulated"):
            land(m)  # the three disk reads and the lookup finish together
        monkeypatch.undo()
        assert disk_prefetch.done  # (its reads were discarded: the create reads them itself)
        land(m)  # the fetch the lookup started
        assert remote_prefetch.done and remote_prefetch.num_remote_pages == 3
        kv = m.create_kv_cache(None, remote_doc)
        assert kv.history_length == 3 * T and kv.resume()
        FakeEngine(m).check_all(kv, remote_doc, 3 * T)
        kv.close()
        m.check_invariants()
    finally:
        m.shutdown()


def test_without_workers_a_prefetch_starts_nothing(make_manager: MakeManager, tmp_path: object) -> None:
    """``load_workers=0``: ``prefetch`` is done at once and moves nothing (the create reads)."""
    m = tiered(make_manager, tmp_path, manual=False, load_workers=0)
    doc = seq(1, 3 * T + 1)
    published_on_disk(m, [doc])
    handle = m.prefetch(doc[:-1])
    assert handle.done and handle.num_disk_pages == 0 and handle.reused_tokens == 3 * T
    assert all(p.level == DISK for p in tree_pages(m, doc))
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()
    FakeEngine(m).check_all(kv, doc, 3 * T)
    kv.close()
