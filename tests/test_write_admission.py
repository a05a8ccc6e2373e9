"""Queued writes per tier and write admission: the manager queues the writes of evicted pages on
each tier's link at the tier's ``write_bytes_per_s`` (the load plan waits behind them), and drops
a reusable page whose write would take its link's backlog beyond ``max_write_backlog_s``
(``TierStatistics.declined_pages``); HELD pages are always written. KV data checked through the
fake engine and the invariant checker."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Clock, kv_layers, shut_down
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, computed, publish, seq, tree_pages

from kv_cache_manager_v2 import (
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    PageStatus,
    compiled,
)

HOST, DISK = CacheLevel(1), CacheLevel(2)
#: host: 1 ms a page read, free writes; disk: 10 ms a page read, 25 ms a page written; no latency
HOST_BPS = SLOT * 1000.0
DISK_BPS = SLOT * 100.0
DISK_WRITE_BPS = SLOT * 40.0
#: 20 ms a block: every block is worth loading from host and disk (see test_load_plan.py)
TWENTY_MS = T / 0.020


@pytest.fixture
def mk(backend: str, tmp_path: Any) -> Any:
    """GPU 4 blocks, host 4, disk 8 (two full-attention layers, one slot a block), on a test clock."""
    made: list[KVCacheManager] = []

    def factory(clock: Clock, backlog: float | None, rate: float | None = None, **kw: Any) -> KVCacheManager:
        host = HostCacheTierConfig(4 * SLOT, read_bytes_per_s=HOST_BPS, read_latency_s=0.0, write_bytes_per_s=1e30)
        disk = DiskCacheTierConfig(
            8 * SLOT, str(tmp_path), read_bytes_per_s=DISK_BPS, read_latency_s=0.0, write_bytes_per_s=DISK_WRITE_BPS
        )
        config = KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=[GpuCacheTierConfig(kw.pop("gpu", 4) * SLOT), host, disk],
            layers=kv_layers(2, T),
            backend=backend,  # type: ignore[arg-type]
            prefill_tokens_per_s=rate,
            refine_tier_costs=False,
            max_util_for_resume=1.0,
            max_write_backlog_s=backlog,
            clock=clock,
            **kw,
        )
        m = KVCacheManager(config)
        made.append(m)
        return m

    yield factory
    shut_down(made)


#: the prompt whose blocks end on host, host, disk, disk after ``spread`` (without declines)
PROMPT = seq(0, 2 * T) + seq(1, 2 * T)


def spread(m: KVCacheManager, engine: FakeEngine) -> None:
    """Publish ``PROMPT``, then three prompts of two blocks pushing it down the tiers (its last two
    blocks are written to the disk, in one batch)."""
    publish(m, PROMPT, engine=engine)
    for r in range(2, 5):
        publish(m, seq(r, 2 * T), engine=engine)


def take(m: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> int:
    """Create, resume, check the reused prefix's data, compute the rest, close; the tokens reused."""
    kv = m.create_kv_cache(None, tokens)
    assert kv.resume()
    h = kv.history_length
    engine.check_all(kv, tokens, h)
    compute(engine, kv, tokens, len(tokens))
    kv.close()
    m.check_invariants()
    return h


def test_the_plan_waits_behind_the_managers_own_writes(mk: Any) -> None:
    """Two pages written to the disk at 25 ms each: 50 ms queued. At 20 ms a block the disk blocks
    saved 58 ms with an idle link, 8 ms behind the queue: the two host blocks (38 ms) win. The
    queue drains as the clock runs: 50 ms later every block loads again."""
    clock = Clock()
    m = mk(clock, None, TWENTY_MS)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.get_tier_statistics(DISK).offloaded_pages == 2
    assert m.load_plan_statistics.link_wait_s == pytest.approx((0.0, 0.0, 0.050))
    assert m.probe_reuse_levels(None, PROMPT) == [1, 1]
    clock.now = 0.030
    assert m.load_plan_statistics.link_wait_s[2] == pytest.approx(0.020)
    clock.now = 0.050
    assert m.load_plan_statistics.link_wait_s == (0.0, 0.0, 0.0)
    assert take(m, engine, PROMPT) == 4 * T


def test_set_tier_wait_drains_and_our_writes_queue_on_top(mk: Any) -> None:
    clock = Clock()
    m = mk(clock, None)
    m.set_tier_wait(2, 0.1)
    clock.now = 0.04
    assert m.load_plan_statistics.link_wait_s[2] == pytest.approx(0.06)
    spread(m, FakeEngine(m))  # two pages written: 50 ms more
    assert m.load_plan_statistics.link_wait_s[2] == pytest.approx(0.11)
    m.set_tier_wait(2, 0.0)  # what the engine knows wins: it counts our writes too
    assert m.load_plan_statistics.link_wait_s[2] == 0.0


