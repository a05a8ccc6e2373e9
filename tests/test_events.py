"""KV-cache events (issue #14): what the manager records, the wire schema, and a router's index rebuilt
from a replica's stream over real ZMQ sockets on loopback, checked against ``probe_reuse``."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Callable, Iterator

import msgspec
import pytest
from conftest import LOOPBACK, MakeManager, kv_layers, sync, toks
from fake_engine import FakeEngine
from tier_helpers import publish, serve

from kv_cache_manager_v2 import (
    AllBlocksClearedEvent,
    BlockMovedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    BufferConfig,
    CacheLevel,
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    LayerGroupSpec,
    LayerId,
    Priority,
    ReuseScope,
    SsmLayerConfig,
    TokenIdExt,
    block_hash,
)
from kv_cache_manager_v2._reuse._keys import block_key, scope_key
from kv_cache_manager_v2.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVAwareRouter,
    KVEventBatch,
    PrefixRouter,
    ReplicaEndpoints,
    ReplicaIndex,
    ZmqEventPublisher,
    block_tokens,
    decode_batch,
    digest_stand_in,
    encode_batch,
    prompt_block_hashes,
    to_wire,
)

T = 8


@pytest.fixture
def with_events(make_manager: MakeManager) -> Callable[..., tuple[KVCacheManager, KVCacheEventManager]]:
    def factory(layers: object, **kw: object) -> tuple[KVCacheManager, KVCacheEventManager]:
        em = KVCacheEventManager(**kw)  # type: ignore[arg-type]
        return make_manager(layers, event_manager=em), em

    return factory


# ---------------------------------------------------------------- what the manager records
def test_no_event_manager_records_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    publish(m, toks(1, 20))
    assert m.event_manager is None and m.get_latest_events() == []


def test_bad_event_manager_is_refused(make_manager: MakeManager) -> None:
    with pytest.raises(TypeError, match="KVCacheEventManager"):  # compiled: mypyc words it
        make_manager(kv_layers(1, T), event_manager=object())
    em = KVCacheEventManager()
    make_manager(kv_layers(1, T), event_manager=em)
    with pytest.raises(ValueError, match="already attached"):
        make_manager(kv_layers(1, T), event_manager=em)
    with pytest.raises(ValueError, match="max_events"):
        KVCacheEventManager(max_events=0)
    with pytest.raises(TypeError, match=r"resync_on_overflow|bool"):  # compiled: mypyc checks it
        KVCacheEventManager(resync_on_overflow=1)  # type: ignore[arg-type]


def test_stored_events_carry_the_key_chain_tokens_and_scope(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(2, T))
    engine = FakeEngine(m)
    prompt = toks(2, 20)  # 2 full blocks + a partial tail published by close()
    scope = ReuseScope(lora_id=7, salt=3)
    kv = m.create_kv_cache(scope, prompt, custom_priority_callback=lambda o, lc: Priority(60))
    serve(engine, kv, prompt)  # type: ignore[arg-type]
    assert [type(e) for e in m.get_latest_events()] == [BlockStoredEvent] * 2  # full blocks at commit
    kv.close()
    evs = em.get_latest_events()
    assert len(evs) == 1 and isinstance(evs[0], BlockStoredEvent) and evs[0].is_partial
    root = scope_key(scope)
    k0 = block_key(root, prompt[:8])  # type: ignore[arg-type]
    k1 = block_key(k0, prompt[8:16])  # type: ignore[arg-type]
    k2 = block_key(k1, prompt[16:])  # type: ignore[arg-type]
    assert evs[0].block_hash == block_hash(k2) == int.from_bytes(k2[-8:], "big")
    assert evs[0].parent_block_hash == block_hash(k1)
    assert evs[0].tokens == tuple(prompt[16:]) and evs[0].lora_id == 7 and evs[0].priority == 60
    assert evs[0].medium == "GPU" and evs[0].group_idx == 0 and evs[0].block_size == T
    assert prompt_block_hashes(prompt, T, scope) == [block_hash(k0), block_hash(k1), block_hash(k2)]
    assert em.layer_groups == [LayerGroupSpec(0, None, 0)] and em.tokens_per_block == T


def test_dedup_records_nothing_and_eviction_records_removals(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(1, T))  # 1 MiB / (2 * 32 * 8 B) = 2048 slots
    engine = FakeEngine(m)
    prompt = toks(3, 24)
    a, b = m.create_kv_cache(input_tokens=prompt), m.create_kv_cache(input_tokens=prompt)
    serve(engine, a, prompt)  # type: ignore[arg-type]
    serve(engine, b, prompt)  # type: ignore[arg-type]  # same blocks: deduplicated onto a's pages
    assert len(em.get_latest_events()) == 3
    a.close()
    b.close()
    assert em.get_latest_events() == []  # no partial tail
    filler = m.create_kv_cache()
    assert filler.resume() and filler.resize(2048 * T)  # evicts all three blocks, tail first
    removed = em.get_latest_events()
    assert all(isinstance(e, BlockRemovedEvent) for e in removed)
    hashes = prompt_block_hashes(prompt, T)
    assert [e.block_hash for e in removed] == hashes[::-1]  # type: ignore[attr-defined]
    filler.close()
    m.clear_reusable_blocks()
    assert [type(e) for e in em.get_latest_events()] == [AllBlocksClearedEvent]


def test_anchor_eviction_removes_the_subtree(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(1, T), max_events=1000)
    engine = FakeEngine(m)
    prompt = toks(4, 32)
    # the first block at a lower priority: its children are capped at it, the tail still goes first
    kv = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=lambda o, lc: Priority(10 if o == 0 else 50))
    serve(engine, kv, prompt)
    kv.close()
    em.get_latest_events()
    page = m._tree.nodes()[0].page(0)  # the first block (pre-order)
    assert page is not None
    page.storage.evictor.remove(page)
    m._storage.drop(page)  # an anchor dropped while its children have pages (as across pool groups)
    removed = em.get_latest_events()
    assert sorted(e.block_hash for e in removed) == sorted(prompt_block_hashes(prompt, T))  # type: ignore[attr-defined]
    assert m.probe_reuse(None, prompt) == 0


def test_overflow_drops_oldest_then_resyncs(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(1, T), max_events=3)
    engine = FakeEngine(m)
    publish(m, toks(5, 40), engine=engine)  # 5 stored events into a queue of 3
    assert em.num_dropped == 2 and em.num_pending == 3
    evs = em.get_latest_events()  # a resync: the whole tree instead of the surviving 3
    assert isinstance(evs[0], AllBlocksClearedEvent) and len(evs) == 6
    index = ReplicaIndex(groups=em.layer_groups)
    index.apply(to_wire(evs))
    assert index.match_length(toks(5, 40)) == m.probe_reuse(None, toks(5, 40)) == 40
    assert em.get_latest_events() == []

    m2, em2 = with_events(kv_layers(1, T), max_events=3, resync_on_overflow=False)
    publish(m2, toks(5, 40))
    evs = em2.get_latest_events()
    assert em2.num_dropped == 2 and [e.block_hash for e in evs] == prompt_block_hashes(toks(5, 40), T)[2:]  # type: ignore[attr-defined]


def test_tier_move_hook_reports_moves(with_events: Callable[..., tuple]) -> None:
    """The storage manager's hook (PageDropListener.page_moved), driven by hand: a moved block is reported
    with both media and stays reusable (three-tier managers: test_router_index_stays_exact_across_three_tiers)."""
    m, em = with_events(kv_layers(1, T))
    prompt = toks(6, 16)
    publish(m, prompt)
    index = ReplicaIndex(groups=em.layer_groups)
    index.apply(to_wire(em.get_latest_events()))
    em._media.append("CPU")  # as a manager with a host tier would set it up
    page = m._tree.nodes()[0].page(0)
    assert page is not None
    page.level = CacheLevel(1)  # the storage manager moved it down...
    try:
        m._storage.drop_listener.page_moved(page, CacheLevel(0))  # type: ignore[union-attr]  # ...and says so
    finally:
        page.level = CacheLevel(0)
    (ev,) = em.get_latest_events()
    assert isinstance(ev, BlockMovedEvent) and (ev.source_medium, ev.medium) == ("GPU", "CPU")
    wire = to_wire([ev])  # vLLM-compatible: removed from the old medium, then stored in the new one
    assert isinstance(wire[0], BlockRemoved) and wire[0].medium == "GPU"
    assert isinstance(wire[1], BlockStored) and wire[1].medium == "CPU"
    index.apply(wire)
    h = prompt_block_hashes(prompt, T)
    assert index.medium_of(h[0]) == "CPU" and index.medium_of(h[1]) == "GPU"
    assert index.match_length(prompt) == m.probe_reuse(None, prompt) == 16  # still reusable
    native = to_wire([ev], moves="native")
    index.apply(native)
    assert len(native) == 1 and index.medium_of(h[0]) == "CPU"


def test_events_carry_the_session_that_published_the_block(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(1, T), max_events=1000)
    engine = FakeEngine(m)
    system, a, b = toks(20, 16), toks(21, 8), toks(22, 8)
    for tokens, session in [(system + a, "a"), (system + b, "b"), (toks(23, 8), None)]:
        kv = m.create_kv_cache(input_tokens=tokens[:T], session_id=session)  # b reuses the system prompt's first block
        serve(engine, kv, tokens)  # type: ignore[arg-type]
        kv.close()
    stored = em.get_latest_events()
    assert [(e.block_hash, e.session) for e in stored] == [
        *[(h, "a") for h in prompt_block_hashes(system + a, T)],
        (prompt_block_hashes(system + b, T)[-1], "b"),  # the system prompt's blocks were a's
        (prompt_block_hashes(toks(23, 8), T)[0], None),
    ]
    assert m.directives.end("b").num_blocks == 1
    removed = em.get_latest_events()
    assert [(type(e), e.session) for e in removed] == [(BlockRemovedEvent, "b")]
    # on the wire: an extension field (the last), runs split by session
    wire = to_wire(stored + removed)
    assert [(type(w), len(w.block_hashes), w.session_id) for w in wire] == [  # type: ignore[union-attr]
        (BlockStored, 3, "a"),
        (BlockStored, 1, "b"),
        (BlockStored, 1, None),
        (BlockRemoved, 1, "b"),
    ]
    payload = encode_batch(KVEventBatch(1.0, wire))
    raw = msgspec.msgpack.decode(payload)[1]
    assert raw[0][-1] == "a" and raw[3] == ["BlockRemoved", wire[3].block_hashes, "GPU", 0, "b"]  # type: ignore[union-attr]
    assert raw[2][-1] is None and len(raw[2]) == len(raw[0])
    assert [w.session_id for w in decode_batch(payload).events] == ["a", "b", None, "b"]  # type: ignore[union-attr]
    theirs = msgspec.msgpack.decode(payload, type=VllmBatch)  # readers without the field ignore it
    assert [e.block_hashes for e in theirs.events] == [w.block_hashes for w in wire]  # type: ignore[union-attr]
    index = ReplicaIndex()
    index.apply(decode_batch(payload).events)  # a router's index applies them as before
    assert index.match_length(system + a) == 24 and index.match_length(system + b) == 16


# ---------------------------------------------------------------- the wire schema
class VllmBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """vLLM's layout, declared independently: our payload must decode into it."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_payload_layout_matches_vllm(with_events: Callable[..., tuple]) -> None:
    m, em = with_events(kv_layers(1, T))
    img = b"\x42" * 32
    prompt: list[TokenIdExt] = [*toks(7, 10), img, *toks(8, 9)]  # the digest sits in block 1
    publish(m, prompt)
    stored = em.get_latest_events()
    m.clear_reusable_blocks()  # (a clear also discards whatever was still queued)
    wire = to_wire(stored + em.get_latest_events())
    assert [type(w) for w in wire] == [BlockStored, AllBlocksCleared]  # 3 stores coalesced into one run
    payload = encode_batch(KVEventBatch(12.5, wire, 3))
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 12.5 and raw[2] == 3
    first = raw[1][0]
    hashes = prompt_block_hashes(prompt, T)
    assert first[:7] == ["BlockStored", hashes, None, wire[0].token_ids, T, None, "GPU"]  # type: ignore[union-attr]
    assert first[7:] == [None, [None, [[2, img]], None], 0, "full_attention", None, 35, first[13], None, None]
    assert first[13] == block_hash(scope_key(ReuseScope()))
    assert raw[1][1] == ["AllBlocksCleared"]
    assert wire[0].token_ids[10] == digest_stand_in(img)  # type: ignore[union-attr]
    assert [t for b in block_tokens(decode_batch(payload).events[0]) for t in b] == prompt  # type: ignore[arg-type]
    theirs = msgspec.msgpack.decode(payload, type=VllmBatch)  # extension fields are ignored
    assert theirs.data_parallel_rank == 3 and theirs.events[0].block_hashes == hashes  # type: ignore[union-attr]


