"""The radix tree of committed blocks (SPEC 5.3, 5.4): matching, publishing (insert and dedup)
and removal. It is the one place blocks enter and leave the reuse cache."""

from __future__ import annotations

from collections.abc import Sequence

import rawref

from .._common import MAX_PRIORITY, LifeCycleId, Priority, ReuseScope, TokenIdExt
from .._life_cycle_registry import LifeCycle
from .._page import Page
from .._storage._storage_manager import PageDropListener
from .._typed import TypedList
from ._keys import BlockHasher, BlockKey, block_key, scope_key


class Node:
    """One committed block (full, or a partial tail) with non-owning refs to its pages."""

    __slots__ = (
        "_children",
        "_children_by_first",
        "key",
        "num_extenders",
        "ordinal",
        "pages",
        "parent",
        "prio_cap",
        "tokens",
    )

    def __init__(
        self, key: BlockKey, parent: Node | None, tokens: tuple[TokenIdExt, ...], num_life_cycles: int
    ) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.ordinal: int = parent.ordinal + 1 if parent is not None else -1
        # Created with the first child: most nodes are leaves, and a tree can hold millions.
        self._children: dict[BlockKey, Node] | None = None
        #: children by their first token, so a partial match scans only plausible candidates
        self._children_by_first: dict[TokenIdExt, list[Node]] | None = None
        self.pages: list[rawref.ref[Page] | None] = [None] * num_life_cycles
        #: requests that will publish the next block under this node: it stays while they may
        self.num_extenders = 0
        #: no page of this node or below it evicts after an anchor page of this node or above it
        self.prio_cap: Priority = parent.prio_cap if parent is not None else MAX_PRIORITY

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

    @property
    def is_removable(self) -> bool:
        """A leaf with no pages that no request extends: nothing can reach or need it."""
        return self._children is None and self.num_extenders == 0 and not self.has_pages()


def common_prefix_len(a: Sequence[TokenIdExt], b: Sequence[TokenIdExt]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ReuseTree(PageDropListener):
    """Roots per reuse scope; matching, publishing and removal of committed blocks."""

    def __init__(self, life_cycles: TypedList[LifeCycleId, LifeCycle], tokens_per_block: int) -> None:
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

    # ------------------------------------------------------------------ matching
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
        """The first block a match of ``length`` tokens needs a page for but has none; -1 if none."""
        t = self.tokens_per_block
        nb = (length + t - 1) // t
        first = -1
        for lc_id, lc in enumerate(self.life_cycles):
            beg, end = lc.stale_range(length)
            for o in range(nb):
                if beg <= o < end:
                    continue
                node = nodes[o] if o < len(nodes) else part
                if node is None or node.page(lc_id) is None:
                    if first < 0 or o < first:
                        first = o
                    break
        return first

    # ------------------------------------------------------------------ publishing
    def publish(
        self, parent: Node, tokens: tuple[TokenIdExt, ...], pages: list[Page | None], locked: bool
    ) -> Node | None:
        """Insert one committed block under ``parent`` (a partial tail when shorter than a block).

        ``pages[lc]`` is the publishing request's page of the block (None: it has none there).
        Where the tree already holds a page for the block, the request switches to it (dedup):
        ``pages[lc]`` becomes the tree's page, taken (locked if ``locked``, else held), and the
        request's own is released; if the tree's page sits in a lower cache level, the two swap
        places first (same data), so an active request keeps a GPU page. Returns the block's
        node, or None when a longer sibling already covers a partial tail (then nothing is
        published).

        A published page's priority is capped by the anchor pages above it, so a block is never
        evicted after its ancestors' anchors (whose eviction would take it along).
        """
        if len(tokens) < self.tokens_per_block and any(
            c.tokens[: len(tokens)] == tokens for c in parent.children_starting_with(tokens[0])
        ):
            return None
        key = block_key(parent.key, tokens)
        node = parent.child(key)
        if node is None:
            node = Node(key, parent, tokens, len(pages))
            parent.add_child(node)
        cap = parent.prio_cap
        for lc in range(len(pages)):
            mine = pages[lc]
            theirs = node.page(lc)
            if theirs is None:
                if mine is not None and mine.node is None:  # owned by the request
                    if mine.priority > cap:
                        mine.set_priority(cap)
                    mine.node = node
                    node.pages[lc] = rawref.ref(mine)
                    if self.life_cycles.items[lc].is_anchor(node.ordinal) and mine.priority < node.prio_cap:
                        node.prio_cap = mine.priority
            elif mine is not None and theirs is not mine:
                if theirs.level > mine.level:  # the tree's copy is in a lower tier: it takes our place
                    theirs.exchange_location(mine)
                theirs.take(locked)
                pages[lc] = theirs
                mine.release(locked)
        return node

    # ------------------------------------------------------------------ removal
    def page_dropped(self, page: Page) -> None:
        """Forget an evicted page; remove what can no longer be reused without it."""
        node = page.node
        page.node = None
        if node is None:
            return
        node.pages[page.life_cycle] = None
        if self.life_cycles[page.life_cycle].is_anchor(node.ordinal):
            self.remove_subtree(node)
        else:
            self.prune(node)

    def remove_subtree(self, node: Node, free_unused: bool = False) -> None:
        """Unlink ``node`` and its descendants; pages in use are detached (private to their owners).

        Unused pages become garbage, evicted before anything else, so an eviction never frees
        more slots than it was asked for; with ``free_unused`` they are freed at once.
        """
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
                        if free_unused:
                            p.storage.evictor.remove(p)
                            p.free()
                        else:
                            p.storage.evictor.to_garbage(p)
        if parent is not None:
            self.prune(parent)

    def prune(self, node: Node) -> None:
        """Remove removable nodes upward (never the scope roots)."""
        n: Node | None = node
        while n is not None and n.parent is not None and n.is_removable:
            parent: Node | None = n.parent
            assert parent is not None
            parent.remove_child(n)
            n.parent = None
            n = parent

    def clear(self) -> None:
        """Remove every block (callers made sure no request uses any)."""
        for root in list(self.roots.values()):
            for child in root.children():
                self.remove_subtree(child, free_unused=True)
        self.roots = {}

    def nodes(self) -> list[Node]:
        """Every node below the roots (for checks and statistics)."""
        out: list[Node] = []
        stack = [c for root in self.roots.values() for c in root.children()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children())
        return out
