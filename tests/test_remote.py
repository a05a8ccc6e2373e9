"""The remote tier on a real redis-server (issue #17), through the fake engine: pages written by one
manager are reused by another (in this process and in a second one) with the right records; layout
fingerprints, namespaces and salts isolate; a dead, hung, flushed, restarted or evicting server and
corrupted or truncated values only cost hits; statistics, events, the write queue's bound."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import REC, kv_layers, remote_keys
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, page_keys, publish, run_worker, seq, tree_pages

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    CacheLevel,
    CacheTier,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LayerId,
    RemoteCacheTierConfig,
    Retention,
    ReuseScope,
)
from kv_cache_manager_v2._config import CacheTierConfig
from kv_cache_manager_v2._storage._remote._value import HEADER_BYTES, decode_value, encode_header
from kv_cache_manager_v2.redis_server import LocalRedisServer

Factory = Callable[..., KVCacheManager]
#: a value's retention when its block had none (``ExpiryQueue.carried``)
NONE = (35, 35, float("inf"), 0.0, -1)


def remote_config(
    url: str,
    gpu: int = 16,
    host: int | None = None,
    layers: list[AttentionLayerConfig] | None = None,
    backend: str = "host",
    **remote: Any,
) -> KVCacheManagerConfig:
    """``gpu`` / ``host`` slots of two K/V layers, then the remote tier (generous timeouts: the
    machine is shared, and a spurious timeout would make a correctness test flaky)."""
    remote.setdefault("namespace", "test-model")
    remote.setdefault("timeout_ms", 3000)
    remote.setdefault("retry_interval_ms", 50)
    remote.setdefault("max_pending_bytes", 8 << 20)  # resident per manager
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu * SLOT)]
    if host is not None:
        tiers.append(HostCacheTierConfig(host * SLOT))
    tiers.append(RemoteCacheTierConfig(url, **remote))
    return KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=tiers,
        layers=layers if layers is not None else kv_layers(2, T),
        backend=backend,  # type: ignore[arg-type]
        max_util_for_resume=1.0,
    )


@pytest.fixture
def managers() -> Iterator[Factory]:
    made: list[KVCacheManager] = []

    def factory(url: str, event_manager: KVCacheEventManager | None = None, **kw: Any) -> KVCacheManager:
        m = KVCacheManager(remote_config(url, **kw), event_manager)
        made.append(m)
        return m

    yield factory
    for m in made:
        for kv in m.open_caches():
            kv.close()
        m.shutdown()


def evict_everything(m: KVCacheManager) -> None:
    """Fill GPU memory with a request's own pages (a GPU-only manager: every reusable page is dropped)."""
    total = m.get_storage_statistics()[0].total
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(total * T)
    kv.close()


def reuse(m: KVCacheManager, toks: list[int], scope: ReuseScope | None = None) -> int:
    """Create, resume and check every record of the reused prefix through ``m``'s own addresses."""
    kv = m.create_kv_cache(scope, toks)
    h = kv.history_length
    assert kv.resume()
    FakeEngine(m).check_all(kv, toks, h)
    kv.close()
    m.check_invariants()
    return h


# ---------------------------------------------------------------- configuration and format
def test_config_validation_and_tier_list(redis_server: LocalRedisServer, managers: Factory) -> None:
    url = redis_server.url
    for bad, match in (
        (dict(url="http://x"), "url must start with"),
        (dict(namespace=""), "namespace"),
        (dict(namespace="a\nb"), "namespace"),
        (dict(timeout_ms=0), "timeout_ms"),
        (dict(quota=0), "quota"),
        (dict(ttl_s=0), "ttl_s"),
        (dict(max_lookup_blocks=0), "max_lookup_blocks"),
    ):
        kw: dict[str, Any] = {"url": url, "namespace": "n", **bad}
        with pytest.raises(ValueError, match=match):
            RemoteCacheTierConfig(**kw)
    with pytest.raises(TypeError):  # (compiled: mypyc checks the annotation itself)
        RemoteCacheTierConfig(url, "n", write_through=1)  # type: ignore[arg-type]
    remote = RemoteCacheTierConfig(url, "n")
    assert remote.tier is CacheTier.REMOTE
    for tiers in (
        [GpuCacheTierConfig(SLOT), remote, HostCacheTierConfig(SLOT)],
        [GpuCacheTierConfig(SLOT), remote, remote],
    ):
        with pytest.raises(ValueError, match="then optionally remote"):
            KVCacheManagerConfig(T, tiers, kv_layers(2, T))
    m = managers(url, host=4)
    assert m.cache_tier_list == [CacheTier.GPU_MEM, CacheTier.HOST_MEM, CacheTier.REMOTE]
    assert m.config.remote_tier is not None and len(m.config.local_tiers) == 2
    remote_level = CacheLevel(2)
    assert m.get_storage_statistics(remote_level) == []  # no slots
    assert m.get_quota(remote_level) == 0
    assert m.get_tier_statistics(remote_level).tier is CacheTier.REMOTE
    assert len(m.take_iteration_stats()) == 3
    with pytest.raises(ValueError, match="cache level"):
        m.get_storage_statistics(CacheLevel(3))
    kv = m.create_kv_cache()
    with pytest.raises(ValueError, match="target_level"):
        kv.prefetch(remote_level)  # only local levels hold pages
    kv.close()


