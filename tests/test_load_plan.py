"""Load or recompute (``load_policy``): which matched blocks below the GPU a request loads, the
tiers' cost model and its refinement, the plan's statistics, and bad configuration refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
from conftest import Clock, attention_and_recurrent, kv_layers, shut_down
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, publish, seq

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kv_cache_manager_v2._storage._tier_costs import REFINE_WEIGHT, TierCosts

#: host: 1 ms a page (one slot: one block of both layers), disk: 10 ms a page, no latency
HOST_BPS = SLOT * 1000.0
DISK_BPS = SLOT * 100.0
#: prefill rates: 5 ms a block (host loads, disk recomputes), 20 ms a block (both load)
FIVE_MS = T / 0.005
TWENTY_MS = T / 0.020


def manager(backend: str, path: str, policy: str = "auto", rate: float | None = None, **kw: Any) -> KVCacheManager:
    """GPU 4 blocks, host 4, disk 8 (two full-attention layers, one slot a block), refinement off."""
    host = HostCacheTierConfig(
        kw.pop("host", 4 * SLOT), read_bytes_per_s=HOST_BPS, read_latency_s=kw.pop("host_latency", 0.0)
    )
    disk = DiskCacheTierConfig(8 * SLOT, path, read_bytes_per_s=DISK_BPS, read_latency_s=0.0)
    layers = kw.pop("layers", kv_layers(2, T))
    config = KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[GpuCacheTierConfig(kw.pop("gpu", 4 * SLOT)), host, disk],
        layers=layers,
        backend=backend,  # type: ignore[arg-type]
        load_policy=policy,  # type: ignore[arg-type]
        prefill_tokens_per_s=rate,
        refine_tier_costs=kw.pop("refine", False),
        max_util_for_resume=1.0,
        **kw,
    )
    return KVCacheManager(config)


#: the prompt whose blocks end on host, host, disk, disk after ``spread``
PROMPT = seq(0, 2 * T) + seq(1, 2 * T)


def spread(m: KVCacheManager, engine: FakeEngine, others: int = 3) -> None:
    """Publish ``PROMPT``, then ``others`` prompts of two blocks pushing it down the tiers."""
    publish(m, PROMPT, engine=engine)
    for r in range(2, 2 + others):
        publish(m, seq(r, 2 * T), engine=engine)


@pytest.fixture
def mk(backend: str, tmp_path: Any) -> Any:
    made: list[KVCacheManager] = []

    def factory(policy: str = "auto", rate: float | None = None, **kw: Any) -> KVCacheManager:
        m = manager(backend, str(tmp_path), policy, rate, **kw)
        made.append(m)
        return m

    yield factory
    shut_down(made)


def take(m: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> int:
    """Create (after a probe, as the adapter does), resume, check the reused prefix's data, compute
    the rest; returns the tokens reused (== the probe's)."""
    probed = m.probe_reuse(None, tokens)
    kv = m.create_kv_cache(None, tokens)
    assert kv.history_length == probed
    assert kv.resume()
    engine.check_all(kv, tokens, kv.history_length)
    h = kv.history_length
    assert kv.resize(len(tokens))
    engine.step(kv, tokens, h, len(tokens))
    kv.commit(tokens[h:])
    kv.close()
    m.check_invariants()
    return probed


def test_auto_loads_host_blocks_and_recomputes_disk_blocks(mk: Any) -> None:
    m = mk("auto")
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse_levels(None, PROMPT) == [1, 1, 2, 2]  # (no rate yet: the whole match)
    m.set_prefill_rate(FIVE_MS)
    assert m.probe_reuse_levels(None, PROMPT) == [1, 1]  # what the create takes
    # saving by blocks taken: +4 ms, +8 ms (host: 1 ms a block against 5), then 3, -2 (disk: 10 ms)
    assert take(m, engine, PROMPT) == 2 * T
    s = m.load_plan_statistics
    assert (s.policy, s.prefill_tokens_per_s, s.cut_matches) == ("auto", FIVE_MS, 1)
    assert s.loaded_tokens == (0, 2 * T, 0) and s.recomputed_tokens == (0, 0, 2 * T)
    assert s.saved_s == pytest.approx(0.008) and s.cut_saved_s == pytest.approx(0.010)
    assert s.read_bytes_per_s == (math.inf, HOST_BPS, DISK_BPS) and s.read_latency_s == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("rate", "reused"),
    [(TWENTY_MS, 4 * T), (T / 0.0005, 0)],  # 20 ms a block: disk too; 0.5 ms a block: not even host
)
def test_auto_follows_the_prefill_rate(mk: Any, rate: float, reused: int) -> None:
    m = mk("auto", rate)
    engine = FakeEngine(m)
    spread(m, engine)
    assert take(m, engine, PROMPT) == reused


