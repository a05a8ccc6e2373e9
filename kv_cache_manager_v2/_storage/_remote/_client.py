"""One remote store's connection side: the client of one server (or a cluster's router), page keys,
and the down state that turns a failed round trip into misses for ``retry_interval_ms``."""

from __future__ import annotations

import binascii
import logging
import time
from typing import Any

from ..._config import RemoteCacheTierConfig, redact_url
from ._cluster import ClusterRouter
from ._protocol import reply_bound, url_password, url_username

LOG = logging.getLogger("kv_cache_manager_v2")


class RemoteClient:
    """The server (or cluster) a ``RemoteStore`` talks to, its keys and its down state; the base of
    the writer (``RemoteWriter``) and of the store's reads (``RemoteStore``)."""

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes, max_page_bytes: int) -> None:
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
        #: one call's replies (with a cluster: one node's) come within this, or the call fails
        self._timeout_s = timeout
        #: the longest bulk string a valid reply holds (a page's value): a longer one is a bad reply
        self._max_bulk = reply_bound(max_page_bytes)
        self._url = redact_url(cfg.url)
        password = url_password(cfg.url)
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
            username = url_username(cfg.url)
            tls = cfg.url.startswith("rediss+")

            def make_client(host: str, port: int) -> Any:
                return redis.Redis(host=host, port=port, username=username, password=password, ssl=tls, **options)

            self.router = ClusterRouter(cfg, make_client, self._errors, self._max_bulk)
        else:
            self.client = redis.Redis.from_url(cfg.url, **options)
        #: key prefix per layer group: ``<prefix><layer group>:``; the block key's hex follows
        self._lc_prefix: list[bytes] = []
        self._ttl = b"%d" % cfg.ttl_s if cfg.ttl_s is not None else b""
        self._retry_s = cfg.retry_interval_ms / 1000.0
        #: the server counts as down until this time.monotonic() value
        self._down_until = 0.0
        self._connected = True
        self._warned_refused = False

    # ------------------------------------------------------------------ keys and state
    def page_key(self, block_key: bytes, layer_group: int) -> bytes:
        prefixes = self._lc_prefix
        while len(prefixes) <= layer_group:
            prefixes.append(self.prefix + b"%d:" % len(prefixes))
        return prefixes[layer_group] + binascii.hexlify(block_key)

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

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

    def _refused(self, e: BaseException) -> None:
        if not self._warned_refused:
            self._warned_refused = True
            LOG.warning("remote KV tier %s refuses writes (%s); they are dropped", self._url, self._scrub(str(e)))
