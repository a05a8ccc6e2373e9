"""The remote tier against a fake server on loopback (issue #38, items 9 and 10): well-formed RESP of
the wrong shape (a Lua lookup answered with strings or an integer, a bad ``CLUSTER SLOTS``, a
``HELLO`` that is not a map) is an outage of that server, counted and retried later, never an
exception in the engine; a server that trickles its replies within ``timeout_ms`` each still
costs one ``timeout_ms`` per call, not one per reply."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_remote import SLOT, Factory, T, publish, seq
from test_remote import managers as managers  # (a fixture)

from kv_cache_manager_v2._storage._remote._protocol import (
    HEADER_BYTES,
    MIN_REPLY_BOUND,
    BadReply,
    ReplyReader,
    reply_bound,
)

#: what the fake server sends for one command: (delay in seconds, bytes) chunks, in order
Chunks = list[tuple[float, bytes]]
Answer = Callable[[list[bytes]], Chunks | None]


def slots_reply(port: int) -> bytes:
    """``CLUSTER SLOTS``: every slot served by 127.0.0.1:``port``."""
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port


class FakeRedis:
    """A RESP server on loopback (one thread per connection) that records every command and answers
    with ``answer(command)`` when it returns chunks, else like an empty Redis."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.commands: list[list[bytes]] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def count(self, name: bytes) -> int:
        return sum(1 for c in list(self.commands) if c[0].upper() == name)

    def settled_count(self, *names: bytes) -> int:
        """How many of these commands came, once none came for 0.3 s: the server thread still reads
        the rest of a pipeline after the client returned on a wrong first reply (late on a busy machine)."""
        last = -1
        while True:
            n = sum(self.count(name) for name in names)
            if n == last:
                return n
            last = n
            time.sleep(0.3)

    def close(self) -> None:
        self._server.close()
        for c in self._conns:
            c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:n])
                self.commands.append(args)
                for delay, chunk in self.answer(args) or self._default(args):
                    if delay:
                        time.sleep(delay)
                    conn.sendall(chunk)
        except (OSError, ValueError):
            return

    def _default(self, args: list[bytes]) -> Chunks:
        name = args[0].upper()
        if name == b"SCRIPT":
            return [(0.0, b"$40\r\n" + b"5" * 40 + b"\r\n")]
        if name in (b"EVALSHA", b"EVAL"):
            n = int(args[2])
            return [(0.0, b"*%d\r\n" % n + b":0\r\n" * n)]
        if name == b"STRLEN":
            return [(0.0, b":0\r\n")]
        if name == b"MGET":
            return [(0.0, b"*%d\r\n" % (len(args) - 1) + b"$-1\r\n" * (len(args) - 1))]
        if name == b"CLUSTER":
            return [(0.0, slots_reply(self.port))]
        if name == b"HELLO":  # (redis-py 8 speaks RESP3 by default)
            return [(0.0, b"%1\r\n$5\r\nproto\r\n:" + args[1] + b"\r\n")]
        return [(0.0, b"+OK\r\n")]


@pytest.fixture
def fake() -> Iterator[Callable[[Answer], FakeRedis]]:
    made: list[FakeRedis] = []

    def factory(answer: Answer) -> FakeRedis:
        made.append(FakeRedis(answer))
        return made[-1]

    yield factory
    for f in made:
        f.close()


def only(name: bytes, chunks: Callable[[list[bytes]], Chunks]) -> Answer:
    """An answer that replaces the reply to command ``name`` only."""
    return lambda args: chunks(args) if args[0].upper() == name else None