def test_latency_counts_once_per_tier(mk: Any) -> None:
    """Host latency 6 ms: one host block (5 - 1 - 6 < 0) is not worth it, two (10 - 2 - 6 > 0) are."""
    m = mk("auto", FIVE_MS, host_latency=0.006)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse(None, PROMPT) == 2 * T
    m.set_prefill_rate(T / 0.0035)  # 3.5 ms a block: two host blocks save 7 - 2 - 6 < 0
    assert m.probe_reuse(None, PROMPT) == 0
    m.set_prefill_rate(FIVE_MS)
    assert take(m, engine, PROMPT) == 2 * T


def test_auto_without_a_rate_and_always_take_everything(mk: Any) -> None:
    for m in (mk("auto", None), mk("always", T / 0.0005)):
        engine = FakeEngine(m)
        spread(m, engine)
        assert take(m, engine, PROMPT) == 4 * T
        s = m.load_plan_statistics
        assert s.loaded_tokens == (0, 2 * T, 2 * T) and s.recomputed_tokens == (0, 0, 0) and s.cut_matches == 0
        # "always" at 0.5 ms a block: 2 ms of recompute against 2 x 1 ms (host) + 2 x 10 ms (disk)
        assert s.saved_s == (pytest.approx(-0.020) if m.config.load_policy == "always" else 0.0)


def test_set_prefill_rate_switches_auto_on_and_off(mk: Any) -> None:
    m = mk("auto", None)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_prefill_rate(FIVE_MS)
    assert m.probe_reuse(None, PROMPT) == 2 * T
    m.set_prefill_rate(None)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    with pytest.raises(ValueError, match="tokens_per_s must be a finite number > 0"):
        m.set_prefill_rate(0)
    with pytest.raises(TypeError, match="tokens_per_s must be a number"):
        m.set_prefill_rate("fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tokens_per_s must be a number"):
        m.set_prefill_rate(True)
    assert m.load_plan_statistics.prefill_tokens_per_s is None  # (unchanged by the refusals)


def test_never_takes_only_gpu_pages(mk: Any) -> None:
    m = mk("never")
    engine = FakeEngine(m)
    spread(m, engine, others=1)
    assert m.probe_reuse_levels(None, PROMPT) == [0, 0]  # of [0, 0, 1, 1]
    kv = m.create_kv_cache(None, PROMPT)
    assert kv.history_length == 2 * T == m.probe_reuse(None, PROMPT)
    table = kv.block_table
    assert all(p is None or p.level == 0 for pages in table.pages for p in pages)
    kv.close()
    assert take(m, engine, PROMPT) == 2 * T
    publish(m, seq(7, 2 * T), engine=engine)
    publish(m, seq(8, 2 * T), engine=engine)
    assert m.probe_reuse_levels(None, PROMPT) == []  # its first block left the GPU
    assert take(m, engine, PROMPT) == 0
    s = m.load_plan_statistics
    assert s.loaded_tokens[1:] == (0, 0) and sum(s.recomputed_tokens[1:]) > 0


