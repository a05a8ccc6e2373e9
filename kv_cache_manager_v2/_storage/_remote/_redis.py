"""The Redis backend: one Redis or Valkey server (``redis://``, ``rediss://``, ``unix://``) or a
cluster (``redis+cluster://``, ``rediss+cluster://``: ``ClusterRouter``), over RESP (``_protocol``).

A lookup is one round trip returning every key's length (a Lua script, or pipelined STRLEN where
scripting is refused); a read is one MGET; a write batch is one MSET (pipelined ``SET key value EX
ttl_s`` with a TTL), its values sent with ``sendmsg`` straight from where they lie. Replies are read
by ``ReplyReader`` under the call's deadline; a reply of the wrong shape is ``BadReply`` (an outage).
A cluster groups keys by hash slot, one command per slot group, each master's pipelined (one round
trip per node, in parallel); a node that fails is down on its own, the others keep serving. The quota
is the server's ``maxmemory`` (every master's) with ``allkeys-lru``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ..._config import CLUSTER_URL_SCHEMES, RemoteCacheTierConfig, cluster_seed_nodes
from ._backend import LOG, RemoteBackend, Value
from ._cluster import NODE_DOWN, ClusterRouter, group_by_slot
from ._protocol import (
    LOOKUP_LUA,
    BadReply,
    ErrorReply,
    ReplyReader,
    connection,
    exchange,
    is_lengths,
    is_values,
    reply_bound,
    resp_command,
    send,
    url_password,
    url_username,
)


class RedisBackend(RemoteBackend):
    """A Redis (or Valkey) server or cluster (see the module doc)."""

    @staticmethod
    def check_url(url: str) -> None:
        if url.startswith(CLUSTER_URL_SCHEMES):
            cluster_seed_nodes(url)  # (each seed node host:port)

    def __init__(self, cfg: RemoteCacheTierConfig, max_page_bytes: int) -> None:
        super().__init__(cfg, max_page_bytes)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError(
                "RemoteCacheTierConfig needs the 'redis' package: pip install 'kv_cache_manager_v2[remote]'"
            ) from None
        timeout = self.timeout_s
        self.errors = (redis.exceptions.RedisError, OSError)
        #: the longest bulk string a valid reply holds (a page's value): a longer one is a bad reply
        self._max_bulk = reply_bound(max_page_bytes)
        password = url_password(cfg.url)
        self.secret = password or ""
        # no retries: a failure is a miss, and the next call after retry_interval_ms tries again
        options: dict[str, Any] = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self.client: Any = None
        self.router: ClusterRouter | None = None
        self._lookup_sha = ""
        self._use_script = True
        self._ttl = b"%d" % cfg.ttl_s if cfg.ttl_s is not None else b""
        if cfg.cluster:
            username = url_username(cfg.url)
            tls = cfg.url.startswith("rediss+")

            def make_client(host: str, port: int) -> Any:
                return redis.Redis(host=host, port=port, username=username, password=password, ssl=tls, **options)

            self.router = ClusterRouter(cfg, make_client, self.errors, self._max_bulk)
            self.reads_in_background = False  # (the router's counters live on the scheduler's thread)
        else:
            self.client = redis.Redis.from_url(cfg.url, **options)

    def _scrub(self, text: str) -> str:
        return text.replace(self.secret, "***") if self.secret else text

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: list[bytes], nbytes: list[int]) -> list[bool] | None:
        lengths = self._cluster_lengths(keys) if self.router is not None else self._lengths(keys)
        if lengths is None:
            return None
        return [n == size for n, size in zip(lengths, nbytes)]

    def _lengths(self, keys: list[bytes]) -> list[int]:
        deadline = time.monotonic() + self.timeout_s
        pool = self.client.connection_pool
        n = len(keys)
        for _ in range(2 if self._use_script else 0):  # (again after NOSCRIPT)
            if not self._lookup_sha:
                sha = exchange(
                    pool,
                    self.errors,
                    [resp_command(b"SCRIPT", b"LOAD", LOOKUP_LUA.encode())],
                    deadline,
                    self._max_bulk,
                )[0]
                if isinstance(sha, bytes):
                    self._lookup_sha = sha.decode(errors="replace")
                elif isinstance(sha, ErrorReply):
                    self._lua_refused(sha, "pipelined STRLEN")
                    break
                else:
                    raise BadReply(f"SCRIPT LOAD answered {sha!r:.80}")
            command = resp_command(b"EVALSHA", self._lookup_sha.encode(), b"%d" % n, *keys)
            reply = exchange(pool, self.errors, [command], deadline, self._max_bulk)[0]
            if is_lengths(reply, n):
                return list(reply)
            if not isinstance(reply, ErrorReply):
                raise BadReply(f"the Lua lookup of {n} keys answered {reply!r:.80}")
            if str(reply).startswith("NOSCRIPT"):  # the server restarted (scripts are not persisted)
                self._lookup_sha = ""
            else:  # scripting disabled on this server: pipeline instead
                self._lua_refused(reply, "pipelined STRLEN")
                break
        replies = exchange(pool, self.errors, [resp_command(b"STRLEN", k) for k in keys], deadline, self._max_bulk)
        for x in replies:
            if not (type(x) is int and x >= 0) and not isinstance(x, ErrorReply):
                raise BadReply(f"STRLEN answered {x!r:.80}")
        # a key of another type answers WRONGTYPE: a miss for that key only
        return [x if type(x) is int else 0 for x in replies]

    def _lua_refused(self, reply: ErrorReply, instead: str) -> None:
        LOG.warning(
            "remote KV tier %s: Lua lookups refused (%s); using %s",
            self.url,
            self._scrub(str(reply)),
            instead,
        )
        self._use_script = False

    def _cluster_lengths(self, keys: list[bytes]) -> list[int] | None:
        """``lookup`` on a cluster: per slot group one STRLEN (one key) or Lua lookup (several), each
        master's pipelined; keys of a node that is down, slow or failing read as absent."""
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
                commands.append([resp_command(b"EVAL", LOOKUP_LUA.encode(), n, *[keys[i] for i in group])])

        def valid(i: int, reply: Any) -> bool:
            return is_lengths(reply, len(groups[i])) if len(groups[i]) > 1 else type(reply) is int and reply >= 0

        replies = router.run(slots, commands, "lookup", False, valid)
        if replies is None:
            return None
        out = [0] * len(keys)
        for group, reply in zip(groups, replies):
            if isinstance(reply, list):
                for i, x in zip(group, reply):
                    out[i] = x
            elif type(reply) is int:
                out[group[0]] = reply
            elif isinstance(reply, ErrorReply) and len(group) > 1:
                self._lua_refused(reply, "STRLEN")
        return out

    # ------------------------------------------------------------------ read
    def read(self, keys: list[bytes], nbytes: list[int]) -> list[Value | None] | None:
        if self.router is not None:
            return self._cluster_values(keys)
        deadline = time.monotonic() + self.timeout_s
        reply = exchange(
            self.client.connection_pool, self.errors, [resp_command(b"MGET", *keys)], deadline, self._max_bulk
        )[0]
        if not is_values(reply, len(keys)):
            raise BadReply(f"MGET of {len(keys)} keys answered {reply!r:.80}")
        return list(reply)

    def _cluster_values(self, keys: list[bytes]) -> list[Value | None] | None:
        """``read`` on a cluster: one MGET per slot group, each master's pipelined; values of a node
        that is down, slow or failing are absent."""
        router = self.router
        assert router is not None
        slots: list[int] = []
        commands: list[list[Any]] = []
        groups: list[list[int]] = []
        for slot, group in group_by_slot(keys).items():
            slots.append(slot)
            groups.append(group)
            commands.append([resp_command(b"MGET", *[keys[i] for i in group])])
        replies = router.run(slots, commands, "fetch", False, lambda i, reply: is_values(reply, len(groups[i])))
        if replies is None:
            return None
        out: list[Value | None] = [None] * len(keys)
        for group, reply in zip(groups, replies):
            if isinstance(reply, list):
                for i, v in zip(group, reply):
                    out[i] = v
        return out

    # ------------------------------------------------------------------ write
    def write(self, keys: list[bytes], values: list[list[Any]], results: list[Any]) -> None:
        """One MSET, or pipelined ``SET key value EX ttl_s`` with a TTL. Values go out with one
        ``sendmsg`` straight from where they are: no copy into a command buffer, and the GIL is
        released while the kernel copies."""
        if self.router is not None:
            self._write_cluster(keys, values, results)
            return
        ttl = self._ttl
        parts: list[Any] = []
        tail = b"\r\n" + (b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) if ttl else b"")
        cmd = b"*5\r\n$3\r\nSET\r\n" if ttl else b""
        before = b"" if ttl else b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(keys))
        for key, value in zip(keys, values):
            size = 0
            for part in value:
                size += len(part)
            parts.append(before + cmd + b"$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size))
            parts.extend(value)
            before = tail
        parts.append(tail)
        replies = len(keys) if ttl else 1
        pool = self.client.connection_pool
        conn: Any = None
        reader: ReplyReader | None = None
        try:
            conn = connection(pool, self.errors)
            send(conn, parts)
            # (the deadline starts once the batch is sent: up to a batch's bytes go out first)
            reader = ReplyReader(conn, time.monotonic() + self.timeout_s, self._max_bulk)
            for _ in range(replies):
                reply = reader.reply()
                if isinstance(reply, ErrorReply):  # e.g. OOM (noeviction, or nothing to evict): lost
                    outcome: Any = reply
                elif reply == b"OK":
                    outcome = True
                else:
                    raise BadReply(f"a write answered {reply!r:.80}")
                if ttl:
                    results.append(outcome)
                else:
                    results.extend([outcome] * len(keys))
        except self.errors:
            if conn is not None:
                conn.disconnect()
            raise
        finally:
            if reader is not None:
                reader.close()
            if conn is not None:
                pool.release(conn)

    def _write_cluster(self, keys: list[bytes], values: list[list[Any]], results: list[Any]) -> None:
        """``write`` on a cluster: one MSET per slot group (one SET per page with a TTL), each
        master's pipelined; writes to a node that is down or failing are dropped."""
        router = self.router
        assert router is not None
        ttl = self._ttl
        expiry = b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) if ttl else b""
        slots: list[int] = []
        commands: list[list[Any]] = []
        members: list[list[int]] = []
        for slot, group in group_by_slot(keys).items():
            subgroups = [[i] for i in group] if ttl else [group]
            for sub in subgroups:
                parts: list[Any] = [b"*5\r\n$3\r\nSET\r\n" if ttl else b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(sub))]
                for i in sub:
                    size = 0
                    for part in values[i]:
                        size += len(part)
                    parts.append(b"$%d\r\n%s\r\n$%d\r\n" % (len(keys[i]), keys[i], size))
                    parts.extend(values[i])
                    parts.append(b"\r\n")
                if ttl:
                    parts.append(expiry)
                slots.append(slot)
                commands.append(parts)
                members.append(sub)
        replies = router.run(slots, commands, "write", True, lambda i, reply: reply == b"OK")
        if replies is None:
            raise NODE_DOWN
        outcomes: list[Any] = [None] * len(keys)
        for reply, sub in zip(replies, members):
            outcome = None if reply is NODE_DOWN else reply if isinstance(reply, BaseException) else True
            for i in sub:
                outcomes[i] = outcome
        results.extend(outcomes)

    # ------------------------------------------------------------------ the rest
    def delete(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        if self.router is not None:
            by_slot = group_by_slot(keys)
            commands = [[resp_command(b"DEL", *[keys[i] for i in group])] for group in by_slot.values()]
            replies = self.router.run(list(by_slot), commands, "delete", True, lambda i, r: type(r) is int)
            return sum(r for r in replies or [] if type(r) is int)
        deadline = time.monotonic() + self.timeout_s
        reply = exchange(
            self.client.connection_pool, self.errors, [resp_command(b"DEL", *keys)], deadline, self._max_bulk
        )[0]
        if type(reply) is not int:
            raise BadReply(f"DEL answered {reply!r:.80}")
        return reply

    def healthy(self) -> bool:
        for client in self._clients():
            deadline = time.monotonic() + self.timeout_s
            if (
                exchange(client.connection_pool, self.errors, [resp_command(b"PING")], deadline, self._max_bulk)[0]
                != b"PONG"
            ):
                return False
        return True

    def _clients(self) -> list[Any]:
        router = self.router
        if router is None:
            return [self.client]
        if not router.refresh():  # every master
            raise ConnectionError("no cluster node answers")
        return [n.client for n in router.masters()]

    def set_quota(self, quota: int) -> bool:
        """The server's ``maxmemory`` (every master's: CONFIG SET is per server), ``allkeys-lru``."""
        commands = [
            resp_command(b"CONFIG", b"SET", b"maxmemory-policy", b"allkeys-lru"),
            resp_command(b"CONFIG", b"SET", b"maxmemory", b"%d" % quota),
        ]
        for client in self._clients():
            deadline = time.monotonic() + self.timeout_s
            for reply in exchange(client.connection_pool, self.errors, commands, deadline, self._max_bulk):
                if reply != b"OK":
                    raise BadReply(f"CONFIG SET answered {reply!r:.80}")
        return True

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        else:
            with contextlib.suppress(*self.errors):
                self.client.close()

    @property
    def node_errors(self) -> int:
        router = self.router
        return router.read_errors + router.write_errors if router is not None else 0

    @property
    def nodes_connected(self) -> bool:
        router = self.router
        return router is None or router.connected