def assert_outage_then_retry(m: Any, server: FakeRedis, command: bytes) -> None:
    """Lookups through ``m`` are misses, counted as one outage, skipped while the server counts as
    down and tried again after ``retry_interval_ms`` (200 ms here)."""
    toks = seq(1, 4 * T)
    assert m.probe_reuse(None, toks + [1]) == 0
    kv = m.create_kv_cache(None, toks + [1])
    assert kv.history_length == 0 and kv.resume()
    kv.close()
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and not st.connected and st.skipped_lookups >= 1
    asked = server.count(command)
    assert asked >= 1
    time.sleep(0.25)
    assert m.probe_reuse(None, toks + [1]) == 0  # retried: the same wrong answer, one more outage
    st = m.remote_statistics
    assert st is not None and st.errors == 2 and server.count(command) > asked
    m.check_invariants()


@pytest.mark.parametrize(
    "reply",
    [
        b"*4\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n$1\r\nd\r\n",
        b":7\r\n",
        b"*4\r\n:1\r\n:2\r\n*0\r\n:3\r\n",
        b"*1\r\n:64\r\n",
    ],
    ids=["strings", "integer", "nested", "short"],
)
def test_a_lua_lookup_of_the_wrong_shape_is_an_outage(
    fake: Callable[[Answer], FakeRedis], managers: Factory, reply: bytes
) -> None:
    server = fake(only(b"EVALSHA", lambda args: [(0.0, reply)]))
    m = managers(f"redis://127.0.0.1:{server.port}", retry_interval_ms=200)
    assert_outage_then_retry(m, server, b"EVALSHA")


def test_values_of_the_wrong_shape_are_an_outage(fake: Callable[[Answer], FakeRedis], managers: Factory) -> None:
    """Every key is present (the lookup says so) but MGET answers an integer."""

    def answer(args: list[bytes]) -> Chunks | None:
        if args[0].upper() == b"EVALSHA":
            n = int(args[2])
            return [(0.0, b"*%d\r\n" % n + b":%d\r\n" % (HEADER_BYTES + SLOT) * n)]
        return [(0.0, b":3\r\n")] if args[0].upper() == b"MGET" else None

    server = fake(answer)
    m = managers(f"redis://127.0.0.1:{server.port}", retry_interval_ms=200)
    toks = seq(2, 4 * T)
    kv = m.create_kv_cache(None, toks + [1])
    assert kv.history_length == 0 and kv.resume()
    kv.close()
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and not st.connected and server.count(b"MGET") == 1
    m.check_invariants()


@pytest.mark.parametrize(
    "entry",
    [
        b"*3\r\n:0\r\n:16384\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n",  # a slot above 16383
        b"*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n$4\r\nport\r\n",  # a port that is no integer
        b"*2\r\n:0\r\n:16383\r\n",  # no master
        b"*3\r\n:0\r\n:16383\r\n*1\r\n$9\r\n127.0.0.1\r\n",  # a master without a port
        b"*3\r\n:9\r\n:3\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n",  # first slot after the last
    ],
    ids=["slot-range", "port", "short-entry", "short-master", "reversed"],
)
def test_a_slot_map_of_the_wrong_shape_is_an_outage(
    fake: Callable[[Answer], FakeRedis], managers: Factory, entry: bytes
) -> None:
    holder: list[int] = []
    server = fake(only(b"CLUSTER", lambda args: [(0.0, b"*1\r\n" + (entry % holder[0] if b"%d" in entry else entry))]))
    holder.append(server.port)
    m = managers(f"redis+cluster://127.0.0.1:{server.port}", retry_interval_ms=200)
    assert_outage_then_retry(m, server, b"CLUSTER")


@pytest.mark.parametrize("redirect", [b"-MOVED 16384 127.0.0.1:7000\r\n", b"-ASK 12 127.0.0.1:port\r\n"])
def test_a_redirect_to_nowhere_is_an_outage_of_that_node(
    fake: Callable[[Answer], FakeRedis], managers: Factory, redirect: bytes
) -> None:
    server = fake(lambda args: [(0.0, redirect)] if args[0].upper() in (b"STRLEN", b"EVAL") else None)
    m = managers(f"redis+cluster://127.0.0.1:{server.port}", retry_interval_ms=60_000)
    toks = seq(5, 4 * T)
    assert m.probe_reuse(None, toks + [1]) == 0
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and not st.connected
    asked = server.settled_count(b"STRLEN", b"EVAL")
    assert m.probe_reuse(None, seq(6, 4 * T) + [1]) == 0  # its node counts as down: not asked again
    assert server.settled_count(b"STRLEN", b"EVAL") == asked
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and st.lookups == 2


