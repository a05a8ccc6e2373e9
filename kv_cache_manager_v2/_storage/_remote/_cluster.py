"""A Redis Cluster seen from the remote tier: hash slots, the slot map, and one pipelined round over
the masters concerned (``ClusterRouter``)."""

from __future__ import annotations

import binascii
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from ..._config import RemoteCacheTierConfig, cluster_seed_nodes, redact_url
from ._protocol import (
    CLUSTER_SLOTS,
    BadReply,
    ErrorReply,
    ReplyReader,
    connection,
    exchange,
    parse_redirect,
    resp_command,
    send,
    slot_ranges,
    url_password,
)
from ._value import forget_frames

LOG = logging.getLogger("kv_cache_manager_v2")


def key_slot(key: bytes) -> int:
    """The cluster hash slot of ``key``: CRC-16/XMODEM of the key, or of the text between its first
    ``{`` and the next ``}`` when that is not empty, mod 16384."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % CLUSTER_SLOTS


def group_by_slot(keys: list[bytes]) -> dict[int, list[int]]:
    """Indices of ``keys`` per hash slot (in order)."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        slot = key_slot(k)
        group = out.get(slot)
        if group is None:
            out[slot] = [i]
        else:
            group.append(i)
    return out


#: the reply of a command that was not answered: its node is down or failed during the round trip
NODE_DOWN: Final = ConnectionError("cluster node down")
#: nodes kept beyond the seeds and the slots' masters (targets of redirects until the map is read
#: again); past that, the others are forgotten, so a node redirecting to ever-new addresses costs
#: a bounded list
MAX_OTHER_NODES: Final = 64


class ClusterNode:
    """One master of a cluster: its client (connection pool) and down-state."""

    __slots__ = ("addr", "client", "connected", "down_until")

    def __init__(self, addr: tuple[str, int], client: Any) -> None:
        self.addr = addr
        self.client = client
        #: the node counts as down until this time.monotonic() value
        self.down_until = 0.0
        self.connected = True


