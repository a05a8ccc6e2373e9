"""The Redis backend's wire format: RESP commands, sending buffers without copies, and reading replies
under one deadline (``ReplyReader``). Values are ``_value``'s."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Final

from mypy_extensions import mypyc_attr

from ._value import HEADER_BYTES

#: buffers per sendmsg call (below IOV_MAX)
_MAX_IOV: Final = 512

#: hash slots of a cluster
CLUSTER_SLOTS: Final = 16384
#: most bytes one ``recv`` asks for (a reply announcing a huge value does not allocate it up front)
_MAX_RECV: Final = 4 << 20
#: deepest array nesting a reply may have (``CLUSTER SLOTS`` in RESP3 has four levels)
_MAX_DEPTH: Final = 8
#: longest line (simple string, error, number) and bulk string of a reply other than a page's value
#: (a script's SHA, a host name, a node id, an error message are far shorter)
MIN_REPLY_BOUND: Final = 64 << 10


def reply_bound(max_page_bytes: int) -> int:
    """The longest bulk string a server of the remote tier can validly send: a page's value (the
    header and the largest page) or ``MIN_REPLY_BOUND``. A reply announcing more is a ``BadReply`` at
    once, nothing of it buffered."""
    return max(MIN_REPLY_BOUND, HEADER_BYTES + max_page_bytes)


#: STRLEN of every key; a key of another type (WRONGTYPE) reads as 0, a miss for that key only
LOOKUP_LUA: Final = (
    "local r = {} for i, k in ipairs(KEYS) do local n = redis.pcall('STRLEN', k) "
    "if type(n) ~= 'number' then n = 0 end r[i] = n end return r"
)


def resp_command(*args: bytes) -> bytes:
    """``args`` as one RESP command."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def send_all(sock: Any, parts: list[Any]) -> None:
    """Send every buffer of ``parts`` in order with as few ``sendmsg`` calls as the kernel allows."""
    i = 0
    while i < len(parts):
        chunk = parts[i : i + _MAX_IOV]
        sent: int = sock.sendmsg(chunk)
        for b in chunk:  # skip what went out; a partly sent buffer continues where it stopped
            n = len(b)
            if sent >= n:
                sent -= n
                i += 1
            else:
                if sent:
                    parts[i] = memoryview(b)[sent:]
                break


def url_password(url: str) -> str | None:
    from urllib.parse import unquote, urlsplit

    password = urlsplit(url).password
    return unquote(password) if password else None


def url_username(url: str) -> str | None:
    from urllib.parse import unquote, urlsplit

    username = urlsplit(url).username
    return unquote(username) if username else None


def send(conn: Any, parts: list[Any]) -> None:
    """Send ``parts`` on a redis-py connection: ``sendmsg`` from where the buffers are on a plain
    socket, the client's own send otherwise (TLS)."""
    sock = getattr(conn, "_sock", None)
    if sock is not None and type(sock) is socket.socket:
        send_all(sock, parts)
    else:
        conn.send_packed_command(parts)


@mypyc_attr(native_class=False)
class BadReply(ConnectionError):
    """A reply no command of ours gets (broken RESP, or well-formed RESP of the wrong shape): the
    server is not one we can use, so it counts as down like one that does not answer."""


@mypyc_attr(native_class=False)
class ErrorReply(Exception):
    """A server's error reply (``-ERR ...``), returned in its command's place, never raised."""


def connection(pool: Any, errors: tuple[type[BaseException], ...]) -> Any:
    """A connected connection of a redis-py ``pool``. A handshake that fails other than with one of
    ``errors`` (e.g. ``HELLO`` answered by something that is not a map) is a ``BadReply``; the
    pool's connections are closed, so none stays half set up."""
    try:
        return pool.get_connection()
    except errors:
        raise
    except Exception as e:
        pool.disconnect()
        raise BadReply(f"connection set-up failed ({type(e).__name__}: {e})") from None


def exchange(
    pool: Any, errors: tuple[type[BaseException], ...], commands: list[bytes], deadline: float, max_bulk: int
) -> list[Any]:
    """Send ``commands`` (each complete) pipelined on a connection of ``pool`` and read their
    replies, all by ``deadline`` (bulk strings up to ``max_bulk`` bytes). Raises one of ``errors``
    when that fails (the connection is closed: it may be in the middle of a reply)."""
    conn = connection(pool, errors)
    reader: ReplyReader | None = None
    try:
        send(conn, list(commands))
        reader = ReplyReader(conn, deadline, max_bulk)
        return [reader.reply() for _ in commands]
    except BaseException:
        conn.disconnect()
        raise
    finally:
        if reader is not None:
            reader.close()
        pool.release(conn)


def is_lengths(reply: Any, n: int) -> bool:
    """Whether ``reply`` is ``n`` value lengths (a Lua lookup's answer)."""
    return isinstance(reply, list) and len(reply) == n and all(type(x) is int and x >= 0 for x in reply)


def is_values(reply: Any, n: int) -> bool:
    """Whether ``reply`` is ``n`` values or nulls (an MGET's answer)."""
    return isinstance(reply, list) and len(reply) == n and all(x is None or isinstance(x, bytes) for x in reply)