def test_writes_beyond_the_backlog_bound_are_declined(mk: Any) -> None:
    """A 30 ms bound takes the first page (25 ms), declines the second: it is dropped (counted at
    the disk as declined, at the host as dropped) and its block is simply not there: a request
    reuses up to it and computes the rest, every byte exact."""
    clock = Clock()
    m = mk(clock, 0.030)
    engine = FakeEngine(m)
    spread(m, engine)
    disk = m.get_tier_statistics(DISK)
    assert (disk.offloaded_pages, disk.declined_pages, disk.declined_bytes) == (1, 1, SLOT)
    assert m.get_tier_statistics(HOST).dropped_pages == 1
    assert m.take_iteration_stats()[2].declined_pages == 1
    assert m.take_iteration_stats()[2].declined_pages == 0  # (per iteration: counted once)
    assert m.load_plan_statistics.link_wait_s[2] == pytest.approx(0.025)
    # the host's victims, tails first: the prompt's last block was declined, the one before written
    assert [p.level for p in tree_pages(m, PROMPT)] == [1, 1, 2]
    assert take(m, engine, PROMPT) == 3 * T


def test_a_drained_link_takes_writes_again(mk: Any) -> None:
    clock = Clock()
    m = mk(clock, 0.030)
    engine = FakeEngine(m)
    publish(m, PROMPT, engine=engine)
    publish(m, seq(2, 2 * T), engine=engine)
    publish(m, seq(3, 2 * T), engine=engine)
    publish(m, seq(4, 2 * T), engine=engine)  # PROMPT's last two blocks leave the host: one fits
    assert m.get_tier_statistics(DISK).declined_pages == 1
    clock.now = 1.0  # the link is idle again
    publish(m, seq(5, 2 * T), engine=engine)  # two more pages leave the host: one fits again
    disk = m.get_tier_statistics(DISK)
    assert (disk.offloaded_pages, disk.declined_pages) == (2, 2)


def test_without_a_bound_nothing_is_declined(mk: Any) -> None:
    clock = Clock()
    m = mk(clock, None)
    engine = FakeEngine(m)
    spread(m, engine)
    for r in range(5, 12):
        publish(m, seq(r, 2 * T), engine=engine)
    disk = m.get_tier_statistics(DISK)
    assert disk.declined_pages == 0 and disk.offloaded_pages == 16
    assert m.load_plan_statistics.link_wait_s[2] == pytest.approx(16 * 0.025)


def test_held_pages_are_written_whatever_the_backlog(mk: Any) -> None:
    """A bound of 0 declines every reusable page, never a suspended request's: its pages go down
    to the disk and come back exact."""
    clock = Clock()
    m = mk(clock, 0.0)
    engine = FakeEngine(m)
    a_toks = seq(1, 4 * T)
    a = computed(m, engine, a_toks, 3 * T + 3)
    a.suspend()
    hogs = []
    for r in (2, 3):  # the whole GPU twice: a's pages go to host, then to disk
        hog = computed(m, engine, seq(r, 4 * T), 4 * T)
        hog.suspend()
        hogs.append(hog)
    assert [p.level for p in a.block_table.pages[0] if p is not None] == [2, 2, 2, 2]
    assert all(p.status is PageStatus.HELD for p in a.block_table.all_pages())
    assert m.get_tier_statistics(DISK).declined_pages == 0 and m.get_tier_statistics(HOST).declined_pages == 0
    for hog in hogs:
        hog.close()
    assert a.resume()  # the hogs' reusable blocks on the GPU make way: dropped, not written
    assert m.get_tier_statistics(HOST).declined_pages == 4 and m.get_tier_statistics(CacheLevel(0)).dropped_pages == 4
    engine.check_all(a, a_toks, 3 * T + 3)
    a.close()
    m.check_invariants()


@pytest.mark.parametrize("backlog", [None, 0.030])
def test_a_saturated_link_drops_reusable_victims_before_writing_held_ones(mk: Any, backlog: float | None) -> None:
    """The host holds a suspended request's two pages (the oldest) and two reusable ones, and must
    make room for two more. Its eviction order sends the suspended pages to the disk; but with the
    disk's link busy for a second (beyond a 30 ms bound) the reusable ones are dropped instead and
    the suspended request stays on the host. Either way its data comes back exact."""
    clock = Clock()
    m = mk(clock, backlog)
    engine = FakeEngine(m)
    a_toks = seq(1, 2 * T)
    a = computed(m, engine, a_toks, 2 * T)
    a.suspend()
    for r in (2, 3, 4):  # a's pages, then seq 2's, move to the host
        publish(m, seq(r, 2 * T), engine=engine)
    assert [p.level for p in a.block_table.pages[0] if p is not None] == [1, 1]
    m.set_tier_wait(2, 1.0)
    publish(m, seq(5, 2 * T), engine=engine)  # the host must take seq 3's two pages
    disk = m.get_tier_statistics(DISK)
    if backlog is None:
        assert [p.level for p in a.block_table.pages[0] if p is not None] == [2, 2]
        assert (disk.offloaded_pages, disk.declined_pages) == (2, 0)
    else:
        assert [p.level for p in a.block_table.pages[0] if p is not None] == [1, 1]
        assert (disk.offloaded_pages, disk.declined_pages) == (0, 2) and len(tree_pages(m, seq(2, 2 * T))) == 0
    m.check_invariants()
    assert a.resume()
    engine.check_all(a, a_toks, 2 * T)
    a.close()
    m.check_invariants()