def test_value_format_refuses_truncated_foreign_and_corrupted_values() -> None:
    fp, key = b"\x01" * 8, b"\x02" * 32
    payload_in = bytes(range(100))
    value = encode_header([memoryview(payload_in[:30]), memoryview(payload_in[30:])], 1, fp, key, NONE) + payload_in
    assert len(value) == HEADER_BYTES + 100
    payload = decode_value(value, 1, fp, key, 100)
    assert payload is not None and bytes(payload) == bytes(range(100))
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 50] ^= 0x40
    bad = [
        value[:-1],  # truncated
        value + b"\0",  # too long
        bytes(flipped),  # corrupted payload
        b"XXXX" + value[4:],  # not ours
    ]
    for v in bad:
        assert decode_value(v, 1, fp, key, 100) is None
    assert decode_value(value, 0, fp, key, 100) is None  # another layer group's page
    assert decode_value(value, 1, b"\x09" * 8, key, 100) is None  # another layout
    assert decode_value(value, 1, fp, b"\x03" * 32, 100) is None  # stored under another key
    assert decode_value(value, 1, fp, key, 99) is None


def test_core_works_without_the_redis_package(redis_server: LocalRedisServer) -> None:
    # a fresh interpreter where ``import redis`` fails (compiled code caches imported modules, so
    # blocking it in this process would not be seen)
    script = f"""
import sys
sys.modules["redis"] = None
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_remote import T, remote_config, publish, seq, kv_layers, SLOT
from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, KVCacheManagerConfig
m = KVCacheManager(KVCacheManagerConfig(T, [GpuCacheTierConfig(8 * SLOT)], kv_layers(2, T), backend="host"))
publish(m, seq(1, 3 * T), match=False)
assert m.probe_reuse(None, seq(1, 3 * T)) == 3 * T
assert m.remote_statistics is None and m.flush_remote_writes()
m.shutdown()
try:
    KVCacheManager(remote_config({redis_server.url!r}))
except ImportError as e:
    print("refused:", e)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "refused: RemoteCacheTierConfig needs the 'redis' package: pip install 'kv_cache_manager_v2[remote]'"
        in out.stdout
    )


# ---------------------------------------------------------------- sharing
@pytest.mark.parametrize("write_through", [False, True])
def test_a_prefix_published_by_one_manager_is_reused_by_another(
    redis_server: LocalRedisServer, managers: Factory, write_through: bool
) -> None:
    a = managers(redis_server.url, write_through=write_through)
    b = managers(redis_server.url, host=16)
    toks = seq(1, 4 * T + 3)
    publish(a, toks, match=False)
    if not write_through:
        assert a.flush_remote_writes() and remote_keys(redis_server) == []  # nothing dropped yet
        evict_everything(a)  # GPU is a's last level: its reusable pages are dropped, i.e. written
    assert a.flush_remote_writes()
    assert len(remote_keys(redis_server)) == 4  # full blocks only, one key per page (one layer group here)
    prompt = toks[: 4 * T] + [7, 7]
    assert b.probe_reuse(None, prompt) == 4 * T
    assert reuse(b, prompt) == 4 * T
    st = b.remote_statistics
    assert st is not None and st.fetched_pages == 4 and st.hit_blocks == 4 and st.corrupt_pages == 0
    assert st.lookups == 1  # create used what the probe found: one lookup round trip in all
    assert b._remote_fill is not None and b._remote_fill.placed == []  # (only a prefetch takes them: none kept)
    host = b.get_tier_statistics(CacheLevel(1))
    assert host.onboarded_pages == 4  # placed in b's host tier, then onboarded like any host page
    assert b.get_tier_statistics(CacheLevel(2)).onboarded_pages == 4
    sa = a.remote_statistics
    assert sa is not None and sa.written_pages == 4
    # fetched pages are known to be remote: dropping them again writes nothing
    c = managers(redis_server.url)
    assert reuse(c, prompt) == 4 * T
    evict_everything(c)
    sc = c.remote_statistics
    assert c.flush_remote_writes() and sc is not None and sc.queued_writes == 0 and sc.written_pages == 0


def test_write_through_sends_a_requests_blocks_when_it_closes(
    redis_server: LocalRedisServer, managers: Factory
) -> None:
    """Write-through hands a request's published blocks to the writer by the time ``close()``
    returns: an idle engine (no later allocation, no flush, no statistics) still shares them."""
    a = managers(redis_server.url, write_through=True)
    toks = seq(6, 3 * T + 2)
    kv = a.create_kv_cache(None, None)
    assert kv.resume()
    compute(FakeEngine(a), kv, toks, len(toks))  # committed: three full blocks published
    kv.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(remote_keys(redis_server)) < 3:
        time.sleep(0.02)
    assert len(remote_keys(redis_server)) == 3
    b = managers(redis_server.url)
    assert reuse(b, toks[: 3 * T] + [1]) == 3 * T


def test_extends_a_local_match_and_fills_missing_pages(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True)
    b = managers(redis_server.url)
    toks = seq(2, 6 * T)
    publish(a, toks, match=False)
    publish(b, toks[: 2 * T], match=False)  # b has the first two blocks itself
    assert a.flush_remote_writes()
    # where the prefix lives: two blocks in b's GPU memory, four in the remote tier (b's level 1)
    assert b.probe_reuse_levels(None, toks + [1]) == [CacheLevel(0)] * 2 + [CacheLevel(1)] * 4
    before = b.remote_statistics
    assert before is not None
    assert reuse(b, toks + [1]) == 6 * T
    after = b.remote_statistics
    assert after is not None and after.fetched_pages - before.fetched_pages == 4  # only what b lacked
    assert after.hit_blocks == 4


def test_two_processes_share_one_redis(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True)
    first = seq(3, 5 * T + 1)
    publish(a, first, match=False)
    assert a.flush_remote_writes()
    second = seq(4, 3 * T)

    def worker(**spec: Any) -> dict[str, Any]:
        spec.setdefault("url", redis_server.url)
        spec.setdefault("namespace", "test-model")
        res = run_worker("remote_worker.py", spec)
        assert res["compiled"] == kv_cache_manager_v2.compiled  # the same build mode as this process
        return res

    # process B reads A's prefix through its own addresses (every record checked), then publishes its own
    res = worker(read=first[: 5 * T] + [9], write=second)
    assert res["history"] == 5 * T and res["checked"] > 0 and res["flushed"]
    assert res["stats"]["fetched_pages"] == 5 and res["stats"]["corrupt_pages"] == 0
    assert reuse(a, second + [9]) == 3 * T  # and A reads B's
    # another dtype (layout fingerprint), another namespace, another salt: nothing is shared
    assert worker(read=first, dtype="fp8")["history"] == 0
    assert worker(read=first, namespace="other-model")["history"] == 0
    assert worker(read=first, salt=5)["history"] == 0


def test_layouts_namespaces_and_scopes_never_share(redis_server: LocalRedisServer, managers: Factory) -> None:
    url = redis_server.url
    a = managers(url, write_through=True)
    toks = seq(5, 3 * T)
    salted = ReuseScope(salt=11)
    publish(a, toks, match=False)
    publish(a, toks, salted, match=False)
    assert a.flush_remote_writes()
    bigger = [
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 2 * REC * T), BufferConfig("value", REC * T)])
        for i in range(2)
    ]
    assert reuse(managers(url, dtype="fp8"), toks + [1]) == 0
    assert reuse(managers(url, namespace="another"), toks + [1]) == 0
    assert reuse(managers(url, layers=bigger), toks + [1]) == 0
    b = managers(url)
    assert reuse(b, toks + [1], ReuseScope(salt=12)) == 0
    assert reuse(b, toks + [1], ReuseScope(lora_id=3)) == 0
    assert reuse(b, toks + [1], salted) == 3 * T
    assert reuse(b, toks + [1]) == 3 * T


def test_sliding_window_layers_fetch_only_what_the_window_needs(
    redis_server: LocalRedisServer, managers: Factory
) -> None:
    layers = kv_layers(4, T, window=2 * T, swa_every=2)  # layers 0, 2 slide (window 16), 1, 3 full
    slot = 4 * 2 * REC * T
    a = managers(redis_server.url, layers=layers, gpu=64 * slot // SLOT, write_through=True)
    b = managers(redis_server.url, layers=layers, gpu=64 * slot // SLOT, host=64 * slot // SLOT)
    toks = seq(6, 10 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    assert reuse(b, toks + [1]) == 10 * T
    st = b.remote_statistics
    assert st is not None
    # 10 full-attention pages, and only the window's sliding-window pages (the last 2 blocks at 80 tokens)
    assert st.fetched_pages == 10 + 2


def test_gpu_only_manager_places_fetched_pages_in_gpu_memory(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True)
    b = managers(redis_server.url, gpu=8)
    toks = seq(7, 5 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    assert reuse(b, toks + [1]) == 5 * T
    # more than b's GPU can place: the match stops where room ends, never fails
    big = seq(8, 12 * T)
    publish(a, big, match=False)
    assert a.flush_remote_writes()
    kv = b.create_kv_cache(None, big + [1])
    assert 0 < kv.history_length <= 8 * T
    assert kv.resume()
    FakeEngine(b).check_all(kv, big, kv.history_length)
    kv.close()


def test_events_report_fetched_pages_at_their_local_medium(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True)
    em = KVCacheEventManager(max_events=1000)
    b = managers(redis_server.url, event_manager=em, host=8)
    toks = seq(9, 2 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    assert reuse(b, toks + [1]) == 2 * T
    media = {getattr(e, "medium", None) for e in b.get_latest_events() if type(e).__name__ == "BlockStoredEvent"}
    assert media == {"CPU"}


# ---------------------------------------------------------------- the server fails, the data is bad
def test_corrupted_truncated_and_foreign_values_are_misses(redis_server: LocalRedisServer, managers: Factory) -> None:
    import redis

    a = managers(redis_server.url, write_through=True)
    toks = seq(10, 6 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    client = redis.Redis.from_url(redis_server.url)
    keys = remote_keys(redis_server)
    assert len(keys) == 6
    from kv_cache_manager_v2._reuse._keys import BlockHasher, scope_key

    chain = BlockHasher(toks, T, "t").chain(scope_key(ReuseScope()))
    prefix = b":".join(keys[0].split(b":")[:3]) + b":"

    def key(o: int) -> bytes:
        """Block ``o``'s page (the one layer group, 0): namespace, layout fingerprint, group, block key."""
        return prefix + b"0:" + chain[o].hex().encode()

    assert set(keys) == {key(o) for o in range(6)}
    b = managers(redis_server.url)
    # a flipped payload bit in block 4: create stops before it (the probe, seeing lengths, cannot tell)
    v = bytearray(client.get(key(4)) or b"")
    v[HEADER_BYTES + 3] ^= 1
    client.set(key(4), bytes(v))
    assert b.probe_reuse(None, toks + [1]) == 6 * T
    assert reuse(b, toks + [1]) == 4 * T
    st = b.remote_statistics
    assert st is not None and st.corrupt_pages == 1
    # truncated (block 3) and foreign (block 2 holds block 1's value): misses at lookup or fetch
    b2 = managers(redis_server.url)
    client.set(key(3), (client.get(key(3)) or b"")[:-5])
    assert b2.probe_reuse(None, toks + [1]) == 3 * T  # a wrong length is a miss at lookup
    client.set(key(2), client.get(key(1)) or b"")
    assert reuse(b2, toks + [1]) == 2 * T
    st = b2.remote_statistics
    assert st is not None and st.corrupt_pages == 1 and st.fetched_pages == 2
    client.close()


