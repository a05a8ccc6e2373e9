"""Router side: subscribe to N replicas' KV-cache event streams and route each prompt by them.

:class:`KVAwareRouter` subscribes to N replicas over ZMQ (replaying missed batches), keeps one
:class:`~kv_cache_manager_v2.events.index.ReplicaIndex` per replica and the load each replica
publishes with its batches, and picks a replica by a routing policy (cache weighted by tier, load,
an affinity window: ``kv_cache_manager_v2._routing``). :class:`PrefixRouter` does the same over
indexes fed directly (simulators), with loads given by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from .._common import ReuseScope, TokenIdExt
from .._events import LayerGroupSpec
from .._routing import DEFAULT_POLICY, ROUTING_POLICIES, ReplicaLoad, RoutePicker, RouteWeights
from ._stream import SEQ_LIMIT, ReplicaEndpoints, _Subscription
from .index import ReplicaIndex, prompt_block_hashes
from .schema import RawEventBatch, decode_raw_batch

__all__ = [
    "ROUTING_POLICIES",
    "KVAwareRouter",
    "PrefixRouter",
    "ReplicaEndpoints",
    "ReplicaIndex",
    "ReplicaLoad",
    "RouteDecision",
    "RouteWeights",
    "prompt_block_hashes",
]

END_SEQ = -1
#: what :meth:`KVAwareRouter._replay` returns for a publisher that does not tell its newest sequence number
UNKNOWN_SEQ = SEQ_LIMIT
#: the least time one ``poll()`` spends applying once something arrived, however small its timeout
MIN_WORK_S = 0.01


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica, the tokens it would reuse, every replica's match length, and the loads
    the decision used (None: unknown or stale)."""

    replica: int
    matched_tokens: int
    scores: tuple[int, ...]
    loads: tuple[ReplicaLoad | None, ...] = ()


class PrefixRouter:
    """Routes over indexes fed directly (simulators, tests) by a routing policy (``policy``, one
    of ``ROUTING_POLICIES``; default ``prefix+load``, ``weights``: see :class:`RouteWeights`).

    Loads are given by the caller: :meth:`set_load` (kept ``weights.load_stale_s`` seconds), or
    ``route(..., loads=...)`` for one decision. A replica without a fresh load is weighed by its
    cache alone."""

    def __init__(
        self, indexes: Sequence[ReplicaIndex], policy: str = DEFAULT_POLICY, weights: RouteWeights | None = None
    ) -> None:
        if len(indexes) == 0:
            raise ValueError("indexes must name at least one replica")
        self.indexes = list(indexes)
        self.picker = RoutePicker(policy, weights)
        #: per replica: its last load and when it came (monotonic seconds)
        self._loads: list[tuple[ReplicaLoad, float] | None] = [None] * len(self.indexes)

    @property
    def weights(self) -> RouteWeights:
        return self.picker.weights

    def set_load(self, replica: int, load: ReplicaLoad | None) -> None:
        """Record ``replica``'s load now (None: forget it)."""
        if not 0 <= replica < len(self.indexes):
            raise ValueError(f"replica must be in [0, {len(self.indexes)}), got {replica}")
        if load is not None and not isinstance(load, ReplicaLoad):
            raise TypeError(f"load must be a ReplicaLoad or None, got {type(load).__name__}")
        self._loads[replica] = None if load is None else (load, time.monotonic())

    def load(self, replica: int) -> ReplicaLoad | None:
        """``replica``'s load if it is fresh (younger than ``weights.load_stale_s``), else None."""
        entry = self._loads[replica]
        if entry is None or time.monotonic() - entry[1] >= self.weights.load_stale_s:
            return None
        return entry[0]

    def scores(self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None = None) -> list[int]:
        """Match length on every replica."""
        return [sum(m.values()) for m in self._media(tokens, reuse_scope)]

    def _media(self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None) -> list[dict[str | None, int]]:
        """Every replica's match, in tokens by medium (empty for an unusable replica)."""
        cache: dict[int, list[int]] = {}
        out: list[dict[str | None, int]] = []
        for i, idx in enumerate(self.indexes):
            t = idx.tokens_per_block
            if t is None or not self._usable(i):
                out.append({})
                continue
            if t not in cache:
                cache[t] = prompt_block_hashes(tokens, t, reuse_scope)
            out.append(idx.match_media(tokens, reuse_scope, cache[t]))
        return out

    def _usable(self, replica: int) -> bool:
        """Whether the replica may be routed to (its index asked; scores 0 otherwise)."""
        return True

    def route(
        self,
        tokens: Sequence[TokenIdExt],
        reuse_scope: ReuseScope | None = None,
        loads: Sequence[ReplicaLoad | None] | None = None,
    ) -> RouteDecision:
        """Pick a replica for ``tokens`` by the policy; ``loads`` (one per replica, None: unknown)
        replaces the recorded ones for this decision."""
        if loads is not None and len(loads) != len(self.indexes):
            raise ValueError(f"loads must give one load (or None) per replica ({len(self.indexes)}), got {len(loads)}")
        media = self._media(tokens, reuse_scope)
        w = self.weights
        known = list(loads) if loads is not None else [self.load(i) for i in range(len(self.indexes))]
        usable = [self._usable(i) for i in range(len(self.indexes))]
        replica = self.picker.pick([w.value(m) for m in media], known, usable)
        s = tuple(sum(m.values()) for m in media)
        return RouteDecision(replica, s[replica], s, tuple(known))