def test_publisher_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        ZmqEventPublisher("")
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(LOOPBACK, buffer_steps=0)
    with pytest.raises(ValueError, match="moves"):
        ZmqEventPublisher(LOOPBACK, moves="raw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be KV-cache events"):
        to_wire([object()])  # type: ignore[list-item]


# ---------------------------------------------------------------- over ZMQ, against probe_reuse
@pytest.fixture
def pubsub() -> Iterator[Callable[..., tuple[ZmqEventPublisher, KVAwareRouter]]]:
    made: list[ZmqEventPublisher | KVAwareRouter] = []

    def factory(n: int = 1, moves: str = "vllm", **kw: object) -> tuple[list[ZmqEventPublisher], KVAwareRouter]:
        pubs = [ZmqEventPublisher(LOOPBACK, LOOPBACK, topic="kv", moves=moves) for _ in range(n)]  # type: ignore[arg-type]
        made.extend(pubs)
        router = KVAwareRouter(
            [ReplicaEndpoints(p.endpoint, p.replay_endpoint) for p in pubs],
            topic="kv",
            **kw,  # type: ignore[arg-type]
        )
        made.append(router)
        return pubs, router  # type: ignore[return-value]

    yield factory  # type: ignore[misc]
    for x in made:
        x.close()


CONFIGS: dict[str, dict[str, object]] = {
    "full": dict(layers=kv_layers(2, T)),
    # two pool groups (SWA slots are twice as large); split evenly in bytes
    "swa+full": dict(layers=kv_layers(3, T, window=20, swa_every=2), initial_pool_ratio=[0.5, 0.5]),
    "swa+sinks+full": dict(layers=kv_layers(2, T, window=12, swa_every=2, sink_tokens=5)),
    # recurrent layers (state snapshots every 2 blocks and at prompt ends) beside attention
    "hybrid": dict(
        layers=[
            SsmLayerConfig(LayerId(10), [BufferConfig("conv_state", 32), BufferConfig("ssm_state", 64)]),
            *kv_layers(2, T, window=20, swa_every=2),
        ],
        ssm_reuse_interval=2 * T,
        # room for many short requests' states (the default split sizes for 4096-token requests)
        initial_pool_ratio=[0.07, 0.93],
    ),
}


