"""Publishes KV-cache event batches over ZMQ PUB, with a replay socket for subscribers that missed some.

Wire protocol (vLLM's): every batch is one multipart message ``[topic, seq, payload]`` on the PUB
socket, ``seq`` an 8-byte big-endian sequence number (0, 1, 2, ... per publisher) and ``payload``
a msgpack :class:`~kv_cache_manager_v2.events.schema.KVEventBatch`. The replay socket (ROUTER)
answers a request whose last frame is an 8-byte big-endian start sequence number with every
buffered batch from there on, one ``[seq, payload]`` message each (behind the requester's
envelope), then ``[seq = -1 (signed), b""]`` as the end marker. It keeps the last
``buffer_steps`` batches.

Encoding and sending run on a background thread: ``publish`` only queues the drained events, so
the scheduler never waits on serialisation or the network. If the hand-off queue is full the
batch is dropped and counted (``num_dropped_batches``), like the manager's own queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from .._events import KVCacheEvent, KVCacheEventManager
from .schema import KVEventBatch, MovesAs, encode_batch, to_wire

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Sends KV-cache event batches to subscribers (routers) over ZMQ, with replay.

    ``endpoint`` is bound by the PUB socket (e.g. ``"tcp://*:5557"``), ``replay_endpoint`` (optional)
    by the ROUTER socket that serves missed batches. Engine loop, once per step::

        publisher.publish(manager.get_latest_events())     # or publisher.drain(event_manager)
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
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError(f"endpoint must be a non-empty ZMQ address such as 'tcp://*:5557', got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise ValueError(f"replay_endpoint must be None or a non-empty ZMQ address, got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue_size", max_queue_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if data_parallel_rank is not None and (type(data_parallel_rank) is not int or data_parallel_rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {data_parallel_rank!r}")
        if moves not in ("vllm", "native"):
            raise ValueError(f"moves must be 'vllm' or 'native', got {moves!r}")
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._moves: MovesAs = moves
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        #: the endpoints actually bound (a ``:*`` / ``:0`` port resolved)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(max_queue_size)
        self._next_seq = 0
        self._sent = threading.Condition()
        #: batches dropped because the hand-off queue was full (cumulative)
        self.num_dropped_batches = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay={self.replay_endpoint!r}, next_seq={self._next_seq})"
        )

    # ------------------------------------------------------------------ scheduler side
    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one batch (nothing when ``events`` is empty); never blocks."""
        if self._closed:
            raise RuntimeError("publish() after close()")
        if self._error is not None:
            raise RuntimeError("the publisher thread failed") from self._error
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), list(events)))
        except queue.Full:
            self.num_dropped_batches += 1

    def drain(self, event_manager: KVCacheEventManager) -> None:
        """``publish(event_manager.get_latest_events())``."""
        self.publish(event_manager.get_latest_events())

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch sent will get (= batches sent so far)."""
        return self._next_seq

    def flush(self, timeout: float = 5.0) -> int:
        """Wait until every queued batch was sent; returns the last sequence number sent (-1: none)."""
        deadline = time.monotonic() + timeout
        with self._sent:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self._queue.unfinished_tasks} batch(es) still queued after {timeout}s")
                self._sent.wait(left)
        if self._error is not None:
            raise RuntimeError("the publisher thread failed") from self._error
        return self._next_seq - 1

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread
    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.005)
                except queue.Empty:
                    self._serve_replay()
                    continue
                try:
                    if item is None:
                        return
                    self._send(item[0], item[1])
                finally:
                    with self._sent:
                        self._queue.task_done()
                        self._sent.notify_all()
                self._serve_replay()
        except BaseException as e:  # surfaced by publish()/flush()
            self._error = e
            with self._sent:
                while True:  # unblock flush()
                    try:
                        self._queue.get_nowait()
                        self._queue.task_done()
                    except queue.Empty:
                        break
                self._sent.notify_all()

    def _send(self, ts: float, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(KVEventBatch(ts, to_wire(events, self._moves), self._rank))
        seq = self._next_seq
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request
            start = int.from_bytes(frames[-1], "big")
            envelope = frames[:-1]  # identity, plus the empty delimiter of REQ/DEALER-with-delimiter peers
            for seq, payload in self._buffer:
                if seq >= start:
                    sock.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([*envelope, END_SEQ, b""])
