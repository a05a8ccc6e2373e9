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
from ._protocol import forget_frames, resp_command, send, url_password

LOG = logging.getLogger("kv_cache_manager_v2")

#: hash slots of a cluster
CLUSTER_SLOTS: Final = 16384


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
    """

    def __init__(
        self, cfg: RemoteCacheTierConfig, make_client: Callable[[str, int], Any], errors: Any, exceptions: Any
    ) -> None:
        # (``exceptions``: the ``redis.exceptions`` module; an ``import redis.exceptions`` here would make
        # mypyc read ``redis.exceptions`` in RemoteStore from its module table before anything set it)
        self.cfg = cfg
        self.seeds = cluster_seed_nodes(cfg.url)
        self._url = redact_url(cfg.url)
        self._secret = url_password(cfg.url) or ""
        self._make_client = make_client
        self._errors: tuple[type[BaseException], ...] = errors
        self._response_error: type[BaseException] = exceptions.ResponseError
        self._moved: type[BaseException] = exceptions.MovedError
        self._ask: type[BaseException] = exceptions.AskError
        self._retry_s = cfg.retry_interval_ms / 1000.0
        self._lock = threading.Lock()
        self.nodes: list[ClusterNode] = []
        self._index: dict[tuple[str, int], int] = {}
        #: node index serving each slot (-1: unknown)
        self.slot_node: list[int] = [-1] * CLUSTER_SLOTS
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

    def node(self, addr: tuple[str, int]) -> int:
        with self._lock:
            i = self._index.get(addr)
            if i is None:
                i = len(self.nodes)
                self.nodes.append(ClusterNode(addr, self._make_client(addr[0], addr[1])))
                self._index[addr] = i
            return i

    def refresh(self) -> bool:
        """Read the slot map (``CLUSTER SLOTS``) from the first node that answers (known nodes that
        are not down first, then the seeds). False when none does."""
        now = time.monotonic()
        candidates = [n.addr for n in list(self.nodes) if n.down_until <= now]
        candidates += [a for a in self.seeds if a not in candidates]
        for addr in candidates:
            reply = self._cluster_slots(addr)
            if reply is None:
                continue
            slot_node = [-1] * CLUSTER_SLOTS
            for entry in reply:
                master = entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                n = self.node((host or addr[0], int(master[1])))
                for slot in range(int(entry[0]), int(entry[1]) + 1):
                    slot_node[slot] = n
            self.slot_node = slot_node
            self.refreshes += 1
            return True
        return False

    def _cluster_slots(self, addr: tuple[str, int]) -> Any:
        """``CLUSTER SLOTS`` as node ``addr`` answers it; None when it does not."""
        pool = self.nodes[self.node(addr)].client.connection_pool
        conn: Any = None
        reply: Any = None
        try:
            conn = pool.get_connection()
            conn.send_packed_command([resp_command(b"CLUSTER", b"SLOTS")])
            reply = conn.read_response()
        except self._errors as e:
            forget_frames(e)
            if conn is not None:
                conn.disconnect()
            reply = None
        finally:
            if conn is not None:
                pool.release(conn)
        return reply

    def run(self, slots: list[int], commands: list[list[Any]], what: str, writer: bool) -> list[Any] | None:
        """Send ``commands[i]`` (RESP parts) to the master of ``slots[i]``, every node's commands
        pipelined and all nodes sent to before any reply is read; follow ``MOVED``/``ASK`` (twice at
        most). Returns each command's reply; an error reply as its exception, ``NODE_DOWN`` where the
        node is down or failed. None when no node tells the slot map."""
        replies: list[Any] = [NODE_DOWN] * len(commands)
        if self._stale or self.slot_node[slots[0]] < 0:
            self._stale = False
            if not self.refresh() and self.slot_node[slots[0]] < 0:
                return None
        pending = list(range(len(commands)))
        ask_to: dict[int, int] = {}
        for _ in range(3):
            now = time.monotonic()
            by_node: dict[int, list[int]] = {}
            slot_node = self.slot_node
            for i in pending:
                n = ask_to.get(i, slot_node[slots[i]])
                if n >= 0 and self.nodes[n].down_until <= now:
                    group = by_node.get(n)
                    if group is None:
                        by_node[n] = [i]
                    else:
                        group.append(i)
            sent: list[tuple[int, Any, list[int]]] = []
            for n, group in by_node.items():
                pool = self.nodes[n].client.connection_pool
                conn: Any = None
                try:
                    conn = pool.get_connection()
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
            moved = False
            asks: dict[int, int] = {}
            for n, conn, group in sent:
                pool = self.nodes[n].client.connection_pool
                try:
                    for i in group:
                        try:
                            if i in ask_to:
                                conn.read_response()  # +OK to ASKING
                            replies[i] = conn.read_response()
                        except self._response_error as e:
                            forget_frames(e)
                            err: Any = e
                            if isinstance(e, self._moved):
                                self.slot_node[err.slot_id] = self.node((err.host, int(err.port)))
                                moved = True
                                self.moved_replies += 1
                                redirected.append(i)
                            elif isinstance(e, self._ask):
                                asks[i] = self.node((err.host, int(err.port)))
                                self.ask_replies += 1
                                redirected.append(i)
                            else:
                                replies[i] = e
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

    def _node_failed(self, node_index: int, what: str, e: BaseException, writer: bool) -> None:
        forget_frames(e)
        node = self.nodes[node_index]
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

    def _node_ok(self, node_index: int) -> None:
        node = self.nodes[node_index]
        if not node.connected:
            node.connected = True
            LOG.warning("remote KV tier %s: node %s:%d is reachable again", self._url, *node.addr)

    @property
    def connected(self) -> bool:
        return all(n.connected for n in self.nodes)

    def close(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(*self._errors):
                n.client.close()