def config_seed(config: str) -> int:
    """The workload seed of a config (the attention-only configs keep the ones they had before "hybrid")."""
    seeds = sorted(c for c in CONFIGS if c != "hybrid")
    return seeds.index(config) if config in seeds else len(seeds)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_router_index_predicts_probe_reuse_exactly(
    config: str, make_manager: MakeManager, pubsub: Callable[..., tuple]
) -> None:
    """A replica serves a random workload under memory pressure (eviction), with shared prefixes,
    decode-time commits, partial tails, stop_committing, suspended requests and clears; after every
    step the router's index, rebuilt from the ZMQ stream, predicts probe_reuse for every probe."""
    kw = dict(CONFIGS[config])
    layers: list[object] = kw.pop("layers")  # type: ignore[assignment]
    em = KVCacheEventManager()
    blocks = 25 if config == "hybrid" else 60  # (hybrid requests publish no partial tails: less memory)
    m = make_manager(layers, quota=len(layers) * 2 * 32 * T * blocks, event_manager=em, **kw)
    (pub,), router = pubsub(1, groups=[em.layer_groups])
    rng = random.Random(config_seed(config))
    hits, partial_hits = serve_and_compare(m, router.indexes[0], over_zmq(m, pub, router), rng)
    dropped = sum(g.num_dropped for g in m._storage.gpu)
    if config == "hybrid":  # a match ends at a snapshot: never partial
        assert hits > 150 and partial_hits == 0 and dropped > 20, (hits, partial_hits, dropped)
        assert m.reuse_statistics.snapshots_evicted > 0
    else:
        assert hits > 300 and partial_hits > 50 and dropped > 20, (hits, partial_hits, dropped)
    assert router.subscriptions[0].num_lost == 0


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_router_index_predicts_probe_reuse_over_many_workloads(config: str, make_manager: MakeManager) -> None:
    """The exactness test's workload, shorter, over 12 seeds, the index fed the events directly (no
    sockets). Under sliding windows several children of a block often share a partial prefix while
    some lost a window page: the match takes the longest among those holding every page it needs
    (seed 2 of "swa+full" once had the replica pick one without and reuse nothing, the router 6)."""
    kw = dict(CONFIGS[config])
    layers: list[object] = kw.pop("layers")  # type: ignore[assignment]
    blocks = 25 if config == "hybrid" else 60
    hits = partial_hits = 0
    for seed in range(12):
        em = KVCacheEventManager()
        m = make_manager(layers, quota=len(layers) * 2 * 32 * T * blocks, event_manager=em, **kw)
        index = ReplicaIndex(groups=em.layer_groups)
        h, p = serve_and_compare(m, index, directly(m, index), random.Random(seed), steps=30)
        hits += h
        partial_hits += p
        m.shutdown()
    assert hits > 1000 and (partial_hits == 0 if config == "hybrid" else partial_hits > 200), (hits, partial_hits)