def test_hybrid_cut_ends_at_a_snapshot(mk: Any) -> None:
    """A hybrid model's cut lands on a block holding a snapshot, where the tree lets a match end."""
    m = mk(
        "auto",
        layers=attention_and_recurrent(T),
        ssm_reuse_interval=2 * T,
        gpu=1 << 15,
        host=1 << 20,
        initial_pool_ratio=(0.8, 0.2),
    )
    engine = FakeEngine(m)
    prompt = seq(0, 6 * T)
    kv = m.create_kv_cache(None, prompt)
    assert kv.resume()
    for h in range(0, 6 * T, 2 * T):  # a step ends at each snapshot position (blocks 1, 3, 5)
        assert kv.resize(h + 2 * T)
        engine.step(kv, prompt, h, h + 2 * T)
        kv.commit(prompt[h : h + 2 * T])
    kv.close()
    assert m.resize(0, 2048)  # three attention blocks stay in GPU memory
    query = [*prompt, 1]
    assert m.probe_reuse_levels(None, query) == [0, 0, 0, 1, 1, 1]
    # 0.1 ms a block, an attention page 0.5 ms from the host, a snapshot (64 bytes) 0.0625 ms:
    # 3 blocks would save 0.3 ms but end without a snapshot; 2 blocks save 0.2 - 0.0625 (the
    # periodic snapshot of block 1 is on the host); 4 and 6 lose
    m.set_prefill_rate(T / 0.0001)
    assert m.probe_reuse_levels(None, query) == [0, 1]
    assert m.resize(0, 1 << 15)  # (room for the request; the pages stay where they are)
    assert take(m, engine, query) == 2 * T


def test_tier_costs_refine_from_timed_batches(tmp_path: Any) -> None:
    disk = DiskCacheTierConfig(1 << 20, str(tmp_path), read_bytes_per_s=1e9, read_latency_s=1e-5)
    tiers = [GpuCacheTierConfig(1 << 20), HostCacheTierConfig(1 << 20), disk]
    costs = TierCosts(tiers, True)
    assert costs.read_s(0, 10**9) == 0.0 and costs.read_s(2, 10**6) == pytest.approx(1e-5 + 1e-3)
    costs.observe(2, 10**6, 1e-5 + 2e-3)  # half the bandwidth: the time per byte moves a fifth of the way
    assert costs.seconds_per_byte[2] == pytest.approx((1 - REFINE_WEIGHT) * 1e-9 + REFINE_WEIGHT * 2e-9)
    costs.observe(2, 1000, 1e-4)  # a small batch (its bytes' time under the latency) refines the latency
    per_byte = costs.seconds_per_byte[2]
    assert costs.latency_s[2] == pytest.approx((1 - REFINE_WEIGHT) * 1e-5 + REFINE_WEIGHT * (1e-4 - 1000 * per_byte))
    # the GPU costs nothing; a host tier's copies are queued on the copy stream: neither is timed
    costs.observe(0, 10**6, 1.0)
    costs.observe(1, 10**6, 1.0)
    assert costs.samples == [0, 0, 2] and costs.seconds_per_byte[1] == 1 / 50e9
    fixed = TierCosts(tiers, False)
    fixed.observe(2, 10**6, 1.0)
    assert fixed.seconds_per_byte[2] == 1e-9 and fixed.samples == [0, 0, 0]


def test_tier_costs_know_the_remote_level(tmp_path: Any) -> None:
    """One figure for the level the remote tier's fetches refine (synchronous or a prefetch's):
    the last, after the local ones; -1 without a remote tier (its observations refine nothing)."""
    local = [GpuCacheTierConfig(1 << 20), HostCacheTierConfig(1 << 20)]
    assert TierCosts(local, True).remote_level == -1
    assert TierCosts([*local, DiskCacheTierConfig(1 << 20, str(tmp_path))], True).remote_level == -1
    costs = TierCosts([*local, RemoteCacheTierConfig("redis://127.0.0.1:1", "m")], True)
    assert costs.remote_level == 2
    costs.observe(costs.remote_level, 10**6, 1.0)
    assert costs.samples == [0, 0, 1]
    costs.observe(TierCosts(local, True).remote_level, 10**6, 1.0)  # (-1: nothing)
    assert costs.samples == [0, 0, 1]