def test_a_hello_that_is_not_a_map_is_an_outage(fake: Callable[[Answer], FakeRedis], managers: Factory) -> None:
    server = fake(only(b"HELLO", lambda args: [(0.0, b"+OK\r\n")]))
    m = managers(f"redis://127.0.0.1:{server.port}/0?protocol=3", retry_interval_ms=200)
    assert_outage_then_retry(m, server, b"HELLO")


def test_a_quota_on_a_server_of_the_wrong_shape_is_an_outage(
    fake: Callable[[Answer], FakeRedis], managers: Factory
) -> None:
    """The constructor sets ``maxmemory``: a broken handshake or a CONFIG SET answered with an
    integer fails that (False, one warning, counted), never the constructor."""
    hello = fake(only(b"HELLO", lambda args: [(0.0, b"*0\r\n")]))
    config = fake(only(b"CONFIG", lambda args: [(0.0, b":0\r\n")]))
    for server in (hello, config):
        m = managers(f"redis://127.0.0.1:{server.port}/0?protocol=3", quota=1 << 20, retry_interval_ms=60_000)
        st = m.remote_statistics
        assert st is not None and st.errors == 1 and not st.connected
        assert m.probe_reuse(None, seq(7, 2 * T) + [1]) == 0
        assert m.remote_statistics is not None and m.remote_statistics.skipped_lookups == 1


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_writes_answered_with_the_wrong_shape_are_dropped_not_counted_written(
    fake: Callable[[Answer], FakeRedis], managers: Factory, cluster: bool
) -> None:
    """MSET answered with an integer: the pages are dropped (counted), the server counts as down."""
    server = fake(only(b"MSET", lambda args: [(0.0, b":1\r\n")]))
    scheme = "redis+cluster" if cluster else "redis"
    m = managers(f"{scheme}://127.0.0.1:{server.port}", write_through=True, retry_interval_ms=60_000)
    publish(m, seq(4, 3 * T), match=False)
    assert m.flush_remote_writes()
    st = m.remote_statistics
    assert st is not None and server.count(b"MSET") >= 1
    assert st.written_pages == 0 and st.dropped_writes == 3 and st.errors == 1 and not st.connected
    m.check_invariants()


# ---------------------------------------------------------------- one deadline per call (item 10)
def trickled(n: int, delay: float) -> Chunks:
    """A Lua lookup's reply of ``n`` lengths, one element every ``delay`` seconds."""
    return [(0.0, b"*%d\r\n" % n)] + [(delay, b":0\r\n")] * n


@pytest.mark.parametrize("how", ["lua-elements", "strlen-replies", "cluster-replies"])
def test_a_trickling_server_costs_one_timeout_per_call(
    fake: Callable[[Answer], FakeRedis], managers: Factory, how: str
) -> None:
    """64 blocks looked up, each element or reply 30 ms apart (each read well within the 100 ms
    timeout): the call gives up after about one ``timeout_ms`` (before: 64 x 30 ms, about 2 s)."""
    delay, timeout_ms, blocks = 0.03, 100, 64

    def answer(args: list[bytes]) -> Chunks | None:
        name = args[0].upper()
        if how == "lua-elements" and name == b"EVALSHA":
            return trickled(int(args[2]), delay)
        if how == "strlen-replies" and name == b"SCRIPT":
            return [(0.0, b"-ERR scripting is disabled\r\n")]
        if how != "lua-elements" and name == b"STRLEN":
            return [(delay, b":0\r\n")]
        if how == "cluster-replies" and name == b"EVAL":
            return trickled(int(args[2]), delay)
        return None

    server = fake(answer)
    scheme = "redis+cluster" if how == "cluster-replies" else "redis"
    m = managers(f"{scheme}://127.0.0.1:{server.port}", timeout_ms=timeout_ms, retry_interval_ms=60_000)
    toks = seq(3, blocks * T)
    t0 = time.monotonic()
    assert m.probe_reuse(None, toks + [1]) == 0
    elapsed = time.monotonic() - t0
    assert elapsed < 5 * timeout_ms / 1000.0, elapsed  # a deadline, with slack for a loaded machine
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and not st.connected
    kv = m.create_kv_cache(None, toks + [1])  # counted as down: no second wait
    assert kv.history_length == 0
    kv.close()


