"""Issue #50: routing by cache and load. Scores by hand (tier weights, load, the affinity window),
the policies, stale and missing load, loads from the event stream and from metrics agreeing, and a
replica that stops publishing load: routed by its cache alone, then not at all once expired."""

from __future__ import annotations

import time

import pytest
from conftest import LOOPBACK, MakeManager, kv_layers, sync, toks
from tier_helpers import publish

from kv_cache_manager_v2 import KVCacheEventManager, block_hash
from kv_cache_manager_v2._common import DEFAULT_REUSE_SCOPE
from kv_cache_manager_v2._reuse._keys import scope_key
from kv_cache_manager_v2._routing import ROUTING_POLICIES, ReplicaLoad, RoutePicker, RouteWeights
from kv_cache_manager_v2.events import (
    BlockStored,
    KVAwareRouter,
    PrefixRouter,
    ReplicaEndpoints,
    ReplicaIndex,
    ZmqEventPublisher,
    prompt_block_hashes,
)

T = 16
#: the default reuse scope's root (what a replica's first block names)
ROOT = block_hash(scope_key(DEFAULT_REUSE_SCOPE))


def stored(tokens: list[int], medium: str) -> BlockStored:
    """A replica caching every full block of ``tokens`` on ``medium``."""
    n = len(tokens) // T
    return BlockStored(prompt_block_hashes(tokens, T)[:n], None, tokens[: n * T], T, None, medium, scope_hash=ROOT)