class ClusterRouter:
    """The slot map of a cluster and one pipelined round over its masters (see the module doc).

    Used from the scheduler's thread and the writer thread: the slot map is replaced, never
    mutated in place, except single entries set from a ``MOVED`` reply (a list store is atomic).
    The slot map and the rounds hold ``ClusterNode`` objects, so forgetting a node (``_prune``:
    after each read of the map, those neither a seed nor a slot's master; and whenever redirects
    made more than ``MAX_OTHER_NODES`` others) never invalidates a round in progress.
    """

    def __init__(
        self,
        cfg: RemoteCacheTierConfig,
        make_client: Callable[[str, int], Any],
        errors: tuple[type[BaseException], ...],
        max_bulk: int,
    ) -> None:
        self.cfg = cfg
        #: the longest bulk string a valid reply holds (``reply_bound``)
        self._max_bulk = max_bulk
        self.seeds = cluster_seed_nodes(cfg.url)
        self._url = redact_url(cfg.url)
        self._secret = url_password(cfg.url) or ""
        self._make_client = make_client
        self._errors: tuple[type[BaseException], ...] = errors
        #: each node's replies of one round are read within this (from when they are first waited for)
        self._timeout_s = cfg.timeout_ms / 1000.0
        self._retry_s = cfg.retry_interval_ms / 1000.0
        self._lock = threading.Lock()
        #: the nodes known, by address: the seeds asked, the slots' masters, redirect targets
        self.nodes: dict[tuple[str, int], ClusterNode] = {}
        #: nodes kept by the last ``_prune`` (the list may grow to this plus ``MAX_OTHER_NODES``)
        self._kept = 0
        #: the node serving each slot (None: unknown)
        self.slot_node: list[ClusterNode | None] = [None] * CLUSTER_SLOTS
        #: failed node round trips, of the scheduler's thread and of the writer thread
        self.read_errors = 0
        self.write_errors = 0
        self.refreshes = 0
        #: pipelined exchanges with one node (a round over three nodes counts three)
        self.node_round_trips = 0
        #: replies redirecting a command: ``MOVED`` (the slot map is read again), ``ASK`` (a slot being migrated)
        self.moved_replies = 0
        self.ask_replies = 0
        #: a node failed since the last slot map read: read it again (a replica may have taken over)
        self._stale = False

    def node(self, addr: tuple[str, int], bounded: bool = True) -> ClusterNode:
        """The node at ``addr`` (made when new; ``bounded``: past ``MAX_OTHER_NODES`` nodes beyond
        the seeds and the masters, the others are forgotten first)."""
        with self._lock:
            node = self.nodes.get(addr)
            if node is None:
                if bounded and len(self.nodes) >= self._kept + MAX_OTHER_NODES:
                    self._prune(self.slot_node)
                node = self.nodes[addr] = ClusterNode(addr, self._make_client(addr[0], addr[1]))
            return node

    def _prune(self, slot_node: list[ClusterNode | None]) -> None:
        """Forget the nodes that are neither a seed nor the master of a slot in ``slot_node``, their
        idle connections closed (one in use by a round closes when the round lets go of it). Holds
        ``_lock``."""
        keep = set(self.seeds)
        for n in set(slot_node):
            if n is not None:
                keep.add(n.addr)
        for addr in [a for a in self.nodes if a not in keep]:
            gone = self.nodes.pop(addr)
            with contextlib.suppress(*self._errors):
                gone.client.connection_pool.disconnect(inuse_connections=False)
        self._kept = len(self.nodes)

    def masters(self) -> list[ClusterNode]:
        """The node of each slot range, once each, in slot order."""
        out: list[ClusterNode] = []
        seen: set[tuple[str, int]] = set()
        for n in self.slot_node:
            if n is not None and n.addr not in seen:
                seen.add(n.addr)
                out.append(n)
        return out

    def refresh(self) -> bool:
        """Read the slot map (``CLUSTER SLOTS``) from the first node that answers (known nodes that
        are not down first, then the seeds), then forget the nodes that are neither a seed nor a
        master. False when none answers."""
        now = time.monotonic()
        with self._lock:
            candidates = [n.addr for n in self.nodes.values() if n.down_until <= now]
        candidates += [a for a in self.seeds if a not in candidates]
        for addr in candidates:
            ranges = self._cluster_slots(addr)
            if ranges is None:
                continue
            slot_node: list[ClusterNode | None] = [None] * CLUSTER_SLOTS
            for first, last, host, port in ranges:
                n = self.node((host or addr[0], port), False)
                for slot in range(first, last + 1):
                    slot_node[slot] = n
            with self._lock:
                self.slot_node = slot_node
                self._prune(slot_node)
            self.refreshes += 1
            return True
        return False

    def _cluster_slots(self, addr: tuple[str, int]) -> list[tuple[int, int, str, int]] | None:
        """``CLUSTER SLOTS`` as node ``addr`` answers it; None when it does not, in time and well formed."""
        pool = self.node(addr, False).client.connection_pool
        try:
            reply = exchange(
                pool,
                self._errors,
                [resp_command(b"CLUSTER", b"SLOTS")],
                time.monotonic() + self._timeout_s,
                self._max_bulk,
            )[0]
            return slot_ranges(reply)
        except self._errors as e:
            forget_frames(e)
            return None

    def run(
        self,
        slots: list[int],
        commands: list[list[Any]],
        what: str,
        writer: bool,
        valid: Callable[[int, Any], bool],
    ) -> list[Any] | None:
        """Send ``commands[i]`` (RESP parts) to the master of ``slots[i]``, every node's commands
        pipelined and all nodes sent to before any reply is read; follow ``MOVED``/``ASK`` (twice at
        most). Returns each command's reply; an error reply as an ``ErrorReply``, ``NODE_DOWN`` where
        the node is down or failed: it failed when a reply comes late (``timeout_ms`` for all of a
        node's replies of one round) or ``valid(i, reply)`` says a reply has the wrong shape. None
        when no node tells the slot map."""
        replies: list[Any] = [NODE_DOWN] * len(commands)
        if self._stale or self.slot_node[slots[0]] is None:
            self._stale = False
            if not self.refresh() and self.slot_node[slots[0]] is None:
                return None
        pending = list(range(len(commands)))
        ask_to: dict[int, ClusterNode] = {}
        for _ in range(3):
            now = time.monotonic()
            by_node: dict[ClusterNode, list[int]] = {}
            slot_node = self.slot_node
            for i in pending:
                n = ask_to.get(i, slot_node[slots[i]])
                if n is not None and n.down_until <= now:
                    group = by_node.get(n)
                    if group is None:
                        by_node[n] = [i]
                    else:
                        group.append(i)
            sent: list[tuple[ClusterNode, Any, list[int]]] = []
            for n, group in by_node.items():
                pool = n.client.connection_pool
                conn: Any = None
                try:
                    conn = connection(pool, self._errors)
                    parts: list[Any] = []
                    for i in group:
                        if i in ask_to:
                            parts.append(b"*1\r\n$6\r\nASKING\r\n")
                        parts.extend(commands[i])
                    send(conn, parts)
                    sent.append((n, conn, group))
                    self.node_round_trips += 1
                except self._errors as e:
                    if conn is not None:
                        conn.disconnect()
                        pool.release(conn)
                    self._node_failed(n, what, e, writer)
            redirected: list[int] = []
            asks: dict[int, ClusterNode] = {}
            moved = False
            for n, conn, group in sent:
                pool = n.client.connection_pool
                try:
                    moved = self._read_node(n, conn, group, ask_to, valid, replies, redirected, asks) or moved
                    self._node_ok(n)
                except self._errors as e:  # the connection failed: this node's other replies are lost
                    conn.disconnect()
                    self._node_failed(n, what, e, writer)
                finally:
                    pool.release(conn)
            if not redirected:
                break
            if moved:
                self.refresh()
            pending = redirected
            ask_to = asks
        return replies

    def _read_node(
        self,
        n: ClusterNode,
        conn: Any,
        group: list[int],
        ask_to: dict[int, ClusterNode],
        valid: Callable[[int, Any], bool],
        replies: list[Any],
        redirected: list[int],
        asks: dict[int, ClusterNode],
    ) -> bool:
        """Read node ``n``'s replies to the commands ``group`` into ``replies``, by one deadline; a
        redirected command goes to ``redirected`` (``ASK``: and its node to ``asks``). Returns whether
        a ``MOVED`` came; raises ``BadReply`` for a reply of the wrong shape."""
        reader = ReplyReader(conn, time.monotonic() + self._timeout_s, self._max_bulk)
        moved = False
        try:
            for i in group:
                if i in ask_to:
                    reader.reply()  # +OK to ASKING
                reply = reader.reply()
                if not isinstance(reply, ErrorReply):
                    if not valid(i, reply):
                        raise BadReply(f"unexpected reply {reply!r:.80}")
                    replies[i] = reply
                    continue
                redirect = parse_redirect(str(reply), n.addr[0])
                if redirect is None:
                    replies[i] = reply
                    continue
                target = self.node(redirect[2])
                if redirect[0]:
                    self.slot_node[redirect[1]] = target
                    self.moved_replies += 1
                    moved = True
                else:
                    asks[i] = target
                    self.ask_replies += 1
                redirected.append(i)
        finally:
            reader.close()
        return moved

    def _node_failed(self, node: ClusterNode, what: str, e: BaseException, writer: bool) -> None:
        forget_frames(e)
        node.down_until = time.monotonic() + self._retry_s
        self._stale = True
        if writer:
            self.write_errors += 1
        else:
            self.read_errors += 1
        if node.connected:
            node.connected = False
            LOG.warning(
                "remote KV tier %s: node %s:%d: %s failed (%s: %s); its keys are misses, retrying in %d ms",
                self._url,
                node.addr[0],
                node.addr[1],
                what,
                type(e).__name__,
                str(e).replace(self._secret, "***") if self._secret else str(e),
                self.cfg.retry_interval_ms,
            )

    def _node_ok(self, node: ClusterNode) -> None:
        if not node.connected:
            node.connected = True
            LOG.warning("remote KV tier %s: node %s:%d is reachable again", self._url, *node.addr)

    @property
    def connected(self) -> bool:
        return all(n.connected for n in list(self.nodes.values()))

    def close(self) -> None:
        for n in list(self.nodes.values()):
            with contextlib.suppress(*self._errors):
                n.client.close()