def test_the_manager_refines_its_costs_from_disk_reads(mk: Any) -> None:
    for refine in (True, False):
        m = mk("auto", TWENTY_MS, refine=refine)  # (every block loads: the disk's two are timed)
        engine = FakeEngine(m)
        spread(m, engine)
        assert take(m, engine, PROMPT) == 4 * T
        s = m.load_plan_statistics
        assert s.read_bytes_per_s[1] == HOST_BPS  # (host copies are not timed)
        assert (s.read_bytes_per_s[2] != DISK_BPS) is refine


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("load_policy", "sometimes", ValueError, "load_policy must be one of 'auto', 'always', 'never'"),
        ("load_policy", 1, TypeError, "load_policy must be str"),
        ("prefill_tokens_per_s", 0, ValueError, "prefill_tokens_per_s must be a finite number > 0"),
        ("prefill_tokens_per_s", math.inf, ValueError, "prefill_tokens_per_s must be a finite number > 0"),
        ("prefill_tokens_per_s", math.nan, ValueError, "prefill_tokens_per_s must be a finite number > 0"),
        ("prefill_tokens_per_s", True, TypeError, "prefill_tokens_per_s must be a number"),
        ("refine_tier_costs", 1, TypeError, "refine_tier_costs must be bool"),
        ("recompute_queue_weight", -0.5, ValueError, "recompute_queue_weight must be a finite number >= 0"),
        ("recompute_queue_weight", None, TypeError, "recompute_queue_weight must be a number"),
    ],
)
def test_bad_manager_config_refused(field: str, value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KVCacheManagerConfig(
            tokens_per_block=T, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=kv_layers(1, T), **{field: value}
        )


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"read_bytes_per_s": 0}, ValueError, r"read_bytes_per_s must be a finite number > 0 \(bytes per second\)"),
        ({"read_bytes_per_s": "fast"}, TypeError, "read_bytes_per_s must be a number"),
        ({"read_latency_s": -1e-3}, ValueError, r"read_latency_s must be a finite number >= 0 \(seconds a transfer\)"),
        ({"read_latency_s": False}, TypeError, "read_latency_s must be a number"),
    ],
)
def test_bad_tier_costs_refused(tmp_path: Any, kw: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error, match="HostCacheTierConfig." + message):
        HostCacheTierConfig(1 << 20, **kw)  # type: ignore[arg-type]
    with pytest.raises(error, match="DiskCacheTierConfig." + message):
        DiskCacheTierConfig(1 << 20, str(tmp_path), **kw)  # type: ignore[arg-type]
    with pytest.raises(error, match="RemoteCacheTierConfig." + message):
        RemoteCacheTierConfig("redis://localhost:1", "ns", **kw)  # type: ignore[arg-type]
    assert HostCacheTierConfig(1, read_latency_s=0).read_latency_s == 0


def _remote_manager(
    url: str, policy: str, rate: float | None, write_through: bool = False, refine: bool = False
) -> KVCacheManager:
    remote = RemoteCacheTierConfig(
        url,
        "load-plan",
        timeout_ms=3000,
        retry_interval_ms=50,
        max_pending_bytes=8 << 20,
        write_through=write_through,
        read_bytes_per_s=DISK_BPS,  # 10 ms a page
        read_latency_s=0.0,
    )
    config = KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[GpuCacheTierConfig(16 * SLOT), remote],
        layers=kv_layers(2, T),
        backend="host",
        max_util_for_resume=1.0,
        load_policy=policy,  # type: ignore[arg-type]
        prefill_tokens_per_s=rate,
        refine_tier_costs=refine,
    )
    return KVCacheManager(config)


