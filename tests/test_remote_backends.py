"""The remote tier's behaviour on every backend (Redis, Redis Cluster, Mooncake Store), each started
for real on loopback, through the fake engine: reuse across managers (write-back and write-through),
a quota, an outage and a restart (Mooncake: the master killed and started again), a hung store, values
gone between lookup and read (a flushed store, evicted objects), a value of the wrong size under our
key, a block's retention carried through a read into slots, and (Mooncake) a client segment too small
for what is written. No wrong byte (every reused record is checked), no exception into the engine, no
call past its deadline."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import NO_REDIS_REASON, REDIS_SERVER
from fake_engine import FakeEngine
from remote_stores import MOONCAKE_REASON, ClusterStore, MooncakeStore, RedisStore, StoreUnderTest
from test_remote import Factory, evict_everything, evict_through_the_lower_tier, reuse
from test_remote import managers as managers  # (a fixture)
from tier_helpers import T, compute, page_keys, publish, seq, tree_pages

from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, CacheLevel, KVCacheManager, LayerId, Retention
from kv_cache_manager_v2._storage._remote._backend import RemoteBackend
from kv_cache_manager_v2._storage._remote._value import HEADER_BYTES


@pytest.fixture(scope="module", params=["redis", "cluster", "mooncake"])
def started(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    """One store of each kind for the module (tests keep apart by namespace)."""
    kind = request.param
    if kind == "mooncake" and MOONCAKE_REASON is not None:
        pytest.skip(MOONCAKE_REASON)
    if kind != "mooncake" and REDIS_SERVER is None:
        pytest.skip(NO_REDIS_REASON)
    store: StoreUnderTest
    if kind == "redis":
        store = RedisStore(REDIS_SERVER or "")
    elif kind == "cluster":
        store = ClusterStore(REDIS_SERVER or "")
    else:
        store = MooncakeStore()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def store(started: StoreUnderTest) -> StoreUnderTest:
    started.ready()
    return started


@pytest.fixture
def make(store: StoreUnderTest, managers: Factory, request: pytest.FixtureRequest) -> Factory:
    """Managers on ``store`` in a namespace of this test's own."""

    def factory(**kw: Any) -> KVCacheManager:
        kw.setdefault("namespace", f"t-{request.node.name}")
        kw.setdefault("gpu", 32)
        return managers(store.url, **kw)

    return factory


PAGE_BYTES = HEADER_BYTES + 2 * 2 * 32 * T  # a stored page: two layers, key and value, one 32-byte record per token


def store_backend(m: KVCacheManager) -> RemoteBackend:
    """``m``'s remote backend."""
    remote = m._remote
    assert remote is not None
    return remote.backend


def written(a: KVCacheManager, toks: list[int]) -> list[bytes]:
    """Publish ``toks`` through ``a`` (computed whole), flush its remote writes: the pages' keys."""
    publish(a, toks, match=False)
    assert a.flush_remote_writes()
    return page_keys(a, toks)


def present(m: KVCacheManager, keys: list[bytes]) -> list[bool]:
    """Whether the store holds a whole page under each key (through ``m``'s backend)."""
    found = store_backend(m).lookup(keys, [PAGE_BYTES] * len(keys))
    assert found is not None
    return found


@pytest.mark.parametrize("write_through", [False, True])
def test_a_prefix_written_by_one_manager_is_reused_by_another(make: Factory, write_through: bool) -> None:
    a = make(write_through=write_through)
    b = make(host=16)
    toks = seq(1, 4 * T + 3)
    publish(a, toks, match=False)
    if not write_through:
        assert a.flush_remote_writes() and not any(present(a, page_keys(a, toks)))  # nothing dropped yet
        evict_everything(a)  # GPU is a's last level: its reusable pages are dropped, i.e. written back
    assert a.flush_remote_writes()
    assert present(a, page_keys(a, toks)) == [True] * 4  # full blocks only
    prompt = toks[: 4 * T] + [7, 7]
    assert b.probe_reuse(None, prompt) == 4 * T
    assert reuse(b, prompt) == 4 * T
    st = b.remote_statistics
    assert st is not None and st.fetched_pages == 4 and st.hit_blocks == 4 and st.corrupt_pages == 0
    assert st.lookups == 1 and st.errors == 0 and st.connected
    sa = a.remote_statistics
    assert sa is not None and sa.written_pages == 4 and sa.dropped_writes == 0


