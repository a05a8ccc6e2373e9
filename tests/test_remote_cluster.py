"""The remote tier on a real 3-master Redis Cluster on loopback (issue #28), through the fake engine:
slot hashing as the server does it, two managers in two processes sharing a prefix, one round trip
per node, a master killed and restarted mid-run (misses for its slots only, its writes dropped),
a slot migrated mid-run (ASK, then MOVED), keys of the wrong type, and credentials kept out of logs."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import NO_REDIS_REASON, REDIS_SERVER
from test_remote import Factory, T, publish, reuse, seq
from test_remote import managers as managers  # (a fixture)
from test_remote_replies import Answer, Chunks, FakeRedis
from test_remote_replies import fake as fake  # (a fixture)
from tier_helpers import page_keys, run_worker

import kv_cache_manager_v2
from kv_cache_manager_v2 import CacheLevel, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2._storage._remote._cluster import MAX_OTHER_NODES, key_slot
from kv_cache_manager_v2.redis_server import LocalRedisCluster, command


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    """One cluster for the module (starting one takes about two seconds); emptied before each test."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_REASON)
    with LocalRedisCluster(3, REDIS_SERVER) as c:
        yield c


@pytest.fixture
def cl(cluster: LocalRedisCluster) -> LocalRedisCluster:
    for s in cluster.servers:
        if s.proc is None:  # a test that failed while a node was down
            s.start()
    cluster.wait_ready()
    for p in cluster.ports:
        command(p, "FLUSHALL")
    return cluster


@pytest.fixture
def make(cl: LocalRedisCluster, managers: Factory) -> Factory:
    """Managers on the cluster, with GPU room for the longer prefixes here."""

    def factory(**kw: Any) -> KVCacheManager:
        kw.setdefault("gpu", 64)
        return managers(cl.url, **kw)

    return factory


def owners(cl: LocalRedisCluster, keys: list[bytes]) -> list[int]:
    return [_owner(key_slot(k), len(cl.servers)) for k in keys]


def _owner(slot: int, n: int) -> int:
    """The node LocalRedisCluster.start gave ``slot`` (equal ranges)."""
    for i in range(n):
        if i * 16384 // n <= slot < (i + 1) * 16384 // n:
            return i
    raise AssertionError(slot)


