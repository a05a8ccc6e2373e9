"""The remote tier's store: content-addressed pages in Redis (or Valkey), shared by many managers.

One key per page (one block of one layer group): ``kvcm:<namespace>:<layout fingerprint>:<layer
group>:<block key hex>``, where the block key is the SHA-256 reuse key (so scopes, salts and LoRA
adapters never share) and the fingerprint covers the model layout, so different models or layouts
never share either. A value is a 64-byte header (magic, format version, layer group, fingerprint,
block key, payload length, CRC-32 of the payload) then the slot's bytes of every pool of the page's
pool group. A value that is missing, truncated, foreign or corrupted is a miss, never bad KV.

Reads (``lookup``: one round trip returning every key's length; ``fetch``: one MGET) run on the
scheduler's thread, bounded by ``timeout_ms`` per network operation. Writes are queued (a bounded
deque; what does not fit is dropped and counted) and sent by a background thread in pipelined
batches. A failed round trip marks the server down for ``retry_interval_ms``: meanwhile lookups are
misses without network traffic and queued writes are dropped. Nothing raises into the engine.

A cluster (``redis+cluster://``: Redis Cluster, Valkey cluster) is served by ``ClusterRouter``: keys
are grouped by hash slot (CRC-16 of the key, or of its ``{tag}``, mod 16384), one command per slot
group (STRLEN or the Lua lookup, MGET, MSET or SET), pipelined to each slot's master: every master
is sent its commands before any reply is read, so a lookup, a fetch or a write batch costs one round
trip to each node concerned, in parallel. ``MOVED`` updates the slot map (re-read from the cluster)
and ``ASK`` follows the migration with ``ASKING``, both retried at once. A node that fails counts as
down for ``retry_interval_ms``: lookups of its keys are misses and writes to it are dropped (counted),
while the other nodes keep serving.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import logging
import mmap
import socket
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from .._common import RemoteStatistics, SlotId
from .._config import AttentionLayerConfig, KVCacheManagerConfig, RemoteCacheTierConfig, cluster_seed_nodes, redact_url
from ._tiers._base import HandOffPart

LOG = logging.getLogger("kv_cache_manager_v2")

MAGIC: Final = b"KVC2"
#: bump when the value layout, the key layout or the slot layout (coalescing order) changes
FORMAT_VERSION: Final = 1
#: magic, version, layer group, layout fingerprint, block key, payload length, CRC-32, reserved
HEADER: Final = struct.Struct("<4sHH8s32sQII")
HEADER_BYTES: Final = 64
#: a write batch ends at this many pages or bytes
BATCH_PAGES: Final = 256
BATCH_BYTES: Final = 8 << 20
#: the writer looks at its queue this often while there is work (a burst of drops goes out as one
#: batch), backing off to ``IDLE_POLL_S`` when there is none. Enqueueing never wakes it: waking a
#: thread is a system call (several us on a VM) on the scheduler's thread, and a woken writer would
#: compete for the GIL in the middle of the step instead of between steps
POLL_S: Final = 0.002
IDLE_POLL_S: Final = 0.05
#: buffers per sendmsg call (below IOV_MAX)
_MAX_IOV: Final = 512

#: STRLEN of every key; a key of another type (WRONGTYPE) reads as 0, a miss for that key only
_LOOKUP_LUA: Final = (
    "local r = {} for i, k in ipairs(KEYS) do local n = redis.pcall('STRLEN', k) "
    "if type(n) ~= 'number' then n = 0 end r[i] = n end return r"
)
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


def resp_command(*args: bytes) -> bytes:
    """``args`` as one RESP command."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def layout_fingerprint(config: KVCacheManagerConfig, dtype: str) -> bytes:
    """8 bytes naming everything that decides what a page's bytes mean: format version, tokens per
    block, ``dtype``, and every layer (id, window, sinks) with its buffers (role, size, override)."""
    parts = [f"kvcm-layout/{FORMAT_VERSION}/T={config.tokens_per_block}/dtype={dtype}"]
    for layer in config.layers:
        if isinstance(layer, AttentionLayerConfig):
            parts.append(f"L{layer.layer_id}/w={layer.sliding_window_size}/s={layer.num_sink_tokens}")
        else:
            parts.append(f"L{layer.layer_id}/recurrent")
        for b in layer.buffers:
            parts.append(f"B{b.role!r}/{b.size}/{b.tokens_per_block_override}")
    return hashlib.sha256("\n".join(parts).encode()).digest()[:8]


