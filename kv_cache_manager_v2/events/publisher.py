"""Publishes KV-cache event batches over ZMQ PUB, with a replay socket for subscribers that missed some.

Wire protocol (vLLM's): every batch is one multipart message ``[topic, seq, payload]`` on the PUB
socket, ``seq`` an 8-byte big-endian sequence number (0, 1, 2, ... per publisher) and ``payload``
a msgpack :class:`~kv_cache_manager_v2.events.schema.KVEventBatch`. The replay socket (ROUTER)
answers a request whose last frame is an 8-byte big-endian start sequence number with every
buffered batch from there on (an extension: a start and a stop frame, the batches in that range),
one ``[seq, payload]`` message each (behind the requester's envelope), then ``[seq = -1 (signed),
instance_id + newest seq]`` as the end marker (vLLM's payload is ``b""``; ours, an extension, is the
publisher's instance id and the newest sequence number it sent (-1: none), 8 bytes each: a router
probing an idle replica notices a restart, and refuses a sequence number never sent). It keeps the last
``buffer_steps`` batches (at most ``max_buffer_bytes`` of payload).

Encoding and sending run on a background thread: ``publish`` only queues the drained events, so
the scheduler never waits on serialisation or the network. Every batch gets its sequence number
when it is published, so a batch that is lost is a visible gap:

- the hand-off queue is full: the batch is dropped and counted (``num_dropped_batches``); its
  sequence number is used up, and ``drain`` sends a full snapshot next (a resynchronisation);
- ZMQ still holds ``max_send_bytes`` of earlier payloads (a subscriber stopped reading): the batch
  goes to the replay buffer only, and the PUB socket carries a *withheld* placeholder (no events,
  ``withheld=True``) under its sequence number, which tells a router to replay it
  (``num_withheld_batches``).

Every batch carries the publisher's random ``instance_id``, so a router notices a restarted replica
(whose sequence numbers start again at 0). A publisher that is garbage-collected without
``close()`` stops its thread and closes its sockets.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

import zmq

from .._events import KVCacheEvent, KVCacheEventManager
from .._routing import ReplicaLoad
from .schema import KVEventBatch, LoadReport, MovesAs, encode_batch, to_wire

END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: one queued batch: (sequence number, timestamp, events, load); None stops the thread
_Item = tuple[int, float, list[KVCacheEvent], LoadReport | None] | None


class _Sender:
    """The publisher thread's state: sockets, hand-off queue, replay buffer, bytes ZMQ holds.

    It holds no reference to its :class:`ZmqEventPublisher`, so a publisher dropped without
    ``close()`` is collected, and its finalizer stops this.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        pub: zmq.Socket[bytes],
        replay: zmq.Socket[bytes] | None,
        topic: bytes,
        rank: int | None,
        moves: MovesAs,
        buffer_steps: int,
        max_buffer_bytes: int,
        max_send_bytes: int,
        max_queue_size: int,
    ) -> None:
        self.ctx = ctx
        self.pub = pub
        self.replay = replay
        self.topic = topic
        self.rank = rank
        self.moves: MovesAs = moves
        self.instance_id = secrets.randbits(63)
        self.buffer: deque[tuple[int, bytes]] = deque()
        self.buffer_steps = buffer_steps
        self.buffer_bytes = 0
        self.max_buffer_bytes = max_buffer_bytes
        #: payloads handed to ZMQ zero-copy, with the trackers that tell when ZMQ let go of them
        self.in_flight: deque[tuple[zmq.MessageTracker, int]] = deque()
        self.in_flight_bytes = 0
        self.max_send_bytes = max_send_bytes
        self.queue: queue.Queue[_Item] = queue.Queue(max_queue_size)
        self.sent = threading.Condition()
        self.last_seq = -1
        self.num_withheld = 0
        self.error: BaseException | None = None
        self.sockets_closed = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="kv-event-publisher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Send what is queued, stop the thread, close the sockets (the finalizer of the publisher)."""
        thread = self.thread
        if thread is not None and thread.is_alive():
            self.queue.put(None)
            thread.join(timeout=10)
            if thread.is_alive():  # pragma: no cover - a send stuck for 10 s: keep the sockets it uses
                return
        self.close_sockets()

    def close_sockets(self) -> None:
        if self.sockets_closed:
            return
        self.sockets_closed = True
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()

    def run(self) -> None:
        try:
            while True:
                try:
                    item = self.queue.get(timeout=0.005)
                except queue.Empty:
                    self.serve_replay()
                    continue
                try:
                    if item is None:
                        return
                    self.send(item[0], item[1], item[2], item[3])
                finally:
                    with self.sent:
                        self.queue.task_done()
                        self.sent.notify_all()
                self.serve_replay()
        except BaseException as e:  # surfaced by publish()/flush()
            self.error = e
            with self.sent:
                while True:  # unblock flush()
                    try:
                        self.queue.get_nowait()
                        self.queue.task_done()
                    except queue.Empty:
                        break
                self.sent.notify_all()

    def send(self, seq: int, ts: float, events: list[KVCacheEvent], load: LoadReport | None) -> None:
        payload = encode_batch(KVEventBatch(ts, to_wire(events, self.moves), self.rank, self.instance_id, load=load))
        self.remember(seq, payload)
        seq_bytes = seq.to_bytes(8, "big")
        in_flight = self.in_flight
        while in_flight and in_flight[0][0].done:
            self.in_flight_bytes -= in_flight.popleft()[1]
        if in_flight and self.in_flight_bytes + len(payload) > self.max_send_bytes:
            # ZMQ still holds too much for a subscriber that does not read: routers replay this one
            placeholder = encode_batch(KVEventBatch(ts, [], self.rank, self.instance_id, withheld=True, load=load))
            self.pub.send_multipart((self.topic, seq_bytes, placeholder))
            self.num_withheld += 1
        else:
            frame = zmq.Frame(payload, track=True, copy=False)
            self.pub.send_multipart((self.topic, seq_bytes, frame), copy=False)
            assert frame.tracker is not None
            in_flight.append((frame.tracker, len(payload)))
            self.in_flight_bytes += len(payload)
        self.last_seq = seq

    def remember(self, seq: int, payload: bytes) -> None:
        buffer = self.buffer
        buffer.append((seq, payload))
        self.buffer_bytes += len(payload)
        while len(buffer) > self.buffer_steps or (self.buffer_bytes > self.max_buffer_bytes and len(buffer) > 1):
            self.buffer_bytes -= len(buffer.popleft()[1])

    def serve_replay(self) -> None:
        sock = self.replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            # [identity, (b"",) start] (vLLM's request), or [identity, (b"",) start, stop] (ours: a range)
            body = 2 if len(frames) >= 3 and len(frames[-2]) == 8 and frames[-3] in (b"", frames[0]) else 1
            if len(frames) < 1 + body or any(len(f) != 8 for f in frames[-body:]):
                continue  # not a replay request
            start = int.from_bytes(frames[-body], "big")
            stop = int.from_bytes(frames[-1], "big") if body == 2 else None
            envelope = frames[:-body]  # identity, plus the empty delimiter of REQ/DEALER-with-delimiter peers
            # a ROUTER socket drops what a slow requester cannot take (it never blocks this thread)
            for seq, payload in self.buffer:
                if seq >= start and (stop is None or seq < stop):
                    sock.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            newest = self.buffer[-1][0] if self.buffer else -1
            end = self.instance_id.to_bytes(8, "big") + newest.to_bytes(8, "big", signed=True)
            sock.send_multipart([*envelope, END_SEQ, end])


