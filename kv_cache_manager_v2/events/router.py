"""Router side: rebuild which replica holds which prefix from KV-cache events, and route by it.

:class:`ReplicaIndex` applies one replica's event batches to a radix tree of block hashes and answers
``match_length(tokens, scope)`` with the same rule as the replica's ``probe_reuse``: walk full blocks
by hash, pick a partially matching child by longest common token prefix among those holding a page of
every attention layer group, then shorten until every layer group holds the pages the match needs
(full attention: every block; sliding window: sinks and the window; recurrent: a snapshot at the last
block). :class:`KVAwareRouter` subscribes to N replicas over ZMQ (replaying missed batches) and picks
the replica with the longest match. :class:`PrefixRouter` does the same over indexes fed
directly (simulators).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from .._common import DEFAULT_REUSE_SCOPE, ReuseScope, TokenIdExt
from .._events import LayerGroupSpec, block_hash
from .._layers._policy import LayerGroup
from .._life_cycle_registry import announced_layer_group
from .._reuse._keys import BlockHasher, scope_key
from .schema import (
    AllBlocksCleared,
    AnyWireEvent,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_tokens,
    decode_batch,
)

END_SEQ = -1


def prompt_block_hashes(
    tokens: Sequence[TokenIdExt], tokens_per_block: int, reuse_scope: ReuseScope | None = None
) -> list[int]:
    """The 64-bit hashes a replica reports for the blocks of ``tokens`` (the last may be partial)."""
    scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
    return [block_hash(k) for k in BlockHasher(tokens, tokens_per_block, "tokens").chain(scope_key(scope))]


class _Node:
    __slots__ = ("by_first", "children", "groups", "hash", "parent", "tokens")

    def __init__(self, block_hash: int, parent: _Node | None, tokens: tuple[TokenIdExt, ...]) -> None:
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.by_first: dict[TokenIdExt, list[_Node]] = {}
        #: layer group -> medium holding its page
        self.groups: dict[int, str | None] = {}


class ReplicaIndex:
    """What one replica caches, rebuilt from its events.

    ``tokens_per_block`` and the layer groups are learnt from ``BlockStored`` events; pass them
    (e.g. ``event_manager.layer_groups``) to match exactly before every group has stored a block.
    """

    def __init__(
        self,
        tokens_per_block: int | None = None,
        groups: Sequence[LayerGroupSpec] = (),
        enable_partial_reuse: bool = True,
    ) -> None:
        self._given_tokens_per_block = tokens_per_block
        self._given_groups = tuple(groups)
        self.enable_partial_reuse = enable_partial_reuse
        self.tokens_per_block = tokens_per_block
        self.groups: dict[int, LayerGroup] = {}
        self._nodes: dict[int, _Node] = {}
        self._roots: dict[tuple[int | None, int | None], _Node] = {}  # (scope hash, lora id)
        self.reset()
        #: wire events applied so far
        self.num_events = 0

    # ------------------------------------------------------------------ applying events
    def apply_batch(self, batch: KVEventBatch) -> None:
        self.apply(batch.events)

    def apply(self, events: Sequence[AnyWireEvent]) -> None:
        for ev in events:
            self.num_events += 1
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._removed(h, ev.group_idx if ev.group_idx is not None else 0)
            elif isinstance(ev, BlockMoved):
                g = ev.group_idx if ev.group_idx is not None else 0
                for h in ev.block_hashes:
                    node = self._nodes.get(h)
                    if node is not None and g in node.groups:
                        node.groups[g] = ev.medium
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """Forget every block (AllBlocksCleared)."""
        self._nodes.clear()
        self._roots.clear()

    def reset(self) -> None:
        """Forget every block and what was learnt of the replica (block size, layer groups) beyond
        what the constructor was given: a restarted replica may use other ones."""
        self.clear()
        self.tokens_per_block = self._given_tokens_per_block
        self.groups = {}
        for spec in self._given_groups:
            self._learn_group(spec.group_idx, spec.kind, spec.window_size, spec.num_sink_blocks)

    def _learn_group(self, group: int, kind: str, window: int | None, sinks: int) -> None:
        if group not in self.groups:
            self.groups[group] = announced_layer_group(kind, window, sinks, self.tokens_per_block or 1)

    def _stored(self, event: BlockStored) -> None:
        t = event.block_size
        n = len(event.block_hashes)
        if t < 1 or n == 0 or not (n - 1) * t < len(event.token_ids) <= n * t:
            raise ValueError(
                f"malformed BlockStored: {n} block hash(es), {len(event.token_ids)} token(s), block_size {t}"
            )
        if self.tokens_per_block is not None and t != self.tokens_per_block:
            raise ValueError(f"BlockStored with block_size {t}, the replica's is {self.tokens_per_block}")
        if self.tokens_per_block is None:
            self.tokens_per_block = t
            self.groups = {
                group: announced_layer_group(spec.kind, spec.window_size, spec.num_sink_blocks, t)
                for group, spec in self.groups.items()
            }
        group = event.group_idx if event.group_idx is not None else 0
        if group not in self.groups:
            window = event.kv_cache_spec_sliding_window if event.kv_cache_spec_kind == "sliding_window" else None
            kind = event.kv_cache_spec_kind or "full_attention"  # (an unknown kind: malformed)
            self._learn_group(group, kind, window, event.num_sink_blocks or 0)
        if event.parent_block_hash is None:
            key = (event.scope_hash, event.lora_id)
            parent = self._roots.get(key)
            if parent is None:
                parent = self._roots[key] = _Node(-1, None, ())
        else:
            found = self._nodes.get(event.parent_block_hash)
            if found is None:
                return  # its parent is gone (or was never seen): unreachable, as on the replica
            parent = found
        for block, toks in zip(event.block_hashes, block_tokens(event)):
            node = self._nodes.get(block)
            if node is None:
                node = self._nodes[block] = _Node(block, parent, toks)
                parent.children[block] = node
                parent.by_first.setdefault(toks[0], []).append(node)
            node.groups[group] = event.medium
            parent = node

    def _removed(self, block_hash: int, group: int) -> None:
        node = self._nodes.get(block_hash)
        if node is None:
            return
        node.groups.pop(group, None)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Drop nodes with no page and no children, upward (a replica keeps them only as chain links)."""
        n: _Node | None = node
        while n is not None and n.parent is not None and not n.groups and not n.children:
            parent = n.parent
            del parent.children[n.hash]
            lst = parent.by_first[n.tokens[0]]
            lst.remove(n)
            if not lst:
                del parent.by_first[n.tokens[0]]
            del self._nodes[n.hash]
            n.parent = None
            n = parent
        # empty roots stay: cheap, and a replica keeps its roots too

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        """Blocks known (with a page in some group, or linking to such blocks)."""
        return len(self._nodes)

    def has_block(self, block_hash: int, group_idx: int | None = None) -> bool:
        node = self._nodes.get(block_hash)
        if node is None:
            return False
        return bool(node.groups) if group_idx is None else group_idx in node.groups

    def medium_of(self, block_hash: int, group_idx: int = 0) -> str | None:
        node = self._nodes.get(block_hash)
        return node.groups.get(group_idx) if node is not None else None

    def match_length(
        self,
        tokens: Sequence[TokenIdExt],
        reuse_scope: ReuseScope | None = None,
        hashes: Sequence[int] | None = None,
    ) -> int:
        """Tokens of ``tokens`` the replica would reuse (what its ``probe_reuse`` returns).

        ``hashes`` (from :func:`prompt_block_hashes`) saves hashing when several indexes are asked.
        """
        t = self.tokens_per_block
        if t is None or len(tokens) == 0:
            return 0
        scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
        root = self._roots.get((block_hash(scope_key(scope)), scope.lora_id))
        if root is None:
            return 0
        if hashes is None:
            hashes = prompt_block_hashes(tokens, t, scope)
        nodes: list[_Node] = []
        node = root
        n_full = len(tokens) // t
        while len(nodes) < n_full:
            child = node.children.get(hashes[len(nodes)])
            if child is None:
                break
            nodes.append(child)
            node = child
        part: _Node | None = None
        part_len = 0
        # recurrent groups: a match ends at a block with a snapshot of each (never partial)
        state_groups = [g for g, lc in self.groups.items() if lc.keeps_live_state]
        if self.enable_partial_reuse and not state_groups and len(nodes) * t < len(tokens):
            # the child sharing the most tokens among those with a page of every attention group
            # (the partial block is the match's last: each group needs it)
            needed = [g for g, lc in self.groups.items() if not lc.keeps_live_state]
            rest = tokens[len(nodes) * t : (len(nodes) + 1) * t]
            for c in node.by_first.get(rest[0], []):
                n = _common_prefix_len(c.tokens, rest)
                if n > part_len and all(g in c.groups for g in needed):
                    part, part_len = c, n
        while True:
            if state_groups:
                n = len(nodes)
                while n > 0 and any(g not in nodes[n - 1].groups for g in state_groups):
                    n -= 1
                del nodes[n:]
            length = len(nodes) * t + part_len
            missing = self._first_missing_block(nodes, part, length)
            if missing < 0:
                return length
            del nodes[missing:]
            part, part_len = None, 0

    def _first_missing_block(self, nodes: list[_Node], part: _Node | None, length: int) -> int:
        t = self.tokens_per_block
        assert t is not None
        nb = (length + t - 1) // t
        first = -1
        for g, lc in self.groups.items():
            beg, end = lc.stale_range(length)
            for o in range(nb):
                if beg <= o < end:
                    continue
                node = nodes[o] if o < len(nodes) else part
                if node is None or g not in node.groups:
                    if first < 0 or o < first:
                        first = o
                    break
        return first