def test_a_dead_server_costs_hits_only_and_reuse_resumes_when_it_returns(
    redis_server: LocalRedisServer, managers: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    a = managers(redis_server.url, gpu=8)
    b = managers(redis_server.url, gpu=8)
    engine_a = FakeEngine(a)
    toks = seq(11, 3 * T)
    publish(a, toks, match=False)
    evict_everything(a)
    assert a.flush_remote_writes()
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        assert b.probe_reuse(None, toks + [1]) == 0
        assert reuse(b, toks + [1]) == 0  # misses, no exception
        # both keep serving: a publishes and evicts (its writes are dropped), b computes
        for r in range(3):
            publish(a, seq(20 + r, 3 * T), match=False)
            evict_everything(a)
            kv = b.create_kv_cache(None, seq(30 + r, 2 * T))
            assert kv.resume()
            compute(FakeEngine(b), kv, seq(30 + r, 2 * T), 2 * T)
            kv.close()
            time.sleep(0.06)  # past retry_interval_ms: the next call tries the server again
    assert any("treating it as a miss" in r.getMessage() for r in caplog.records)
    assert a.flush_remote_writes()  # (statistics are a snapshot: read them after the flush)
    sa, sb = a.remote_statistics, b.remote_statistics
    assert sa is not None and sb is not None
    assert sa.dropped_writes > 0
    assert sb.errors > 0 and not sb.connected
    redis_server.start()  # back, empty (same port)
    time.sleep(0.06)
    assert reuse(b, toks + [1]) == 0  # the old data is gone
    kv = a.create_kv_cache(None, toks)
    assert kv.resume()
    compute(engine_a, kv, toks, len(toks))
    kv.close()
    evict_everything(a)
    assert a.flush_remote_writes()
    assert reuse(b, toks + [1]) == 3 * T  # reuse resumed
    sb = b.remote_statistics
    assert sb is not None and sb.connected


def test_a_hung_server_times_out_into_misses(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True)
    b = managers(redis_server.url, timeout_ms=100, retry_interval_ms=60_000)
    toks = seq(12, 3 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    redis_server.pause()  # accepts nothing, answers nothing
    try:
        t0 = time.monotonic()
        assert reuse(b, toks + [1]) == 0
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert reuse(b, toks + [1]) == 0  # counted as down: no second wait
        second = time.monotonic() - t0
    finally:
        redis_server.resume()
    assert first < 2.0 and second < first  # bounded by the timeout (0.1 s per operation), not hung
    st = b.remote_statistics
    assert st is not None and st.errors == 1 and st.skipped_lookups >= 1


def test_flushed_and_evicting_servers_cost_hits_only(redis_server: LocalRedisServer, managers: Factory) -> None:
    import redis

    a = managers(redis_server.url, write_through=True, gpu=64)
    toks = seq(13, 4 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    assert reuse(managers(redis_server.url), toks + [1]) == 0
    # a server short of memory evicts keys (allkeys-lru): whatever is left is reused correctly
    quota = int(client.info("memory")["used_memory"]) + (1 << 20)
    wide = [  # 16 KiB pages: 240 of them do not fit in 1 MiB
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 4 << 10), BufferConfig("value", 4 << 10)])
        for i in range(2)
    ]
    big = managers(redis_server.url, write_through=True, gpu=64 * 16, quota=quota, layers=wide)
    assert client.config_get("maxmemory")["maxmemory"] == str(quota)
    assert big.get_quota(CacheLevel(1)) == quota
    for r in range(40):
        publish(big, seq(100 + r, 6 * T), match=False)
        assert big.flush_remote_writes()
    assert int(client.info("stats")["evicted_keys"]) > 0
    assert big.resize(CacheLevel(1), quota + 1) and big.get_quota(CacheLevel(1)) == quota + 1
    b = managers(redis_server.url, gpu=64 * 16, layers=wide)
    for r in (0, 20, 39):
        reuse(b, seq(100 + r, 6 * T) + [1])  # any length, every record checked
    client.close()