def test_a_quota_bounds_the_store_and_what_is_left_is_reused_correctly(
    store: StoreUnderTest, make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    quota = 3 << 19  # 1.5 MiB (Mooncake: each client's share of the store's memory)
    caplog.set_level(logging.WARNING, "kv_cache_manager_v2")
    wide = [  # 16 KiB pages: 240 of them do not fit
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 4 << 10), BufferConfig("value", 4 << 10)])
        for i in range(2)
    ]
    big = make(write_through=True, gpu=64 * 16, quota=quota, layers=wide)
    assert big.get_quota(CacheLevel(1)) == quota
    assert not [r for r in caplog.records if "quota" in r.getMessage()]  # it was applied: no warning
    for r in range(40):
        publish(big, seq(100 + r, 6 * T), match=False)
        assert big.flush_remote_writes()
    b = make(gpu=64 * 16, layers=wide, quota=quota)
    reused = 0
    for r in range(0, 40, 3):
        reused += reuse(b, seq(100 + r, 6 * T) + [1])  # any length, every record checked
    assert reused < 14 * 6 * T  # the store kept less than was written
    # Redis: the servers' maxmemory, changed at once; Mooncake: its clients' memory, set at start
    assert big.resize(CacheLevel(1), quota + 1) == (store.name != "mooncake")
    assert big.resize(CacheLevel(1), quota)  # (Mooncake: the share it has)


def test_an_outage_costs_hits_only_and_reuse_resumes_after_a_restart(store: StoreUnderTest, make: Factory) -> None:
    a = make(gpu=8)
    b = make(gpu=8)
    toks = seq(11, 3 * T)
    publish(a, toks, match=False)
    evict_everything(a)
    assert a.flush_remote_writes()
    store.kill()
    assert b.probe_reuse(None, toks + [1]) == 0
    assert reuse(b, toks + [1]) == 0  # misses, no exception
    for r in range(3):  # both keep serving: a's writes are dropped, b computes
        publish(a, seq(20 + r, 3 * T), match=False)
        evict_everything(a)
        assert reuse(b, seq(30 + r, 2 * T) + [1]) == 0
        time.sleep(0.06)  # past retry_interval_ms: the next call tries again
    assert a.flush_remote_writes()  # (statistics are a snapshot: read them after the flush)
    sa, sb = a.remote_statistics, b.remote_statistics
    assert sa is not None and sb is not None
    assert sa.dropped_writes > 0
    assert sb.errors > 0 and not sb.connected
    store.start()  # back, empty, at the same address
    time.sleep(0.06)
    assert reuse(b, toks + [1]) == 0  # the old data is gone
    deadline = time.monotonic() + 10
    while True:  # (a reconnects on its next write after retry_interval_ms)
        publish(a, toks, match=False)
        evict_everything(a)
        assert a.flush_remote_writes()
        if all(present(a, page_keys(a, toks))) or time.monotonic() > deadline:
            break
        time.sleep(0.06)
    assert reuse(b, toks + [1]) == 3 * T  # reuse resumed
    sb = b.remote_statistics
    assert sb is not None and sb.connected


def test_a_hung_store_times_out_into_misses(store: StoreUnderTest, make: Factory) -> None:
    a = make(write_through=True)
    b = make(timeout_ms=200, retry_interval_ms=60_000)
    toks = seq(12, 3 * T)
    written(a, toks)
    assert b.probe_reuse(None, seq(13, 2 * T) + [1]) == 0  # (b connected before the store hangs)
    store.pause()
    try:
        t0 = time.monotonic()
        assert reuse(b, toks + [1]) == 0
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert reuse(b, toks + [1]) == 0  # counted as down: no second wait
        second = time.monotonic() - t0
    finally:
        store.resume()
    assert first < 2.0 and second < 2.0  # bounded by the deadline, not hung
    st = b.remote_statistics
    assert st is not None and st.errors >= 1
    if store.name != "cluster":  # (a cluster's nodes are down one by one: the next call asks the others)
        assert second < first and st.skipped_lookups >= 1


def test_values_gone_between_lookup_and_read_are_misses(make: Factory) -> None:
    """A flushed store, or objects the store evicted after the lookup found them."""
    a = make(write_through=True)
    b = make()
    toks = seq(14, 4 * T)
    keys = written(a, toks)
    assert b.probe_reuse(None, toks + [1]) == 4 * T  # the lookup finds all four
    backend = store_backend(a)
    assert backend.delete(keys[2:]) == 2  # gone before the read
    assert reuse(b, toks + [1]) == 2 * T  # create reads: what is left, checked
    assert backend.delete(keys) == 2  # flushed
    c = make()
    assert reuse(c, toks + [1]) == 0


