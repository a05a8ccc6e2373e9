"""Issue #29: the router and publisher under faults, over real ZMQ sockets on loopback.

A replay endpoint that is dead or silent, a restarted replica, malformed frames, a full hand-off
queue, a subscriber that stops reading (byte bound), a publisher dropped without ``close()``.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from conftest import LOOPBACK, MakeManager, kv_layers, sync, toks
from tier_helpers import publish

from kv_cache_manager_v2 import KVCacheEventManager, KVCacheManager, TokenIdExt
from kv_cache_manager_v2.events import (
    BlockStored,
    KVAwareRouter,
    KVEventBatch,
    ReplicaEndpoints,
    ZmqEventPublisher,
    encode_batch,
    to_wire,
)

T = 8


def free_tcp_endpoint() -> str:
    """A loopback address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


class RawPublisher:
    """A bare XPUB socket speaking the wire protocol, so tests choose every frame; ``wait_subscriber``
    returns once a router's subscription arrived (nothing sent before it would be lost)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue refuses a message (zmq.Again) instead of dropping it
        self.sock.bind(LOOPBACK)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def wait_subscriber(self) -> None:
        assert self.sock.poll(10_000), "no subscriber"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def raw() -> Iterator[RawPublisher]:
    p = RawPublisher()
    yield p
    p.close()


def batch(m: KVCacheManager, tokens: list[TokenIdExt], instance_id: int | None = 7) -> bytes:
    """The payload announcing ``tokens`` (cached on ``m``, whose events are drained)."""
    publish(m, tokens)
    return encode_batch(KVEventBatch(time.time(), to_wire(m.get_latest_events()), None, instance_id))


# ---------------------------------------------------------------- 1. a dead or silent replay endpoint
@pytest.mark.parametrize("endpoint", ["dead", "silent"])
def test_unreachable_replay_endpoint_never_blocks_poll(endpoint: str, raw: RawPublisher) -> None:
    """Every message opens a gap (odd sequence numbers only). The replay endpoint has no listener
    ("dead") or a ROUTER socket that never answers ("silent"): poll() costs at most one
    replay_timeout per outage, then backs off; it never blocks on a full request queue."""
    silent: zmq.Socket[bytes] | None = None
    if endpoint == "dead":
        replay_endpoint = free_tcp_endpoint()
    else:
        silent = raw.ctx.socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind(LOOPBACK)
        replay_endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    timeout = 0.25
    router = KVAwareRouter(
        [ReplicaEndpoints(raw.endpoint, replay_endpoint)], replay_timeout=timeout, replay_backoff=5.0
    )
    raw.wait_subscriber()
    payload = encode_batch(KVEventBatch(0.0, []))
    n = 3000
    slowest = [0.0]
    elapsed = [0.0]

    def poll(timeout: float) -> None:
        start = time.monotonic()
        router.poll(timeout)
        slowest[0] = max(slowest[0], time.monotonic() - start)

    def drive() -> None:
        t0 = time.monotonic()
        for k in range(n):
            while True:  # nothing is lost on the way: every gap is one the publisher made
                try:
                    raw.sock.send_multipart((b"", (2 * k + 1).to_bytes(8, "big"), payload), zmq.NOBLOCK)
                    break
                except zmq.Again:
                    poll(0.001)
            if k % 10 == 9:
                poll(0)
        while router.last_seq(0) < 2 * n - 1:  # what is still on its way
            poll(0.05)
            assert time.monotonic() - t0 < 60
        elapsed[0] = time.monotonic() - t0

    failure: list[BaseException] = []

    def run() -> None:
        try:
            drive()
        except BaseException as e:
            failure.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)
    try:
        assert not worker.is_alive(), "poll() hung"
        if failure:
            raise failure[0]
        s = router.subscriptions[0]
        assert s.last_seq == 2 * n - 1 and s.num_lost == n and s.stale
        # one failure, then backed off for 5 s (a second one only if the run took that long)
        assert 1 <= s.num_replay_failures <= 1 + int(elapsed[0] / 5.0), (s.num_replay_failures, elapsed[0])
        assert slowest[0] < timeout + 1.0, slowest[0]
        if endpoint == "dead":  # no connection: nothing to wait for at all
            assert router.catch_up(0) == 0
    finally:
        router.close()
        if silent is not None:
            silent.close(linger=0)


def test_replay_backoff_grows_and_recovers(make_manager: MakeManager) -> None:
    """While the endpoint stays unreachable the back-off doubles; once a replay succeeds it resets."""
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    with ZmqEventPublisher(LOOPBACK, LOOPBACK) as pub:
        router = KVAwareRouter(
            [ReplicaEndpoints(pub.endpoint, free_tcp_endpoint())], replay_timeout=0.05, replay_backoff=0.1
        )
        try:
            s = router.subscriptions[0]
            for expected in (0.1, 0.2, 0.4):
                s.replay_retry_at = 0.0  # the back-off expired
                assert router.catch_up(0) == 0
                assert s.backoff == pytest.approx(expected)
            publish(m, toks(1, 24))
            pub.drain(em)
            pub.flush()
            s.endpoints = ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)  # the endpoint is back
            s.open_replay()
            s.replay_retry_at = 0.0
            assert router.catch_up(0) == 1 and s.backoff == 0.0
            assert router.indexes[0].match_length(toks(1, 24)) == m.probe_reuse(None, toks(1, 24)) == 24
        finally:
            router.close()


# ---------------------------------------------------------------- 2. a restarted replica
def test_restarted_replica_resets_its_index(make_manager: MakeManager) -> None:
    """The replica restarts (new manager, new publisher on the same ports): its sequence numbers start
    at 0 again. The router notices the new instance, clears the replica's index and replays the new
    stream, so it no longer claims the old prefix and finds the new one."""
    old_prompt, new_prompt = toks(10, 32), toks(11, 40)
    em1 = KVCacheEventManager()
    m1 = make_manager(kv_layers(1, T), event_manager=em1)
    pub1 = ZmqEventPublisher(LOOPBACK, LOOPBACK)
    endpoints = ReplicaEndpoints(pub1.endpoint, pub1.replay_endpoint)
    router = KVAwareRouter([endpoints], replay_timeout=1.0)
    try:
        for i in range(4):  # a few batches: the old instance got further than the new one will
            publish(m1, old_prompt if i == 0 else toks(20 + i, 16))
            pub1.drain(em1)
        sync(router, 0, pub1)
        assert router.indexes[0].match_length(old_prompt) == 32 and router.last_seq(0) == 3
        old_instance = pub1.instance_id
        pub1.close()
        m1.shutdown()

        em2 = KVCacheEventManager()
        m2 = make_manager(kv_layers(1, T), event_manager=em2)
        with ZmqEventPublisher(endpoints.endpoint, endpoints.replay_endpoint) as pub2:
            assert pub2.instance_id != old_instance
            publish(m2, new_prompt)
            pub2.drain(em2)
            deadline = time.monotonic() + 15
            k = 0
            while router.subscriptions[0].num_restarts == 0:  # the SUB socket reconnects meanwhile
                assert time.monotonic() < deadline, "the restart was never noticed"
                router.poll(0.05)
                if router.subscriptions[0].num_restarts == 0:
                    k += 1
                    publish(m2, toks(100 + k, 16))
                    pub2.drain(em2)
            sync(router, 0, pub2)
            s = router.subscriptions[0]
            assert s.num_restarts == 1 and s.instance == pub2.instance_id and s.num_lost == 0 and not s.stale
            for p in (old_prompt, new_prompt, *[toks(100 + i, 16) for i in range(1, k + 1)]):
                assert router.indexes[0].match_length(p) == m2.probe_reuse(None, p), len(p)
            assert router.indexes[0].match_length(old_prompt) == 0
            assert router.indexes[0].match_length(new_prompt) == 40
            # a late batch of the old instance changes nothing
            assert not router._same_instance(0, old_instance)
    finally:
        router.close()
        pub1.close()


# ---------------------------------------------------------------- 3. malformed frames
def test_malformed_frames_are_counted_and_skipped(make_manager: MakeManager, raw: RawPublisher) -> None:
    m = make_manager(kv_layers(1, T), event_manager=KVCacheEventManager())
    router = KVAwareRouter([ReplicaEndpoints(raw.endpoint)])
    try:
        raw.wait_subscriber()
        good = batch(m, toks(30, 24))
        stored = msgspec.msgpack.decode(good)[1][0]
        bad_stored = [*stored[:3], stored[3][:-10], *stored[4:]]  # tokens short
        seq0 = (0).to_bytes(8, "big")
        raw.send(b"", seq0)  # two frames
        raw.send(b"", b"\x00", good)  # a sequence number of one byte
        raw.send(b"", seq0, b"\xc1")  # not msgpack
        raw.send(b"", seq0, msgspec.msgpack.encode({"ts": 1}))  # msgpack, not a batch
        # a batch of two events: an unknown tag; a BlockStored that decodes but cannot be applied
        raw.send(b"", seq0, msgspec.msgpack.encode([0.0, [["NoSuchEvent", 1], bad_stored]]))
        raw.send(b"", (1).to_bytes(8, "big"), good)
        deadline = time.monotonic() + 10
        while router.last_seq(0) < 1:
            router.poll(0.05)  # never raises
            assert time.monotonic() < deadline
        s = router.subscriptions[0]
        # the unknown tag and the short BlockStored are events of decodable batches: refused alone
        assert s.num_malformed == 4 and s.num_refused == 2 and s.num_lost == 0
        assert router.indexes[0].match_length(toks(30, 24)) == m.probe_reuse(None, toks(30, 24)) == 24
        assert isinstance(msgspec.msgpack.decode(good, type=KVEventBatch).events[0], BlockStored)
    finally:
        router.close()


# ---------------------------------------------------------------- 4. a full hand-off queue
def test_dropped_batches_leave_a_gap_then_drain_resynchronises(make_manager: MakeManager) -> None:
    """The publisher thread stalls (the test holds its lock) with a one-batch queue: a batch is
    dropped. Its sequence number is used up, so the router sees the gap, asks for a replay that
    cannot fill it, marks the replica stale; the next drain sends a snapshot that makes it exact."""
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    prompts = [toks(40 + i, 24) for i in range(5)]
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, max_queue_size=1) as pub:
        router = KVAwareRouter([ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)], replay_timeout=2.0)
        try:
            publish(m, prompts[0])
            pub.drain(em)
            sync(router, 0, pub)
            sender = pub._sender
            with sender.sent:  # the thread blocks after its next send
                publish(m, prompts[1])
                pub.drain(em)  # seq 1: taken by the thread, which then waits for the lock
                deadline = time.monotonic() + 10
                while sender.queue.qsize():
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                publish(m, prompts[2])
                pub.drain(em)  # seq 2: queued
                publish(m, prompts[3])
                pub.drain(em)  # seq 3: dropped (queue full)
            pub.flush()
            assert pub.num_dropped_batches == 1 and pub.next_seq == 4
            sync(router, 0, pub)
            s = router.subscriptions[0]
            assert s.last_seq == 2 and s.num_lost == 0  # nothing reveals the gap yet
            publish(m, prompts[4])
            pub.drain(em)  # seq 4: the snapshot (the events of prompts[3] and [4] included)
            sync(router, 0, pub)
            assert s.num_lost == 1 and s.num_replay_failures == 0  # the gap was seen; replay had nothing for it
            assert not s.stale  # the snapshot made the index exact again
            for p in prompts:
                assert router.indexes[0].match_length(p) == m.probe_reuse(None, p) == 24
            # publish() without the event manager cannot resynchronise: the gap stays visible as staleness
            with sender.sent:
                pub.publish([*em.snapshot()[1:2]])
                while sender.queue.qsize():
                    time.sleep(0.001)
                pub.publish([*em.snapshot()[1:2]])
                pub.publish([*em.snapshot()[1:2]])  # dropped
            pub.flush()
            pub.publish([*em.snapshot()[1:2]])
            sync(router, 0, pub)
            assert s.num_lost == 2 and s.stale, (pub.num_dropped_batches, pub.next_seq, s.last_seq, s.num_replayed)
        finally:
            router.close()


# ---------------------------------------------------------------- 5. the byte bound
def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_subscriber_that_stops_reading_holds_at_most_the_byte_bound(make_manager: MakeManager) -> None:
    """A SUB socket connects and never reads. ZMQ would queue every batch for it (up to ``hwm``
    messages: 72 MB here); the publisher keeps what ZMQ holds under ``max_send_bytes`` and sends
    withheld placeholders beyond it, which a healthy router replays: its index stays exact."""
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), quota=4 << 20, event_manager=em)
    prompt = toks(50, 2048)
    publish(m, prompt)
    events = em.get_latest_events()  # one BlockStored of 2048 tokens on the wire: ~12 KB
    limit = 2 << 20
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, max_send_bytes=limit, max_buffer_bytes=limit) as pub:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        stalled = ctx.socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 4096)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.setsockopt(zmq.LINGER, 0)
        stalled.connect(pub.endpoint)
        router = KVAwareRouter([ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)])
        try:
            pub.publish(events)
            sync(router, 0, pub)  # both subscriptions are in place from here on
            time.sleep(0.2)
            before = rss_mib()
            n = 6000
            for k in range(n):
                pub.publish(events)
                if k % 100 == 99:
                    pub.flush()
                    while router.poll(0.001):  # the healthy router keeps up (replaying the withheld batches)
                        pass
                    assert pub.send_bytes_in_flight <= limit + 20_000
            sync(router, 0, pub)
            grown = rss_mib() - before
            size = pub.replay_buffer_bytes / len(pub._sender.buffer)
            assert size > 10_000 and n * size > 60 << 20  # what ZMQ would otherwise hold for the stalled socket
            assert grown < 24, f"the process grew by {grown:.0f} MiB"
            assert pub.replay_buffer_bytes <= limit and pub.num_withheld_batches > n // 2
            s = router.subscriptions[0]
            assert s.num_replayed > 0 and not s.stale
            assert router.indexes[0].match_length(prompt) == m.probe_reuse(None, prompt) == 2048
        finally:
            router.close()
            stalled.close(linger=0)
            ctx.term()


# ---------------------------------------------------------------- 6. a publisher collected without close()
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def publisher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-event-publisher"]


def test_a_publisher_collected_without_close_stops_and_closes(make_manager: MakeManager) -> None:
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    publish(m, toks(60, 24))
    events = em.get_latest_events()
    with ZmqEventPublisher(LOOPBACK, LOOPBACK) as warm:  # pyzmq's process-wide helpers start once
        warm.publish(events)
        warm.flush()
    gc.collect()
    fds, threads = open_fds(), len(publisher_threads())
    for _ in range(3):
        pub = ZmqEventPublisher(LOOPBACK, LOOPBACK)
        pub.publish(events)
        pub.flush()
        assert open_fds() > fds and len(publisher_threads()) == threads + 1
        del pub  # no close()
        gc.collect()
        deadline = time.monotonic() + 10
        while len(publisher_threads()) > threads or open_fds() > fds:
            assert time.monotonic() < deadline, (open_fds(), fds, publisher_threads())
            time.sleep(0.01)


def test_a_reset_index_learns_the_restarted_replicas_block_size() -> None:
    """A restarted replica may run another block size or other groups: reset() forgets what was
    learnt from events (what the constructor was given stays)."""
    from kv_cache_manager_v2.events.router import ReplicaIndex
    from kv_cache_manager_v2.events.schema import BlockStored

    def stored(block_size: int) -> BlockStored:
        return BlockStored([1], None, list(range(block_size)), block_size, None, "GPU", group_idx=0)

    index = ReplicaIndex()
    index.apply([stored(16)])
    assert index.tokens_per_block == 16 and index.num_blocks == 1
    with pytest.raises(ValueError, match="block_size 32"):
        index.apply([stored(32)])
    index.reset()
    index.apply([stored(32)])
    assert index.tokens_per_block == 32 and index.num_blocks == 1


def test_an_unknown_layer_kind_is_malformed_not_full_attention() -> None:
    """A group whose kind this router does not know is refused (counted as malformed by the router),
    never taken for full attention."""
    from kv_cache_manager_v2.events.router import ReplicaIndex
    from kv_cache_manager_v2.events.schema import BlockStored

    index = ReplicaIndex()
    event = BlockStored([1], None, list(range(16)), 16, None, "GPU", group_idx=0, kv_cache_spec_kind="mamba")
    with pytest.raises(ValueError, match="unknown layer kind 'mamba'"):
        index.apply([event])
    assert index.num_blocks == 0 and 0 not in index.groups


# ---------------------------------------------------------------- 7. issue 38: router limits
def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def wait_applied(router: KVAwareRouter, seq: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while router.last_seq(0) < seq:
        router.poll(0.05)
        s = router.subscriptions[0]
        assert time.monotonic() < deadline, (router.last_seq(0), s.last_seq, s.num_malformed, s.num_lost)


class GcPauses:
    """Seconds the cyclic garbage collector ran since ``total`` was last reset (its full passes
    take time in proportion to the process's heap, whatever the code that allocated)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.monotonic()
        else:
            self.total += time.monotonic() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def test_a_resync_sized_batch_is_applied_in_slices(raw: RawPublisher) -> None:
    """A 96k-event batch (the size of a resync snapshot) and a small one after it: each poll(0.1)
    keeps its bound, the big batch is applied over several polls and the small one after it (in
    order). Mid-batch, the index is the replica's as of an event inside the batch: the prompts it
    matches in full are a prefix of the snapshot's order, at most one is partly matched."""
    from kv_cache_manager_v2 import ReuseScope, block_hash
    from kv_cache_manager_v2._reuse._keys import scope_key
    from kv_cache_manager_v2.events import AllBlocksCleared, BlockRemoved, prompt_block_hashes

    root = block_hash(scope_key(ReuseScope()))
    t, blocks, n_prompts = 4, 16, 6000
    prompts = [toks(1000 + k, t * blocks) for k in range(n_prompts)]
    events: list[BlockStored] = []
    last_hashes = []
    for p in prompts:
        parent = None
        for b, h in enumerate(prompt_block_hashes(p, t)):
            tokens = list(p[b * t : (b + 1) * t])
            scope = root if parent is None else None
            events.append(BlockStored([h], parent, tokens, t, None, "GPU", group_idx=0, scope_hash=scope))
            parent = h
        last_hashes.append(parent)
    assert len(events) == 96_000
    router = KVAwareRouter([ReplicaEndpoints(raw.endpoint)])
    try:
        raw.wait_subscriber()
        raw.send(b"", seq_frame(0), encode_batch(KVEventBatch(0.0, [AllBlocksCleared(), *events], None, 7)))
        raw.send(
            b"", seq_frame(1), encode_batch(KVEventBatch(0.0, [BlockRemoved([last_hashes[0]], "GPU", 0)], None, 7))
        )
        assert router.subscriptions[0].sub.poll(10_000)
        sample = [*prompts[:: n_prompts // 40], prompts[-1]]
        index = router.indexes[0]
        slowest, polls, partial_views, middle = 0.0, 0, 0, 0
        deadline = time.monotonic() + 120
        gc_pause = GcPauses()
        while router.last_seq(0) < 1:
            start = time.monotonic()
            gc_pause.total = 0.0
            router.poll(0.1)
            slowest = max(slowest, time.monotonic() - start - gc_pause.total)
            polls += 1
            assert time.monotonic() < deadline
            if router.last_seq(0) < 0 and 0 < index.num_blocks < len(events):
                partial_views += 1
                matched = [index.match_length(p) for p in sample]
                assert matched == sorted(matched, reverse=True), matched
                assert sum(0 < x < t * blocks for x in matched) <= 1, matched
                middle += matched[0] == t * blocks and matched[-1] < t * blocks
        gc_pause.close()
        assert slowest < 1.0, f"one poll(0.1) took {slowest:.2f} s (besides cyclic-GC pauses)"
        assert polls > 2 and partial_views > 0 and middle > 0, (polls, partial_views, middle)
        s = router.subscriptions[0]
        assert s.num_malformed == s.num_refused == s.num_lost == 0 and not s.stale
        assert index.num_blocks == len(events) - 1  # the removal (batch 1) came after the stores (batch 0)
        assert index.match_length(prompts[0]) == t * (blocks - 1)
        assert all(index.match_length(p) == t * blocks for p in prompts[1:])
    finally:
        router.close()


def test_an_impossible_sequence_number_does_not_poison_the_replica(
    make_manager: MakeManager, raw: RawPublisher
) -> None:
    """One decodable frame with sequence 2**64 - 1 (the replay end marker, as a signed number) and no
    instance id is refused and counted; the batches after it apply."""
    m = make_manager(kv_layers(1, T), event_manager=KVCacheEventManager())
    router = KVAwareRouter([ReplicaEndpoints(raw.endpoint)])
    try:
        raw.wait_subscriber()
        raw.send(b"", seq_frame(0), batch(m, toks(70, 24), None))
        raw.send(b"", seq_frame(2**64 - 1), encode_batch(KVEventBatch(0.0, [])))
        raw.send(b"", seq_frame(1), batch(m, toks(71, 24), None))
        wait_applied(router, 1)
        s = router.subscriptions[0]
        for p in (toks(70, 24), toks(71, 24)):
            assert router.indexes[0].match_length(p) == m.probe_reuse(None, p) == 24
        assert s.num_malformed == 1 and s.num_lost == 0 and not s.stale
    finally:
        router.close()


def test_a_sequence_number_the_publisher_never_sent_is_refused(make_manager: MakeManager, raw: RawPublisher) -> None:
    """A frame jumps the sequence far ahead: the router asks the replay socket, whose end marker
    names the newest batch the publisher sent; the frame is beyond it, so it is refused (counted)
    and the stream goes on. (The live stream comes from a bare socket carrying the publisher's own
    batches, so the test can add a forged one.)"""
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    with ZmqEventPublisher(LOOPBACK, LOOPBACK) as pub:
        router = KVAwareRouter([ReplicaEndpoints(raw.endpoint, pub.replay_endpoint)], replay_timeout=2.0)
        try:
            raw.wait_subscriber()

            def forward(tokens: list[TokenIdExt]) -> None:
                publish(m, tokens)
                events = em.get_latest_events()
                pub.publish(events)
                seq = pub.flush()
                raw.send(b"", seq_frame(seq), encode_batch(KVEventBatch(0.0, to_wire(events), None, pub.instance_id)))

            forward(toks(80, 24))
            wait_applied(router, 0)
            forged = encode_batch(KVEventBatch(0.0, [], None, pub.instance_id))
            raw.send(b"", seq_frame(10**12), forged)
            forward(toks(81, 24))
            wait_applied(router, 1)
            s = router.subscriptions[0]
            assert s.num_malformed == 1 and s.num_lost == 0 and not s.stale and s.last_seq == 1
            for p in (toks(80, 24), toks(81, 24)):
                assert router.indexes[0].match_length(p) == m.probe_reuse(None, p) == 24
        finally:
            router.close()


def test_an_event_with_impossible_values_is_refused_alone(make_manager: MakeManager, raw: RawPublisher) -> None:
    """A BlockStored for a layer group that cannot exist (-1, window -100), a removal for one, a
    negative hash: each event is refused and counted, the others of the batch apply, and the
    replica's matches stay exact."""
    from kv_cache_manager_v2.events import BlockRemoved

    m = make_manager(kv_layers(1, T), event_manager=KVCacheEventManager())
    prompt = toks(90, 40)
    publish(m, prompt)
    good = to_wire(m.get_latest_events())
    impossible = [
        BlockStored(
            [5],
            None,
            list(range(T)),
            T,
            None,
            "GPU",
            group_idx=-1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=-100,
        ),
        BlockStored(
            [6],
            None,
            list(range(T)),
            T,
            None,
            "GPU",
            group_idx=0,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=-100,
        ),
        BlockStored([-7], None, list(range(T)), T, None, "GPU", group_idx=0),
        BlockRemoved([1], "GPU", -1),
    ]
    router = KVAwareRouter([ReplicaEndpoints(raw.endpoint)])
    try:
        raw.wait_subscriber()
        raw.send(b"", seq_frame(0), encode_batch(KVEventBatch(0.0, [impossible[0], *good, *impossible[1:]])))
        wait_applied(router, 0)
        assert router.indexes[0].match_length(prompt) == m.probe_reuse(None, prompt) == 40
        s = router.subscriptions[0]
        assert s.num_refused == len(impossible) and s.num_malformed == 0 and not s.stale
        assert sorted(router.indexes[0].groups) == [0] and router.indexes[0].num_blocks == 5
    finally:
        router.close()


def test_a_refused_event_teaches_the_router_nothing(make_manager: MakeManager, raw: RawPublisher) -> None:
    """A router given neither the block size nor the groups receives one impossible BlockStored (block
    size 7, a sliding-window group, a digest offset outside its block): it is refused and learns
    nothing from it, so the replica's valid events that follow still apply (issue 47)."""
    m = make_manager(kv_layers(1, T), event_manager=KVCacheEventManager())
    prompt = toks(95, 40)
    publish(m, prompt)
    good = to_wire(m.get_latest_events())
    impossible = [
        BlockStored(
            [5, 6],
            None,
            list(range(14)),
            7,
            None,
            "GPU",
            extra_keys=[None, [(off, b"d")]],
            group_idx=0,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=7,
        )
        for off in (7, -1)
    ]
    router = KVAwareRouter([ReplicaEndpoints(raw.endpoint)])
    try:
        raw.wait_subscriber()
        raw.send(b"", seq_frame(0), encode_batch(KVEventBatch(0.0, [*impossible, *good])))
        wait_applied(router, 0)
        index = router.indexes[0]
        s = router.subscriptions[0]
        assert s.num_refused == 2 and s.num_malformed == 0
        assert index.tokens_per_block == T and sorted(index.groups) == [0] and index.groups[0].kind == "full_attention"
        assert index.match_length(prompt) == m.probe_reuse(None, prompt) == 40 and index.num_blocks == 5
    finally:
        router.close()


def test_an_index_given_the_groups_refuses_any_other() -> None:
    """With the replica's layer groups given, an event for another group (or one announcing a group
    as another kind) is refused and changes nothing."""
    from kv_cache_manager_v2 import LayerGroupSpec
    from kv_cache_manager_v2.events import ReplicaIndex

    index = ReplicaIndex(4, [LayerGroupSpec(0, None, 0)])
    for group, kind in ((3, None), (0, "sliding_window")):
        event = BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", group_idx=group, kv_cache_spec_kind=kind,
                            kv_cache_spec_sliding_window=8)  # fmt: skip
        with pytest.raises(ValueError, match="group"):
            index.apply_event(event)
    assert index.num_blocks == 0 and sorted(index.groups) == [0] and index.num_events == 0
    index.apply_event(BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", group_idx=0))
    assert index.num_blocks == 1 and index.match_length([1, 2, 3, 4]) == 0  # (hash 1 is not the prompt's)


def test_a_restarted_replica_that_stays_idle_is_noticed(make_manager: MakeManager) -> None:
    """The replica restarts and publishes nothing: the router probes it once it has been silent for
    ``probe_interval``; the replay socket's end marker names the new publisher instance, so the old
    index is dropped without waiting for a batch."""
    old_prompt = toks(110, 32)
    em = KVCacheEventManager()
    m = make_manager(kv_layers(1, T), event_manager=em)
    pub1 = ZmqEventPublisher(LOOPBACK, LOOPBACK)
    endpoints = ReplicaEndpoints(pub1.endpoint, pub1.replay_endpoint)
    router = KVAwareRouter([endpoints], replay_timeout=0.5, replay_backoff=0.2, probe_interval=0.2)
    try:
        publish(m, old_prompt)
        pub1.drain(em)
        sync(router, 0, pub1)
        assert router.indexes[0].match_length(old_prompt) == 32
        pub1.close()
        with ZmqEventPublisher(endpoints.endpoint, endpoints.replay_endpoint) as pub2:  # idle
            s = router.subscriptions[0]
            deadline = time.monotonic() + 15
            while s.num_restarts == 0:
                assert time.monotonic() < deadline, "the restart was never noticed"
                router.poll(0.05)
            assert s.instance == pub2.instance_id and not s.expired
            assert router.indexes[0].match_length(old_prompt) == 0 and router.indexes[0].num_blocks == 0
    finally:
        router.close()
        pub1.close()


def test_a_replica_restarted_on_the_same_endpoints_is_noticed_at_once(make_manager: MakeManager) -> None:
    """The replica restarts on the same endpoints and publishes at once, before the router's SUB
    socket reconnected (that batch is lost live), then stays idle. The replay socket's monitor sees
    it connect again: the router probes at once (well within the default ``probe_interval`` of 5 s),
    drops the old index and replays the new stream from 0 (issue 47)."""
    old_prompt, new_prompt = toks(130, 32), toks(131, 40)
    em1 = KVCacheEventManager()
    m1 = make_manager(kv_layers(1, T), event_manager=em1)
    pub1 = ZmqEventPublisher(LOOPBACK, LOOPBACK)
    endpoints = ReplicaEndpoints(pub1.endpoint, pub1.replay_endpoint)
    router = KVAwareRouter([endpoints], replay_timeout=1.0)
    try:
        publish(m1, old_prompt)
        pub1.drain(em1)
        sync(router, 0, pub1)
        assert router.indexes[0].match_length(old_prompt) == 32
        pub1.close()
        m1.shutdown()
        em2 = KVCacheEventManager()
        m2 = make_manager(kv_layers(1, T), event_manager=em2)
        with ZmqEventPublisher(endpoints.endpoint, endpoints.replay_endpoint) as pub2:
            publish(m2, new_prompt)
            pub2.drain(em2)
            pub2.flush()
            s = router.subscriptions[0]
            t0 = time.monotonic()
            while router.indexes[0].match_length(new_prompt) != 40:
                assert time.monotonic() - t0 < 3.0, "the restart was not noticed before probe_interval"
                router.poll(0.05)
            assert s.num_restarts == 1 and s.instance == pub2.instance_id and s.num_lost == 0 and not s.stale
            assert router.indexes[0].match_length(old_prompt) == 0 == m2.probe_reuse(None, old_prompt)
            assert not s.expired and s.num_replay_failures == 0
    finally:
        router.close()
        pub1.close()


def test_a_replica_whose_publisher_is_gone_scores_zero(make_manager: MakeManager) -> None:
    """Replica 0 holds the longer prefix, then its publisher goes away for good: once it is silent
    and its replay socket does not answer a probe, it is expired (counted) and routes go to replica 1;
    an idle replica that answers its probes stays."""
    prompt = toks(120, 32)
    ems = [KVCacheEventManager() for _ in range(2)]
    ms = [make_manager(kv_layers(1, T), event_manager=em) for em in ems]
    pubs = [ZmqEventPublisher(LOOPBACK, LOOPBACK) for _ in range(2)]
    router = KVAwareRouter(
        [ReplicaEndpoints(p.endpoint, p.replay_endpoint) for p in pubs],
        replay_timeout=0.3,
        replay_backoff=0.2,
        probe_interval=0.2,
    )
    try:
        publish(ms[0], prompt)
        publish(ms[1], prompt[:16])
        for i in range(2):
            pubs[i].drain(ems[i])
            sync(router, i, pubs[i])
        assert router.route(prompt).replica == 0 and router.scores(prompt) == [32, 16]
        pubs[0].close()
        s = router.subscriptions[0]
        deadline = time.monotonic() + 15
        while not s.expired:
            assert time.monotonic() < deadline, "the gone replica was never expired"
            router.poll(0.05)
        assert s.num_expired == 1 and router.scores(prompt) == [0, 16] and router.route(prompt).replica == 1
        assert not router.subscriptions[1].expired and router.subscriptions[1].num_expired == 0
    finally:
        router.close()
        for p in pubs:
            p.close()