def encode_header(parts: list[memoryview], layer_group: int, fingerprint: bytes, block_key: bytes) -> bytes:
    """The header of a value whose payload is ``parts`` (concatenated)."""
    crc = 0
    n = 0
    for part in parts:
        crc = zlib.crc32(part, crc)  # (releases the GIL for parts above 5 KiB)
        n += len(part)
    return HEADER.pack(MAGIC, FORMAT_VERSION, layer_group, fingerprint, block_key, n, crc, 0)


def decode_value(value: bytes, layer_group: int, fingerprint: bytes, block_key: bytes, size: int) -> memoryview | None:
    """The payload of ``value`` if it is a complete, intact page of ``size`` bytes for exactly this
    layer group, layout and block; None otherwise."""
    if len(value) != HEADER_BYTES + size:
        return None
    fields = HEADER.unpack_from(value)
    if (
        fields[0] != MAGIC
        or fields[1] != FORMAT_VERSION
        or fields[2] != layer_group
        or fields[3] != fingerprint
        or fields[4] != block_key
        or fields[5] != size
    ):
        return None
    payload = memoryview(value)[HEADER_BYTES:]
    if zlib.crc32(payload) != fields[6]:
        return None
    return payload


class _Pending:
    """One page queued for writing: its payload is a span of the write ring (``ring_pos`` >= 0), or
    the slot of a dropped page handed to the writer (``parts``: where the slot of each pool is read,
    ``_tiers``' ``HandOffPart``), given back to ``parked`` once sent."""

    __slots__ = ("block_key", "layer_group", "nbytes", "parked", "parts", "ring_pos", "slot")

    def __init__(
        self,
        block_key: bytes,
        layer_group: int,
        nbytes: int,
        ring_pos: int,
        parts: list[HandOffPart] | None,
        parked: list[SlotId] | None,
        slot: SlotId,
    ) -> None:
        self.block_key = block_key
        self.layer_group = layer_group
        self.nbytes = nbytes
        self.ring_pos = ring_pos
        self.parts = parts
        self.parked = parked
        self.slot = slot


def _forget_frames(e: BaseException) -> None:
    """Drop the tracebacks of ``e`` and the exceptions it chains: their frames hold memory views of
    slots, which would keep the pools' memory exported (so it could not be released)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__context__ or x.__cause__


def _populated_mapping(nbytes: int) -> mmap.mmap:
    """Anonymous memory of ``nbytes``, faulted in at once where the OS offers it (MAP_POPULATE)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except OSError:
            pass
    return mmap.mmap(-1, nbytes)


def _send_all(sock: Any, parts: list[Any]) -> None:
    """Send every buffer of ``parts`` in order with as few ``sendmsg`` calls as the kernel allows."""
    i = 0
    while i < len(parts):
        chunk = parts[i : i + _MAX_IOV]
        sent: int = sock.sendmsg(chunk)
        for b in chunk:  # skip what went out; a partly sent buffer continues where it stopped
            n = len(b)
            if sent >= n:
                sent -= n
                i += 1
            else:
                if sent:
                    parts[i] = memoryview(b)[sent:]
                break


def _url_password(url: str) -> str | None:
    from urllib.parse import unquote, urlsplit

    password = urlsplit(url).password
    return unquote(password) if password else None


def _url_username(url: str) -> str | None:
    from urllib.parse import unquote, urlsplit

    username = urlsplit(url).username
    return unquote(username) if username else None


def _send(conn: Any, parts: list[Any]) -> None:
    """Send ``parts`` on a redis-py connection: ``sendmsg`` from where the buffers are on a plain
    socket, the client's own send otherwise (TLS)."""
    sock = getattr(conn, "_sock", None)
    if sock is not None and type(sock) is socket.socket:
        _send_all(sock, parts)
    else:
        conn.send_packed_command(parts)


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
        self._secret = _url_password(cfg.url) or ""
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
            _forget_frames(e)
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
                    _send(conn, parts)
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
                            _forget_frames(e)
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
        _forget_frames(e)
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


