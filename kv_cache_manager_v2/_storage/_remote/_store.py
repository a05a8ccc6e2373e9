"""The remote store: ``RemoteStore``, what the remote tier reads from (``lookup``, ``fetch``) and writes
to (``RemoteWriter``) through one backend, with its statistics. The package's doc tells the whole
design."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..._common import RemoteStatistics
from ..._config import RemoteCacheTierConfig
from ._backend import LOG, Value
from ._writer import RemoteWriter

_T = TypeVar("_T")


class RemoteStore(RemoteWriter):
    """The remote tier's store for one manager (see the module doc).

    ``lookup``/``fetch``/``enqueue`` are called on the scheduler's thread (one at a time, like the
    manager); the writer thread only pops the queue. Each counter is written by one thread.

    Deeper because: the reads (here) and the write queue (``RemoteWriter``) share one client
    (``RemoteClient``: the backend, the keys, the down state); the writer's thread uses only the
    writer's part.
    """

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes, max_page_bytes: int) -> None:
        super().__init__(cfg, fingerprint, max_page_bytes)
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

    def lookup(self, keys: list[bytes], nbytes: list[int]) -> list[bool] | None:
        """Whether each key holds a value of ``nbytes[i]`` bytes, in one call; None when the store is
        down, slow (no complete answer within ``timeout_ms`` of the call) or failing (count it as all
        misses)."""
        if not keys:
            return []
        if self._skipped():
            return None
        self.lookups += 1
        self.looked_up_pages += len(keys)
        backend = self.backend
        return self._read("lookup", lambda: backend.lookup(keys, nbytes))

    def fetch(self, keys: list[bytes], nbytes: list[int]) -> list[Value | None] | None:
        """Every key's whole value (None: absent or not of ``nbytes[i]`` bytes) in one call; None when
        it fails (or takes more than ``timeout_ms``)."""
        if not keys:
            return []
        if self._skipped():
            return None
        backend = self.backend
        return self._read("fetch", lambda: backend.read(keys, nbytes))

    def fetch_into(self, keys: list[bytes], targets: list[list[memoryview]]) -> list[bool] | None:
        """Every key's whole value into ``targets[i]`` (its parts, in order: ``RemoteBackend.read_into``)
        in one call: True where it was read whole; None when the call fails (or takes more than
        ``timeout_ms``): then the targets may still be written until ``backend.busy()`` is False."""
        if not keys:
            return []
        if self._skipped():
            return None
        backend = self.backend
        return self._read("fetch", lambda: backend.read_into(keys, targets))

    def _skipped(self) -> bool:
        """Whether the store is down: the call is skipped (counted in ``skipped_lookups``)."""
        if self.is_down:
            self.skipped_lookups += 1
            return True
        return False

    def _read(self, what: str, call: Callable[[], _T | None]) -> _T | None:
        """``call()``, or None (a miss) where it raises an outage error or returns None (no node of the
        store answers): then the error is counted and the outage begins (``_failed``)."""
        try:
            out = call()
        except self._errors as e:
            self.read_errors += 1
            self._failed(what, e)
            return None
        if out is None:
            self.read_errors += 1
            self._failed(f"{what} (no node of the store answers)", ConnectionError("no node answers"))
            return None
        self._succeeded()
        return out

    # ------------------------------------------------------------------ background reads
    @property
    def reads_in_background(self) -> bool:
        """Whether ``background_read`` serves this store (its backend serves reads from a worker thread)."""
        return self.backend.reads_in_background

    def background_read(self, keys: list[bytes], nbytes: list[int], values: bool) -> list[Any] | BaseException:
        """A lookup's (``values`` False: whether each key holds ``nbytes[i]`` bytes) or a fetch's round
        trip on a worker thread (the backend's connection for that thread, the same ``timeout_ms``
        deadline), touching no counter or state: the replies (values as ``bytes``: a backend's views
        last only until the thread's next read), or the error; ``account_background`` counts it on
        the scheduler's thread."""
        backend = self.backend
        try:
            if values:
                got = backend.read(keys, nbytes)
                return ConnectionError("no node answers") if got is None else [_own(v) for v in got]
            found = backend.lookup(keys, nbytes)
            return ConnectionError("no node answers") if found is None else list(found)
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
        """Make the store keep at most ``quota`` bytes (Redis: the server's ``maxmemory`` with LRU
        eviction over all keys). Returns False (with a warning) when the store is unreachable or
        refuses, or its backend cannot set a quota."""
        backend = self.backend
        done = self._read("set the quota", lambda: backend.set_quota(quota))
        if done is False:
            LOG.warning("remote KV tier %s: this backend cannot set a quota (its operator does)", self._url)
        return done is True

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
        """Failed calls (with a cluster: failed node round trips too)."""
        return self.read_errors + self.write_errors + self.backend.node_errors

    @property
    def connected(self) -> bool:
        """Whether the last call (with a cluster: the last one of every node) succeeded."""
        return self._connected and self.backend.nodes_connected

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
        left is dropped) and disconnect. Returns False if the writer did not stop (it may still read
        handed-off slots) or a read past its deadline may still write slots: their memory must not be
        released."""
        if not self._stopping:
            if drain_timeout_s > 0 and not self.is_down:
                self.flush(drain_timeout_s)
            self._stopping = True
            self._down_until = float("inf")  # what is still queued is dropped, not sent
            self._wake.set()
        # each backend call is bounded by timeout_ms; the rest of the queue is dropped at once
        self._writer.join(2 * self.cfg.timeout_ms / 1000.0 + 5.0)
        if self._writer.is_alive():
            LOG.error("remote KV tier writer did not stop; keeping the memory it may still read")
            return False
        self.backend.close()
        if self.backend.busy():
            LOG.error("remote KV tier: a read past its deadline may still write local memory; keeping it")
            return False
        return True


def _own(value: Value | None) -> bytes | None:
    """``value`` as bytes of its own (None stays None)."""
    return value if value is None or type(value) is bytes else bytes(value)