def load(queued: int = 0, running: int = 0, util: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(queued, running, util)


def test_tier_weights_by_hand() -> None:
    """Replica 0 holds 32 tokens on the GPU (32.0), replica 1 48 on the host (48 * 0.8 = 38.4),
    replica 2 64 on disk (64 * 0.5 = 32.0): "prefix" takes replica 1; with the host worth 0.5
    (24.0) replicas 0 and 2 tie at 32.0 and the rotation takes the first from its start."""
    prompt = toks(1, 80)
    indexes = [ReplicaIndex(T) for _ in range(3)]
    indexes[0].apply([stored(prompt[:32], "GPU")])
    indexes[1].apply([stored(prompt[:48], "CPU")])
    indexes[2].apply([stored(prompt[:64], "DISK")])
    assert indexes[1].match_media(prompt) == {"CPU": 48}
    router = PrefixRouter(indexes, "prefix")
    d = router.route(prompt)
    assert (d.replica, d.matched_tokens, d.scores) == (1, 48, (32, 48, 64))
    cheap_host = RouteWeights(tier_weights={"GPU": 1.0, "CPU": 0.5, "DISK": 0.5})
    router = PrefixRouter(indexes, "prefix", cheap_host)
    assert [router.route(prompt).replica for _ in range(3)] == [0, 2, 2]  # starts 0, 1, 2: first best after each
    assert RouteWeights().value({"GPU": 10, "CPU": 10, "DISK": 10, "REMOTE": 10, None: 10}) == pytest.approx(26.0)


def test_a_block_counts_at_its_slowest_page() -> None:
    prompt = toks(2, 32)
    idx = ReplicaIndex(T)
    idx.apply([stored(prompt, "GPU")])
    h = prompt_block_hashes(prompt, T)
    ev = BlockStored(
        h[:1], None, prompt[:16], T, None, "DISK", group_idx=1, scope_hash=ROOT
    )  # block 0 of group 1: on disk
    idx.apply([ev])
    assert idx.match_media(prompt) == {"DISK": 16}  # group 1 holds block 0 only: the match ends there


def test_load_and_affinity_by_hand() -> None:
    """cost = queued + 128 * running + 1024 * utilisation; window = least * 1.25."""
    w = RouteWeights(running_request=128.0, affinity_ratio=0.25)
    loads = [load(3000), load(1000, 2), load(0, 0, 0.5)]
    assert [x.cost(w) for x in loads] == [3000.0, 1256.0, 512.0]
    # the defaults: a running request weighs 1024 tokens, the window is 10 % of the least load
    d = RouteWeights()
    assert load(1000, 2, 0.5).cost(d) == 1000 + 2 * 1024 + 512
    assert RoutePicker().pick([320.0, 0.0], [load(1100), load(1000)], [True, True]) == 0  # 1100 <= 1000 * 1.1
    assert RoutePicker().pick([320.0, 0.0], [load(1200), load(1000)], [True, True]) == 0  # 320 - 1200 > -1000
    assert RoutePicker().pick([100.0, 0.0], [load(1200), load(1000)], [True, True]) == 1  # 100 - 1200 < -1000
    values = [320.0, 0.0, 0.0]
    usable = [True] * 3
    # best cache (0) costs 3000 > 512 * 1.25 = 640: the best value - cost: -2680, -1256, -512
    assert RoutePicker("prefix+load", w).pick(values, loads, usable) == 2
    # within the window (600 <= 640): affinity keeps the cache
    assert RoutePicker("prefix+load", w).pick(values, [load(600), *loads[1:]], usable) == 0
    # out of the window, a big enough cache still wins on value - cost: 2000 - 1700 = 300 > -512
    assert RoutePicker("prefix+load", w).pick([2000.0, 0.0, 0.0], [load(1700), *loads[1:]], usable) == 0
    # a wider window keeps it at 3000 too: 512 * 5 + 1024 = 3584
    wide = RouteWeights(running_request=128.0, affinity_ratio=4.0, affinity_tokens=1024.0)
    assert RoutePicker("prefix+load", wide).pick(values, loads, usable) == 0
    assert RoutePicker("least-load", w).pick(values, loads, usable) == 2
    assert RoutePicker("prefix", w).pick(values, loads, usable) == 0
    rr = RoutePicker("round-robin")
    assert [rr.pick(values, loads, usable) for _ in range(4)] == [0, 1, 2, 0]
    # no cache anywhere: the least loaded (the highest 0 - cost)
    assert RoutePicker("prefix+load", w).pick([0.0] * 3, loads, usable) == 2


def test_stale_missing_and_unusable_replicas() -> None:
    values = [320.0, 0.0, 0.0]
    loads: list[ReplicaLoad | None] = [None, load(1000), load(500)]
    usable = [True] * 3
    assert RoutePicker().pick(values, loads, usable) == 0  # unknown load: weighed by its cache alone
    assert RoutePicker().pick([0.0] * 3, loads, usable) == 2  # nothing cached: never blind to a replica without load
    assert RoutePicker("least-load").pick(values, loads, usable) == 2
    assert RoutePicker("least-load").pick(values, [None] * 3, usable) == 0  # none known: round-robin
    assert RoutePicker().pick(values, [None] * 3, usable) == 0  # none known: prefix
    for policy in ROUTING_POLICIES:  # an unusable replica is never picked while another is usable
        p = RoutePicker(policy)
        assert {p.pick(values, loads, [False, True, True]) for _ in range(6)} <= {1, 2}
        assert p.pick(values, loads, [False] * 3) in (0, 1, 2)  # none usable: still an answer
    with pytest.raises(ValueError, match="one value, load"):
        RoutePicker().pick(values, loads[:2], usable)


def test_router_forgets_a_stale_load() -> None:
    prompt = toks(3, 32)
    indexes = [ReplicaIndex(T) for _ in range(2)]
    indexes[0].apply([stored(prompt, "GPU")])
    router = PrefixRouter(indexes, weights=RouteWeights(load_stale_s=0.2, affinity_tokens=0.0))
    router.set_load(0, load(10_000))
    router.set_load(1, load(0))
    d = router.route(prompt)
    assert d.replica == 1 and d.loads == (load(10_000), load(0))
    time.sleep(0.25)
    assert router.load(0) is None and router.route(prompt).replica == 0  # by its cache alone
    assert router.route(prompt, loads=[load(10_000), load(0)]).replica == 1  # given by the caller


def test_bad_weights_policy_and_load() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        RoutePicker("random")
    with pytest.raises(TypeError, match="policy must be a str"):
        RoutePicker(3)
    with pytest.raises(TypeError, match="weights must be a RouteWeights"):
        RoutePicker("prefix", {"GPU": 1.0})
    with pytest.raises(ValueError, match="queued_token"):
        RouteWeights(queued_token=-1.0)
    with pytest.raises(ValueError, match="load_stale_s"):
        RouteWeights(load_stale_s=0.0)
    with pytest.raises(TypeError, match="affinity_ratio"):
        RouteWeights(affinity_ratio="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tier_weights"):
        RouteWeights(tier_weights={"GPU": True})  # type: ignore[dict-item]
    given = {"GPU": 1.0, "CPU": 0.5}
    checked = RouteWeights(tier_weights=given)
    given["GPU"] = float("nan")  # (the caller's mapping changes later: the checked weights do not)
    assert checked.value({"GPU": 10, "CPU": 10}) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="kv_utilization"):
        ReplicaLoad(0, 0, 1.5)
    with pytest.raises(TypeError, match="running_requests"):
        ReplicaLoad(0, True)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        ReplicaLoad(-1)
    router = PrefixRouter([ReplicaIndex(T)])
    with pytest.raises(ValueError, match="replica must be"):
        router.set_load(1, load())
    with pytest.raises(ValueError, match="one load"):
        router.route(toks(1, 16), loads=[])