def test_the_write_queue_is_bounded(redis_server: LocalRedisServer, managers: Factory) -> None:
    m = managers(redis_server.url, max_pending_bytes=1)
    publish(m, seq(14, 4 * T), match=False)
    evict_everything(m)  # nothing fits the queue: the writes are dropped and counted
    assert m.flush_remote_writes()
    st = m.remote_statistics
    assert st is not None and st.dropped_writes == 4 and st.queued_writes == 0
    assert m.get_tier_statistics(CacheLevel(1)).dropped_pages == 4
    assert remote_keys(redis_server) == []


def test_statistics_of_the_remote_level(redis_server: LocalRedisServer, managers: Factory) -> None:
    a = managers(redis_server.url, write_through=True, ttl_s=60)
    b = managers(redis_server.url)
    publish(a, seq(15, 2 * T), match=False)
    assert a.flush_remote_writes()
    ta = a.take_iteration_stats()[-1]
    assert ta.tier is CacheTier.REMOTE and ta.offloaded_pages == 2 and ta.offloaded_bytes == 2 * (HEADER_BYTES + SLOT)
    assert a.take_iteration_stats()[-1].offloaded_pages == 0  # per interval
    assert a.get_tier_statistics(CacheLevel(1)).offloaded_pages == 2  # cumulative
    assert reuse(b, seq(15, 2 * T) + [1]) == 2 * T
    tb = b.get_tier_statistics(CacheLevel(1))
    assert tb.onboarded_pages == 2 and tb.onboarded_bytes == 2 * (HEADER_BYTES + SLOT) and tb.io_errors == 0
    import redis

    client = redis.Redis.from_url(redis_server.url)
    assert all(0 < client.ttl(k) <= 60 for k in remote_keys(redis_server))
    client.close()
    stats = b.remote_statistics
    assert stats is not None
    st = dataclasses.asdict(stats)
    assert st["found_pages"] == 2 and st["pending_bytes"] == 0


