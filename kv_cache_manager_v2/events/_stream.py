"""One replica's event stream on the router side: its sockets, sequence state, counters, and the
batches received but not yet applied (a large batch is applied in slices, over several polls).
A monitor on the replay socket tells when it connects again (a restarted replica, one back after
an outage): the router then probes the replica at once."""

from __future__ import annotations

import struct
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from .index import ReplicaIndex
from .schema import AllBlocksCleared, decode_event

#: sequence numbers from here on are impossible (as signed 8-byte ints they are negative: -1 is the
#: replay end marker; a publisher counting from 0 never gets there)
SEQ_LIMIT = 1 << 63
#: a monitor message's event id (16 bits, native order) for a completed connection
_HANDSHAKE_SUCCEEDED = struct.pack("=H", zmq.EVENT_HANDSHAKE_SUCCEEDED)


@dataclass(frozen=True)
class ReplicaEndpoints:
    """Where one replica publishes (``endpoint``) and replays (``replay_endpoint``) its events."""

    endpoint: str
    replay_endpoint: str | None = None


class _Pending:
    """A batch received in order and not yet fully applied."""

    __slots__ = ("counted", "events", "lost_before", "next", "resync", "seq")

    def __init__(self, seq: int, events: list[msgspec.Raw], lost_before: bool, counted: bool) -> None:
        self.seq = seq
        #: still encoded: each is decoded when it is applied
        self.events = events
        #: batches were lost just before this one (or it is a withheld batch that could not be replayed)
        self.lost_before = lost_before
        #: counted as an applied batch once done (a withheld placeholder is not)
        self.counted = counted
        #: events applied so far
        self.next = 0
        #: it starts with AllBlocksCleared (a resynchronisation)
        self.resync = False


class _Subscription:
    """One replica's sockets and stream state (sequence, publisher instance, replay back-off, counters)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], ep: ReplicaEndpoints, topic: bytes) -> None:
        self.ctx = ctx
        self.endpoints = ep
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(ep.endpoint)
        self.replay: zmq.Socket[bytes] | None = None
        #: the replay socket's monitor (its completed connections)
        self.monitor: zmq.Socket[bytes] | None = None
        #: connections the replay sockets completed so far
        self.connections = 0
        #: the replay socket connected again (or after a failure): probe the replica at once
        self.probe_wanted = False
        #: last sequence number received in order (-1: none); batches up to it are applied or pending
        self.last_seq = -1
        #: batches received, applied in order by :meth:`apply_pending` (the first may be partly applied)
        self.pending: deque[_Pending] = deque()
        #: the publisher instance the index reflects (None: not known yet, or a publisher without ids)
        self.instance: int | None = None
        self.retired: set[int] = set()
        #: when the next replay may be tried (monotonic seconds), and the wait after the next failure
        self.replay_retry_at = 0.0
        self.backoff = 0.0
        #: when the publisher was last heard from (a batch, or an answer of its replay socket)
        self.last_heard = time.monotonic()
        self.num_replayed = 0
        #: batches that could not be replayed: the index may miss their events until a resync
        self.num_lost = 0
        #: frames or batches that could not be decoded or were impossible (skipped)
        self.num_malformed = 0
        #: events refused for impossible values (each skipped alone; the rest of its batch applies)
        self.num_refused = 0
        #: times the replica's publisher was seen restarted (its index was cleared)
        self.num_restarts = 0
        #: replay attempts that failed (endpoint unreachable or silent): each started a back-off
        self.num_replay_failures = 0
        #: times the replica was found gone (silent, and its replay socket did not answer a probe)
        self.num_expired = 0
        #: the publisher is gone: the index is not used for routing until the replica is heard again
        self.expired = False
        #: whether the index may be stale (a batch was lost since the last AllBlocksCleared)
        self.stale = False
        self.open_replay()

    def open_replay(self) -> None:
        """A fresh DEALER socket (after a failed replay: no stale answer can reach the new one),
        monitored from before it connects."""
        self._close_replay()
        if self.endpoints.replay_endpoint is None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue requests only on a completed connection
        sock.setsockopt(zmq.SNDHWM, 1)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints.replay_endpoint)
        self.replay = sock

    def _close_replay(self) -> None:
        if self.replay is not None:
            self.replay.disable_monitor()
            self.replay.close(linger=0)
            self.replay = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

    def reconnected(self) -> bool:
        """Read the replay socket's connection events; whether the replica should be probed: its
        replay socket connected again since the first connection (or since a failed replay)."""
        mon = self.monitor
        while mon is not None and mon.poll(0):
            frames = mon.recv_multipart()
            if len(frames) == 2 and frames[0][:2] == _HANDSHAKE_SUCCEEDED:
                self.connections += 1
                self.probe_wanted = self.probe_wanted or self.connections > 1 or self.num_replay_failures > 0
        return self.probe_wanted

    def heard(self) -> None:
        """The publisher answered: it is alive."""
        self.last_heard = time.monotonic()
        self.expired = False

    def receive(self, seq: int, events: list[msgspec.Raw], lost: int, withheld: bool) -> None:
        """Queue the batch ``seq`` (the next in order; ``lost`` batches before it could not be had)."""
        self.num_lost += lost + withheld
        self.pending.append(_Pending(seq, [] if withheld else events, lost > 0 or withheld, not withheld))
        self.last_seq = seq

    def apply_pending(self, index: ReplicaIndex, deadline: float) -> int:
        """Apply queued events in order until ``deadline`` (monotonic seconds; at least one event);
        returns how many batches were completed. An impossible event is refused and counted alone."""
        done = 0
        while self.pending:
            p = self.pending[0]
            if p.next == 0 and p.lost_before:
                self.stale = True
            events = p.events
            while p.next < len(events):
                raw = events[p.next]
                p.next += 1
                try:
                    ev = decode_event(raw)
                    index.apply_event(ev)
                except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError):  # not an event, impossible
                    self.num_refused += 1
                else:
                    p.resync = p.resync or (p.next == 1 and isinstance(ev, AllBlocksCleared))
                if p.next < len(events) and time.monotonic() >= deadline:
                    return done
            if p.resync:
                self.stale = False  # a resynchronisation (or a clear): the index is rebuilt from here
            self.pending.popleft()
            done += p.counted
            if time.monotonic() >= deadline:
                break
        return done

    def close(self) -> None:
        self.sub.close(linger=0)
        self._close_replay()