@pytest.mark.parametrize(
    ("policy", "rate", "reused"), [("auto", FIVE_MS, 2), ("auto", TWENTY_MS, 6), ("never", None, 2)]
)
def test_remote_blocks_are_fetched_only_when_worth_it(
    redis_server: Any, policy: str, rate: float | None, reused: int
) -> None:
    """Two blocks in GPU memory, four more in the remote tier (10 ms a page): at 5 ms a block they
    are recomputed (nothing fetched), at 20 ms fetched; "never" does not even look them up."""
    a = _remote_manager(redis_server.url, "always", None, write_through=True)
    b = _remote_manager(redis_server.url, policy, rate)
    try:
        toks = seq(2, 6 * T)
        publish(a, toks, match=False)
        publish(b, toks[: 2 * T], match=False)
        assert a.flush_remote_writes()
        query = [*toks, 1]
        before = b.remote_statistics
        assert before is not None
        assert take(b, FakeEngine(b), query) == reused * T  # (probe == create)
        after = b.remote_statistics
        assert after is not None
        assert after.fetched_pages - before.fetched_pages == (4 if reused == 6 else 0)
        assert (after.lookups > before.lookups) is (policy != "never")
        s = b.load_plan_statistics
        # ("never" never looks the remote blocks up: it does not count them)
        recomputed = 0 if policy == "never" else (6 - reused) * T
        assert s.loaded_tokens == (2 * T, (reused - 2) * T) and s.recomputed_tokens == (0, recomputed)
    finally:
        a.shutdown()
        b.shutdown()


def test_remote_fetches_refine_the_remote_cost(redis_server: Any) -> None:
    a = _remote_manager(redis_server.url, "always", None, write_through=True)
    b = _remote_manager(redis_server.url, "always", None, refine=True)
    try:
        toks = seq(3, 4 * T)
        publish(a, toks, match=False)
        assert a.flush_remote_writes()
        assert take(b, FakeEngine(b), [*toks, 1]) == 4 * T
        assert b.load_plan_statistics.read_bytes_per_s[1] != DISK_BPS  # the fetch was timed
        costs = b._storage.costs
        assert costs is not None and costs.remote_level == b._storage.num_levels == 1 and costs.samples[1] > 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_links_wait_counts_once_per_tier(mk: Any) -> None:
    """At 20 ms a block every block loads (savings 19, 38, 48, 58 ms: host 1 ms a page, disk 10);
    45 ms queued on the disk's link make the disk blocks 58 - 45 = 13 ms: two host blocks (38)
    win by more than a block. 9 ms on the host's link at 5 ms a block: two host blocks save
    10 - 2 - 9 < 0, nothing is loaded."""
    m = mk("auto", TWENTY_MS, clock=Clock())  # (the waits drain as the clock runs: it stands still here)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_tier_wait(2, 0.045)
    assert m.probe_reuse_levels(None, PROMPT) == [1, 1]
    m.set_prefill_rate(FIVE_MS)
    m.set_tier_wait(1, 0.009)
    assert m.probe_reuse(None, PROMPT) == 0
    m.set_tier_wait(1, 0.007)  # 10 - 2 - 7 > 0
    with pytest.raises(ValueError, match=r"level must be a cache level below the GPU \(1 to 2\), got 0"):
        m.set_tier_wait(0, 1.0)
    with pytest.raises(ValueError, match=r"level must be a cache level below the GPU \(1 to 2\), got 3"):
        m.set_tier_wait(3, 1.0)
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        m.set_tier_wait(1, -1.0)
    with pytest.raises(TypeError, match="level must be"):
        m.set_tier_wait(True, 1.0)
    assert take(m, engine, PROMPT) == 2 * T  # (unchanged by the refusals)