# ---------------------------------------------------------------- CUDA backend logic (emulated driver)
def test_remote_tier_on_the_cuda_backend(redis_server: LocalRedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda.bindings
    from fake_cuda_driver import FakeDriver

    drv = FakeDriver()
    monkeypatch.setattr(cuda.bindings, "driver", drv)
    a = KVCacheManager(remote_config(redis_server.url, backend="cuda", gpu=2048))
    b = KVCacheManager(remote_config(redis_server.url, backend="cuda", gpu=2048))
    toks = seq(16, 3 * T)
    publish(a, toks, match=False)
    evict_everything(a)  # GPU pages copied out through the staging buffer
    assert a.flush_remote_writes()
    assert reuse(b, toks + [1]) == 3 * T  # fetched into GPU memory through the staging buffer
    assert "cuMemcpyBatchAsync" in drv.calls or "cuMemcpyAsync" in drv.calls
    for m in (a, b):
        m.shutdown()
    assert not drv.mapped and not drv.handles and not drv.reservations


def evict_through_the_lower_tier(m: KVCacheManager) -> None:
    """Fill GPU memory with a suspended request's pages, then with another's: the first one's move to
    the level below (as large as the GPU tier), pushing every reusable page there out (dropped)."""
    total = m.get_storage_statistics()[0].total
    first = m.create_kv_cache()
    assert first.resume() and first.resize(total * T)
    first.suspend()
    second = m.create_kv_cache()
    assert second.resume() and second.resize(total * T)
    second.close()
    first.close()


@pytest.mark.parametrize("lower", ["host", "disk"])
def test_pages_dropped_from_a_lower_tier_are_sent_from_their_slots(
    redis_server: LocalRedisServer, managers: Factory, tmp_path: Any, lower: str
) -> None:
    """A last level below the GPU hands a dropped page's slot to the writer (no copy on the
    scheduler's thread); headroom slots stand in meanwhile and are not counted as capacity."""
    from kv_cache_manager_v2 import DiskCacheTierConfig

    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(16 * SLOT)]
    if lower == "host":
        tiers.append(HostCacheTierConfig(16 * SLOT))
    else:
        tiers.append(DiskCacheTierConfig(16 * SLOT, str(tmp_path)))
    tiers.append(RemoteCacheTierConfig(redis_server.url, "test-model", timeout_ms=3000, max_pending_bytes=4 * SLOT))
    a = KVCacheManager(KVCacheManagerConfig(T, tiers, kv_layers(2, T), backend="host", max_util_for_resume=1.0))
    try:
        level = CacheLevel(1)
        stats = a.get_storage_statistics(level)[0]
        assert stats.total == 16 and stats.free == 16  # the 4 headroom slots are not capacity
        group = a._storage.levels[level][0]
        tier = a._storage.remote_tier
        assert tier is not None and tier.headroom_of(group) == 4 and len(tier.parked_of(group)) == 4
        assert group.set_aside == 4
        toks = [seq(40 + r, 4 * T) for r in range(3)]  # 12 blocks: more than the headroom
        for t in toks:
            publish(a, t, match=False)
        evict_through_the_lower_tier(a)
        assert a.flush_remote_writes()
        a.check_invariants()
        assert len(tier.parked_of(group)) == 4  # every handed-off slot came back
        st = a.remote_statistics
        # one burst of 12 drops: 4 slots handed off, 4 pages copied into the ring (4 slots' worth),
        # the rest dropped (counted): the writer had no time to drain
        assert st is not None and st.written_pages == 8 and st.dropped_writes == 4
        assert a._remote is not None and a._remote.slots_queued == 4
        b = managers(redis_server.url)
        assert sum(reuse(b, t + [1]) for t in toks) == 8 * T  # every record checked
        # a tier resize waits for the writer, moves pages out of the headroom and puts it back
        publish(a, seq(50, 4 * T), match=False)
        assert a.resize(level, 8 * SLOT)
        assert a.get_storage_statistics(level)[0].total == 8 and tier.headroom_of(group) == 4
        a.check_invariants()
        assert a.resize(level, 20 * SLOT) and a.get_storage_statistics(level)[0].total == 20
        a.check_invariants()
    finally:
        a.shutdown()


