"""The Mooncake Store backend: ``mooncake://host:port?metadata=...`` (the master's RPC address; the
query gives the metadata server, the transport and this client's share of the store's memory).

The client (``mooncake.store.MooncakeDistributedStore``) moves values with its zero-copy batch calls
between the store and memory registered with it: the write ring and the pools whose slots are handed
off (``register``), values written whole straight from there (``batch_put_from_multi_buffers``: the
header from a registered area, the page where it lies), and read whole into a registered buffer of the
reading thread (``batch_get_into``; a value of another size fails there, a miss) or, where the local
cache reads into slots of registered pools, straight into them (``batch_get_into_multi_buffers``: the
header into the thread's buffer, each pool's part into its slot; the value's checksum is verified there
before the page is published). A lookup is one
``batch_is_exist``. Mooncake evicts and leases on its own: an object it dropped is a miss; a value of
the wrong size, or whose checksum fails (``_value``), is a miss too.

Each call runs on a helper thread and is waited for until the deadline ``timeout_ms``: a call past it
is an outage (the client is rebuilt on the next call, as after a failed RPC to the master: a restarted
master knows nothing of the old client), and no memory that call may still touch is reused until it
returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import queue
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs, urlsplit

import numpy as np
from mypy_extensions import mypyc_attr

from ..._config import RemoteCacheTierConfig, redact_url
from ._backend import RemoteBackend, Value

_T = TypeVar("_T")

#: status codes of a failed exchange with the master or a peer (an outage, not a missing key)
_OUTAGE_CODES: Final = range(-1099, -899)
#: defaults of the URL's query: this client's share of the store's memory (Mooncake's global
#: segment: the store keeps values there, every client reaching them), and its transfer buffer
DEFAULT_SEGMENT: Final = 256 << 20
DEFAULT_BUFFER: Final = 16 << 20
#: helper threads running the client's calls (the scheduler's reads, the writer, a loader)
_HELPERS: Final = 4
#: a read into many buffers is issued in batches of at most this many bytes and keys (one batch of a
#: gigabyte over TCP fails its last transfers: status -800)
_READ_BATCH_BYTES: Final = 64 << 20
_READ_BATCH_KEYS: Final = 256


class DaemonHelpers:
    """Helper threads running submitted calls, daemons: a call stuck on a master that never answers
    does not hold the process at exit (a ``ThreadPoolExecutor``'s threads are joined then)."""

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        for i in range(count):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run ``fn(*args)`` on a helper thread; its future."""
        future: Future[_T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

    def shutdown(self) -> None:
        """Let the threads end once the calls queued before are done (not waiting for them)."""
        for _ in range(self._count):
            self._jobs.put(None)


def _abandon(client: Any) -> None:
    """Keep ``client`` alive until the process ends (its destructor would close it: see ``_drop_client``)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


@mypyc_attr(native_class=False)
class MooncakeError(ConnectionError):
    """A Mooncake call failed as a whole (the master unreachable, no answer in time)."""


#: what a Mooncake URL may say
_URL_FORM: Final = (
    "mooncake://host:port?metadata=<http://host:port/metadata, etcd://host:port or P2PHANDSHAKE>"
    "[&protocol=tcp|rdma][&device=<RDMA devices>][&segment=<bytes>][&buffer=<bytes>][&hostname=<this host>]"
)
#: the transports of Mooncake's transfer engine a URL may name
_PROTOCOLS: Final = ("tcp", "rdma")


def parse_url(url: str) -> dict[str, Any]:
    """The client's ``setup`` arguments from a Mooncake URL (``_URL_FORM``); ValueError saying what is
    wrong, with the form allowed."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port  # (ValueError when out of range)
    except ValueError as e:
        raise ValueError(f"a Mooncake URL is {_URL_FORM}; got {shown!r} ({e})") from None
    if parts.scheme != "mooncake" or not parts.hostname or port is None:
        raise ValueError(f"a Mooncake URL is {_URL_FORM}; got {shown!r} (the master's host:port)")
    if parts.path not in ("", "/") or parts.fragment:
        raise ValueError(f"a Mooncake URL is {_URL_FORM}; got {shown!r} (a path or fragment)")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    allowed = {"metadata", "protocol", "device", "segment", "buffer", "hostname"}
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ValueError(f"Mooncake URL: unknown parameters {unknown}; allowed: {sorted(allowed)} ({_URL_FORM})")
    metadata = query.get("metadata", "")
    if not metadata:
        raise ValueError(f"Mooncake URL: metadata=<the metadata server> is required ({_URL_FORM})")
    if any(c.isspace() for c in metadata):
        raise ValueError(f"Mooncake URL: metadata must be a server's URL or P2PHANDSHAKE, got {metadata!r}")
    protocol = query.get("protocol") or "tcp"
    if protocol not in _PROTOCOLS:
        raise ValueError(f"Mooncake URL: protocol must be one of {_PROTOCOLS}, got {protocol!r}")
    sizes = {}
    for name, default in (("segment", DEFAULT_SEGMENT), ("buffer", DEFAULT_BUFFER)):
        text = query.get(name, str(default))
        if not text.isdigit():
            raise ValueError(f"Mooncake URL: {name} must be a number of bytes, got {text!r}")
        sizes[name] = int(text)
    hostname = query.get("hostname", "")
    if any(c.isspace() or c in "/?#@" for c in hostname):
        raise ValueError(f"Mooncake URL: hostname must be this host's name or address, got {hostname!r}")
    host = parts.hostname
    loopback = host in ("127.0.0.1", "localhost", "::1")
    return {
        "local_hostname": hostname or ("127.0.0.1" if loopback else socket.gethostname()),
        "metadata_server": metadata,
        "global_segment_size": sizes["segment"],
        "local_buffer_size": sizes["buffer"],
        "protocol": protocol,
        "rdma_devices": query.get("device", ""),
        "master_server_addr": f"{host}:{port}",
    }


def address(view: memoryview) -> int:
    """Where ``view``'s first byte lies (read-only views too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)


class _Staging:
    """A registered buffer of one thread: read values land here, headers of written ones lie here."""

    __slots__ = ("addr", "mem", "size")

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.size = size


class MooncakeBackend(RemoteBackend):
    """A Mooncake Store cluster, through one client of this process (see the module doc)."""

    def __init__(self, cfg: RemoteCacheTierConfig, max_page_bytes: int) -> None:
        super().__init__(cfg, max_page_bytes)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "RemoteCacheTierConfig with a mooncake:// URL needs the Mooncake Store client: pip install "
                "'kv_cache_manager_v2[mooncake]' (and Debian's libibverbs1, librdmacm1, libnuma1): "
                f"{type(e).__name__}: {e}"
            ) from None
        self._make: Callable[[], Any] = MooncakeDistributedStore
        self._args = parse_url(cfg.url)
        if cfg.quota is not None:  # this client's share of the store's memory
            self._args["global_segment_size"] = cfg.quota
        self.errors = (MooncakeError, OSError)
        self._helpers = DaemonHelpers(_HELPERS, "kvcm-mooncake")
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._client: Any = None
        #: memory registered with the client (again with a new one): (address, bytes)
        self._registered: list[tuple[int, int]] = []
        #: addresses of ``_registered`` the current client knows
        self._known: set[int] = set()
        #: staging buffers outgrown (kept mapped: see ``_staging``)
        self._retired: list[_Staging] = []
        self._local = threading.local()
        #: calls past their deadline, with the memory they may still touch
        self._stuck: list[tuple[Future[Any], object]] = []
        self._closed = False
        #: whether the last call got its answers (else closing might wait for a hung master)
        self._answered = True

    # ------------------------------------------------------------------ calls
    def _call(self, what: str, fn: Callable[[Any], _T], memory: object = None, late_wait: bool = False) -> _T:
        """``fn(client)`` on a helper thread within the deadline (the client made first where there is
        none); MooncakeError past it, or while an earlier call past its deadline still runs. With
        ``late_wait`` (a write: the writer reuses the values' memory, the ring and handed-off slots,
        once it returns) a call past its deadline is an outage at once for every other call, but this
        one raises only once the late call has returned (a master that never answers keeps the writer
        there: closing then keeps that memory, see ``RemoteStore.close``)."""
        with self._lock:
            self._stuck = [(f, m) for f, m in self._stuck if not f.done()]
            if self._stuck:
                raise MooncakeError(f"{what}: an earlier call has not returned")
            if self._closed:
                raise MooncakeError(f"{what}: closed")
        future = self._helpers.submit(self._run, fn)
        try:
            out: _T = future.result(self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._stuck.append((future, memory))
                self._answered = False
                self._drop_client()
            if late_wait:
                with contextlib.suppress(BaseException):
                    future.exception()  # (waits until it is done)
            raise MooncakeError(f"{what}: no answer within {self.cfg.timeout_ms} ms") from None
        except BaseException:
            self._answered = False
            raise
        self._answered = True
        return out

    def _run(self, fn: Callable[[Any], _T]) -> _T:
        with self._connecting:  # (one client at a time, made by the first call that needs it)
            client = self._client
            if client is None:
                client = self._connect()
            self._register_new(client)
        return fn(client)

    def _connect(self) -> Any:
        a = self._args
        self._probe(a["metadata_server"])
        client = self._make()
        rc = client.setup(
            a["local_hostname"],
            a["metadata_server"],
            a["global_segment_size"],
            a["local_buffer_size"],
            a["protocol"],
            a["rdma_devices"],
            a["master_server_addr"],
        )
        if rc != 0:
            _abandon(client)  # (its destructor would talk to the master too: see ``_drop_client``)
            raise MooncakeError(f"the client's setup failed (status {rc})")
        with self._lock:
            self._known = set()
            self._client = client
        return client

    def _probe(self, metadata: str) -> None:
        """Whether an HTTP metadata server (the master's own, where it serves one) answers within the
        deadline: the client's ``setup`` holds the GIL while it waits for a hung master, so it is
        called only once the master's process answers."""
        if not metadata.startswith("http://"):
            return
        try:
            with urllib.request.urlopen(f"{metadata}?key=kvcm-probe", timeout=self.timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # it answered (no such key)
        except (OSError, ValueError) as e:
            raise MooncakeError(f"the metadata server does not answer ({type(e).__name__}: {e})") from None

    def _drop_client(self) -> None:
        """Forget the client (the next call makes another). It is never closed nor destroyed: closing
        talks to the master, which may hang, and holds the GIL meanwhile; closing a client after its
        master went away can crash the process. Its memory stays with the process (an outage costs
        one client's segment)."""
        client = self._client
        self._client = None
        if client is not None:
            _abandon(client)

    def _outage(self, what: str, codes: list[int]) -> None:
        """Raise MooncakeError where a status in ``codes`` is a failed exchange (and rebuild the client)."""
        for code in codes:
            if code in _OUTAGE_CODES:
                with self._lock:
                    self._drop_client()
                self._answered = False
                raise MooncakeError(f"{what} failed (status {code})")

    def _staging(self, size: int) -> _Staging:
        """The calling thread's buffer, of at least ``size`` bytes (registered with the client by the
        next call: ``_register_new``). A buffer outgrown stays mapped and registered: a call past its
        deadline may still use it."""
        buf: _Staging | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            new = _Staging(max(size, 1 << 20, 2 * buf.size if buf is not None else 0))
            with self._lock:
                self._registered.append((new.addr, new.size))
                if buf is not None:
                    self._retired.append(buf)
            self._local.buf = buf = new
        return buf

    def _register_new(self, client: Any) -> None:
        """Register with ``client`` the memory it does not know yet (on a helper thread)."""
        with self._lock:
            todo = [r for r in self._registered if r[0] not in self._known]
        for addr, size in todo:
            if client.register_buffer(addr, size) != 0:
                raise MooncakeError("registering memory with the client failed")
            with self._lock:
                self._known.add(addr)

    # ------------------------------------------------------------------ the interface
    @staticmethod
    def check_url(url: str) -> None:
        parse_url(url)

    def register(self, view: memoryview) -> None:
        with self._lock:
            self._registered.append((address(view), len(view)))

    def lookup(self, keys: list[bytes], nbytes: list[int]) -> list[bool] | None:
        names = [k.decode() for k in keys]
        found: list[int] = self._call("lookup", lambda c: c.batch_is_exist(names))
        if len(found) != len(keys):
            raise MooncakeError(f"lookup of {len(keys)} keys answered {len(found)}")
        self._outage("lookup", [x for x in found if x < 0])
        return [x == 1 for x in found]

    def read(self, keys: list[bytes], nbytes: list[int]) -> list[Value | None] | None:
        names = [k.decode() for k in keys]
        offsets = [0]
        for n in nbytes:
            offsets.append(offsets[-1] + n)

        buf = self._staging(offsets[-1])
        ptrs = [buf.addr + off for off in offsets[:-1]]
        got: list[int] = self._call("read", lambda c: list(c.batch_get_into(names, ptrs, nbytes)), buf)
        if len(got) != len(keys):
            raise MooncakeError(f"read of {len(keys)} keys answered {len(got)}")
        self._outage("read", got)
        view = memoryview(buf.mem)
        return [view[offsets[i] : offsets[i] + n] if got[i] == n else None for i, n in enumerate(nbytes)]

    def read_into(self, keys: list[bytes], targets: list[list[memoryview]]) -> list[bool] | None:
        # straight into the targets where they lie in registered memory (the pools' slots); other
        # parts (headers) land in this thread's buffer first and are copied out
        names = [k.decode() for k in keys]
        with self._lock:
            ranges = list(self._registered)
        at = [[address(part) for part in parts] for parts in targets]
        bounce = sum(
            len(p) for parts, a in zip(targets, at) for p, x in zip(parts, a) if not _inside(x, len(p), ranges)
        )
        buf = self._staging(bounce)
        pos = 0
        copies: list[tuple[int, memoryview, int]] = []  # (key, target, staging offset)
        sizes: list[list[int]] = []
        for i, parts in enumerate(targets):
            for j, part in enumerate(parts):
                if not _inside(at[i][j], len(part), ranges):
                    copies.append((i, part, pos))
                    at[i][j] = buf.addr + pos
                    pos += len(part)
            sizes.append([len(part) for part in parts])
        batches: list[tuple[int, int]] = []  # [start, end) of each batch
        start = nbytes = 0
        for i, n in enumerate(sizes):
            if i > start and (nbytes + sum(n) > _READ_BATCH_BYTES or i - start >= _READ_BATCH_KEYS):
                batches.append((start, i))
                start, nbytes = i, 0
            nbytes += sum(n)
        batches.append((start, len(sizes)))

        def get(c: Any) -> list[int]:
            out: list[int] = []
            for b, e in batches:
                out.extend(c.batch_get_into_multi_buffers(names[b:e], at[b:e], sizes[b:e]))
            return out

        got: list[int] = self._call("read", get, (buf, targets))
        if len(got) != len(keys):
            raise MooncakeError(f"read of {len(keys)} keys answered {len(got)}")
        self._outage("read", got)
        ok = [got[i] == sum(sizes[i]) for i in range(len(keys))]  # (a value of another size fails: a miss)
        mem = memoryview(buf.mem)
        for i, part, off in copies:
            if ok[i]:
                part[:] = mem[off : off + len(part)]
        return ok

    def busy(self) -> bool:
        with self._lock:
            return any(not f.done() for f, _ in self._stuck)

    def write(self, keys: list[bytes], values: list[list[Any]], results: list[Any]) -> None:
        names = [k.decode() for k in keys]

        with self._lock:
            ranges = list(self._registered)
        # headers, and parts outside registered memory, are copied to this thread's buffer first
        addrs: list[list[int]] = []
        bounce = 0
        for value in values:
            at = [-1 if isinstance(part, bytes) else address(part) for part in value]
            for a, part in zip(at, value):
                if a < 0 or not _inside(a, len(part), ranges):
                    bounce += len(part)
            addrs.append(at)
        buf = self._staging(bounce)
        mem = buf.mem
        pos = 0
        all_sizes: list[list[int]] = []
        for value, at in zip(values, addrs):
            sizes: list[int] = []
            for i, part in enumerate(value):
                n = len(part)
                if at[i] < 0 or not _inside(at[i], n, ranges):
                    mem[pos : pos + n] = part
                    at[i] = buf.addr + pos
                    pos += n
                sizes.append(n)
            all_sizes.append(sizes)
        codes: list[int] = self._call(
            "write", lambda c: list(c.batch_put_from_multi_buffers(names, addrs, all_sizes)), (buf, values), True
        )
        if len(codes) != len(keys):
            raise MooncakeError(f"write of {len(keys)} keys answered {len(codes)}")
        self._outage("write", codes)
        for code in codes:
            results.append(True if code == 0 else MooncakeError(f"Mooncake refused a value (status {code})"))

    def delete(self, keys: list[bytes]) -> int:
        names = [k.decode() for k in keys]
        codes: list[int] = self._call("delete", lambda c: c.batch_remove(names, True))
        self._outage("delete", codes)
        return sum(1 for x in codes if x == 0)

    def healthy(self) -> bool:
        codes: list[int] = self._call("health", lambda c: c.batch_is_exist(["kvcm:health"]))
        self._outage("health", codes)
        return True

    def set_quota(self, quota: int) -> bool:
        # the store's memory is what its clients give it: this client's share is set at start
        # (``segment``, or ``quota``), so only that quota holds (no warning at start), no other
        return bool(quota == self._args["global_segment_size"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client = self._client
            self._client = None
            if client is not None and (self._stuck or not self._answered):
                _abandon(client)  # the master may hang: closing would hold the GIL meanwhile
                client = None
        if client is not None:
            with contextlib.suppress(FutureTimeout):
                self._helpers.submit(client.close).result(self.timeout_s + 1.0)
        self._helpers.shutdown()


def _inside(addr: int, size: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``[addr, addr + size)`` lies in one registered range."""
    return any(start <= addr and addr + size <= start + n for start, n in ranges)