@pytest.mark.parametrize(("block_ms", "weight", "reused"), [(6, 1.0, 4), (6, 0.1, 2), (5, 1.0, 2), (5, 0.0, 2)])
def test_waiting_requests_make_recompute_dearer(mk: Any, block_ms: int, weight: float, reused: int) -> None:
    """Host 1 ms a page, disk 10. At 6 ms a block the savings are 5, 10, 6, 2 ms: two blocks (the
    cut saves more than a block's 6 ms); with one request waiting for the engine a recomputed
    block costs 6 * (1 + weight) ms: at weight 1, 11, 22, 24, 26 (the whole match, which still
    saves the request itself 2 ms); at 0.1, 5.6, 11.2, 7.8, 4.4 (two blocks). At 5 ms a block
    (4, 8, 3, -2 ms) the charge at
    weight 1 makes the whole match save the most (18 ms, as two and three blocks), but it would
    make the request itself 2 ms slower than recomputing (no step time known): two blocks."""
    m = mk("auto", T / (block_ms / 1000.0), recompute_queue_weight=weight)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse(None, PROMPT) == 2 * T
    with pytest.raises(ValueError, match="waiting_requests must be >= 0"):
        m.set_engine_queue(-1)
    with pytest.raises(TypeError, match="waiting_requests must be"):
        m.set_engine_queue(True)
    assert m.probe_reuse(None, PROMPT) == 2 * T  # (unchanged by the refusals)
    m.set_engine_queue(1)
    assert take(m, engine, PROMPT) == reused * T


def test_the_queue_charge_may_make_a_request_slower_by_at_most_a_step(mk: Any) -> None:
    """At 5 ms a block with one request waiting at weight 1 (a recomputed block costs 10 ms) the
    whole match reads in 22 ms, 2 ms more than its own recompute time: no choice while the step
    time is unknown (two blocks). With 25 ms steps its disk reads cost a step: 5 ms more than its
    recompute time, within a step; it saves 40 - 25 = 15 ms, 3 ms (under a block's 5) less than
    two blocks' 20 - 2: the whole match. With 3 ms steps, 22 + 1.5 ms: 3.5 ms more, beyond a step."""
    m = mk("auto", T / 0.005, recompute_queue_weight=1.0)
    engine = FakeEngine(m)
    spread(m, engine)
    m.set_engine_queue(1)
    assert m.probe_reuse(None, PROMPT) == 2 * T
    m.set_prefill_rate(T / 0.005, 0.003)
    assert m.probe_reuse(None, PROMPT) == 2 * T
    m.set_prefill_rate(T / 0.005, 0.025)
    assert take(m, engine, PROMPT) == 4 * T


def test_a_cut_must_save_a_blocks_time(mk: Any) -> None:
    """Two host blocks and a 3-token partial block on disk, at 20 ms a block: the two blocks save
    40 - 2 = 38 ms, the whole match 47.5 - 2 - 10 = 35.5 ms; the cut saves 2.5 ms, less than a
    block's 20 ms: the whole match is taken. At 5 ms a block the cut saves 8 - (-0.125) ms > 5 ms."""
    m = mk("auto", TWENTY_MS)
    planner = m._planner
    n = m.num_layer_groups
    levels = [[1] * n, [1] * n, [2] * n]
    assert planner.plan(levels, 2, 3) == (2 * T + 3, pytest.approx(0.0355), pytest.approx(0.0355))
    m.set_prefill_rate(FIVE_MS)
    assert planner.plan(levels, 2, 3) == (2 * T, pytest.approx(0.008), pytest.approx(-0.000125))