@pytest.mark.parametrize("moves", ["vllm", "native"])
@pytest.mark.parametrize("config", ["full", "swa+full", "hybrid"])
def test_router_index_stays_exact_across_three_tiers(
    config: str, moves: str, make_manager: MakeManager, pubsub: Callable[..., tuple], tmp_path: object
) -> None:
    """GPU + host + disk with small quotas: pages move down and come back (reuse, resume of suspended
    requests, GPU and host tier resizes), some disk reads and writes fail. Every move is reported with its
    medium, so the index predicts probe_reuse and knows which medium holds each page."""
    em = KVCacheEventManager()
    m = three_tiers(make_manager, config, str(tmp_path), em)
    (pub,), router = pubsub(1, moves=moves, groups=[em.layer_groups])
    rng = random.Random(7 + config_seed(config))
    hits, partial_hits = serve_over_flaky_disk(m, router.indexes[0], over_zmq(m, pub, router), rng)
    stats = [m.get_tier_statistics(CacheLevel(level)) for level in range(3)]
    assert stats[1].offloaded_pages > 50 and stats[2].offloaded_pages > 20, stats
    assert stats[1].onboarded_pages > 10 and stats[2].onboarded_pages > 5, stats
    assert stats[2].io_errors > 0 and stats[2].dropped_pages > 0, stats
    assert hits > 300 and (partial_hits == 0 if config == "hybrid" else partial_hits > 50), (hits, partial_hits)
    assert router.subscriptions[0].num_lost == 0