class RemoteStore:
    """The Redis side of the remote tier for one manager (see the module doc).

    ``lookup``/``fetch``/``enqueue`` are called on the scheduler's thread (one at a time, like the
    manager); the writer thread only pops the queue. Each counter is written by one thread.
    """

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError(
                "RemoteCacheTierConfig needs the 'redis' package: pip install 'kv_cache_manager_v2[remote]'"
            ) from None
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.prefix = f"kvcm:{cfg.namespace}:{fingerprint.hex()}:".encode()
        timeout = cfg.timeout_ms / 1000.0
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._response_error: type[BaseException] = redis.exceptions.ResponseError
        self._no_script: type[BaseException] = redis.exceptions.NoScriptError
        self._url = redact_url(cfg.url)
        password = _url_password(cfg.url)
        #: words that must not reach a log line (the password)
        self._secret = password or ""
        # no retries: a failure is a miss, and the next call after retry_interval_ms tries again
        options: dict[str, Any] = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self.client: Any = None
        self.router: ClusterRouter | None = None
        if cfg.cluster:
            username = _url_username(cfg.url)
            tls = cfg.url.startswith("rediss+")

            def make_client(host: str, port: int) -> Any:
                return redis.Redis(host=host, port=port, username=username, password=password, ssl=tls, **options)

            self.router = ClusterRouter(cfg, make_client, self._errors, redis.exceptions)
        else:
            self.client = redis.Redis.from_url(cfg.url, **options)
        #: key prefix per layer group: ``<prefix><layer group>:``; the block key's hex follows
        self._lc_prefix: list[bytes] = []
        self._max_pending = cfg.max_pending_bytes
        self._lookup_sha = ""
        self._use_script = True
        self._ttl = b"%d" % cfg.ttl_s if cfg.ttl_s is not None else b""
        self._retry_s = cfg.retry_interval_ms / 1000.0
        #: the server counts as down until this time.monotonic() value
        self._down_until = 0.0
        self._connected = True
        self._warned_refused = False
        # scheduler-thread counters
        self.lookups = 0
        self.looked_up_pages = 0
        self.found_pages = 0
        self.fetched_pages = 0
        self.fetched_bytes = 0
        self.hit_blocks = 0
        self.corrupt_pages = 0
        self.queued_writes = 0
        self.dropped_on_queue = 0
        self.dropped_bytes_on_queue = 0
        self.read_errors = 0
        self.skipped_lookups = 0
        # writer-thread counters
        self.written_pages = 0
        self.written_bytes = 0
        self.dropped_by_writer = 0
        self.dropped_bytes_by_writer = 0
        self.write_errors = 0
        #: end of the last span reserved in the write ring (a position that only grows)
        self._head = 0
        #: ring positions below this are free again (the writer sent or dropped what was there)
        self._done = 0
        #: handed-off slots queued, and finished by the writer
        self.slots_queued = 0
        self.slots_done = 0
        self._queue: deque[_Pending] = deque()
        #: the write queue's memory: a ring of ``max_pending_bytes``, mapped in full up front (a page
        #: fault on the scheduler's thread costs ~10 us on these VMs), reused from its start whenever
        #: the queue is empty
        self._ring = _populated_mapping(cfg.max_pending_bytes)
        self._ring_view = memoryview(self._ring)
        self._wake = threading.Event()
        self._stopping = False
        self._writer = threading.Thread(target=self._writer_loop, name="kvcm-remote-writer", daemon=True)
        self._writer.start()
        if cfg.quota is not None:
            self.apply_quota(cfg.quota)

    # ------------------------------------------------------------------ keys and state
    def page_key(self, block_key: bytes, layer_group: int) -> bytes:
        prefixes = self._lc_prefix
        while len(prefixes) <= layer_group:
            prefixes.append(self.prefix + b"%d:" % len(prefixes))
        return prefixes[layer_group] + binascii.hexlify(block_key)

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    @property
    def pending_bytes(self) -> int:
        """Ring bytes queued and not yet sent (or dropped) by the writer."""
        return self._head - self._done

    @property
    def idle(self) -> bool:
        """Nothing queued or being sent."""
        return self._head == self._done and self.slots_queued == self.slots_done

    def _failed(self, what: str, e: BaseException) -> None:
        """A round trip failed: the server counts as down for ``retry_interval_ms``; warn once per outage."""
        self._down_until = time.monotonic() + self._retry_s
        if self._connected:
            self._connected = False
            LOG.warning(
                "remote KV tier %s: %s failed (%s: %s); treating it as a miss and retrying in %d ms",
                self._url,
                what,
                type(e).__name__,
                self._scrub(
                    str(e)
                ),  # not the exception: a kept log record would keep its frames (and slot views) alive
                self.cfg.retry_interval_ms,
            )

    def _scrub(self, text: str) -> str:
        """``text`` without the password (a server's or library's message might quote it)."""
        return text.replace(self._secret, "***") if self._secret else text

    def _succeeded(self) -> None:
        if not self._connected:
            self._connected = True
            LOG.warning("remote KV tier %s is reachable again", self._url)

    # ------------------------------------------------------------------ reads (scheduler thread)
    def lookup(self, keys: list[bytes]) -> list[int] | None:
        """The length of each key's value (0: absent) in one round trip; None when the server is
        down, slow or failing (count it as all misses)."""
        if not keys:
            return []
        if self.is_down:
            self.skipped_lookups += 1
            return None
        self.lookups += 1
        self.looked_up_pages += len(keys)
        if self.router is not None:
            return self._cluster_lengths(keys)
        try:
            out = self._lengths(keys)
        except self._errors as e:
            self.read_errors += 1
            self._failed("lookup", e)
            return None
        self._succeeded()
        return out

    def _lengths(self, keys: list[bytes]) -> list[int]:
        client = self.client
        if self._use_script:
            try:
                if not self._lookup_sha:
                    self._lookup_sha = str(client.script_load(_LOOKUP_LUA))
                try:
                    res: list[Any] = client.evalsha(self._lookup_sha, len(keys), *keys)
                except self._no_script:  # the server restarted (scripts are not persisted)
                    self._lookup_sha = str(client.script_load(_LOOKUP_LUA))
                    res = client.evalsha(self._lookup_sha, len(keys), *keys)
                return [int(x) for x in res]
            except self._response_error as e:  # scripting disabled on this server: pipeline instead
                LOG.warning(
                    "remote KV tier %s: Lua lookups refused (%s); using pipelined STRLEN",
                    self._url,
                    self._scrub(str(e)),
                )
                self._use_script = False
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        # a key of another type answers WRONGTYPE: a miss for that key only
        return [x if type(x) is int else 0 for x in pipe.execute(raise_on_error=False)]

    def _cluster_lengths(self, keys: list[bytes]) -> list[int] | None:
        """``lookup`` on a cluster: per slot group one STRLEN (one key) or Lua lookup (several), each
        master's pipelined; keys of a node that is down or failing read as absent."""
        router = self.router
        assert router is not None
        slots: list[int] = []
        commands: list[list[Any]] = []
        groups: list[list[int]] = []
        for slot, group in group_by_slot(keys).items():
            if len(group) == 1 or not self._use_script:
                for i in group:
                    slots.append(slot)
                    groups.append([i])
                    commands.append([resp_command(b"STRLEN", keys[i])])
            else:
                slots.append(slot)
                groups.append(group)
                n = b"%d" % len(group)
                commands.append([resp_command(b"EVAL", _LOOKUP_LUA.encode(), n, *[keys[i] for i in group])])
        replies = router.run(slots, commands, "lookup", False)
        if replies is None:
            self.read_errors += 1
            self._failed("lookup (no cluster node answers)", NODE_DOWN)
            return None
        self._succeeded()
        out = [0] * len(keys)
        for group, reply in zip(groups, replies):
            if isinstance(reply, list):
                for i, x in zip(group, reply):
                    out[i] = x if type(x) is int else 0
            elif type(reply) is int:
                out[group[0]] = reply
            elif isinstance(reply, self._response_error) and len(group) > 1:
                LOG.warning(
                    "remote KV tier %s: Lua lookups refused (%s); using STRLEN", self._url, self._scrub(str(reply))
                )
                self._use_script = False
        return out

    def fetch(self, keys: list[bytes]) -> list[bytes | None] | None:
        """Every key's value (None: absent) in one MGET; None when the round trip fails."""
        if not keys:
            return []
        if self.is_down:
            self.skipped_lookups += 1
            return None
        if self.router is not None:
            return self._cluster_fetch(keys)
        try:
            res: list[Any] = self.client.execute_command("MGET", *keys)
        except self._errors as e:
            self.read_errors += 1
            self._failed("fetch", e)
            return None
        self._succeeded()
        return [v if isinstance(v, bytes) else None for v in res]

    def _cluster_fetch(self, keys: list[bytes]) -> list[bytes | None] | None:
        """``fetch`` on a cluster: one MGET per slot group, each master's pipelined; values of a node
        that is down or failing are absent."""
        router = self.router
        assert router is not None
        slots: list[int] = []
        commands: list[list[Any]] = []
        groups: list[list[int]] = []
        for slot, group in group_by_slot(keys).items():
            slots.append(slot)
            groups.append(group)
            commands.append([resp_command(b"MGET", *[keys[i] for i in group])])
        replies = router.run(slots, commands, "fetch", False)
        if replies is None:
            self.read_errors += 1
            self._failed("fetch (no cluster node answers)", NODE_DOWN)
            return None
        self._succeeded()
        out: list[bytes | None] = [None] * len(keys)
        for group, reply in zip(groups, replies):
            if isinstance(reply, list):
                for i, v in zip(group, reply):
                    out[i] = v if isinstance(v, bytes) else None
        return out

    def apply_quota(self, quota: int) -> bool:
        """Set the server's ``maxmemory`` to ``quota`` bytes with LRU eviction over all keys.
        Returns False (with a warning) when the server is unreachable or refuses."""
        try:
            router = self.router
            if router is None:
                clients = [self.client]
            else:  # every master (CONFIG SET is per server)
                if not router.refresh():
                    raise ConnectionError("no cluster node answers")
                clients = [router.nodes[n].client for n in sorted(set(router.slot_node)) if n >= 0]
            for client in clients:
                client.config_set("maxmemory-policy", "allkeys-lru")
                client.config_set("maxmemory", str(quota))
        except self._errors as e:
            self.read_errors += 1
            self._failed("CONFIG SET maxmemory", e)
            return False
        self._succeeded()
        return True

    # ------------------------------------------------------------------ writes
    def reserve(self, nbytes: int) -> int:
        """Room for one value of ``nbytes`` in the write ring: its position (fill ``span(pos, nbytes)``
        then ``enqueue``), or -1 when the queue is full or the server counts as down (counted as a
        dropped write). Never blocks."""
        cap = self._max_pending
        pos = self._head
        off = pos % cap
        if off and pos == self._done:
            # nothing in flight (the writer is done with every span): start again at the ring's
            # beginning, so only its high-water mark is ever mapped
            pos += cap - off
            self._head = self._done = pos
        elif off + nbytes > cap:  # does not fit before the end of the ring: start the next lap
            pos += cap - off
        if pos + nbytes - self._done > cap or self._stopping or time.monotonic() < self._down_until:
            self.dropped_on_queue += 1
            self.dropped_bytes_on_queue += nbytes
            return -1
        self._head = pos + nbytes
        return pos

    def span(self, pos: int, nbytes: int) -> memoryview:
        off = pos % self._max_pending
        return self._ring_view[off : off + nbytes]

    def enqueue(self, pos: int, nbytes: int, block_key: bytes, layer_group: int) -> None:
        """Hand a filled ring span (``reserve``) to the writer. An empty ``block_key`` gives the
        span back unused (a failed copy)."""
        if block_key:
            self.queued_writes += 1
        else:
            self.dropped_on_queue += 1
            self.dropped_bytes_on_queue += nbytes
        self._queue.append(_Pending(block_key, layer_group, nbytes, pos, None, None, SlotId(-1)))

    def accepts_slot(self) -> bool:
        """Whether a handed-off slot would be sent now (not while the server counts as down)."""
        return not self._stopping and time.monotonic() >= self._down_until

    def enqueue_slot(
        self,
        block_key: bytes,
        layer_group: int,
        parts: list[HandOffPart],
        nbytes: int,
        parked: list[SlotId],
        slot: SlotId,
    ) -> None:
        """Hand the slot of a dropped page to the writer (no copy here): it sends the slot's bytes
        straight from ``parts`` and then appends ``slot`` to ``parked``."""
        self.queued_writes += 1
        self.slots_queued += 1
        self._queue.append(_Pending(block_key, layer_group, nbytes, -1, parts, parked, slot))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is finished (written or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()  # no need to wait for the writer's next poll
        while not self.idle:
            if time.monotonic() >= deadline or not self._writer.is_alive():
                return False
            time.sleep(0.001)
        return True

    def _writer_loop(self) -> None:
        queue = self._queue
        poll = IDLE_POLL_S
        while True:
            self._wake.wait(poll)  # (flush and close set it)
            self._wake.clear()
            poll = POLL_S if queue else min(IDLE_POLL_S, 2 * poll)
            while queue:
                batch: list[_Pending] = []
                nbytes = 0
                while queue and len(batch) < BATCH_PAGES and nbytes < BATCH_BYTES:
                    w = queue.popleft()
                    if w.block_key:
                        batch.append(w)
                        nbytes += w.nbytes
                    else:
                        self._done = w.ring_pos + w.nbytes  # an abandoned span
                if not batch:
                    continue
                try:
                    self._write_batch(batch)
                except BaseException as e:  # never let the thread die (it would stall flush)
                    _forget_frames(e)
                    self._dropped(batch)
                    LOG.error("remote KV tier writer: unexpected %s: %s", type(e).__name__, str(e))
                self._finished(batch)
            if self._stopping:
                return

    def _finished(self, batch: list[_Pending]) -> None:
        """Nothing reads the batch's memory any more: ring spans are free, handed-off slots parked."""
        for w in batch:
            if w.ring_pos >= 0:
                self._done = w.ring_pos + w.nbytes
            else:
                parked = w.parked
                assert parked is not None
                w.parts = None
                parked.append(w.slot)
                self.slots_done += 1

    def _payload(self, write: _Pending) -> list[memoryview]:
        if write.ring_pos >= 0:
            return [self.span(write.ring_pos, write.nbytes)]
        parts = write.parts
        assert parts is not None
        return [part.read() for part in parts]

    def _write_batch(self, batch: list[_Pending]) -> None:
        """Send ``batch`` in one go: one MSET, or pipelined ``SET key value EX ttl_s`` with a TTL.
        Values go out with one ``sendmsg`` straight from where they are (the ring, or the dropped
        pages' slots): no copy into a command buffer, and the GIL is released while the kernel copies."""
        if self.is_down:
            self._dropped(batch)
            return
        fp = self.fingerprint
        ttl = self._ttl
        sent: list[_Pending] = []
        payloads: list[list[memoryview]] = []
        for w in batch:
            try:
                payloads.append(self._payload(w))
                sent.append(w)
            except OSError as e:  # a disk read failed or did not verify: this page is not written
                _forget_frames(e)
                self._dropped([w])
                if w.parts:
                    w.parts[0].unsent()
        if not sent:
            return
        if self.router is not None:
            self._write_cluster(sent, payloads)
            return
        parts: list[Any] = []
        tail = b"\r\n" + (b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) if ttl else b"")
        cmd = b"*5\r\n$3\r\nSET\r\n" if ttl else b""
        before = b"" if ttl else b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(sent))
        for w, payload in zip(sent, payloads):
            key = self.page_key(w.block_key, w.layer_group)
            header = encode_header(payload, w.layer_group, fp, w.block_key)
            parts.append(before + cmd + b"$%d\r\n%s\r\n$%d\r\n" % (len(key), key, HEADER_BYTES + w.nbytes) + header)
            parts.extend(payload)
            before = tail
        parts.append(tail)
        replies = len(sent) if ttl else 1
        pool = self.client.connection_pool
        done = 0
        conn: Any = None
        try:
            conn = pool.get_connection()
            _send(conn, parts)
            while done < replies:
                try:
                    conn.read_response()
                    self._written(sent[done : done + 1] if ttl else sent)
                except self._response_error as e:  # e.g. OOM (noeviction, or nothing to evict): lost
                    _forget_frames(e)
                    self._dropped(sent[done : done + 1] if ttl else sent)
                    self._refused(e)
                done += 1
        except self._errors as e:
            _forget_frames(e)
            if conn is not None:
                conn.disconnect()
            self._dropped(sent[done:] if ttl else sent)
            self.write_errors += 1
            self._failed("write", e)
            return
        finally:
            if conn is not None:
                pool.release(conn)
        self._succeeded()

    def _refused(self, e: BaseException) -> None:
        if not self._warned_refused:
            self._warned_refused = True
            LOG.warning("remote KV tier %s refuses writes (%s); they are dropped", self._url, self._scrub(str(e)))

    def _write_cluster(self, sent: list[_Pending], payloads: list[list[memoryview]]) -> None:
        """``_write_batch`` on a cluster: one MSET per slot group (one SET per page with a TTL),
        each master's pipelined; writes to a node that is down or failing are dropped."""
        router = self.router
        assert router is not None
        fp = self.fingerprint
        ttl = self._ttl
        keys = [self.page_key(w.block_key, w.layer_group) for w in sent]
        expiry = b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) if ttl else b""
        slots: list[int] = []
        commands: list[list[Any]] = []
        members: list[list[int]] = []
        for slot, group in group_by_slot(keys).items():
            subgroups = [[i] for i in group] if ttl else [group]
            for sub in subgroups:
                parts: list[Any] = [b"*5\r\n$3\r\nSET\r\n" if ttl else b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(sub))]
                for i in sub:
                    w, key, payload = sent[i], keys[i], payloads[i]
                    header = encode_header(payload, w.layer_group, fp, w.block_key)
                    parts.append(b"$%d\r\n%s\r\n$%d\r\n" % (len(key), key, HEADER_BYTES + w.nbytes) + header)
                    parts.extend(payload)
                    parts.append(b"\r\n")
                if ttl:
                    parts.append(expiry)
                slots.append(slot)
                commands.append(parts)
                members.append(sub)
        replies = router.run(slots, commands, "write", True)
        if replies is None:
            self._dropped(sent)
            self.write_errors += 1
            self._failed("write (no cluster node answers)", NODE_DOWN)
            return
        for reply, sub in zip(replies, members):
            writes = [sent[i] for i in sub]
            if isinstance(reply, BaseException):
                self._dropped(writes)
                if reply is not NODE_DOWN:
                    self._refused(reply)
            else:
                self._written(writes)
        self._succeeded()

    def _written(self, writes: list[_Pending]) -> None:
        self.written_pages += len(writes)
        self.written_bytes += sum(HEADER_BYTES + w.nbytes for w in writes)

    def _dropped(self, writes: list[_Pending]) -> None:
        self.dropped_by_writer += len(writes)
        self.dropped_bytes_by_writer += sum(HEADER_BYTES + w.nbytes for w in writes)

    # ------------------------------------------------------------------ layer group and statistics
    def counters(self) -> list[int]:
        """Cumulative (written, fetched, dropped) pages then bytes, and errors (failed round trips and
        refused values): the remote level's ``TierStatistics``."""
        return [
            self.written_pages,
            self.fetched_pages,
            self.dropped_on_queue + self.dropped_by_writer,
            self.written_bytes,
            self.fetched_bytes,
            self.dropped_bytes_on_queue + self.dropped_bytes_by_writer,
            self.errors + self.corrupt_pages,
        ]

    @property
    def errors(self) -> int:
        """Failed round trips (with a cluster: failed node round trips)."""
        router = self.router
        extra = router.read_errors + router.write_errors if router is not None else 0
        return self.read_errors + self.write_errors + extra

    @property
    def connected(self) -> bool:
        """Whether the last round trip (with a cluster: the last one of every node) succeeded."""
        router = self.router
        return self._connected and (router is None or router.connected)

    def statistics(self) -> RemoteStatistics:
        return RemoteStatistics(
            lookups=self.lookups,
            looked_up_pages=self.looked_up_pages,
            found_pages=self.found_pages,
            fetched_pages=self.fetched_pages,
            fetched_bytes=self.fetched_bytes,
            hit_blocks=self.hit_blocks,
            corrupt_pages=self.corrupt_pages,
            queued_writes=self.queued_writes,
            written_pages=self.written_pages,
            written_bytes=self.written_bytes,
            dropped_writes=self.dropped_on_queue + self.dropped_by_writer,
            errors=self.errors,
            skipped_lookups=self.skipped_lookups,
            pending_bytes=self.pending_bytes,
            connected=self.connected,
        )

    def close(self, drain_timeout_s: float) -> bool:
        """Stop the writer (after draining the queue for at most ``drain_timeout_s``; then what is
        left is dropped) and disconnect. Returns False if the writer did not stop: it may still read
        handed-off slots, so their memory must not be released."""
        if not self._stopping:
            if drain_timeout_s > 0 and not self.is_down:
                self.flush(drain_timeout_s)
            self._stopping = True
            self._down_until = float("inf")  # what is still queued is dropped, not sent
            self._wake.set()
        # each network operation is bounded by timeout_ms; the rest of the queue is dropped at once
        self._writer.join(2 * self.cfg.timeout_ms / 1000.0 + 5.0)
        if self._writer.is_alive():
            LOG.error("remote KV tier writer did not stop; keeping the memory it may still read")
            return False
        if self.router is not None:
            self.router.close()
        else:
            with contextlib.suppress(*self._errors):
                self.client.close()
        return True