def _common_prefix_len(a: Sequence[TokenIdExt], b: Sequence[TokenIdExt]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica, the tokens it would reuse, and every replica's match length."""

    replica: int
    matched_tokens: int
    scores: tuple[int, ...]


class PrefixRouter:
    """Routes to the replica whose index matches the longest prefix (ties: random, seeded)."""

    def __init__(self, indexes: Sequence[ReplicaIndex], seed: int | None = 0) -> None:
        if len(indexes) == 0:
            raise ValueError("indexes must name at least one replica")
        self.indexes = list(indexes)
        self._rng = random.Random(seed)

    def scores(self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None = None) -> list[int]:
        """Match length on every replica."""
        cache: dict[int, list[int]] = {}
        out = []
        for idx in self.indexes:
            t = idx.tokens_per_block
            if t is None:
                out.append(0)
                continue
            if t not in cache:
                cache[t] = prompt_block_hashes(tokens, t, reuse_scope)
            out.append(idx.match_length(tokens, reuse_scope, cache[t]))
        return out

    def route(self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None = None) -> RouteDecision:
        s = self.scores(tokens, reuse_scope)
        best = max(s)
        replica = self._rng.choice([i for i, x in enumerate(s) if x == best])
        return RouteDecision(replica, best, tuple(s))


@dataclass(frozen=True)
class ReplicaEndpoints:
    """Where one replica publishes (``endpoint``) and replays (``replay_endpoint``) its events."""

    endpoint: str
    replay_endpoint: str | None = None


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
        self.open_replay()
        #: last sequence number applied (-1: none)
        self.last_seq = -1
        #: the publisher instance the index reflects (None: not known yet, or a publisher without ids)
        self.instance: int | None = None
        self.retired: set[int] = set()
        #: when the next replay may be tried (monotonic seconds), and the wait after the next failure
        self.replay_retry_at = 0.0
        self.backoff = 0.0
        self.num_replayed = 0
        #: batches that could not be replayed: the index may miss their events until a resync
        self.num_lost = 0
        #: frames or batches that could not be decoded or applied (skipped)
        self.num_malformed = 0
        #: times the replica's publisher was seen restarted (its index was cleared)
        self.num_restarts = 0
        #: replay attempts that failed (endpoint unreachable or silent): each started a back-off
        self.num_replay_failures = 0
        #: whether the index may be stale (a batch was lost since the last AllBlocksCleared)
        self.stale = False

    def open_replay(self) -> None:
        """A fresh DEALER socket (after a failed replay: no stale answer can reach the new one)."""
        if self.replay is not None:
            self.replay.close(linger=0)
            self.replay = None
        if self.endpoints.replay_endpoint is None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue requests only on a completed connection
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.connect(self.endpoints.replay_endpoint)
        self.replay = sock

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class KVAwareRouter(PrefixRouter):
    """Subscribes to N replicas' event streams and routes each prompt to the best one.

    Call :meth:`poll` regularly (it applies what arrived; on a sequence gap it fetches the missed
    batches from the replica's replay socket first); :meth:`route` answers from the indexes.

    Guarantees: ``poll`` never blocks longer than its ``timeout`` plus one ``replay_timeout`` per
    replica whose replay endpoint stopped answering; after such a failure that replica's replays
    are skipped for ``replay_backoff`` seconds, doubling up to ``max_replay_backoff`` while it keeps
    failing. Malformed frames and batches are counted (``num_malformed``) and skipped. A batch from
    a new publisher instance (a restarted replica) clears that replica's index and replays the new
    stream from 0. A batch that could not be replayed is counted (``num_lost``) and marks the index
    ``stale`` until the replica sends a resynchronisation (a batch starting with AllBlocksCleared).
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaEndpoints],
        topic: str = "",
        groups: Sequence[Sequence[LayerGroupSpec]] | None = None,
        tokens_per_block: int | None = None,
        enable_partial_reuse: bool = True,
        replay_timeout: float = 2.0,
        seed: int | None = 0,
        replay_backoff: float = 1.0,
        max_replay_backoff: float = 30.0,
    ) -> None:
        if len(replicas) == 0:
            raise ValueError("replicas must name at least one replica")
        if groups is not None and len(groups) != len(replicas):
            raise ValueError(f"groups must give one list per replica ({len(replicas)}), got {len(groups)}")
        for name, value in (
            ("replay_timeout", replay_timeout),
            ("replay_backoff", replay_backoff),
            ("max_replay_backoff", max_replay_backoff),
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
            seed,
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replay_timeout = float(replay_timeout)
        self._replay_backoff = float(replay_backoff)
        self._max_replay_backoff = float(max_replay_backoff)
        self.subscriptions = [_Subscription(self._ctx, ep, topic.encode()) for ep in replicas]
        self._poller = zmq.Poller()
        for s in self.subscriptions:
            self._poller.register(s.sub, zmq.POLLIN)

    def close(self) -> None:
        for s in self.subscriptions:
            s.close()
        self._ctx.term()

    def __enter__(self) -> KVAwareRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def last_seq(self, replica: int) -> int:
        return self.subscriptions[replica].last_seq

    def poll(self, timeout: float = 0.0) -> int:
        """Apply the batches that arrived (waiting up to ``timeout`` seconds for the first); returns
        how many batches were applied, replayed ones included. Under a flood it stops after
        ``max(timeout, 0.01)`` seconds of work (plus replay waits); the rest waits for the next call."""
        applied = 0
        ready = dict(self._poller.poll(int(timeout * 1000)))
        budget_end = time.monotonic() + max(timeout, 0.01)
        while ready:
            for i, s in enumerate(self.subscriptions):
                if s.sub in ready:
                    while s.sub.poll(0):
                        applied += self._on_message(i, s.sub.recv_multipart())
                        if time.monotonic() > budget_end:
                            return applied
            ready = dict(self._poller.poll(0))
        return applied

    def catch_up(self, replica: int) -> int:
        """Ask the replica's replay socket for every batch after the last one applied (e.g. when
        the stream went quiet after a loss); returns how many were applied (0 while its replays
        are backed off)."""
        return self._replay(replica, self.subscriptions[replica].last_seq + 1, None)

    # ------------------------------------------------------------------ stream handling
    def _decode(self, s: _Subscription, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            s.num_malformed += 1
            return None

    def _apply(self, i: int, batch: KVEventBatch) -> None:
        s = self.subscriptions[i]
        try:
            self.indexes[i].apply_batch(batch)
        except (ValueError, TypeError, IndexError, KeyError):  # well-formed msgpack, impossible content
            s.num_malformed += 1
            s.stale = True
            return
        if batch.events and isinstance(batch.events[0], AllBlocksCleared):
            s.stale = False  # a resynchronisation (or a clear): the index is rebuilt from here

    def _same_instance(self, i: int, batch: KVEventBatch) -> bool:
        """Track the publisher instance; a new one (restarted replica) resets the replica's index.
        False for a late batch of an instance already replaced."""
        s = self.subscriptions[i]
        inst = batch.instance_id
        if inst is None or inst == s.instance:
            return True
        if inst in s.retired:
            return False
        if s.instance is not None:
            s.retired.add(s.instance)
            s.num_restarts += 1
            self.indexes[i].reset()
            s.last_seq = -1
            s.stale = False
        s.instance = inst
        return True

    def _on_message(self, i: int, frames: list[bytes]) -> int:
        s = self.subscriptions[i]
        if len(frames) != 3 or len(frames[1]) != 8:
            s.num_malformed += 1
            return 0
        batch = self._decode(s, frames[2])
        if batch is None or not self._same_instance(i, batch):
            return 0
        seq = int.from_bytes(frames[1], "big")
        if seq <= s.last_seq:
            return 0  # already applied (replayed before it arrived live)
        applied = 0
        if seq > s.last_seq + 1 or batch.withheld:
            # a withheld batch: ask for everything buffered (the placeholders after it are then covered too)
            applied += self._replay(i, s.last_seq + 1, None if batch.withheld else seq)
            if seq <= s.last_seq:
                return applied  # the withheld batch came with the replay
        if seq > s.last_seq + 1:  # replay could not fill the gap: the view may be stale
            s.num_lost += seq - s.last_seq - 1
            s.stale = True
        if batch.withheld:
            s.num_lost += 1
            s.stale = True
        else:
            self._apply(i, batch)
        s.last_seq = seq
        return applied + (not batch.withheld)

    def _replay(self, i: int, start: int, stop: int | None) -> int:
        """Apply replayed batches ``start <= seq < stop`` (``stop`` None: all buffered). Waits at most
        ``replay_timeout``; a failure backs this replica's replays off."""
        s = self.subscriptions[i]
        sock = s.replay
        now = time.monotonic()
        if sock is None or now < s.replay_retry_at:
            return 0
        deadline = now + self._replay_timeout
        applied = 0
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
                    if seq == END_SEQ:
                        s.backoff = 0.0
                        return applied
                    batch = self._decode(s, frames[-1])
                    if batch is None or batch.withheld or not self._same_instance(i, batch):
                        continue
                    if seq > s.last_seq and (stop is None or seq < stop):
                        if seq > s.last_seq + 1:  # no longer buffered: go on from the oldest batch it has
                            s.num_lost += seq - s.last_seq - 1
                            s.stale = True
                        self._apply(i, batch)
                        s.last_seq = seq
                        s.num_replayed += 1
                        applied += 1
        # no connection, or no end marker in time: back off, and forget the request
        s.num_replay_failures += 1
        s.backoff = min(self._max_replay_backoff, s.backoff * 2 if s.backoff else self._replay_backoff)
        s.replay_retry_at = time.monotonic() + s.backoff
        s.open_replay()
        return applied


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
