"""One remote store's connection side: its backend (chosen by the URL's scheme, ``_registry.py``), page
keys, and the down state that turns a failed call into misses for ``retry_interval_ms``."""

from __future__ import annotations

import binascii
import time

from ..._config import RemoteCacheTierConfig
from ._backend import LOG, RemoteBackend
from ._registry import backend_class


def open_backend(cfg: RemoteCacheTierConfig, max_page_bytes: int) -> RemoteBackend:
    """The backend serving ``cfg.url``, connected (its module imported now: a backend's client
    library is needed only where a URL names it)."""
    backend = backend_class(cfg.url)(cfg, max_page_bytes)
    assert isinstance(backend, RemoteBackend)
    return backend


class RemoteClient:
    """The store a ``RemoteStore`` talks to (its ``backend``), its keys and its down state; the base of
    the writer (``RemoteWriter``) and of the store's reads (``RemoteStore``)."""

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes, max_page_bytes: int) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.prefix = f"kvcm:{cfg.namespace}:{fingerprint.hex()}:".encode()
        self.backend = open_backend(cfg, max_page_bytes)
        #: exceptions of a failed call (an outage)
        self._errors: tuple[type[BaseException], ...] = self.backend.errors
        self._timeout_s = cfg.timeout_ms / 1000.0
        self._url = self.backend.url
        #: words that must not reach a log line (the password)
        self._secret = self.backend.secret
        #: key prefix per layer group: ``<prefix><layer group>:``; the block key's hex follows
        self._lc_prefix: list[bytes] = []
        self._retry_s = cfg.retry_interval_ms / 1000.0
        #: the store counts as down until this time.monotonic() value
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
        """A call failed: the store counts as down for ``retry_interval_ms``; warn once per outage."""
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