def test_a_value_of_the_wrong_size_under_our_key_is_a_miss(make: Factory) -> None:
    a = make(write_through=True)
    b = make()
    toks = seq(15, 3 * T)
    keys = written(a, toks)
    backend = store_backend(a)
    assert backend.delete(keys[1:2]) == 1
    results: list[Any] = []
    backend.write(keys[1:2], [[b"\0" * 100]], results)  # a foreign value of another size
    assert results == [True]
    assert reuse(b, toks + [1]) == T  # block 1 is a miss: the match ends before it
    st = b.remote_statistics
    assert st is not None and st.errors == 0


def test_a_corrupt_value_read_into_slots_is_a_miss_and_its_slot_given_back(make: Factory) -> None:
    """A value of the right size whose payload was damaged is read into a new slot, fails its checksum
    there and is never published (the match ends before it); every slot read is accounted for."""
    a = make(write_through=True)
    b = make(host=16)
    toks = seq(17, 3 * T)
    keys = written(a, toks)
    backend = store_backend(a)
    values = backend.read(keys[1:2], [PAGE_BYTES])
    assert values is not None and values[0] is not None
    bad = bytearray(values[0])
    bad[-1] ^= 0xFF  # one payload byte: the size and header stay right
    assert backend.delete(keys[1:2]) == 1
    results: list[Any] = []
    backend.write(keys[1:2], [[bytes(bad)]], results)
    assert results == [True]
    assert reuse(b, toks + [1]) == T  # checked record by record; invariants: no slot lost
    st = b.remote_statistics
    assert st is not None and st.corrupt_pages == 1 and st.fetched_pages == 1 and st.errors == 0


def test_mooncake_reads_land_in_the_host_slots_without_a_staging_copy(store: StoreUnderTest, make: Factory) -> None:
    """Values are read straight into the host tier's slots (registered with the client): the reading
    thread's buffer stays at its minimum (1 MiB) while 2 MiB of pages arrive."""
    if store.name != "mooncake":
        pytest.skip("Mooncake's zero-copy reads")
    wide = [
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 64 << 10), BufferConfig("value", 64 << 10)])
        for i in range(2)
    ]
    page = 4 * (64 << 10)
    slots = page // (2 * 2 * 32 * T)  # (a manager's gpu/host sizes count slots of the default layers)
    a = make(write_through=True, gpu=16 * slots, layers=wide)
    b = make(gpu=16 * slots, host=16 * slots, layers=wide)
    toks = seq(18, 8 * T)
    written(a, toks)
    assert reuse(b, toks + [1]) == 8 * T
    st = b.remote_statistics
    assert st is not None and st.fetched_pages == 8 and st.fetched_bytes >= 8 * page
    buf = getattr(store_backend(b)._local, "buf", None)
    assert buf is not None and buf.size == 1 << 20  # headers only went through it


def test_mooncake_a_read_into_slots_of_many_pages_is_issued_in_batches(store: StoreUnderTest, make: Factory) -> None:
    """300 pages: more than one batch of the client's multi-buffer reads (256 keys), every byte right."""
    if store.name != "mooncake":
        pytest.skip("Mooncake's read batches")
    a = make(write_through=True, gpu=320)
    b = make(gpu=320, host=320)
    toks = seq(21, 300 * T)
    written(a, toks)
    assert reuse(b, toks + [1]) == 300 * T  # every record checked
    st = b.remote_statistics
    assert st is not None and st.fetched_pages == 300 and st.corrupt_pages == 0


def test_mooncake_slots_a_late_read_may_write_are_held_until_it_returns(store: StoreUnderTest, make: Factory) -> None:
    """A read into slots past its deadline (a hung master) leaves them allocated, set aside (not
    capacity, no page), and a resize waits; once the call has returned they are free again."""
    if store.name != "mooncake":
        pytest.skip("a call Mooncake's client cannot bound runs on")
    b = make(host=16, timeout_ms=300, retry_interval_ms=50)
    keys = page_keys(b, seq(19, 2 * T))  # (never written: any answer needs the master)
    assert b.probe_reuse(None, seq(13, 2 * T) + [1]) == 0  # (b's client is set up)
    tier = b._storage.remote_tier
    assert tier is not None
    group = b._storage.levels[CacheLevel(1)][0]
    before = (group.set_aside, group.num_slots, b.get_storage_statistics(CacheLevel(1))[0].free)
    slots = group.allocator.allocate(2)
    store.pause()
    try:
        ok = tier.read_into_slots(keys, [(0, b"")] * 2, [(group, s) for s in slots])
        assert ok is None and tier.held_of(group) == slots
        assert group.set_aside == before[0] + 2 and group.num_slots == before[1] - 2
        b.check_invariants()
        assert not b.resize(CacheLevel(1), 8 * 2 * 2 * 32 * T)  # refused while a late call may write
    finally:
        store.resume()
    deadline = time.monotonic() + 30
    while not tier.settle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.held_of(group) == [] and group.set_aside == before[0] and group.num_slots == before[1]
    assert b.get_storage_statistics(CacheLevel(1))[0].free == before[2]
    b.check_invariants()