@pytest.mark.parametrize("path", ["write_through", "evicted", "handed_off"])
def test_retention_travels_in_the_remote_values(redis_server: LocalRedisServer, managers: Factory, path: str) -> None:
    """A block's retention goes into its value's header (written through, copied out when evicted,
    sent from a handed-off slot): another manager fetching it gives the page the same priority for
    the time left (within a second), then its base priority."""
    a = managers(redis_server.url, write_through=path == "write_through", host=16 if path == "handed_off" else None)
    toks = seq(70, 2 * T)
    kv = a.create_kv_cache(None, toks)
    assert kv.resume()
    compute(FakeEngine(a), kv, toks, len(toks))
    kv.close(retain=Retention(90, 10.0))  # its 10 s run from here
    closed = time.monotonic()
    if path == "evicted":
        evict_everything(a)
    elif path == "handed_off":
        evict_through_the_lower_tier(a)
    assert a.flush_remote_writes() and len(remote_keys(redis_server)) == 2
    time.sleep(1.5)  # (the time left is then clearly below the whole duration)
    b = managers(redis_server.url, host=16)
    handle = b.prefetch(toks + [1])  # fetched into b's host tier, taken by no request
    deadline = time.monotonic() + 10
    while not handle.done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    left = 10.0 - (time.monotonic() - closed)
    now = b._storage.expiries.now()
    pages = tree_pages(b, toks)
    assert [(p.level, p.priority, p.base_priority) for p in pages] == [(1, 90, 35)] * 2
    assert all(abs((p.expires - now) - left) < 1.0 for p in pages), [(p.expires - now, left) for p in pages]
    assert b.get_storage_statistics(CacheLevel(1))[0].retained == 2
    assert reuse(b, toks + [1]) == 2 * T