def test_load_from_events_and_metrics_agree(make_manager: MakeManager) -> None:
    """The engine gives its load to the publisher (with a batch, or alone) and to the metrics
    collector: the router's view and a scrape's read the same figures."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from kv_cache_manager_v2.metrics import KVCacheMetricsCollector, load_from_metrics

    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, 8), event_manager=em)
    pub = ZmqEventPublisher(LOOPBACK, LOOPBACK)
    router = KVAwareRouter([ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)])
    now = ReplicaLoad(1234, 3, 0.375)
    registry = CollectorRegistry()
    registry.register(KVCacheMetricsCollector(m, labels={"engine": "0"}, load=lambda: now))
    try:
        publish(m, toks(4, 24))
        pub.drain(em, now)
        sync(router, 0, pub)
        text = generate_latest(registry).decode()
        assert router.load(0) == now == load_from_metrics(text, {"engine": "0"})
        assert load_from_metrics(text, {"engine": "1"}) is None
        now = ReplicaLoad(10, 0, 0.0)
        pub.publish([], now)  # no events: the load alone
        sync(router, 0, pub)
        assert router.load(0) == now == load_from_metrics(generate_latest(registry).decode())
        with pytest.raises(TypeError, match="load must be a ReplicaLoad"):
            pub.publish([], (1, 2, 3))  # type: ignore[arg-type]
    finally:
        router.close()
        pub.close()
        m.shutdown()


def test_a_replica_that_stops_publishing_load(make_manager: MakeManager) -> None:
    """Replica 0 caches the prompt but is loaded: routes go to replica 1. It stops publishing its
    load: after load_stale_s it is routed by its cache alone; once its publisher is gone it expires
    and is not routed to at all. No call waits longer than its bounds."""
    prompt = toks(5, 64)
    ems = [KVCacheEventManager() for _ in range(2)]
    ms = [make_manager(kv_layers(1, 8), event_manager=em) for em in ems]
    pubs = [ZmqEventPublisher(LOOPBACK, LOOPBACK) for _ in range(2)]
    router = KVAwareRouter(
        [ReplicaEndpoints(p.endpoint, p.replay_endpoint) for p in pubs],
        weights=RouteWeights(load_stale_s=2.0),
        replay_timeout=0.3,
        replay_backoff=0.2,
        probe_interval=0.3,
    )
    try:
        publish(ms[0], prompt)
        pubs[0].drain(ems[0], load(50_000, 8, 0.9))
        pubs[1].drain(ems[1], load(0))
        for i in range(2):
            sync(router, i, pubs[i])
        pubs[0].publish([], load(50_000, 8, 0.9))  # the loads again, fresh (the syncs may have taken a while)
        pubs[1].publish([], load(0))
        for i in range(2):
            sync(router, i, pubs[i])
        assert router.load(0) is not None and router.load(1) is not None
        assert router.route(prompt).replica == 1
        deadline = time.monotonic() + 10
        while router.load(0) is not None:  # replica 1 keeps publishing its load, replica 0 stopped
            pubs[1].publish([], load(0))
            router.poll(0.05)
            assert time.monotonic() < deadline
        d = router.route(prompt)
        assert (d.replica, d.matched_tokens, d.loads) == (0, 64, (None, load(0)))
        pubs[0].close()
        s = router.subscriptions[0]
        while not s.expired:
            t0 = time.monotonic()
            pubs[1].publish([], load(0))
            router.poll(0.05)
            assert time.monotonic() - t0 < 2.0 and time.monotonic() < deadline + 15
        assert [router.route(prompt).replica for _ in range(4)] == [1] * 4
    finally:
        router.close()
        for p in pubs:
            p.close()
        for m in ms:
            m.shutdown()