def test_key_slot_is_the_servers(cl: LocalRedisCluster) -> None:
    rng = random.Random(5)
    keys = [b"kvcm:m:%x:0:%x" % (rng.getrandbits(64), rng.getrandbits(256)) for _ in range(200)]
    keys += [b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap", b"foo{bar}{zap}", b"{", b"}{x}", b""]
    for k in keys:
        assert key_slot(k) == command(cl.ports[0], "CLUSTER", "KEYSLOT", k), k


def test_cluster_url_validation_and_redaction() -> None:
    cfg = RemoteCacheTierConfig("redis+cluster://admin:s3cret@10.0.0.1:7000,10.0.0.2:7000", "n")
    assert cfg.cluster and "s3cret" not in repr(cfg) and "admin:***@" in repr(cfg)
    assert not RemoteCacheTierConfig("redis://h:1/0", "n").cluster
    for bad in ("redis+cluster://:s3cret@h", "redis+cluster://h:1,h:x", "redis+cluster://h:70000"):
        with pytest.raises(ValueError, match="host:port") as info:
            RemoteCacheTierConfig(bad, "n")
        assert "s3cret" not in str(info.value)
    with pytest.raises(ValueError) as info2:
        RemoteCacheTierConfig("http://u:s3cret@h:1", "n")
    assert "s3cret" not in str(info2.value)


def test_a_prefix_is_shared_across_nodes_with_one_round_trip_per_node(cl: LocalRedisCluster, make: Factory) -> None:
    a = make(write_through=True)
    b = make(host=32)
    toks = seq(1, 24 * T + 5)
    publish(a, toks)
    assert a.flush_remote_writes()
    assert sorted(set(owners(cl, page_keys(a, toks)))) == [0, 1, 2]  # the prefix spans every master
    sa = a.remote_statistics
    assert sa is not None and sa.written_pages == 24 and sa.dropped_writes == 0 and sa.errors == 0
    assert sum(int(command(p, "DBSIZE")) for p in cl.ports) == 24  # type: ignore[call-overload]
    router = b._remote.backend.router  # type: ignore[union-attr]
    assert router is not None
    assert b.probe_reuse(None, toks) == 24 * T
    trips = router.node_round_trips
    assert trips <= 3  # the lookup: one pipelined exchange per node (the slot map read aside)
    assert reuse(b, toks) == 24 * T  # records checked
    assert router.node_round_trips - trips <= 3  # the fetch: one per node too
    st = b.remote_statistics
    assert st is not None and st.lookups == 1 and st.fetched_pages == 24 and st.errors == 0 and st.connected


def test_two_processes_share_a_prefix_through_the_cluster(cl: LocalRedisCluster, make: Factory) -> None:
    a = make(write_through=True)
    first = seq(3, 9 * T + 1)
    publish(a, first)
    assert a.flush_remote_writes()
    second = seq(4, 7 * T)
    spec = {"url": cl.url, "namespace": "test-model", "read": first[: 9 * T] + [9], "write": second}
    res = run_worker("remote_worker.py", spec)
    assert res["compiled"] == kv_cache_manager_v2.compiled
    assert res["history"] == 9 * T and res["checked"] > 0 and res["flushed"]
    assert res["stats"]["fetched_pages"] == 9 and res["stats"]["corrupt_pages"] == 0
    assert res["stats"]["dropped_writes"] == 0
    assert reuse(a, second + [9]) == 7 * T  # and the first process reads the second's


def expected_reuse(owner_of_blocks: list[int], down: int) -> int:
    """Blocks a prefix keeps while node ``down`` is away: up to its first key on that node."""
    return next((o for o, n in enumerate(owner_of_blocks) if n == down), len(owner_of_blocks))


def test_a_killed_master_costs_its_slots_only_and_reuse_resumes(
    cl: LocalRedisCluster, make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    a = make(write_through=True)
    b = make(host=64)
    prompts = [seq(10 + r, 3 * T) for r in range(12)]
    for toks in prompts:
        publish(a, toks)
    assert a.flush_remote_writes()
    down = 1
    cl.servers[down].kill()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        for toks in prompts:  # b has nothing locally: what it reuses comes from the two live masters
            want = expected_reuse(owners(cl, page_keys(b, toks)), down)
            assert b.probe_reuse(None, toks + [1]) == want * T
            assert reuse(b, toks + [1]) == want * T  # records checked
        # a keeps publishing: writes for the dead master's slots are dropped (counted), the rest land
        before = a.remote_statistics
        assert before is not None
        fresh = [seq(40 + r, 3 * T) for r in range(6)]
        for toks in fresh:
            publish(a, toks)
        assert a.flush_remote_writes()
    after = a.remote_statistics
    assert after is not None
    fresh_owners = [n for toks in fresh for n in owners(cl, page_keys(a, toks))]
    assert after.dropped_writes - before.dropped_writes == fresh_owners.count(down)
    assert after.written_pages - before.written_pages == len(fresh_owners) - fresh_owners.count(down)
    assert after.errors > before.errors
    assert any("its keys are misses" in r.getMessage() for r in caplog.records)
    sb = b.remote_statistics
    assert sb is not None and not sb.connected and sb.corrupt_pages == 0
    # the master comes back (empty, same slots); after retry_interval_ms it is asked again
    cl.servers[down].start()
    cl.wait_ready()
    time.sleep(0.06)
    c = make(host=64)
    for toks in fresh:  # what was written while it was down is there, what it held is gone
        want = expected_reuse(owners(cl, page_keys(c, toks)), down)
        assert reuse(c, toks + [1]) == want * T
    again = [seq(50 + r, 3 * T) for r in range(6)]  # (a page whose write was dropped is not sent again)
    for toks in again:
        publish(a, toks)
    assert a.flush_remote_writes()
    assert 1 in [n for toks in again for n in owners(cl, page_keys(a, toks))]
    d = make(host=64)
    for toks in again:
        assert reuse(d, toks + [1]) == 3 * T
    sd = d.remote_statistics
    assert sd is not None and sd.connected and sd.errors == 0


def test_a_slot_migrated_mid_run_keeps_results_correct(cl: LocalRedisCluster, make: Factory) -> None:
    a = make(write_through=True)
    toks = seq(60, 6 * T)
    publish(a, toks)
    assert a.flush_remote_writes()
    keys = page_keys(a, toks)
    slot = key_slot(keys[2])
    source = _owner(slot, 3)
    target = (source + 1) % 3
    checks: list[int] = []
    c = make(host=32)
    assert c.probe_reuse(None, toks) == 6 * T  # c reads the slot map now
    c_router = c._remote.backend.router  # type: ignore[union-attr]
    assert c_router is not None

    def half_moved() -> None:
        # the key sits on the target now while the source still owns the slot (MIGRATING): ASK
        b = make(host=32)
        checks.append(reuse(b, toks + [1]))
        router = b._remote.backend.router  # type: ignore[union-attr]
        assert router is not None and router.ask_replies >= 1 and router.moved_replies == 0
        publish(a, seq(61, 6 * T))  # writes keep landing
        assert a.flush_remote_writes()

    assert cl.migrate_slot(slot, target, half_moved) >= 1
    assert cl.slot_owner(slot) == target
    checks.append(reuse(c, toks + [1]))  # c's map is stale: MOVED, then the map is read again
    assert c_router.moved_replies >= 1
    assert checks == [6 * T, 6 * T]
    st = a.remote_statistics
    assert st is not None and st.dropped_writes == 0 and st.errors == 0
    d = make(host=32)
    assert reuse(d, seq(61, 6 * T) + [1]) == 6 * T
    router = d._remote.backend.router  # type: ignore[union-attr]
    assert router is not None and router.slot_node[slot] == router.node(("127.0.0.1", cl.ports[target]))


def test_a_key_of_the_wrong_type_costs_that_key_only(cl: LocalRedisCluster, make: Factory) -> None:
    a = make(write_through=True)
    b = make(host=32)
    toks = seq(70, 5 * T)
    publish(a, toks)
    assert a.flush_remote_writes()
    bad = page_keys(a, toks)[3]
    port = cl.ports[_owner(key_slot(bad), 3)]
    command(port, "DEL", bad)
    command(port, "RPUSH", bad, "x")
    assert b.probe_reuse(None, toks + [1]) == 3 * T
    assert reuse(b, toks + [1]) == 3 * T
    st = b.remote_statistics
    assert st is not None and st.errors == 0 and st.connected and st.skipped_lookups == 0


def test_quota_on_every_master_and_unreachable_seeds(cl: LocalRedisCluster, make: Factory, managers: Factory) -> None:
    m = make(quota=64 << 20)
    for port in cl.ports:
        assert command(port, "CONFIG", "GET", "maxmemory") == [b"maxmemory", str(64 << 20).encode()]
        assert command(port, "CONFIG", "GET", "maxmemory-policy") == [b"maxmemory-policy", b"allkeys-lru"]
    assert m.get_quota(CacheLevel(1)) == 64 << 20
    m.resize(CacheLevel(1), 32 << 20)  # the remote level: maxmemory of every master
    assert {command(p, "CONFIG", "GET", "maxmemory") == [b"maxmemory", str(32 << 20).encode()] for p in cl.ports} == {
        True
    }
    # no seed answers: the whole tier is down (misses, writes dropped), nothing raises
    from kv_cache_manager_v2.redis_server import free_cluster_port

    dead = managers(f"redis+cluster://127.0.0.1:{free_cluster_port()}", write_through=True)
    toks = seq(80, 2 * T)
    publish(dead, toks)
    assert dead.flush_remote_writes()
    assert reuse(dead, seq(81, 2 * T)) == 0
    st = dead.remote_statistics
    assert st is not None and st.errors > 0 and not st.connected and st.dropped_writes > 0


def test_a_hung_master_times_out_into_misses_for_its_slots(cl: LocalRedisCluster, make: Factory) -> None:
    a = make(write_through=True)
    prompts = [seq(90 + r, 3 * T) for r in range(6)]
    for toks in prompts:
        publish(a, toks)
    assert a.flush_remote_writes()
    b = make(host=64, timeout_ms=200, retry_interval_ms=60_000)
    assert b.probe_reuse(None, seq(99, 2 * T)) == 0  # b reads the slot map while all answer
    hung = 2
    assert hung in [n for toks in prompts for n in owners(cl, page_keys(b, toks))]
    cl.servers[hung].pause()  # keeps its connections, answers nothing
    try:
        t0 = time.monotonic()
        for toks in prompts:
            want = expected_reuse(owners(cl, page_keys(b, toks)), hung)
            assert reuse(b, toks + [1]) == want * T  # records checked
        elapsed = time.monotonic() - t0
    finally:
        cl.servers[hung].resume()
    assert elapsed < 5.0  # one timeout, then the node is skipped for retry_interval_ms
    st = b.remote_statistics
    assert st is not None and st.errors >= 1 and not st.connected and st.corrupt_pages == 0


@pytest.mark.parametrize("redirect", ["MOVED", "ASK"])
def test_redirects_to_ever_new_addresses_keep_the_node_list_bounded(
    fake: Callable[[Answer], FakeRedis], managers: Factory, redirect: str
) -> None:
    """A node answering every lookup with a redirect to an address never seen before (nothing
    listens there): the client forgets the nodes that are neither a seed nor a slot's master, so its
    node list stays bounded (before: 12 more nodes per lookup, hundreds after 40 lookups)."""
    ports = iter(range(50_000, 60_000))

    def answer(args: list[bytes]) -> Chunks | None:
        if args[0].upper() in (b"STRLEN", b"EVAL"):
            slot = key_slot(args[3] if args[0].upper() == b"EVAL" else args[1])
            return [(0.0, b"-%s %d 127.0.0.1:%d\r\n" % (redirect.encode(), slot, next(ports)))]
        return None

    server = fake(answer)
    m = managers(f"redis+cluster://127.0.0.1:{server.port}", timeout_ms=1000, retry_interval_ms=60_000)
    router = m._remote.backend.router  # type: ignore[union-attr]
    assert router is not None
    sizes = []
    for k in range(40):
        assert m.probe_reuse(None, seq(300 + k, 4 * T) + [1]) == 0
        sizes.append(len(router.nodes))
    assert router.moved_replies + router.ask_replies >= 40 * 4
    assert max(sizes) <= 1 + MAX_OTHER_NODES, sizes
    assert router.slot_node[0] is router.nodes[("127.0.0.1", server.port)]
    # however many addresses are made known between two reads of the map
    for port in range(30_000, 31_000):
        router.node(("127.0.0.1", port))
        assert len(router.nodes) <= 1 + MAX_OTHER_NODES
    assert router.slot_node[0] is router.nodes[("127.0.0.1", server.port)]
    m.check_invariants()