@pytest.mark.parametrize("hybrid", [False, True])
def test_frequency_policy_and_batched_decode_with_a_remote_tier(redis_server: LocalRedisServer, hybrid: bool) -> None:
    """The seams of the three: a manager decoding through the batch calls under the frequency
    policy, with GPU + host + a write-through remote tier; a second manager reuses what reached
    Redis, with the records checked and the invariants after every round."""
    import random

    from conftest import make_config

    rng = random.Random(3)
    layers = kv_layers(4, T, window=20, swa_every=2, sink_tokens=4) if hybrid else kv_layers(2, T)
    slot = len(layers) * 2 * REC * T

    def make() -> KVCacheManager:
        cfg = make_config(layers, T, slot * 40, host_quota=slot * 60, eviction_policy="frequency")
        remote = RemoteCacheTierConfig(redis_server.url, namespace="seam", timeout_ms=3000, write_through=True)
        return KVCacheManager(dataclasses.replace(cfg, cache_tiers=[*cfg.cache_tiers, remote]))

    a, b = make(), make()
    try:
        engine = FakeEngine(a)
        system = [rng.randrange(1 << 20) for _ in range(5 * T)]
        done: list[list[int]] = []
        for _ in range(4):
            running: list[tuple[KVCache, list[int]]] = []
            for _ in range(6):
                p = system[: rng.randrange(len(system))] + [
                    rng.randrange(1 << 20) for _ in range(rng.randrange(1, 3 * T))
                ]
                kv = a.create_kv_cache(input_tokens=p)
                assert kv.resume()
                h = kv.history_length
                if not kv.resize(len(p)):
                    kv.close()
                    continue
                engine.step(kv, p, h, len(p))
                kv.commit(p[h:])
                running.append((kv, p + [rng.randrange(1 << 20) for _ in range(40)]))
            for _ in range(30):
                live = [c for c in running if c[0].status is KVCacheStatus.ACTIVE]
                failed = set(a.resize_batch([kv for kv, _ in live]))
                for i in failed:
                    live[i][0].close()
                go = [c for i, c in enumerate(live) if i not in failed]
                for kv, s in go:
                    n = kv.num_committed_tokens
                    engine.step(kv, s, n, n + 1)
                a.commit_batch([kv for kv, _ in go], [s[kv.num_committed_tokens] for kv, s in go])
            for kv, s in running:
                done.append(s[: kv.num_committed_tokens])
                if kv.status is not KVCacheStatus.CLOSED:
                    kv.close()
            a.check_invariants()
        assert a.flush_remote_writes(10)
        hits = 0
        for s in done[-12:]:
            hits += reuse(b, s) > 0  # records checked through b's own pages
        st = b.remote_statistics
        assert st is not None and hits > 0 and st.corrupt_pages == 0
    finally:
        for m in (a, b):
            for kv in m.open_caches():
                kv.close()
            m.shutdown()