# ---------------------------------------------------------------- a reply longer than any valid one (issue 47)
class _Conn:
    """What ``ReplyReader`` reads of a redis-py connection: its socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


@pytest.mark.parametrize("reply", ["bulk", "line"])
def test_a_reply_longer_than_any_valid_one_is_bad_at_once(reply: str) -> None:
    """A bulk string announced longer than the longest valid value (``$10000000000``), or a line
    without its end past ``MIN_REPLY_BOUND``: a ``BadReply`` at once, not bytes buffered until the
    deadline; a value of exactly the bound is read."""
    bound = reply_bound(4096)
    assert bound == MIN_REPLY_BOUND and reply_bound(1 << 20) == HEADER_BYTES + (1 << 20)
    a, b = socket.socketpair()
    try:
        b.sendall(b"$%d\r\n" % bound + b"v" * bound + b"\r\n")
        reader = ReplyReader(_Conn(a), time.monotonic() + 30.0, bound)
        assert reader.reply() == b"v" * bound
        head = b"$10000000000\r\n" if reply == "bulk" else b"+"
        b.sendall(head + b"x" * (2 * MIN_REPLY_BOUND))
        t0 = time.monotonic()
        with pytest.raises(BadReply):
            reader.reply()
        assert time.monotonic() - t0 < 10.0  # (before: the whole deadline, buffering what came)
        reader.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_a_value_longer_than_any_page_is_an_outage_at_once(
    fake: Callable[[Answer], FakeRedis], managers: Factory, cluster: bool
) -> None:
    """Every key is present, and MGET announces a 10 GB value and sends 8 MiB of it: the fetch is
    a bad reply (an outage, counted) at once, not a wait of ``timeout_ms`` buffering what comes."""

    def answer(args: list[bytes]) -> Chunks | None:
        name = args[0].upper()
        if name in (b"EVALSHA", b"EVAL"):
            n = int(args[2])
            return [(0.0, b"*%d\r\n" % n + b":%d\r\n" % (HEADER_BYTES + SLOT) * n)]
        if name == b"STRLEN":
            return [(0.0, b":%d\r\n" % (HEADER_BYTES + SLOT))]
        if name == b"MGET":
            return [(0.0, b"*%d\r\n$10000000000\r\n" % (len(args) - 1) + b"x" * (8 << 20))]
        return None

    server = fake(answer)
    timeout_ms = 4000
    scheme = "redis+cluster" if cluster else "redis"
    m = managers(f"{scheme}://127.0.0.1:{server.port}", timeout_ms=timeout_ms, retry_interval_ms=60_000)
    toks = seq(8, 4 * T)
    t0 = time.monotonic()
    kv = m.create_kv_cache(None, toks + [1])
    elapsed = time.monotonic() - t0
    assert kv.history_length == 0 and kv.resume()
    kv.close()
    assert elapsed < timeout_ms / 2000.0, elapsed  # (before: at least timeout_ms)
    st = m.remote_statistics
    assert st is not None and st.errors == 1 and not st.connected and server.count(b"MGET") >= 1
    m.check_invariants()
