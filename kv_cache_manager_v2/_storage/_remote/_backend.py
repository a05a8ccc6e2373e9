"""The remote-store interface: what one kind of shared store (a backend, chosen by the URL's scheme in
``_registry.py``) does for the remote tier. Batch first: every call takes many keys.

Keys are ``_client``'s (scope + block key, layer group, layout fingerprint, namespace); values are
``_value``'s (a header with a checksum, then the page), written and read whole. Each call is bounded
by the deadline ``timeout_ms`` (a backend that cannot bound a call itself runs it on a helper thread
and stops waiting). An outage is a call that raises one of ``errors`` (or returns None): the store
then counts the backend down for ``retry_interval_ms`` and every lookup is a miss; nothing raises into
the engine. Calls come from the scheduler's thread (lookups, reads), the writer thread (writes) and
possibly a loader's worker thread (reads): a backend serves concurrent calls, each on a connection
of its own.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from ..._config import RemoteCacheTierConfig, redact_url

LOG = logging.getLogger("kv_cache_manager_v2")

#: a value as a backend returns it (bytes or a view of memory the backend reads into)
Value = Any


class RemoteBackend(ABC):
    """One remote store (a server, a cluster, a distributed store) for one manager."""

    def __init__(self, cfg: RemoteCacheTierConfig, max_page_bytes: int) -> None:
        self.cfg = cfg
        #: the URL without its password (for log lines)
        self.url = redact_url(cfg.url)
        #: a call's deadline, in seconds from its start
        self.timeout_s = cfg.timeout_ms / 1000.0
        #: the largest value: a header and the largest page
        self.max_page_bytes = max_page_bytes
        #: exceptions that mean an outage (raised by calls, caught by the store)
        self.errors: tuple[type[BaseException], ...] = (OSError,)
        #: words that must not reach a log line (a password in the URL)
        self.secret = ""
        #: whether ``lookup``/``read`` may be called from a loader's worker thread too
        self.reads_in_background = True

    @staticmethod
    def check_url(url: str) -> None:
        """ValueError, saying what is wrong and what is allowed, where this backend cannot serve ``url``
        (``RemoteCacheTierConfig`` checks its URL with it)."""
        return None

    @abstractmethod
    def lookup(self, keys: list[bytes], nbytes: list[int]) -> list[bool] | None:
        """Whether each key holds a value of ``nbytes[i]`` bytes, as far as the store tells without
        reading it (a value found here may still be a miss when read); None: an outage."""

    @abstractmethod
    def read(self, keys: list[bytes], nbytes: list[int]) -> list[Value | None] | None:
        """Each key's whole value (None: absent, or not of ``nbytes[i]`` bytes); None: an outage. A
        view into the backend's buffers stays valid until the same thread's next ``read``."""

    def read_into(self, keys: list[bytes], targets: list[list[memoryview]]) -> list[bool] | None:
        """Each key's whole value into ``targets[i]``, its parts in order (the value must be exactly
        their length): True where it was read so; None: an outage. Targets a call past its deadline may
        still write are not reused until ``busy`` says it returned. Here: ``read`` and one copy."""
        values = self.read(keys, [sum(len(part) for part in parts) for parts in targets])
        if values is None:
            return None
        out: list[bool] = []
        for value, parts in zip(values, targets):
            if value is not None:
                view = memoryview(value)
                at = 0
                for part in parts:
                    part[:] = view[at : at + len(part)]
                    at += len(part)
            out.append(value is not None)
        return out

    def busy(self) -> bool:
        """Whether a call past its deadline may still write memory it was given (``read_into``'s targets)."""
        return False

    @abstractmethod
    def write(self, keys: list[bytes], values: list[list[Any]], results: list[Any]) -> None:
        """Store each value (its parts, concatenated) whole under its key, ``cfg.ttl_s`` applying.
        Appends one result per value, in order: True (written), None (dropped: the node holding it
        is down) or an exception (refused, e.g. the store is full). Raises ``errors`` on an outage:
        values without a result are dropped."""

    @abstractmethod
    def delete(self, keys: list[bytes]) -> int:
        """Remove ``keys``; the number removed."""

    @abstractmethod
    def healthy(self) -> bool:
        """Whether the store answers now (one bounded round trip)."""

    @abstractmethod
    def set_quota(self, quota: int) -> bool:
        """Make the store keep at most ``quota`` bytes, evicting least recently used values beyond it;
        False where this backend cannot set it (the store's operator does)."""

    def register(self, view: memoryview) -> None:
        """``view`` is memory values are written from (the write ring, pools whose slots are handed
        off): a zero-copy backend registers it with its transport."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Disconnect (no call follows)."""

    @property
    def node_errors(self) -> int:
        """Failed round trips the backend counted itself (a cluster's nodes)."""
        return 0

    @property
    def nodes_connected(self) -> bool:
        """Whether the backend's last round trip to each of its nodes succeeded."""
        return True
