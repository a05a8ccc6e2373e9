"""Reuse keys (SHA-256 hash chain) and the radix tree of committed blocks (SPEC 5.3, 5.4)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Final, Sequence, cast

import rawref

from ._common import MAX_TOKEN_ID, ReuseScope, TokenIdExt
from ._life_cycle_registry import LifeCycle, stale_range
from ._page import Page

BlockKey = bytes
# Copying an initialised context is ~7% cheaper than constructing one per block.
_SHA256_INIT: Final = hashlib.sha256()


def _sha256_digest(data: bytes) -> bytes:
    h = _SHA256_INIT.copy()
    h.update(data)
    return h.digest()


#: Blocks validated and encoded together by ``BlockHasher``.
_CHUNK_BLOCKS: Final = 8

# Block encodings. Plain-id blocks: uint32 LE per token, so their length is a multiple of 4.
# Blocks holding digests: 0x01, then per token a tag (0x00 id + 4 bytes, 0x01 + uint32 length +
# raw bytes), zero-padded to a length of 1 mod 4. Both are prefix-free and their lengths differ
# mod 4, so no encoding of one block equals that of another: a digest never collides with ids.
_MIXED = b"\x01"


def scope_key(scope: ReuseScope) -> BlockKey:
    """Root of the key chain: SHA-256 of the encoded reuse scope."""
    parts = [b"kv_cache_manager_v2/scope"]
    for value in (scope.lora_id, scope.salt):
        parts.append(b"\x00" if value is None else b"\x01" + value.to_bytes(8, "little"))
    return _sha256_digest(b"".join(parts))


def encode_tokens(tokens: Sequence[TokenIdExt]) -> bytes:
    """Injective encoding of one block's tokens (plain-id blocks take the fast path)."""
    try:
        return array("I", cast(Sequence[int], tokens)).tobytes()
    except TypeError:
        pass
    parts = [_MIXED]
    for tok in tokens:
        if isinstance(tok, bytes):
            parts.append(b"\x01" + len(tok).to_bytes(4, "little") + tok)
        else:
            parts.append(b"\x00" + tok.to_bytes(4, "little"))
    out = b"".join(parts)
    return out + b"\x00" * ((1 - len(out)) % 4)


def check_token(tok: object) -> None:
    """A token is an int in ``[0, 2**32)`` or a non-empty ``bytes`` digest."""
    if isinstance(tok, int) and not isinstance(tok, bool):  # isinstance: a fast check compiled
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise ValueError(f"token id {tok} is outside [0, 2**32)")
    elif isinstance(tok, bytes):
        if len(tok) == 0:
            raise ValueError("a bytes token must not be empty")
    else:
        raise TypeError(f"tokens must be ints or bytes, got {type(tok).__name__} {tok!r}")


def validate_tokens(tokens: Sequence[TokenIdExt]) -> None:
    """Check every token (ints in ``[0, 2**32)`` or non-empty bytes); clear errors otherwise."""
    if len(tokens) > 8 and _encode_ids(tokens) is not None:
        return
    for tok in tokens:
        check_token(tok)