class ReplyReader:
    """RESP replies read straight from a redis-py connection's socket, every wait bounded by one
    ``deadline`` (``time.monotonic()``) for the whole exchange, so a server that trickles its
    replies times out like a silent one. A bulk string announced longer than ``max_bulk`` bytes
    (``reply_bound``), or a line longer than ``MIN_REPLY_BOUND``, is a ``BadReply`` before any of it is
    buffered. ``close`` gives the socket its own timeout back."""

    __slots__ = ("buf", "deadline", "max_bulk", "pos", "sock", "timeout")

    def __init__(self, conn: Any, deadline: float, max_bulk: int) -> None:
        self.sock: Any = conn._sock
        if self.sock is None:
            raise ConnectionError("not connected")
        self.timeout: Any = self.sock.gettimeout()
        self.deadline = deadline
        self.max_bulk = max_bulk
        self.buf = bytearray()
        self.pos = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):  # (closed meanwhile)
            self.sock.settimeout(self.timeout)

    def reply(self) -> Any:
        """The next reply: ``int``, ``bytes`` (bulk or simple string), None (null), a list, or an
        ``ErrorReply``. Raises ``TimeoutError`` past the deadline, ``BadReply`` on broken RESP."""
        return self._reply(0)

    def _reply(self, depth: int) -> Any:
        line = self._line()
        kind = line[:1]
        if kind == b"+":
            return line[1:]
        if kind == b"-":
            return ErrorReply(line[1:].decode(errors="replace"))
        if kind == b":":
            return self._int(line)
        if kind == b"$":
            n = self._int(line)
            return None if n == -1 else self._bulk(n)
        if kind == b"*" or kind == b"%" or kind == b"~":  # (RESP3 maps and sets read as arrays, a map's
            n = self._int(line)  # keys and values alternating; CLUSTER SLOTS has maps in RESP3)
            if n == -1:
                return None
            if n < 0 or depth >= _MAX_DEPTH:
                raise BadReply(f"array {line[:32]!r} at depth {depth}")
            return [self._reply(depth + 1) for _ in range(2 * n if kind == b"%" else n)]
        if line == b"_":  # RESP3 null
            return None
        raise BadReply(f"unexpected reply {line[:32]!r}")

    def _int(self, line: bytes) -> int:
        try:
            return int(line[1:])
        except ValueError:
            raise BadReply(f"not an integer: {line[:32]!r}") from None

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            if len(self.buf) - self.pos > MIN_REPLY_BOUND:
                raise BadReply(
                    f"a line of more than {MIN_REPLY_BOUND} bytes: {bytes(self.buf[self.pos : self.pos + 32])!r}"
                )
            self._fill(1)

    def _bulk(self, n: int) -> bytes:
        if not 0 <= n <= self.max_bulk:
            raise BadReply(f"bulk string of length {n} (at most {self.max_bulk} bytes are valid)")
        while len(self.buf) - self.pos < n + 2:
            self._fill(n + 2 - (len(self.buf) - self.pos))
        end = self.pos + n
        if self.buf[end : end + 2] != b"\r\n":
            raise BadReply("bulk string not ended by CRLF")
        value = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return value

    def _fill(self, need: int) -> None:
        """Receive at least one more byte before the deadline."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no complete reply within timeout_ms")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.sock.settimeout(remaining)
        chunk = self.sock.recv(min(max(need, 65536), _MAX_RECV))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk


def parse_redirect(message: str, default_host: str) -> tuple[bool, int, tuple[str, int]] | None:
    """``(moved, slot, address)`` of a ``MOVED``/``ASK`` error reply, None for any other error;
    ``BadReply`` when it names no valid slot or address."""
    words = message.split(" ")
    if words[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = words[-1].rpartition(":")
    try:
        slot = int(words[1])
        port_number = int(port)
    except (ValueError, IndexError):
        raise BadReply(f"redirect {message[:80]!r}") from None
    if len(words) != 3 or not 0 <= slot < CLUSTER_SLOTS or not 0 < port_number < 65536:
        raise BadReply(f"redirect {message[:80]!r}")
    return words[0] == "MOVED", slot, (host or default_host, port_number)


def slot_ranges(reply: Any) -> list[tuple[int, int, str, int]]:
    """``(first slot, last slot, master host, master port)`` of each entry of a ``CLUSTER SLOTS``
    reply; ``BadReply`` unless every entry is well formed (an empty host is the node asked)."""
    if not isinstance(reply, list):
        raise BadReply(f"CLUSTER SLOTS answered {type(reply).__name__}")
    out: list[tuple[int, int, str, int]] = []
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3 or not isinstance(entry[2], list) or len(entry[2]) < 2:
            raise BadReply(f"CLUSTER SLOTS entry {entry!r:.80}")
        first, last, host, port = entry[0], entry[1], entry[2][0], entry[2][1]
        if (
            type(first) is not int
            or type(last) is not int
            or not 0 <= first <= last < CLUSTER_SLOTS
            or not isinstance(host, bytes)
            or type(port) is not int
            or not 0 < port < 65536
        ):
            raise BadReply(f"CLUSTER SLOTS entry {entry!r:.80}")
        out.append((first, last, host.decode(errors="replace"), port))
    return out
