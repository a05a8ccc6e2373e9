"""The remote store: ``RemoteStore``, what the remote tier reads from (``lookup``, ``fetch``) and writes
to (``RemoteWriter``) one Redis server or cluster, with its statistics. The package's doc tells the
whole design."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..._common import RemoteStatistics
from ..._config import RemoteCacheTierConfig
from ._client import LOG
from ._cluster import NODE_DOWN, group_by_slot
from ._protocol import LOOKUP_LUA, BadReply, ErrorReply, exchange, is_lengths, is_values, resp_command
from ._writer import RemoteWriter

_T = TypeVar("_T")


class RemoteStore(RemoteWriter):
    """The Redis side of the remote tier for one manager (see the module doc).

    ``lookup``/``fetch``/``enqueue`` are called on the scheduler's thread (one at a time, like the
    manager); the writer thread only pops the queue. Each counter is written by one thread.
    """

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes, max_page_bytes: int) -> None:
        super().__init__(cfg, fingerprint, max_page_bytes)
        self._lookup_sha = ""
        self._use_script = True
        # scheduler-thread counters
        self.lookups = 0
        self.looked_up_pages = 0
        self.found_pages = 0
        self.fetched_pages = 0
        self.fetched_bytes = 0
        self.hit_blocks = 0
        self.corrupt_pages = 0
        self.read_errors = 0
        self.skipped_lookups = 0
        self._writer.start()
        if cfg.quota is not None:
            self.apply_quota(cfg.quota)

    def lookup(self, keys: list[bytes]) -> list[int] | None:
        """The length of each key's value (0: absent) in one round trip; None when the server is
        down, slow (no complete answer within ``timeout_ms`` of the call) or failing (count it as all
        misses)."""
        if not keys:
            return []
        if self.is_down:
            self.skipped_lookups += 1
            return None
        self.lookups += 1
        self.looked_up_pages += len(keys)
        if self.router is not None:
            return self._cluster_lengths(keys)
        return self._read("lookup", lambda: self._lengths(keys, time.monotonic() + self._timeout_s))

    def _read(self, what: str, round_trip: Callable[[], _T | None]) -> _T | None:
        """``round_trip()``, or None (a miss) where it raises a client error or returns None (no cluster
        node answers): then the error is counted and the outage begins (``_failed``)."""
        try:
            out = round_trip()
        except self._errors as e:
            self.read_errors += 1
            self._failed(what, e)
            return None
        if out is None:
            self.read_errors += 1
            self._failed(f"{what} (no cluster node answers)", NODE_DOWN)
            return None
        self._succeeded()
        return out

    def _lengths(self, keys: list[bytes], deadline: float) -> list[int]:
        pool = self.client.connection_pool
        n = len(keys)
        for _ in range(2 if self._use_script else 0):  # (again after NOSCRIPT)
            if not self._lookup_sha:
                sha = exchange(
                    pool,
                    self._errors,
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
            reply = exchange(pool, self._errors, [command], deadline, self._max_bulk)[0]
            if is_lengths(reply, n):
                return list(reply)
            if not isinstance(reply, ErrorReply):
                raise BadReply(f"the Lua lookup of {n} keys answered {reply!r:.80}")
            if str(reply).startswith("NOSCRIPT"):  # the server restarted (scripts are not persisted)
                self._lookup_sha = ""
            else:  # scripting disabled on this server: pipeline instead
                self._lua_refused(reply, "pipelined STRLEN")
                break
        replies = exchange(pool, self._errors, [resp_command(b"STRLEN", k) for k in keys], deadline, self._max_bulk)
        for x in replies:
            if not (type(x) is int and x >= 0) and not isinstance(x, ErrorReply):
                raise BadReply(f"STRLEN answered {x!r:.80}")
        # a key of another type answers WRONGTYPE: a miss for that key only
        return [x if type(x) is int else 0 for x in replies]

    def _lua_refused(self, reply: ErrorReply, instead: str) -> None:
        LOG.warning(
            "remote KV tier %s: Lua lookups refused (%s); using %s", self._url, self._scrub(str(reply)), instead
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

        replies = self._read("lookup", lambda: router.run(slots, commands, "lookup", False, valid))
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

    def fetch(self, keys: list[bytes]) -> list[bytes | None] | None:
        """Every key's value (None: absent) in one MGET; None when the round trip fails (or takes
        more than ``timeout_ms``)."""
        if not keys:
            return []
        if self.is_down:
            self.skipped_lookups += 1
            return None
        if self.router is not None:
            return self._cluster_fetch(keys)
        return self._read("fetch", lambda: self._values(keys))

    def _values(self, keys: list[bytes]) -> list[bytes | None]:
        deadline = time.monotonic() + self._timeout_s
        reply = exchange(
            self.client.connection_pool, self._errors, [resp_command(b"MGET", *keys)], deadline, self._max_bulk
        )[0]
        if not is_values(reply, len(keys)):
            raise BadReply(f"MGET of {len(keys)} keys answered {reply!r:.80}")
        return list(reply)

    def _cluster_fetch(self, keys: list[bytes]) -> list[bytes | None] | None:
        """``fetch`` on a cluster: one MGET per slot group, each master's pipelined; values of a node
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
        replies = self._read(
            "fetch",
            lambda: router.run(slots, commands, "fetch", False, lambda i, reply: is_values(reply, len(groups[i]))),
        )
        if replies is None:
            return None
        out: list[bytes | None] = [None] * len(keys)
        for group, reply in zip(groups, replies):
            if isinstance(reply, list):
                for i, v in zip(group, reply):
                    out[i] = v
        return out

    # ------------------------------------------------------------------ background reads
    @property
    def reads_in_background(self) -> bool:
        """Whether ``background_read`` serves this store (one server; a cluster reads on the scheduler's thread)."""
        return self.router is None

    def background_read(self, keys: list[bytes], values: bool) -> list[Any] | BaseException:
        """A lookup's (``values`` False: lengths) or a fetch's round trip on a worker thread (its own
        connection from the pool, the same ``timeout_ms`` deadline), touching no counter or state:
        the replies, or the error; ``account_background`` counts it on the scheduler's thread."""
        try:
            if values:
                return list(self._values(keys))
            return list(self._lengths(keys, time.monotonic() + self._timeout_s))
        except self._errors as e:
            return e

    def account_background(self, keys: list[bytes], values: bool, outcome: list[Any] | BaseException) -> bool:
        """Count a ``background_read`` like ``lookup``/``fetch`` count theirs (an error begins the
        outage); returns whether it answered."""
        if not values:
            self.lookups += 1
            self.looked_up_pages += len(keys)
        if isinstance(outcome, BaseException):
            self.read_errors += 1
            self._failed("fetch" if values else "lookup", outcome)
            return False
        self._succeeded()
        return True

    def apply_quota(self, quota: int) -> bool:
        """Set the server's ``maxmemory`` to ``quota`` bytes with LRU eviction over all keys.
        Returns False (with a warning) when the server is unreachable or refuses."""
        return self._read("CONFIG SET maxmemory", lambda: self._set_quota(quota)) is not None

    def _set_quota(self, quota: int) -> bool:
        commands = [
            resp_command(b"CONFIG", b"SET", b"maxmemory-policy", b"allkeys-lru"),
            resp_command(b"CONFIG", b"SET", b"maxmemory", b"%d" % quota),
        ]
        router = self.router
        if router is None:
            clients = [self.client]
        else:  # every master (CONFIG SET is per server)
            if not router.refresh():
                raise ConnectionError("no cluster node answers")
            clients = [n.client for n in router.masters()]
        for client in clients:
            deadline = time.monotonic() + self._timeout_s
            for reply in exchange(client.connection_pool, self._errors, commands, deadline, self._max_bulk):
                if reply != b"OK":
                    raise BadReply(f"CONFIG SET answered {reply!r:.80}")
        return True

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