def test_a_failed_eviction_below_leaves_the_declined_pages_dropped(mk: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU evicts a suspended request's two pages and two reusable ones to a host whose link is
    saturated: the reusable ones are declined (dropped), the held ones must go, and making room for
    them on the full host fails writing its victims to the disk (an emulated driver error). The
    eviction is undone for the pages still there; the dropped ones are not listed again (they were
    once: a freed page in the GPU's evictor, freed twice later). Then everything works, exact."""
    if compiled:
        pytest.skip("a compiled class's methods cannot be patched to inject the failure")
    clock = Clock()
    m = mk(clock, 0.030)
    engine = FakeEngine(m)
    for r in (10, 11):  # the host full of reusable pages
        publish(m, seq(r, 2 * T), engine=engine)
    a_toks = seq(1, 2 * T)
    a = computed(m, engine, a_toks, 2 * T)
    a.suspend()
    publish(m, seq(2, 2 * T), engine=engine)  # the GPU: a's two held pages, two reusable ones
    assert [p.level for p in a.block_table.all_pages()] == [0, 0] and [
        p.level for p in tree_pages(m, seq(2, 2 * T))
    ] == [0, 0]
    m.set_tier_wait(1, 1.0)
    copier = m._storage.copier
    disk_pools = m._storage.levels.items[2].items[0].pools
    copy = copier.copy

    def failing(src: Any, dst: Any, sizes: Any, pairs: Any) -> Any:
        if dst is disk_pools or list(dst) == list(disk_pools):
            raise RuntimeError("emulated: the copy to the disk failed")
        return copy(src, dst, sizes, pairs)

    monkeypatch.setattr(copier, "copy", failing)
    kv = m.create_kv_cache()
    assert kv.resume()
    with pytest.raises(RuntimeError, match="emulated"):
        kv.resize(4 * T)
    monkeypatch.undo()
    m.check_invariants()
    assert m.get_tier_statistics(HOST).declined_pages == 2 and len(tree_pages(m, seq(2, 2 * T))) == 0
    assert [p.level for p in a.block_table.all_pages()] == [0, 0]
    assert kv.resize(4 * T)  # the next attempt writes the host's victims to the disk
    kv.close()
    m.check_invariants()
    assert a.resume()
    engine.check_all(a, a_toks, 2 * T)
    a.close()
    m.check_invariants()
    take(m, engine, seq(10, 2 * T))  # whatever is left of it reused exact


def test_the_default_bound_keeps_a_link_that_keeps_up(mk: Any) -> None:
    """The default bound (1 s) at the default disk speed: nothing declined."""
    m = mk(Clock(), 1.0)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.get_tier_statistics(DISK).declined_pages == 0
    assert KVCacheManagerConfig.max_write_backlog_s == 1.0


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1.0, ValueError, r"max_write_backlog_s must be a finite number >= 0"),
        (float("inf"), ValueError, r"max_write_backlog_s must be a finite number >= 0"),
        (True, TypeError, "max_write_backlog_s must be a number"),
        ("1s", TypeError, "max_write_backlog_s must be a number"),
    ],
)
def test_bad_backlog_bound_refused(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=[GpuCacheTierConfig(1 << 20)],
            layers=kv_layers(1, T),
            max_write_backlog_s=value,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, r"write_bytes_per_s must be a finite number > 0 \(bytes per second\)"),
        ("fast", TypeError, "write_bytes_per_s must be a number"),
        (False, TypeError, "write_bytes_per_s must be a number"),
    ],
)
def test_bad_write_speed_refused(tmp_path: Any, value: object, error: type, message: str) -> None:
    with pytest.raises(error, match="HostCacheTierConfig." + message):
        HostCacheTierConfig(1 << 20, write_bytes_per_s=value)  # type: ignore[arg-type]
    with pytest.raises(error, match="DiskCacheTierConfig." + message):
        DiskCacheTierConfig(1 << 20, str(tmp_path), write_bytes_per_s=value)  # type: ignore[arg-type]
