"""A node of the reuse tree: one committed block (its key, tokens and pages per layer group) and
its children, with the partial-match index over them and the token comparisons matching uses."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from typing import Final, cast

import rawref
from blockhash import same_block

from .._common import (
    MAX_PRIORITY,
    BlockTokens,
    Priority,
    SessionId,
    TokenIdExt,
)
from .._page import Page
from ._keys import BlockHasher, BlockKey
from ._walk import ChainNode

#: Children a node scans one by one for a partial match; beyond this it keeps a sorted index.
_SCAN_LIMIT: Final = 8

#: bound once: mypyc looks a module's attribute up at every call (hot: once or twice per block)
_untrack: Final = rawref.untrack


class _PartialIndex:
    """A node's children sorted by the uint32 LE encoding of their tokens, so the child with the
    longest common token prefix is a neighbour of a binary search (fixed-width encoding: a common
    byte prefix of ``4k`` bytes is a common prefix of ``k`` tokens). Children holding digests
    are few and scanned."""

    __slots__ = ("keys", "nodes", "others")

    def __init__(self, children: list[Node]) -> None:
        pairs: list[tuple[bytes, Node]] = []
        self.others: list[Node] = []
        for c in children:
            enc = _id_encoding(c.tokens)
            if enc is None:
                self.others.append(c)
            else:
                pairs.append((enc, c))
        pairs.sort(key=lambda kv: kv[0])
        self.keys = [k for k, _ in pairs]
        self.nodes = [n for _, n in pairs]

    def add(self, child: Node) -> None:
        enc = _id_encoding(child.tokens)
        if enc is None:
            self.others.append(child)
            return
        i = bisect_left(self.keys, enc)
        self.keys.insert(i, enc)
        self.nodes.insert(i, child)

    def remove(self, child: Node) -> None:
        enc = _id_encoding(child.tokens)
        if enc is None:
            self.others.remove(child)
            return
        i = bisect_left(self.keys, enc)
        while self.nodes[i] is not child:  # equal encodings: a full block and a partial one never are
            i += 1
        del self.keys[i]
        del self.nodes[i]

    def best(self, tokens: Sequence[TokenIdExt], groups: list[int]) -> tuple[Node | None, int]:
        """The child holding a page of each of ``groups`` with the longest common token prefix with
        ``tokens`` (>= 1), and its length. Moving away from the binary search's position the common
        prefix never grows, so each direction stops at its first child holding the pages (or once
        the prefix is no longer than the best)."""
        enc = _id_encoding(tokens)
        if enc is None:
            return _best_of(list(self.nodes) + self.others, tokens, groups)
        best, best_len = _best_of(self.others, tokens, groups)
        nodes = self.nodes
        i = bisect_left(self.keys, enc)
        for step in (-1, 1):
            j = i - 1 if step < 0 else i
            while 0 <= j < len(nodes):
                child = nodes[j]
                n = common_prefix_len(child.tokens, tokens)
                if n <= best_len:
                    break
                if child.holds_pages(groups):
                    best, best_len = child, n
                    break
                j += step
        return best, best_len

    def candidates(self, tokens: Sequence[TokenIdExt]) -> list[Node]:
        """The children that can share the longest prefix with ``tokens`` (or start with them)."""
        enc = _id_encoding(tokens)
        if enc is None:
            return list(self.nodes) + self.others
        i = bisect_left(self.keys, enc)
        out = self.others + self.nodes[max(0, i - 1) : i + 1]
        return out


def _best_of(children: list[Node], tokens: Sequence[TokenIdExt], groups: list[int]) -> tuple[Node | None, int]:
    """Of ``children``, the one holding a page of each of ``groups`` with the longest common token
    prefix with ``tokens`` (>= 1; the first of equals), and its length."""
    best: Node | None = None
    best_len = 0
    for child in children:
        n = common_prefix_len(child.tokens, tokens)
        if n > best_len and child.holds_pages(groups):
            best, best_len = child, n
    return best, best_len


def _id_encoding(tokens: Sequence[TokenIdExt]) -> bytes | None:
    if all(type(tok) is int for tok in tokens):
        return array("I", cast(Sequence[int], tokens)).tobytes()
    return None


class Node(ChainNode):
    """One committed block (full, or a partial tail) with non-owning refs to its pages.

    A tree can hold millions of nodes, so nodes, their ``pages`` lists and ``_children`` dicts
    (a node with one child, the usual case down a prompt, keeps it in ``_only``: no dict) are
    untracked by the cyclic garbage collector (which would traverse them all at every full
    collection). The tree breaks its cycles itself: a node leaving the tree loses its ``parent``
    and children; the manager clears the tree at shutdown or when it is dropped.

    A node leaves the tree only with its whole subtree (a leaf when pruned) and never returns
    (the same block comes back as a new node): a node whose ``parent`` is set has every ancestor
    in the tree, which is how a kept walk (``PrefixMatcher``) is known to be still valid.
    """

    __slots__ = (
        "_children",
        "_index",
        "_only",
        "key",
        "lora_id",
        "num_extenders",
        "ordinal",
        "pages",
        "parent",
        "prio_cap",
        "scope",
        "session",
        "shared",
        "snapshot_reach",
        "tokens",
    )

    def __init__(self, key: BlockKey, parent: Node | None, tokens: BlockTokens, num_layer_groups: int) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.ordinal: int = parent.ordinal + 1 if parent is not None else -1
        #: the scope's LoRA adapter (set on roots, inherited): KV-cache events report it per block
        self.lora_id: int | None = parent.lora_id if parent is not None else None
        # Created with the second child: most nodes are leaves or have one child (``_only``).
        self._children: dict[BlockKey, Node] | None = None
        #: the child while it is the only one (then ``_children`` is None)
        self._only: Node | None = None
        #: sorted children for partial matching, built once a node has many children
        self._index: _PartialIndex | None = None
        # (a list display for one group: ``[None] * n`` allocates a second list)
        self.pages: list[rawref.ref[Page] | None] = _untrack(
            [None] if num_layer_groups == 1 else [None] * num_layer_groups
        )
        #: requests that will publish the next block under this node: it stays while they may
        self.num_extenders = 0
        #: no page of this node or below it evicts after an anchor page of this node or above it
        self.prio_cap: Priority = parent.prio_cap if parent is not None else MAX_PRIORITY
        #: hybrid models: 1 if the block holds a snapshot of every state group, plus its children
        #: whose ``snapshot_reach`` is positive (0: no match can end at or below it: its KV is useless)
        self.snapshot_reach = 0
        #: the scope's ``(lora_id, salt)`` (set on roots, inherited; a persistent disk tier records it)
        self.scope: tuple[int | None, int | None] | None = parent.scope if parent is not None else None
        #: the session of the request that published the block (None: none, or not known)
        self.session: SessionId | None = None
        #: a session other than ``session`` used the block too (``_core/_sessions.py``)
        self.shared = False
        _untrack(self)

    def page(self, layer_group: int) -> Page | None:
        r = self.pages[layer_group]
        return r() if r is not None else None

    def next(self, prompt: object, ordinal: int) -> Node | None:
        """The child holding full block ``ordinal`` of ``prompt`` (a ``BlockHasher``): by its key
        when known. Else a few children are compared with the block token by token: equal tokens
        under one parent are an equal key (the hasher records it), so a walk down a chain hashes
        nothing; at a branch of more children, or when ``same_block`` cannot tell, the block is
        hashed and looked up."""
        hasher = cast(BlockHasher, prompt)
        keys = hasher.keys
        if ordinal < len(keys):
            return self.child(keys[ordinal])
        tokens = hasher.tokens
        t = hasher.tokens_per_block
        only = self._only
        if only is not None:
            same = same_block(only.tokens, tokens, ordinal * t, t)
            if same:
                hasher.matched(ordinal, only.key)
                return only
            if same is not None:
                return None
        else:
            children = self._children
            if children is None:
                return None
            if len(children) <= _SCAN_LIMIT:
                for child in children.values():
                    same = same_block(child.tokens, tokens, ordinal * t, t)
                    if same is None:
                        break
                    if same:
                        hasher.matched(ordinal, child.key)
                        return child
                else:
                    return None
        return self.child(hasher.key_alone(self.key, ordinal))

    def holds(self, layer_group: int) -> bool:
        r = self.pages[layer_group]
        return r is not None and r() is not None

    @property
    def has_children(self) -> bool:
        return self._only is not None or self._children is not None

    def child(self, key: BlockKey) -> Node | None:
        only = self._only
        if only is not None:
            return only if only.key == key else None
        c = self._children
        return c.get(key) if c is not None else None

    def children(self) -> list[Node]:
        only = self._only
        if only is not None:
            return [only]
        c = self._children
        return list(c.values()) if c is not None else []

    def add_child(self, child: Node) -> None:
        only = self._only
        if self._children is None and (only is None or only.key == child.key):
            self._only = child
            return
        if self._children is None:
            assert only is not None
            self._children = {only.key: only}
            self._only = None
        self._children[child.key] = child
        _untrack(self._children)  # inserting a node re-tracks a dict
        if self._index is not None:
            self._index.add(child)

    def remove_child(self, child: Node) -> None:
        if self._only is not None:
            assert self._only.key == child.key
            self._only = None
            return
        children = self._children
        assert children is not None
        del children[child.key]
        if not children:
            self._children = None
            self._index = None
        elif self._index is not None:
            self._index.remove(child)

    def drop_children(self) -> list[Node]:
        """Unlink every child (subtree removal); returns them."""
        out = self.children()
        self._only = None
        self._children = None
        self._index = None
        return out

    def partial_candidates(self, tokens: Sequence[TokenIdExt]) -> list[Node]:
        """Children that may share the longest token prefix with ``tokens`` (at most a few plus
        the digest-holding ones, whatever the number of children)."""
        only = self._only
        if only is not None:
            return [only]
        c = self._children
        if c is None:
            return []
        if len(c) <= _SCAN_LIMIT:
            return list(c.values())
        if self._index is None:
            self._index = _PartialIndex(list(c.values()))
        return self._index.candidates(tokens)

    def best_partial(self, tokens: Sequence[TokenIdExt], groups: list[int]) -> tuple[Node | None, int]:
        """The child with the longest common token prefix with ``tokens`` (>= 1) among those holding
        a page of each of ``groups`` (a partially matched block is the last block of the match: every
        attention group needs its page), and its length. A child lacking one is skipped, not
        picked and then cut: a sibling sharing as many tokens may hold them all."""
        only = self._only
        if only is not None:
            return _best_of([only], tokens, groups)
        c = self._children
        if c is None:
            return None, 0
        if len(c) <= _SCAN_LIMIT:
            return _best_of(list(c.values()), tokens, groups)
        if self._index is None:
            self._index = _PartialIndex(list(c.values()))
        return self._index.best(tokens, groups)

    def covers(self, tokens: Sequence[TokenIdExt]) -> bool:
        """Whether some child's tokens start with ``tokens``."""
        n = len(tokens)
        return any(common_prefix_len(c.tokens, tokens) == n for c in self.partial_candidates(tokens))

    def holds_pages(self, groups: list[int]) -> bool:
        """Whether the block holds a page of each of ``groups``."""
        pages = self.pages
        for layer_group in groups:
            r = pages[layer_group]
            if r is None or r() is None:
                return False
        return True

    @property
    def is_removable(self) -> bool:
        """A leaf with no pages that no request extends: nothing can reach or need it."""
        if self._only is not None or self._children is not None or self.num_extenders:
            return False
        for r in self.pages:  # noqa: SIM110 - a plain loop (no generator): asked of each evicted block's parent
            if r is not None and r() is not None:
                return False
        return True


def common_prefix_len(a: Sequence[TokenIdExt], b: Sequence[TokenIdExt]) -> int:
    """Leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    # A block's tokens (a tuple) usually start with the whole query: compared in one C-level
    # call (tokens are ints or bytes, whose == is reflexive: the tuple's identity shortcut agrees)
    if type(a) is tuple and a[:n] == tuple(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def same_tokens(a: BlockTokens, b: BlockTokens) -> bool:
    """Whether two blocks hold the same tokens (whichever of tuple and array each is)."""
    if type(a) is type(b):
        return a == b
    return len(a) == len(b) and common_prefix_len(a, b) == len(a)
