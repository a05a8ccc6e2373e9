"""Which cached blocks each session has (``create_kv_cache(session_id=...)``; values:
``_sessions.py``; directives over them: ``_directives.py``).

A session's blocks are the tree nodes its requests reused or published: recorded per request,
never per block of a request without a session, when it is created (its match) and when it
closes (its published history), by walking from the chain's last node up to the first node the
session knows already (a conversation's turns extend each other: each turn adds its new blocks
only). A node knows the session that published it (``Node.session``, set by ``publish``) and
whether another session used it too (``Node.shared``, set here): a session's *private* blocks are
those it published and no other session used (a request without a session is not counted).
Nodes that left the tree are forgotten lazily (a node never returns to the tree).
"""

from __future__ import annotations

from .._common import SessionId
from .._reuse._node import Node


class _Record:
    """One session's nodes by ``id`` (each held: its id stays unique), and the size at which the
    ones that left the tree are next swept out."""

    __slots__ = ("limit", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.limit = 64


class SessionTable:
    """The manager's sessions: their nodes (see the module)."""

    __slots__ = ("_records",)

    def __init__(self) -> None:
        self._records: dict[SessionId, _Record] = {}

    def __len__(self) -> int:
        return len(self._records)

    def record(self, session: SessionId, last: Node | None) -> None:
        """``session`` uses the chain of blocks ending at ``last`` (None, or a node out of the
        tree: nothing); another session's blocks among them become shared."""
        if last is None or last.parent is None:
            return
        rec = self._records.get(session)
        if rec is None:
            rec = self._records[session] = _Record()
        nodes = rec.nodes
        n: Node | None = last
        while n is not None and n.parent is not None and id(n) not in nodes:
            nodes[id(n)] = n
            if n.session != session:
                n.shared = True  # (published without a session or by another: never this one's alone)
            n = n.parent
        if len(nodes) > rec.limit:
            self._sweep(rec)

    def nodes(self, session: SessionId) -> list[Node]:
        """The blocks of ``session`` in the tree now, parents before children: those recorded and
        the private blocks below them (a partial tail published at close, or blocks its requests
        published after they were recorded)."""
        rec = self._records.get(session)
        if rec is None:
            return []
        self._sweep(rec)
        found = rec.nodes
        stack = list(found.values())
        while stack:
            for child in stack.pop().children():
                if id(child) not in found and is_private(child, session):
                    found[id(child)] = child
                    stack.append(child)
        return sorted(found.values(), key=_ordinal)

    def forget(self, session: SessionId) -> bool:
        """Forget ``session`` (its blocks stay as they are); False if it had none."""
        return self._records.pop(session, None) is not None

    def clear(self) -> None:
        """Forget every session (the tree was emptied)."""
        self._records.clear()

    @staticmethod
    def _sweep(rec: _Record) -> None:
        """Forget the nodes of ``rec`` that left the tree; sweep again at twice the size left."""
        rec.nodes = {k: n for k, n in rec.nodes.items() if n.parent is not None}
        rec.limit = max(64, 2 * len(rec.nodes))


def is_private(node: Node, session: SessionId) -> bool:
    """Whether ``node`` is a block ``session`` published and no other session used."""
    return node.session == session and not node.shared


def _ordinal(node: Node) -> int:
    return node.ordinal
