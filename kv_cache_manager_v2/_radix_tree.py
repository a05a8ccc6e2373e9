"""Reuse keys (SHA-256 hash chain) and the radix tree of committed blocks (SPEC 5.3, 5.4)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence, cast

import rawref

from ._common import ReuseScope, TokenIdExt
from ._life_cycle_registry import LifeCycle, stale_range
from ._page import Page

BlockKey = bytes

_PLAIN_IDS = b"\x00"  # block of token ids only: 4-byte LE each
_MIXED = b"\x01"  # block with digests: every token tagged, bytes length-delimited


def scope_key(scope: ReuseScope) -> BlockKey:
    """Root of the key chain: SHA-256 of the encoded reuse scope."""
    parts = [b"kv_cache_manager_v2/scope"]
    for value in (scope.lora_id, scope.salt):
        parts.append(b"\x00" if value is None else b"\x01" + value.to_bytes(8, "little"))
    return hashlib.sha256(b"".join(parts)).digest()


def encode_tokens(tokens: Sequence[TokenIdExt]) -> bytes:
    """Injective encoding of one block's tokens (plain-id blocks take the fast path)."""
    try:
        return _PLAIN_IDS + array("I", cast(Sequence[int], tokens)).tobytes()
    except TypeError:
        pass
    parts = [_MIXED]
    for tok in tokens:
        if isinstance(tok, bytes):
            parts.append(b"\x01" + len(tok).to_bytes(4, "little") + tok)
        else:
            parts.append(b"\x00" + tok.to_bytes(4, "little"))
    return b"".join(parts)


def block_key(parent: BlockKey, tokens: Sequence[TokenIdExt]) -> BlockKey:
    """Key of a block: SHA-256(parent key || encoded tokens)."""
    return hashlib.sha256(parent + encode_tokens(tokens)).digest()


class BlockHasher:
    """Keys of consecutive blocks of one token sequence, encoding the sequence only once.

    ``key(parent, beg, end)`` equals ``block_key(parent, tokens[beg:end])``; for plain ids it
    hashes a slice of one pre-encoded buffer instead of re-encoding every block.
    """

    def __init__(self, tokens: Sequence[TokenIdExt]) -> None:
        self.tokens = tokens
        self.data: bytes | None
        try:
            self.data = array("I", cast(Sequence[int], tokens)).tobytes()
        except TypeError:
            self.data = None

    def key(self, parent: BlockKey, beg: int, end: int) -> BlockKey:
        data = self.data
        if data is None:
            return block_key(parent, self.tokens[beg:end])
        return hashlib.sha256(parent + _PLAIN_IDS + data[beg * 4 : end * 4]).digest()


class Node:
    """One committed block (full, or a partial tail) with non-owning refs to its pages."""

    def __init__(self, key: BlockKey, parent: Node | None, tokens: tuple[TokenIdExt, ...], num_life_cycles: int) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.ordinal: int = parent.ordinal + 1 if parent is not None else -1
        self.children: dict[BlockKey, Node] = {}
        self.pages: list[rawref.ref[Page] | None] = [None] * num_life_cycles

    def page(self, lc: int) -> Page | None:
        r = self.pages[lc]
        return r() if r is not None else None

    def has_pages(self) -> bool:
        return any(r is not None and r.is_valid for r in self.pages)


def common_prefix_len(a: Sequence[TokenIdExt], b: Sequence[TokenIdExt]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ReuseTree:
    """Roots per reuse scope; matching, publishing and removal of committed blocks."""

    def __init__(self, life_cycles: list[LifeCycle], tokens_per_block: int) -> None:
        self.life_cycles = life_cycles
        self.tokens_per_block = tokens_per_block
        self.roots: dict[BlockKey, Node] = {}

    def root(self, scope: ReuseScope, create: bool) -> Node | None:
        key = scope_key(scope)
        node = self.roots.get(key)
        if node is None and create:
            node = self.roots[key] = Node(key, None, (), len(self.life_cycles))
        return node

    def match(
        self, root: Node, tokens: Sequence[TokenIdExt], partial: bool
    ) -> tuple[list[Node], Node | None, int]:
        """Longest reusable prefix: matched full-block nodes, then an optional partial node and its length.

        Walks full blocks by key; at the first miss picks the child with the longest common
        token prefix; then shortens until every life cycle has the pages it needs there.
        """
        t = self.tokens_per_block
        nodes: list[Node] = []
        node = root
        n_full = len(tokens) // t
        hasher = BlockHasher(tokens) if node.children else None
        while len(nodes) < n_full and hasher is not None and node.children:
            o = len(nodes)
            child = node.children.get(hasher.key(node.key, o * t, (o + 1) * t))
            if child is None:
                break
            nodes.append(child)
            node = child
        part: Node | None = None
        part_len = 0
        if partial:
            rest = tokens[len(nodes) * t : (len(nodes) + 1) * t]
            for child in node.children.values():
                n = common_prefix_len(child.tokens, rest)
                if n > part_len:
                    part, part_len = child, n
        # Shorten until the pages needed at the matched length exist for every life cycle.
        while True:
            length = len(nodes) * t + part_len
            missing = self._first_missing_block(nodes, part, length)
            if missing < 0:
                return nodes, part, part_len
            del nodes[missing:]
            part, part_len = None, 0

    def _first_missing_block(self, nodes: list[Node], part: Node | None, length: int) -> int:
        t = self.tokens_per_block
        nb = (length + t - 1) // t
        first = -1
        for lc_id, lc in enumerate(self.life_cycles):
            beg, end = stale_range(lc, length, t)
            for o in range(nb):
                if beg <= o < end:
                    continue
                node = nodes[o] if o < len(nodes) else part
                if node is None or node.page(lc_id) is None:
                    if first < 0 or o < first:
                        first = o
                    break
        return first

    def is_anchor(self, lc_id: int, ordinal: int) -> bool:
        """Whether later blocks are useless without this block's page (full attention, sinks)."""
        lc = self.life_cycles[lc_id]
        return lc.window_size is None or ordinal < lc.num_sink_blocks

    def drop_page(self, page: Page) -> None:
        """Free an evicted page; remove what can no longer be reused without it."""
        node = page.node
        page.node = None
        page.free()
        if node is None:
            return
        node.pages[page.life_cycle] = None
        if self.is_anchor(page.life_cycle, node.ordinal):
            self.remove_subtree(node)
        else:
            self.prune(node)

    def remove_subtree(self, node: Node) -> None:
        """Unlink ``node`` and its descendants; their unused pages are freed, used ones detached."""
        parent = node.parent
        if parent is not None:
            del parent.children[node.key]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            n.parent = None
            for lc, r in enumerate(n.pages):
                p = r() if r is not None else None
                n.pages[lc] = None
                if p is not None:
                    p.node = None
                    if p.num_locks == 0 and p.num_holds == 0:
                        p.storage.evictor.remove(p)
                        p.free()
        if parent is not None:
            self.prune(parent)

    def prune(self, node: Node) -> None:
        """Remove empty leaves upward (never the scope roots)."""
        n: Node | None = node
        while n is not None and n.parent is not None and not n.children and not n.has_pages():
            parent: Node | None = n.parent
            assert parent is not None
            del parent.children[n.key]
            n.parent = None
            n = parent

    def clear(self) -> None:
        for root in list(self.roots.values()):
            for child in list(root.children.values()):
                self.remove_subtree(child)
        self.roots = {}