class ZmqEventPublisher:
    """Sends KV-cache event batches to subscribers (routers) over ZMQ, with replay.

    ``endpoint`` is bound by the PUB socket (e.g. ``"tcp://*:5557"``), ``replay_endpoint`` (optional)
    by the ROUTER socket that serves missed batches. Engine loop, once per step::

        publisher.drain(event_manager)       # or publisher.publish(manager.get_latest_events())

    Bounds: ``max_queue_size`` batches waiting for the thread; ``hwm`` messages queued per
    subscriber by ZMQ, and ``max_send_bytes`` of payload held by ZMQ for all subscribers together;
    ``buffer_steps`` batches and ``max_buffer_bytes`` of payload kept for replay.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        moves: MovesAs = "vllm",
        max_send_bytes: int = 64 << 20,
        max_buffer_bytes: int = 64 << 20,
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError(f"endpoint must be a non-empty ZMQ address such as 'tcp://*:5557', got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise ValueError(f"replay_endpoint must be None or a non-empty ZMQ address, got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
            ("max_send_bytes", max_send_bytes),
            ("max_buffer_bytes", max_buffer_bytes),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if data_parallel_rank is not None and (type(data_parallel_rank) is not int or data_parallel_rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {data_parallel_rank!r}")
        if moves not in ("vllm", "native"):
            raise ValueError(f"moves must be 'vllm' or 'native', got {moves!r}")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.bind(endpoint)
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(replay_endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()
            raise
        #: the endpoints actually bound (a ``:*`` / ``:0`` port resolved)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT) if replay is not None else None
        self._sender = _Sender(
            ctx,
            pub,
            replay,
            topic.encode(),
            data_parallel_rank,
            moves,
            buffer_steps,
            max_buffer_bytes,
            max_send_bytes,
            max_queue_size,
        )
        self._next_seq = 0
        #: batches dropped because the hand-off queue was full (cumulative; each used up its sequence number)
        self.num_dropped_batches = 0
        self._resync_due = False
        self._closed = False
        self._sender.start()
        # stops the thread and closes the sockets when the publisher is collected without close()
        self._finalizer = weakref.finalize(self, _Sender.stop, self._sender)

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay={self.replay_endpoint!r}, next_seq={self._next_seq})"
        )

    # ------------------------------------------------------------------ scheduler side
    def publish(self, events: Sequence[KVCacheEvent], load: ReplicaLoad | None = None) -> None:
        """Queue one batch (nothing when ``events`` is empty and no ``load`` is given); never blocks.
        ``load``: the replica's load now, sent with the batch (routers weigh it against cache;
        publish it every step or so, a router forgets a load after its ``load_stale_s``). A full
        queue drops the batch (counted); its sequence number is used up, so subscribers see the gap."""
        if self._closed:
            raise RuntimeError("publish() after close()")
        if self._sender.error is not None:
            raise RuntimeError("the publisher thread failed") from self._sender.error
        if load is not None and not isinstance(load, ReplicaLoad):
            raise TypeError(f"load must be a ReplicaLoad or None, got {type(load).__name__}")
        if not events and load is None:
            return
        report = (
            None if load is None else LoadReport(load.queued_prefill_tokens, load.running_requests, load.kv_utilization)
        )
        seq = self._next_seq
        self._next_seq = seq + 1
        try:
            self._sender.queue.put_nowait((seq, time.time(), list(events), report))
        except queue.Full:
            self.num_dropped_batches += 1
            self._resync_due = True

    def drain(self, event_manager: KVCacheEventManager, load: ReplicaLoad | None = None) -> None:
        """``publish(event_manager.get_latest_events(), load)``; after a dropped batch, publishes
        ``event_manager.snapshot()`` instead (AllBlocksCleared + every cached block), which makes
        subscribers exact again."""
        events = event_manager.get_latest_events()
        if self._resync_due:
            events = event_manager.snapshot()  # the state now, the events just drained included
            self._resync_due = False
        dropped = self.num_dropped_batches
        self.publish(events, load)
        if self.num_dropped_batches != dropped:
            self._resync_due = True

    @property
    def instance_id(self) -> int:
        """Random id of this publisher, carried by every batch (tells a restarted replica apart)."""
        return self._sender.instance_id

    @property
    def next_seq(self) -> int:
        """Sequence number the next published batch will get (= batches published so far, dropped ones included)."""
        return self._next_seq

    @property
    def num_withheld_batches(self) -> int:
        """Batches sent as a withheld placeholder because ZMQ held ``max_send_bytes`` (cumulative)."""
        return self._sender.num_withheld

    @property
    def send_bytes_in_flight(self) -> int:
        """Payload bytes handed to ZMQ that it had not let go of at the last send (at most ``max_send_bytes``
        plus one batch)."""
        return self._sender.in_flight_bytes

    @property
    def replay_buffer_bytes(self) -> int:
        """Payload bytes kept for replay."""
        return self._sender.buffer_bytes

    def flush(self, timeout: float = 5.0) -> int:
        """Wait until every queued batch was sent; returns the last sequence number sent (-1: none)."""
        sender = self._sender
        deadline = time.monotonic() + timeout
        with sender.sent:
            while sender.queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{sender.queue.unfinished_tasks} batch(es) still queued after {timeout}s")
                sender.sent.wait(left)
        if sender.error is not None:
            raise RuntimeError("the publisher thread failed") from sender.error
        return sender.last_seq

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