def test_mooncake_a_full_segment_refuses_writes_without_harm(store: StoreUnderTest, make: Factory) -> None:
    if store.name != "mooncake":
        pytest.skip("Mooncake's client segments")
    wide = [
        AttentionLayerConfig(LayerId(i), [BufferConfig("key", 4 << 10), BufferConfig("value", 4 << 10)])
        for i in range(2)
    ]
    a = make(write_through=True, gpu=64 * 16, quota=256 << 10, layers=wide)  # room for about 16 pages
    for r in range(6):
        publish(a, seq(200 + r, 6 * T), match=False)
    assert a.flush_remote_writes()
    st = a.remote_statistics
    assert st is not None and st.dropped_writes > 0 and st.written_pages + st.dropped_writes == 36
    b = make(gpu=64 * 16, layers=wide, quota=256 << 10)
    for r in range(6):
        reuse(b, seq(200 + r, 6 * T) + [1])  # whatever is there, checked


def test_a_backend_serves_reads_from_another_thread(make: Factory) -> None:
    """A loader's worker thread reads with a connection (and buffers) of its own."""
    import threading

    a = make(write_through=True)
    toks = seq(16, 4 * T)
    keys = written(a, toks)
    backend = store_backend(a)
    out: dict[str, Any] = {}

    def worker() -> None:
        values = backend.read(keys, [PAGE_BYTES] * 4)
        out["sizes"] = [len(v) if v is not None else -1 for v in values or []]
        out["mine"] = backend.read(keys[:1], [PAGE_BYTES])

    t = threading.Thread(target=worker)
    t.start()
    here = backend.read(keys[1:2], [PAGE_BYTES])  # (meanwhile, on this thread)
    t.join(30)
    assert out["sizes"] == [PAGE_BYTES] * 4
    assert here is not None and out["mine"] is not None
    assert bytes(here[0]) != bytes(out["mine"][0])  # each thread's value intact


def test_a_url_scheme_chooses_the_backend_and_bad_urls_are_refused() -> None:
    from kv_cache_manager_v2 import RemoteCacheTierConfig
    from kv_cache_manager_v2._storage._remote._mooncake import parse_url
    from kv_cache_manager_v2._storage._remote._registry import BACKENDS, REMOTE_URL_SCHEMES, backend_of

    assert backend_of("redis://h:1/0")[:2] == ("_redis", "RedisBackend")
    assert backend_of("redis+cluster://h:1,h:2")[:2] == ("_redis", "RedisBackend")
    assert backend_of("mooncake://h:1?metadata=P2PHANDSHAKE") == ("_mooncake", "MooncakeBackend", "mooncake")
    assert len(BACKENDS) == 2 and "mooncake://" in REMOTE_URL_SCHEMES
    with pytest.raises(ValueError, match="no remote backend"):
        backend_of("http://x")
    with pytest.raises(ValueError, match="url must start with"):
        RemoteCacheTierConfig("memcached://x:1", "n")
    args = parse_url("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&protocol=rdma&device=mlx5_0")
    assert args["master_server_addr"] == "10.0.0.5:50051" and args["protocol"] == "rdma"
    assert args["rdma_devices"] == "mlx5_0" and args["metadata_server"] == "http://10.0.0.5:8080/metadata"
    for bad, match in (
        ("mooncake://h?metadata=x", "mooncake://host:port"),
        ("mooncake://h:1", "metadata="),
        ("mooncake://h:1?metadata=x&segment=big", "segment must be a number"),
        ("mooncake://h:1?metadata=x&colour=red", "unknown parameters"),
        ("mooncake://h:99999?metadata=x", "mooncake://host:port.*'mooncake://h:99999.*out of range"),
        ("mooncake://[::1?metadata=x", "mooncake://host:port"),
        ("mooncake://u:secret@h?metadata=x", r"got 'mooncake://u:\*\*\*@h"),
    ):
        with pytest.raises(ValueError, match=match) as caught:
            parse_url(bad)
        assert "secret" not in str(caught.value)