def test_a_failed_constructor_stops_the_remote_writer(
    redis_server: LocalRedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the remote store started (here: reserving its headroom slots) stops its
    writer thread and releases the pools."""
    import threading

    from kv_cache_manager_v2._storage._storage_manager import StorageManager

    if kv_cache_manager_v2.compiled:
        pytest.skip("a compiled class's methods cannot be patched to inject the failure")

    def no_memory(self: StorageManager, *args: object) -> None:
        raise MemoryError("injected")

    monkeypatch.setattr(StorageManager, "attach_remote", no_memory)
    others = set(threading.enumerate())  # (writers of managers an earlier test in this process left open)
    with pytest.raises(MemoryError, match="injected"):
        KVCacheManager(remote_config(redis_server.url))
    assert not any(t.name == "kvcm-remote-writer" and t not in others for t in threading.enumerate())


def test_probe_reports_what_create_reuses_with_a_partial_block(
    redis_server: LocalRedisServer, managers: Factory
) -> None:
    """Regression (issue #28): when the local match stops early for want of sliding-window pages
    the remote tier has, probe reported the remote tier's full blocks (56 tokens) while create,
    once the fetched pages were in the tree, also matched the local partial block after them (59)."""
    layers = kv_layers(4, T, window=2 * T, swa_every=2)
    slot = 4 * 2 * REC * T
    a = managers(redis_server.url, layers=layers, gpu=64 * slot // SLOT, write_through=True)
    toks = seq(40, 10 * T)

    def publish_block_by_block(m: KVCacheManager) -> None:
        """Every block's window pages are published, and released oldest first (one step each)."""
        kv = m.create_kv_cache()
        assert kv.resume()
        for end in range(T, 10 * T + 1, T):
            compute(FakeEngine(m), kv, toks, end)
        kv.close()

    publish_block_by_block(a)
    assert a.flush_remote_writes()
    prompt = toks[: 7 * T + 3] + [5, 5]
    for with_levels in (False, True):
        b = managers(redis_server.url, layers=layers, gpu=32 * slot // SLOT)
        publish_block_by_block(b)
        # a request of 25 blocks takes 50 of b's 64 slots: 6 published pages make room, the
        # sliding-window pages of blocks 0-5 (the nodes stay); a match at 59 tokens needs 5, 6, 7
        kv = b.create_kv_cache()
        assert kv.resume() and kv.resize(25 * T)
        if with_levels:
            levels = b.probe_reuse_levels(None, prompt)
            assert levels == [CacheLevel(0)] * 5 + [CacheLevel(1)] + [CacheLevel(0)] * 2  # block 5 is remote
        probed = b.probe_reuse(None, prompt)
        kv.close()
        assert probed == 7 * T + 3
        assert reuse(b, prompt) == probed


def test_a_key_of_the_wrong_type_costs_that_key_only(redis_server: LocalRedisServer, managers: Factory) -> None:
    """Regression (issue #28): a list under one page's key made the Lua lookup fail, which turned Lua
    off for good, marked the whole tier down and lost the intact blocks before it."""
    import redis

    a = managers(redis_server.url, write_through=True)
    b = managers(redis_server.url, host=16)
    toks = seq(41, 5 * T)
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = remote_keys(redis_server)
        assert len(keys) == 5
        # the key of block 3: the one b's lookup finds at position 3 of its STRLEN answers
        by_block = {k: i for i, k in enumerate(sorted(keys))}
        assert by_block
        bad = page_keys(b, toks)[3]
        assert bad in keys
        client.delete(bad)
        client.rpush(bad, b"x")
        evalsha_before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        assert b.probe_reuse(None, toks + [1]) == 3 * T
        assert reuse(b, toks + [1]) == 3 * T
        st = b.remote_statistics
        assert st is not None and st.errors == 0 and st.connected and st.skipped_lookups == 0
        # still the Lua lookup, and the tier stays up: the next prompt is looked up at once
        other = seq(42, 2 * T)
        publish(a, other, match=False)
        assert a.flush_remote_writes()
        assert reuse(b, other + [1]) == 2 * T
        assert client.info("commandstats")["cmdstat_evalsha"]["calls"] >= evalsha_before + 2
    finally:
        client.close()


def test_credentials_never_reach_logs_repr_or_errors(
    managers: Factory, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    """Regression (issue #28): the outage warning logged ``redis://user:password@host`` and ``repr``
    of the config showed the password."""
    from conftest import REDIS_SERVER

    if REDIS_SERVER is None:
        pytest.skip("no redis-server")
    secret = "s3cr3t-pw"
    with LocalRedisServer(REDIS_SERVER, extra_args=["--requirepass", secret]) as server:
        url = f"redis://default:{secret}@127.0.0.1:{server.port}/0"
        cfg = RemoteCacheTierConfig(url, "n")
        assert secret not in repr(cfg) and secret not in str(cfg) and "default:***@" in repr(cfg)
        a = managers(url, write_through=True)
        b = managers(url)
        toks = seq(43, 2 * T)
        publish(a, toks, match=False)
        assert a.flush_remote_writes()
        assert reuse(b, toks + [1]) == 2 * T  # the password is used, just never shown
        assert secret not in repr(a.config) and secret not in str(b.remote_statistics)
        with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
            server.kill()
            assert reuse(b, seq(44, 2 * T)) == 0
            wrong = managers(f"redis://default:wrong-{secret}@127.0.0.1:{server.port}/0")
            server.start()
            assert reuse(wrong, toks + [1]) == 0  # WRONGPASS: a miss
        messages = [r.getMessage() for r in caplog.records]
        assert any("treating it as a miss" in m for m in messages)
        assert not any(secret in m for m in messages), messages
    for bad in (f"http://u:{secret}@h", f"redis+cluster://u:{secret}@h"):
        with pytest.raises(ValueError) as info:
            RemoteCacheTierConfig(bad, "n")
        assert secret not in str(info.value)