@pytest.mark.parametrize("config", ["full", "swa+full", "hybrid"])
def test_router_index_stays_exact_across_three_tiers_over_many_workloads(
    config: str, make_manager: MakeManager, tmp_path: pathlib.Path
) -> None:
    """The three-tier workload over 6 seeds, the index fed the events directly (no sockets). (Seed 4 of
    "hybrid" once resumed a request whose live state a disk error had lost ACTIVE without one.)"""
    hits = 0
    for seed in range(6):
        em = KVCacheEventManager()
        (tmp_path / str(seed)).mkdir()
        m = three_tiers(make_manager, config, str(tmp_path / str(seed)), em)
        index = ReplicaIndex(groups=em.layer_groups)
        hits += serve_over_flaky_disk(m, index, directly(m, index), random.Random(seed))[0]
        m.shutdown()
    assert hits > 1500, hits


def three_tiers(make_manager: MakeManager, config: str, path: str, em: KVCacheEventManager) -> KVCacheManager:
    """A manager of ``config`` on GPU + host + disk with small quotas."""
    kw = dict(CONFIGS[config])
    layers: list[object] = kw.pop("layers")  # type: ignore[assignment]
    block = len(layers) * 2 * 32 * T  # bytes of one block of every layer
    if config == "hybrid":  # (no partial tails: the same pressure in less memory)
        block //= 2
    return make_manager(
        layers,
        quota=block * 24,
        host_quota=block * 24,
        disk_quota=block * 48,
        disk_path=path,
        max_util_for_resume=1.0,
        event_manager=em,
        **kw,
    )


def serve_over_flaky_disk(
    m: KVCacheManager, index: ReplicaIndex, deliver: Callable[[], None], rng: random.Random
) -> tuple[int, int]:
    """``serve_and_compare`` with media checked and tier resizes, one disk read or write in 23 failing."""
    calls = [0]

    def flaky(op: str, offset: int, nbytes: int) -> bool:
        calls[0] += 1
        return calls[0] % 23 == 0

    disk_pools = [p for g in m._storage.levels[2] for p in g.pools]
    for pool in disk_pools:
        pool.error_hook = flaky  # type: ignore[attr-defined]
    try:
        return serve_and_compare(m, index, deliver, rng, check_media=True, resize_tiers=True)
    finally:
        for pool in disk_pools:
            pool.error_hook = None  # type: ignore[attr-defined]