def test_the_config_refuses_a_bad_mooncake_url_saying_what_is_allowed() -> None:
    """``RemoteCacheTierConfig`` checks a URL with the backend its scheme names, before any manager starts."""
    from kv_cache_manager_v2 import RemoteCacheTierConfig

    good = RemoteCacheTierConfig("mooncake://10.0.0.5:50051?metadata=P2PHANDSHAKE&protocol=rdma&device=mlx5_0", "n")
    assert good.url.startswith("mooncake://")
    for bad, match in (
        ("mooncake://h:1", r"url: Mooncake URL: metadata=<the metadata server> is required \(mooncake://host:port"),
        ("mooncake://h:1?metadata=x&protocol=udp", r"protocol must be one of \('tcp', 'rdma'\), got 'udp'"),
        ("mooncake://h:1?metadata=x&segment=-5", "segment must be a number of bytes"),
        ("mooncake://h:1?metadata=x&colour=red", r"unknown parameters \['colour'\]; allowed: \['buffer'"),
        ("mooncake://h?metadata=x", r"a Mooncake URL is mooncake://host:port\?metadata=.*\(the master's host:port\)"),
        ("mooncake://h:1/db?metadata=x", "a path or fragment"),
        ("mooncake://h:1?metadata=x&hostname=a b", "hostname must be"),
        ("mooncake://u:secret@h?metadata=x", r"got 'mooncake://u:\*\*\*@h"),
    ):
        with pytest.raises(ValueError, match=r"RemoteCacheTierConfig\.url: ") as caught:
            RemoteCacheTierConfig(bad, "n")
        assert re.search(match, str(caught.value)), (bad, str(caught.value))
        assert "secret" not in str(caught.value)


def test_a_mooncake_url_without_its_client_is_refused_with_the_extra_to_install() -> None:
    import os
    import subprocess
    import sys

    script = """
import sys
sys.modules["mooncake"] = None
sys.modules["mooncake.store"] = None
from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, KVCacheManagerConfig, RemoteCacheTierConfig
from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, LayerId
layers = [AttentionLayerConfig(LayerId(0), [BufferConfig("key", 64), BufferConfig("value", 64)])]
url = "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata"
try:
    KVCacheManager(KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 16), RemoteCacheTierConfig(url, "n")], layers, backend="host"))
except ImportError as e:
    print("refused:", e)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: RemoteCacheTierConfig with a mooncake:// URL needs the Mooncake Store client" in out.stdout
    assert "kv_cache_manager_v2[mooncake]" in out.stdout


def test_pages_dropped_from_the_host_tier_are_sent_from_their_slots(make: Factory) -> None:
    """The host pool's slots go to the writer as they are (Mooncake: registered memory, zero-copy)."""
    from test_remote import evict_through_the_lower_tier

    a = make(gpu=16, host=16, max_pending_bytes=4 * 2 * 2 * 32 * T)
    toks = [seq(40 + r, 4 * T) for r in range(3)]
    for t in toks:
        publish(a, t, match=False)
    evict_through_the_lower_tier(a)
    assert a.flush_remote_writes()
    a.check_invariants()
    remote = a._remote
    assert remote is not None and remote.slots_queued == 4
    st = a.remote_statistics
    assert st is not None and st.written_pages == 8 and st.dropped_writes == 4
    b = make()
    assert sum(reuse(b, t + [1]) for t in toks) == 8 * T  # every record checked