def _encode_ids(tokens: Sequence[TokenIdExt]) -> bytes | None:
    """uint32 LE encoding if every token is an id in range, else None (digests or bad input)."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens.tobytes()  # a memory copy: no per-token conversion
    try:
        if isinstance(tokens, list):
            encoded: array[int] = array("I")
            encoded.fromlist(tokens)  # about twice as fast as array("I", tokens) for lists
            return encoded.tobytes()
        return array("I", cast(Sequence[int], tokens)).tobytes()
    except (TypeError, OverflowError):
        return None


def block_key(parent: BlockKey, tokens: Sequence[TokenIdExt]) -> BlockKey:
    """Key of a block: SHA-256(parent key || encoded tokens)."""
    return _sha256_digest(parent + encode_tokens(tokens))


class BlockHasher:
    """Keys of the consecutive blocks of one token sequence.

    Tokens are validated and encoded lazily, a chunk of blocks at a time, so a match that
    stops early neither converts nor checks the rest of a long prompt; plain-id blocks hash a
    slice of the chunk's encoding. ``key(parent, o)`` equals
    ``block_key(parent, tokens[o*T:(o+1)*T])`` (the last block may be partial).
    Passing an ``array('I')`` makes encoding a memory copy.
    """

    def __init__(self, tokens: Sequence[TokenIdExt], tokens_per_block: int) -> None:
        self.tokens = tokens
        self.tokens_per_block = tokens_per_block
        self.num_blocks = (len(tokens) + tokens_per_block - 1) // tokens_per_block
        self._chunks: list[bytes | None] = []  # None: the chunk holds digests

    def key(self, parent: BlockKey, o: int) -> BlockKey:
        t = self.tokens_per_block
        c = o // _CHUNK_BLOCKS
        while len(self._chunks) <= c:
            self._encode_chunk()
        chunk = self._chunks[c]
        end = min((o + 1) * t, len(self.tokens))
        if chunk is None:
            return block_key(parent, self.tokens[o * t : end])
        base = c * _CHUNK_BLOCKS * t
        return _sha256_digest(parent + chunk[(o * t - base) * 4 : (end - base) * 4])

    def chain(self, parent: BlockKey) -> list[BlockKey]:
        """Keys of every block of the sequence, chained from ``parent``."""
        keys: list[BlockKey] = []
        for o in range(self.num_blocks):
            parent = self.key(parent, o)
            keys.append(parent)
        return keys

    def _encode_chunk(self) -> None:
        span = _CHUNK_BLOCKS * self.tokens_per_block
        beg = len(self._chunks) * span
        seg = self.tokens[beg : beg + span]
        encoded = _encode_ids(seg)
        if encoded is None:
            validate_tokens(seg)  # raises for bad tokens; otherwise the chunk holds digests
        self._chunks.append(encoded)


class Node:
    """One committed block (full, or a partial tail) with non-owning refs to its pages."""

    def __init__(self, key: BlockKey, parent: Node | None, tokens: tuple[TokenIdExt, ...], num_life_cycles: int) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.ordinal: int = parent.ordinal + 1 if parent is not None else -1
        # Created with the first child: most nodes are leaves, and a tree can hold millions.
        self._children: dict[BlockKey, Node] | None = None
        #: children by their first token, so a partial match scans only plausible candidates
        self._children_by_first: dict[TokenIdExt, list[Node]] | None = None
        self.pages: list[rawref.ref[Page] | None] = [None] * num_life_cycles

    def page(self, lc: int) -> Page | None:
        r = self.pages[lc]
        return r() if r is not None else None

    @property
    def has_children(self) -> bool:
        return self._children is not None

    def child(self, key: BlockKey) -> Node | None:
        c = self._children
        return c.get(key) if c is not None else None

    def children(self) -> list[Node]:
        c = self._children
        return list(c.values()) if c is not None else []

    def children_starting_with(self, token: TokenIdExt) -> list[Node]:
        by_first = self._children_by_first
        if by_first is None:
            return []
        return by_first.get(token, [])

    def add_child(self, child: Node) -> None:
        if self._children is None or self._children_by_first is None:
            self._children = {}
            self._children_by_first = {}
        self._children[child.key] = child
        lst = self._children_by_first.get(child.tokens[0])
        if lst is None:
            self._children_by_first[child.tokens[0]] = [child]
        else:
            lst.append(child)

    def remove_child(self, child: Node) -> None:
        children = self._children
        by_first = self._children_by_first
        assert children is not None and by_first is not None
        del children[child.key]
        lst = by_first[child.tokens[0]]
        lst.remove(child)
        if not lst:
            del by_first[child.tokens[0]]
        if not children:
            self._children = self._children_by_first = None

    def drop_children(self) -> list[Node]:
        """Unlink every child (subtree removal); returns them."""
        out = self.children()
        self._children = self._children_by_first = None
        return out

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
        self.roots: dict[tuple[int | None, int | None], Node] = {}

    def root(self, scope: ReuseScope, create: bool) -> Node | None:
        """The root node of a scope (keyed by the scope's digest), created on first publish."""
        ident = (scope.lora_id, scope.salt)
        node = self.roots.get(ident)
        if node is None and create:
            node = self.roots[ident] = Node(scope_key(scope), None, (), len(self.life_cycles))
        return node

    def match(
        self,
        root: Node,
        tokens: Sequence[TokenIdExt],
        partial: bool,
        keys: list[BlockKey],
    ) -> tuple[list[Node], Node | None, int]:
        """Longest reusable prefix: matched full-block nodes, then an optional partial node and its length.

        Walks full blocks by key; at the first miss picks the child with the longest common
        token prefix; then shortens until every life cycle has the pages it needs there.
        ``keys`` holds the keys of the first full blocks already computed for ``tokens``;
        keys computed here are appended, so a later match of the same tokens hashes nothing.
        Only the tokens of the blocks looked at are validated.
        """
        t = self.tokens_per_block
        nodes: list[Node] = []
        node = root
        n_full = len(tokens) // t
        hasher: BlockHasher | None = None
        while len(nodes) < n_full and node.has_children:
            o = len(nodes)
            if o == len(keys):
                if hasher is None:
                    hasher = BlockHasher(tokens, t)
                keys.append(hasher.key(node.key, o))
            child = node.child(keys[o])
            if child is None:
                break
            nodes.append(child)
            node = child
        part: Node | None = None
        part_len = 0
        if partial and len(nodes) * t < len(tokens):
            rest = tokens[len(nodes) * t : (len(nodes) + 1) * t]
            for child in node.children_starting_with(rest[0]):
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
            parent.remove_child(node)
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.drop_children())
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
        while n is not None and n.parent is not None and not n.has_children and not n.has_pages():
            parent: Node | None = n.parent
            assert parent is not None
            parent.remove_child(n)
            n.parent = None
            n = parent

    def clear(self) -> None:
        for root in list(self.roots.values()):
            for child in root.children():
                self.remove_subtree(child)
        self.roots = {}