MEDIA = ["GPU", "CPU", "DISK"]


def directly(m: KVCacheManager, index: ReplicaIndex) -> Callable[[], None]:
    """Apply the manager's latest events to ``index`` (no sockets)."""
    return lambda: index.apply(to_wire(m.get_latest_events()))


def over_zmq(m: KVCacheManager, pub: ZmqEventPublisher, router: KVAwareRouter) -> Callable[[], None]:
    """Publish the manager's latest events and wait until the router (replica 0) applied them."""

    def deliver() -> None:
        pub.publish(m.get_latest_events())
        sync(router, 0, pub)

    return deliver


def serve_and_compare(
    m: KVCacheManager,
    index: ReplicaIndex,
    deliver: Callable[[], None],
    rng: random.Random,
    check_media: bool = False,
    resize_tiers: bool = False,
    steps: int = 60,
) -> tuple[int, int]:
    """The random workload of the exactness tests; returns (probes with a hit, with a partial hit).
    ``deliver`` brings the manager's latest events to ``index`` (over ZMQ, or applied directly)."""
    engine = FakeEngine(m)
    systems = [toks(100 + i, rng.randrange(4, 30)) for i in range(3)]
    scopes = [None, ReuseScope(salt=1)]
    seen: list[tuple[ReuseScope | None, list[TokenIdExt]]] = []
    open_caches: list[KVCache] = []
    hits = partial_hits = 0
    for step in range(steps):
        scope = rng.choice(scopes)
        prompt: list[TokenIdExt] = list(rng.choice(systems)) + toks(1000 + step, rng.randrange(1, 24))
        if rng.random() < 0.3 and seen:  # a follow-up turn of an earlier conversation
            scope, prev = rng.choice(seen)
            prompt = list(prev) + toks(2000 + step, rng.randrange(1, 12))
        kv = m.create_kv_cache(scope, prompt)
        if not kv.resume() or not kv.resize(len(prompt)):
            kv.close()
        else:
            h = kv.history_length
            while h < len(prompt):  # chunks cut where a hybrid model keeps state snapshots
                nxt = kv.next_snapshot_position(h)
                end = len(prompt) if nxt is None else min(len(prompt), nxt)
                engine.step(kv, prompt, h, end)
                kv.commit(prompt[h:end])
                h = end
            decode = rng.randrange(0, 12)
            out = toks(3000 + step, decode)
            ok = True
            for tok in out:
                if not kv.resize(kv.capacity + 1):
                    ok = False
                    break
                prompt.append(tok)
                engine.step(kv, prompt, len(prompt) - 1, len(prompt))
                kv.commit([tok])
            seen.append((scope, prompt))
            r = rng.random()
            if r < 0.15 and ok:
                kv.stop_committing()
            if r < 0.35:
                kv.suspend()
                open_caches.append(kv)  # keeps its pages held for a while
            else:
                kv.close()
        if open_caches and (len(open_caches) > 3 or rng.random() < 0.1):
            c = open_caches.pop(0)
            if rng.random() < 0.5 and c.resume():  # its pages come back up (from wherever they went)
                engine.check_all(c, c.committed_tokens, c.num_committed_tokens)
            c.close()
        if resize_tiers and step % 25 == 12:  # every open cache is suspended here
            for level in (CacheLevel(0), CacheLevel(1)):
                quota = m.get_quota(level)
                assert m.resize(level, quota // 2)  # pages move a level down (or are dropped), others compact
                assert m.resize(level, quota)
            engine = FakeEngine(m)  # the GPU's page index bound changed
        if step % 25 == 24:
            for c in open_caches:
                c.close()
            open_caches.clear()
            m.clear_reusable_blocks()
        deliver()
        for pscope, p in seen[-12:]:
            for q in (p, p[: rng.randrange(1, len(p) + 1)], p[: rng.randrange(1, len(p) + 1)] + [5]):
                want = m.probe_reuse(pscope, q)
                assert index.match_length(q, pscope) == want, (step, len(q), want)
                hits += want > 0
                partial_hits += want % T != 0
        if check_media:
            pages = 0
            for node in m._tree.nodes():
                for lc in range(len(node.pages)):
                    page = node.page(lc)
                    if page is not None:
                        assert index.medium_of(block_hash(node.key), lc) == MEDIA[page.level], (step, lc)
                        pages += 1
            assert pages == sum(len(n.groups) for n in index._nodes.values()), step  # nothing stale either
    for c in open_caches:
        c.close()
    return hits, partial_hits


def test_lost_batches_are_recovered_by_replay(make_manager: MakeManager, pubsub: Callable[..., tuple]) -> None:
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    engine = FakeEngine(m)
    (pub,), router = pubsub(1)
    prompts = [toks(200 + i, 20) for i in range(6)]
    publish(m, prompts[0], engine=engine)
    pub.publish(em.get_latest_events())
    sync(router, 0, pub)  # (batch 0 may itself be replayed: a fresh SUB socket misses the first messages)
    replayed = router.subscriptions[0].num_replayed
    # the router's SUB socket loses batch 1 (taken off the socket before the index sees it)
    publish(m, prompts[1], engine=engine)
    pub.publish(em.get_latest_events())
    pub.flush()
    assert router.subscriptions[0].sub.poll(5000)
    assert int.from_bytes(router.subscriptions[0].sub.recv_multipart()[1], "big") == 1
    assert router.indexes[0].match_length(prompts[1]) == 0
    publish(m, prompts[2], engine=engine)
    pub.publish(em.get_latest_events())
    sync(router, 0, pub)  # batch 2 reveals the gap: batch 1 is replayed first
    assert router.subscriptions[0].num_replayed == replayed + 1 and router.subscriptions[0].num_lost == 0
    for p in prompts[:3]:
        assert router.indexes[0].match_length(p) == m.probe_reuse(None, p) == 20
    # the newest batch lost and nothing after it: catch_up asks the replay socket
    publish(m, prompts[3], engine=engine)
    pub.publish(em.get_latest_events())
    pub.flush()
    assert router.subscriptions[0].sub.poll(5000)
    router.subscriptions[0].sub.recv_multipart()
    assert router.catch_up(0) == 1 and router.indexes[0].match_length(prompts[3]) == 20


def test_late_router_catches_up_from_the_replay_buffer(make_manager: MakeManager) -> None:
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    engine = FakeEngine(m)
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=100) as pub:
        for i in range(3):  # nobody subscribes yet: PUB drops these
            publish(m, toks(300 + i, 16), engine=engine)
            pub.publish(em.get_latest_events())
        pub.flush()
        with KVAwareRouter([ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)]) as router:
            assert router.catch_up(0) == 3
            for i in range(3):
                assert router.indexes[0].match_length(toks(300 + i, 16)) == 16