def test_disk_reads_wait_for_a_step(mk: Any) -> None:
    """A request reading from disk waits apart from the engine's steps and joins the first that
    starts after its reads: with the step time known they cost the current step if they land
    within it, else their time and half a step (host copies: their time). At 20 ms a block every
    block loads (savings 19, 38, 48, 58 ms: host 1 ms a page, disk 10). With 100 ms steps the disk
    blocks' reads (22 ms with the host's) cost a step: 80 - 100 ms, while two host blocks
    (copies within the step) still save 38 ms: the plan takes those. With 25 ms steps the whole
    match costs one step and saves 55 ms, more than the host blocks."""
    m = mk("auto", TWENTY_MS)
    engine = FakeEngine(m)
    spread(m, engine)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_prefill_rate(TWENTY_MS, 0.1)
    assert m.probe_reuse_levels(None, PROMPT) == [1, 1]
    m.set_prefill_rate(TWENTY_MS, 0.025)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_prefill_rate(TWENTY_MS, 0.1)
    for bad, error, message in (
        (0.0, ValueError, "step_s must be a finite number > 0"),
        (-1.0, ValueError, "step_s must be a finite number > 0"),
        (True, TypeError, "step_s must be a number"),
        ("1", TypeError, "step_s must be a number"),
    ):
        with pytest.raises(error, match=message):
            m.set_prefill_rate(T / 0.0005, bad)  # (neither is set)
    assert m.probe_reuse(None, PROMPT) == 2 * T  # (unchanged by the refusals)
    m.set_prefill_rate(TWENTY_MS)  # unknown again: reads cost their time
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_prefill_rate(TWENTY_MS, 0.015)
    planner = m._planner
    assert planner.read_cost(0.012, True) == 0.015 and planner.read_cost(0.022, True) == pytest.approx(0.0295)
    assert planner.read_cost(0.022, False) == 0.022  # (the host's copies)
    assert m.probe_reuse(None, PROMPT) == 4 * T
    m.set_prefill_rate(TWENTY_MS, 0.1)
    assert take(m, engine, PROMPT) == 2 * T
    s = m.load_plan_statistics
    assert s.loaded_tokens == (0, 2 * T, 0) and s.recomputed_tokens == (0, 0, 2 * T)
    assert s.saved_s == pytest.approx(0.038) and s.cut_saved_s == pytest.approx(0.058)


@pytest.mark.parametrize(("step_s", "saved"), [(None, 0.058), (0.1, -0.02)])
def test_a_match_taken_whole_prices_its_disk_reads_as_the_plan_does(
    mk: Any, step_s: float | None, saved: float
) -> None:
    """Under "always" every block loads; its estimated saving at 20 ms a block is 80 ms less the
    reads (host 1 ms a page, disk 10: 22 ms), and with 100 ms steps the disk's reads cost a step
    (the request joins the step after them): 80 - 100 ms."""
    m = mk("always", TWENTY_MS)
    engine = FakeEngine(m)
    spread(m, engine)
    m.set_prefill_rate(TWENTY_MS, step_s)
    assert take(m, engine, PROMPT) == 4 * T
    s = m.load_plan_statistics
    assert s.loaded_tokens == (0, 2 * T, 2 * T) and s.saved_s == pytest.approx(saved)


@pytest.mark.parametrize(("policy", "rate"), [("always", None), ("auto", None), ("always", TWENTY_MS)])
def test_blocks_fetched_whole_count_as_the_remote_tiers(redis_server: Any, policy: str, rate: float | None) -> None:
    """A match taken whole ("always", "auto" without a rate) counts the blocks it fetched as the
    remote tier's (not as the tier they were placed in), as the plan counts them."""
    a = _remote_manager(redis_server.url, "always", None, write_through=True)
    b = _remote_manager(redis_server.url, policy, rate)
    try:
        toks = seq(3, 6 * T)
        publish(a, toks, match=False)
        publish(b, toks[: 2 * T], match=False)
        assert a.flush_remote_writes()
        assert take(b, FakeEngine(b), [*toks, 1]) == 6 * T
        s = b.load_plan_statistics
        assert s.loaded_tokens == (2 * T, 4 * T) and s.recomputed_tokens == (0, 0)
    finally:
        a.shutdown()
        b.shutdown()
