"""A TCP proxy on loopback that delays every reply: a remote tier "far away" for tests and
benchmarks (``DelayProxy(redis_port, 0.05)``: every reply of the server reaches the client 50 ms
after the server sent it; requests go through at once). One connection to the server per client
connection; bytes are forwarded unchanged, in order."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time


class DelayProxy:
    """Listens on ``127.0.0.1:<port>`` (a free port) and forwards to ``127.0.0.1:upstream_port``,
    holding each chunk of the server's replies for ``delay_s`` seconds. ``close`` stops it."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5.0)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()
            threading.Thread(target=_read_replies, args=(server, due, self.delay_s), daemon=True).start()
            threading.Thread(target=_send_replies, args=(client, due), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Client -> server, at once."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _read_replies(server: socket.socket, due: queue.SimpleQueue[tuple[float, bytes]], delay_s: float) -> None:
    """Server -> queue, each chunk stamped with the time it may reach the client."""
    try:
        while True:
            data = server.recv(1 << 16)
            if not data:
                break
            due.put((time.monotonic() + delay_s, data))
    except OSError:
        pass
    due.put((0.0, b""))


def _send_replies(client: socket.socket, due: queue.SimpleQueue[tuple[float, bytes]]) -> None:
    """Queue -> client, each chunk when it is due."""
    try:
        while True:
            when, data = due.get()
            if not data:
                break
            wait = when - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            client.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        client.shutdown(socket.SHUT_WR)