class _HungPuts:
    """A Mooncake client whose puts wait for ``gate`` and then read what they send (``sent``)."""

    gate = threading.Event()
    sent: list[bytes] = []

    def setup(self, *args: object) -> int:
        return 0

    def register_buffer(self, addr: int, size: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    def batch_put_from_multi_buffers(
        self, names: list[str], addrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        import ctypes

        self.gate.wait(10)
        for at, ns in zip(addrs, sizes):
            _HungPuts.sent.append(b"".join(ctypes.string_at(a, n) for a, n in zip(at, ns)))
        return [0] * len(names)


def test_mooncake_a_late_write_keeps_its_memory_until_it_returns() -> None:
    """A write past its deadline is an outage at once for everyone else, but the writer's call
    returns only once the late put has read its values: the writer reuses that memory (the ring,
    handed-off slots, its thread's buffer) after ``write`` returns, and the late put must not send
    the next values' bytes under its own keys."""
    pytest.importorskip("mooncake.store")
    from kv_cache_manager_v2 import RemoteCacheTierConfig
    from kv_cache_manager_v2._storage._remote._mooncake import MooncakeBackend, MooncakeError

    cfg = RemoteCacheTierConfig("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE", "n", timeout_ms=50)
    backend = MooncakeBackend(cfg, 1 << 16)
    backend._make = _HungPuts
    _HungPuts.gate.clear()
    _HungPuts.sent.clear()
    try:
        threading.Timer(0.3, _HungPuts.gate.set).start()
        t0 = time.monotonic()
        with pytest.raises(MooncakeError, match="no answer within 50 ms"):
            backend.write([b"k1"], [[b"header-1", b"page-1" * 100]], [])
        assert time.monotonic() - t0 >= 0.25
        assert _HungPuts.sent == [b"header-1" + b"page-1" * 100]  # read before write returned
        results: list[object] = []
        backend.write([b"k2"], [[b"header-2", b"page-2" * 100]], results)  # a new client, at once
        assert results == [True] and _HungPuts.sent[-1] == b"header-2" + b"page-2" * 100
    finally:
        _HungPuts.gate.set()
        backend.close()


def test_mooncake_helpers_never_hold_the_process_at_exit() -> None:
    """The client's calls run on daemon helper threads: one stuck on a master that never answers
    cannot keep the interpreter from exiting (an executor's threads would be joined at exit)."""
    pytest.importorskip("mooncake.store")
    from kv_cache_manager_v2._storage._remote._mooncake import DaemonHelpers

    gate = threading.Event()
    helpers = DaemonHelpers(2, "kvcm-test-helpers")
    try:
        stuck = helpers.submit(gate.wait)
        assert helpers.submit(lambda x: x + 1, 41).result(5.0) == 42  # the other helper still serves
        ours = [t for t in threading.enumerate() if t.name.startswith("kvcm-test-helpers")]
        assert len(ours) == 2 and all(t.daemon for t in ours)
        assert not stuck.done()
    finally:
        gate.set()
        helpers.shutdown()
    assert stuck.result(5.0) is True


@pytest.mark.parametrize("path", ["write_through", "handed_off"])
def test_retention_travels_through_reads_into_slots(make: Factory, path: str) -> None:
    """A retained block's value (written through, or sent from a handed-off host slot) carries its
    retention through a read straight into the host tier's slots (a create's own fetch): the other
    manager's pages get the same priority over their base one, their duration running for the time
    left (within a second) until the create takes them; released, the whole duration runs again,
    as on the manager that wrote them."""
    a = make(write_through=True) if path == "write_through" else make(host=32)
    toks = seq(71, 3 * T)
    kv = a.create_kv_cache(None, toks)
    assert kv.resume()
    compute(FakeEngine(a), kv, toks, len(toks))
    kv.close(retain=Retention(90, 10.0))  # its 10 s run from here; the hint ends at the third block
    closed = time.monotonic()
    if path == "handed_off":
        evict_through_the_lower_tier(a)
        assert a._remote is not None and a._remote.slots_queued >= 3
    assert a.flush_remote_writes() and present(a, page_keys(a, toks)) == [True] * 3
    time.sleep(1.5)  # (the time left is then clearly below the whole duration)
    b = make(host=16)
    expiries = b._storage.expiries
    prompt = toks[: 2 * T] + [1]  # short of the hint's end: the retention stays
    kb = b.create_kv_cache(None, prompt)  # fetched into b's host tier by the create itself
    left = 10.0 - (time.monotonic() - closed)
    st = b.remote_statistics
    assert st is not None and st.fetched_pages == 2 and st.corrupt_pages == 0
    pages = tree_pages(b, prompt)
    assert [(p.level, p.priority, p.base_priority) for p in pages] == [(1, 90, 35)] * 2
    # placed with the time left running (the create's take then stopped it: the queue keeps the entry)
    now = expiries.now()
    ran = [min(t for i, t in expiries.pending() if i == id(p)) - now for p in pages]
    assert all(abs(t - left) < 1.0 for t in ran), (ran, left)
    assert kb.resume()
    FakeEngine(b).check_all(kb, prompt, kb.history_length)
    kb.close()
    now = expiries.now()
    assert all(p.priority == 90 and abs((p.expires - now) - 10.0) < 1.0 for p in pages)
    assert b.get_storage_statistics()[0].retained == 2  # (moved up to GPU memory by the resume)
    b.check_invariants()