class KVAwareRouter(PrefixRouter):
    """Subscribes to N replicas' event streams and routes each prompt to the best one.

    Call :meth:`poll` regularly (it applies what arrived; on a sequence gap it fetches the missed
    batches from the replica's replay socket first); :meth:`route` answers from the indexes.

    Guarantees: ``poll(timeout)`` returns within ``max(timeout, wait + 0.01)`` seconds (``wait``:
    until the first message), plus one event, plus one ``replay_timeout`` per replica whose replay
    endpoint stopped answering; a batch too large for that is applied in slices by the next polls,
    in order, before anything that arrived after it (a router then answers from the index as of an
    event inside that batch: every event before it applied, none after). After a replay failure
    that replica's replays are skipped for ``replay_backoff`` seconds, doubling up to
    ``max_replay_backoff`` while it keeps failing. Malformed frames and batches are counted
    (``num_malformed``) and skipped; so is a sequence number no publisher can send (at or above
    2**63, or ahead of everything its replay socket holds); an event with impossible values is
    refused alone (``num_refused``). A batch from a new publisher instance (a restarted replica)
    clears that replica's index and replays the new stream from 0. A batch that could not be
    replayed is counted (``num_lost``) and marks the index ``stale`` until the replica sends a
    resynchronisation (a batch starting with AllBlocksCleared). A replica silent for
    ``probe_interval`` seconds is probed through its replay socket: the answer names its publisher
    instance (a restarted idle replica is noticed), no answer marks it ``expired`` (it scores 0
    until it is heard again). A replica whose replay socket connects again (a monitor on it tells)
    is probed at once, whatever ``probe_interval``: a replica restarted on the same endpoints is
    noticed, and the batches it published before the subscription reconnected are replayed.
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaEndpoints],
        topic: str = "",
        groups: Sequence[Sequence[LayerGroupSpec]] | None = None,
        tokens_per_block: int | None = None,
        enable_partial_reuse: bool = True,
        replay_timeout: float = 2.0,
        policy: str = DEFAULT_POLICY,
        weights: RouteWeights | None = None,
        replay_backoff: float = 1.0,
        max_replay_backoff: float = 30.0,
        probe_interval: float | None = 5.0,
    ) -> None:
        if len(replicas) == 0:
            raise ValueError("replicas must name at least one replica")
        if groups is not None and len(groups) != len(replicas):
            raise ValueError(f"groups must give one list per replica ({len(replicas)}), got {len(groups)}")
        for name, value in (
            ("replay_timeout", replay_timeout),
            ("replay_backoff", replay_backoff),
            ("max_replay_backoff", max_replay_backoff),
            ("probe_interval", 1.0 if probe_interval is None else probe_interval),
        ):
            if type(value) not in (int, float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if max_replay_backoff < replay_backoff:
            raise ValueError(f"max_replay_backoff ({max_replay_backoff}) must be >= replay_backoff ({replay_backoff})")
        super().__init__(
            [
                ReplicaIndex(tokens_per_block, groups[i] if groups is not None else (), enable_partial_reuse)
                for i in range(len(replicas))
            ],
            policy,
            weights,
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replay_timeout = float(replay_timeout)
        self._replay_backoff = float(replay_backoff)
        self._max_replay_backoff = float(max_replay_backoff)
        self._probe_interval = None if probe_interval is None else float(probe_interval)
        self.subscriptions = [_Subscription(self._ctx, ep, topic.encode()) for ep in replicas]
        self._poller = zmq.Poller()
        for s in self.subscriptions:
            self._poller.register(s.sub, zmq.POLLIN)
        #: per replica: the sequence number of the batch whose load is kept (-1: none)
        self._load_seq = [-1] * len(replicas)
        self._first = 0  # the replica each poll serves first (rotates: a flood cannot starve the others)

    def close(self) -> None:
        for s in self.subscriptions:
            s.close()
        self._ctx.term()

    def __enter__(self) -> KVAwareRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def last_seq(self, replica: int) -> int:
        """Sequence number up to which every batch of ``replica`` is applied (-1: none yet)."""
        s = self.subscriptions[replica]
        return s.pending[0].seq - 1 if s.pending else s.last_seq

    def _usable(self, replica: int) -> bool:
        return not self.subscriptions[replica].expired

    def poll(self, timeout: float = 0.0) -> int:
        """Apply the batches that arrived (waiting up to ``timeout`` seconds for the first); returns
        how many batches were completed, replayed ones included. Work left when the bound is reached
        (see the class) waits for the next call."""
        start = time.monotonic()
        busy = any(s.pending for s in self.subscriptions)
        self._poller.poll(0 if busy else int(timeout * 1000))
        deadline = max(start + timeout, time.monotonic() + MIN_WORK_S)
        applied = 0
        n = len(self.subscriptions)
        first = self._first
        self._first = (first + 1) % n
        for k in range(n):
            i = (first + k) % n
            s = self.subscriptions[i]
            applied += s.apply_pending(self.indexes[i], deadline)
            while not s.pending and time.monotonic() < deadline and s.sub.poll(0):
                self._on_message(i, s.sub.recv_multipart())
                applied += s.apply_pending(self.indexes[i], deadline)
            if time.monotonic() >= deadline:
                break
        self._probe_silent()
        return applied

    def catch_up(self, replica: int) -> int:
        """Ask the replica's replay socket for every batch after the last one received (e.g. when
        the stream went quiet after a loss); returns how many batches were completed (nothing while
        its replays are backed off; the rest of a large one is applied by the next polls)."""
        s = self.subscriptions[replica]
        self._replay(replica, s.last_seq + 1, None)
        return s.apply_pending(self.indexes[replica], time.monotonic() + MIN_WORK_S)

    # ------------------------------------------------------------------ stream handling
    def _decode(self, s: _Subscription, payload: bytes) -> RawEventBatch | None:
        try:
            return decode_raw_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            s.num_malformed += 1
            return None

    def _same_instance(self, i: int, instance: int | None) -> bool:
        """Track the publisher instance; a new one (restarted replica) resets the replica's index.
        False for a late batch of an instance already replaced."""
        s = self.subscriptions[i]
        if instance is None or instance == s.instance:
            return True
        if instance in s.retired:
            return False
        if s.instance is not None:
            s.retired.add(s.instance)
            s.num_restarts += 1
            self.indexes[i].reset()
            self._loads[i] = None  # (a new instance's sequence numbers start again)
            self._load_seq[i] = -1
            s.pending.clear()
            s.last_seq = -1
            s.stale = False
        s.instance = instance
        return True

    def _on_message(self, i: int, frames: list[bytes]) -> None:
        s = self.subscriptions[i]
        seq = int.from_bytes(frames[1], "big") if len(frames) == 3 and len(frames[1]) == 8 else SEQ_LIMIT
        if seq >= SEQ_LIMIT:
            s.num_malformed += 1
            return
        batch = self._decode(s, frames[2])
        if batch is None or not self._same_instance(i, batch.instance_id):
            return
        s.heard()
        self._take_load(i, seq, batch)
        if seq <= s.last_seq:
            return  # already received (replayed before it arrived live)
        if seq > s.last_seq + 1 or batch.withheld:
            # a withheld batch: ask for everything buffered (the placeholders after it are then covered too)
            newest = self._replay(i, s.last_seq + 1, None if batch.withheld else seq)
            if seq <= s.last_seq:
                return  # the withheld batch came with the replay
            if newest is not None and seq > newest:
                s.num_malformed += 1  # ahead of everything the publisher sent: not its batch
                return
        s.receive(seq, batch.events, seq - s.last_seq - 1, batch.withheld)

    def _take_load(self, i: int, seq: int, batch: RawEventBatch) -> None:
        """Keep the load a batch carries when it is the newest batch that carried one (live or
        replayed: the replica's latest known state)."""
        ld = batch.load
        if ld is None or seq <= self._load_seq[i]:
            return
        try:
            load = ReplicaLoad(ld.queued_prefill_tokens, ld.running_requests, ld.kv_utilization)
        except (TypeError, ValueError):
            self.subscriptions[i].num_malformed += 1
            return
        self._loads[i] = (load, time.monotonic())
        self._load_seq[i] = seq

    def _replay(self, i: int, start: int, stop: int | None) -> int | None:
        """Queue replayed batches ``start <= seq < stop`` (``stop`` None: all buffered). Returns the
        newest sequence number the publisher says it sent (``UNKNOWN_SEQ`` when it does not say), None
        without a full answer. Waits at most ``replay_timeout``; a failure backs this replica's
        replays off."""
        s = self.subscriptions[i]
        sock = s.replay
        now = time.monotonic()
        if sock is None or now < s.replay_retry_at:
            return None
        deadline = now + self._replay_timeout
        if sock.poll(_ms_until(deadline), zmq.POLLOUT):
            try:
                request = [b"", start.to_bytes(8, "big")]
                if stop is not None and s.instance is not None:  # our publisher: ask for the range only
                    request.append(stop.to_bytes(8, "big"))
                sock.send_multipart(request, zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                while sock.poll(_ms_until(deadline)):
                    frames = sock.recv_multipart()
                    if len(frames) < 2 or len(frames[-2]) != 8:
                        s.num_malformed += 1
                        continue
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if seq == END_SEQ:  # its payload: our publisher's instance id and newest seq (others: empty)
                        s.backoff = 0.0
                        s.heard()
                        end = frames[-1]
                        if len(end) != 16:
                            return UNKNOWN_SEQ
                        self._same_instance(i, int.from_bytes(end[:8], "big"))
                        return int.from_bytes(end[8:], "big", signed=True)
                    batch = self._decode(s, frames[-1])
                    if batch is None or batch.withheld or not self._same_instance(i, batch.instance_id):
                        continue
                    self._take_load(i, seq, batch)
                    if seq > s.last_seq and (stop is None or seq < stop):
                        s.receive(seq, batch.events, seq - s.last_seq - 1, False)  # a gap: no longer buffered
                        s.num_replayed += 1
        # no connection, or no end marker in time: back off, and forget the request
        s.num_replay_failures += 1
        s.backoff = min(self._max_replay_backoff, s.backoff * 2 if s.backoff else self._replay_backoff)
        s.replay_retry_at = time.monotonic() + s.backoff
        s.open_replay()
        return None

    def _probe_silent(self) -> None:
        """Probe each replica silent for ``probe_interval``, or whose replay socket just connected
        again (a restarted replica, one back after an outage), through its replay socket (see the
        class); a silent one that does not answer expires."""
        now = time.monotonic()
        for i, s in enumerate(self.subscriptions):
            reconnected = s.reconnected()
            if s.replay is None or now < s.replay_retry_at:
                continue
            silent = self._probe_interval is not None and not s.pending and now - s.last_heard >= self._probe_interval
            if not (silent or reconnected):
                continue
            s.probe_wanted = False
            if not self._probe(i) and silent:
                s.num_expired += not s.expired
                s.expired = True

    def _probe(self, i: int) -> bool:
        """Ask replica ``i``'s replay socket for what follows its last batch; our publisher is first
        asked for an empty range (its end marker names its instance and newest batch), so a
        restarted one is noticed before any of its batches is taken for the old stream's. A new
        publisher's stream is then replayed from 0. False when the replica does not answer."""
        s = self.subscriptions[i]
        restarts = s.num_restarts
        start = s.last_seq + 1
        newest = self._replay(i, start, start if s.instance is not None else None)
        if newest is None:
            return False
        if s.num_restarts != restarts:  # a new publisher: its stream from the start
            self._replay(i, 0, None)
        elif s.instance is not None and s.last_seq < newest < UNKNOWN_SEQ:  # batches the SUB socket missed
            self._replay(i, s.last_seq + 1, None)
        return True


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