def test_router_sends_each_prompt_to_the_replica_holding_its_prefix(
    make_manager: MakeManager, pubsub: Callable[..., tuple]
) -> None:
    ems = [KVCacheEventManager() for _ in range(3)]
    ms = [make_manager(kv_layers(1, T), event_manager=em) for em in ems]
    pubs, router = pubsub(3)
    docs = [toks(400 + i, 40) for i in range(3)]
    for i, (m, em, pub) in enumerate(zip(ms, ems, pubs)):
        publish(m, docs[i])
        pub.publish(em.get_latest_events())
        sync(router, i, pub)
    for i, doc in enumerate(docs):
        d = router.route(doc[:35] + [1, 2, 3])
        assert (d.replica, d.matched_tokens) == (i, 35)
        assert d.scores[i] == ms[i].probe_reuse(None, doc[:35] + [1, 2, 3])
    d = router.route(toks(999, 30))
    assert d.matched_tokens == 0 and d.scores == (0, 0, 0)


def test_prefix_router_without_sockets(make_manager: MakeManager) -> None:
    """Simulators feed indexes directly from get_latest_events()."""
    ems = [KVCacheEventManager() for _ in range(2)]
    ms = [make_manager(kv_layers(1, T), event_manager=em) for em in ems]
    indexes = [ReplicaIndex() for _ in ms]
    router = PrefixRouter(indexes)
    publish(ms[1], toks(500, 24))
    for idx, m in zip(indexes, ms):
        idx.apply(to_wire(m.get_latest_events()))
    assert router.route(toks(500, 24)).replica == 1
    with pytest.raises(ValueError, match="at least one"):
        PrefixRouter([])
