"""The router index's core (compiled): one replica's cached blocks as a tree of block hashes, its
matching rule, and the media a match is on. ``kv_cache_manager_v2.events.index.ReplicaIndex``
checks and decodes the wire events (plain Python, msgspec) and calls this.

Nodes, their dicts and token tuples are untracked by the cyclic garbage collector (which would
traverse them all at every full collection): a node leaves the tree with its links to it cut
(``_prune``), and ``clear`` cuts every link, so no untracked cycle outlives the tree's use.

A node exists while it holds a page of some layer group or has children (a replica keeps
pageless blocks only as chain links), so the nodes along a prompt's hash chain are a prefix of it:
when the replica has a single full-attention group and no pageless link anywhere, the longest
full-block match is found by a binary search over the prompt's hashes, not a walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, cast

import rawref

from ._common import TokenIdExt
from ._events import block_hash
from ._layers._policy import LayerGroup
from ._reuse._keys import BlockHasher
from ._reuse._walk import ChainNode, Walk

#: media from the fastest to the slowest (a block counts at its slowest page; other names last)
MEDIA_RANK: Final = {"GPU": 0, "CPU": 1, "DISK": 2, "REMOTE": 3}
_GPU: Final = "GPU"
#: bound once (a module attribute is looked up at every call compiled)
_untrack: Final = rawref.untrack
_block_hash: Final = block_hash

RootKey = tuple[int | None, int | None]


class RNode(ChainNode):
    """One block: its hash, parent, tokens, children (lazily made) and, per layer group, the
    medium of its page."""

    def __init__(self, block_hash: int, parent: RNode | None, tokens: tuple[TokenIdExt, ...], depth: int) -> None:
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        #: full blocks from the root (the root: 0)
        self.depth = depth
        self.children: dict[int, RNode] | None = None
        self.by_first: dict[TokenIdExt, list[RNode]] | None = None
        #: layer group -> medium holding its page
        self.groups: dict[int, str | None] = {}
        _untrack(self.groups)
        _untrack(tokens)
        _untrack(self)

    def next(self, prompt: object, ordinal: int) -> RNode | None:
        """The child holding full block ``ordinal`` of ``prompt`` (the prompt's block hashes)."""
        children = self.children
        return children.get(cast("list[int]", prompt)[ordinal]) if children is not None else None

    def holds(self, layer_group: int) -> bool:
        return layer_group in self.groups


class BlockTree:
    """The nodes by hash, the roots by (scope hash, lora id), and counters for the fast match."""

    def __init__(self) -> None:
        self.nodes: dict[int, RNode] = {}
        self.roots: dict[RootKey, RNode] = {}
        #: nodes holding no page (chain links)
        self.num_pageless = 0
        #: pages (node, group) not on the GPU
        self.num_off_gpu = 0

    def clear(self) -> None:
        """Forget every node, cutting their links (they are not collected as cycles)."""
        for node in self.nodes.values():
            _cut(node)
        for node in self.roots.values():
            _cut(node)
        self.nodes.clear()
        self.roots.clear()
        self.num_pageless = 0
        self.num_off_gpu = 0

    # ------------------------------------------------------------------ changes
    def store(
        self,
        root_key: RootKey,
        parent_hash: int | None,
        hashes: list[int],
        token_ids: list[int],
        block_tokens: list[tuple[TokenIdExt, ...]] | None,
        t: int,
        group: int,
        medium: str | None,
    ) -> None:
        """A run of blocks (each the parent of the next) gained pages of ``group`` on ``medium``;
        a block's tokens are ``block_tokens[k]`` when given, else its slice of ``token_ids``."""
        nodes = self.nodes
        ids = cast("list[TokenIdExt]", token_ids)  # (plain ids: TokenId values)
        if parent_hash is None:
            root = self.roots.get(root_key)
            if root is None:
                root = RNode(-1, None, (), 0)
                self.roots[root_key] = root
            parent = root
        else:
            found = nodes.get(parent_hash)
            if found is None:
                return  # its parent is gone (or was never seen): unreachable, as on the replica
            parent = found
        for k in range(len(hashes)):
            block = hashes[k]
            node = nodes.get(block)
            if node is None:
                toks = block_tokens[k] if block_tokens is not None else tuple(ids[k * t : (k + 1) * t])
                node = RNode(block, parent, toks, parent.depth + 1)
                nodes[block] = node
                self.num_pageless += 1
                children = parent.children
                if children is None:
                    children = parent.children = {}
                children[block] = node
                _untrack(children)  # inserting a node re-tracks a dict
                by_first = parent.by_first
                if by_first is None:
                    by_first = parent.by_first = {}
                lst = by_first.get(toks[0])
                if lst is None:
                    lst = by_first[toks[0]] = [node]
                    _untrack(by_first)
                else:
                    lst.append(node)
                _untrack(lst)
            self._set(node, group, medium)
            parent = node

    def _set(self, node: RNode, group: int, medium: str | None) -> None:
        groups = node.groups
        if group in groups:
            if groups[group] != _GPU:
                self.num_off_gpu -= 1
        elif not groups:
            self.num_pageless -= 1
        groups[group] = medium
        _untrack(groups)
        if medium != _GPU:
            self.num_off_gpu += 1

    def remove(self, hashes: list[int], group: int) -> None:
        """Blocks lost their page of ``group``; nodes left with no page and no child go, upward."""
        for h in hashes:
            node = self.nodes.get(h)
            if node is None or group not in node.groups:
                continue
            if node.groups.pop(group) != _GPU:
                self.num_off_gpu -= 1
            if not node.groups:
                self.num_pageless += 1
                self._prune(node)

    def move(self, hashes: list[int], group: int, medium: str | None) -> None:
        """Blocks' pages of ``group`` moved to ``medium``."""
        for h in hashes:
            node = self.nodes.get(h)
            if node is not None and group in node.groups:
                self._set(node, group, medium)

    def _prune(self, node: RNode) -> None:
        n: RNode | None = node
        while n is not None and n.parent is not None and not n.groups and not n.children:
            parent = n.parent
            children = parent.children
            assert children is not None
            del children[n.hash]
            by_first = parent.by_first
            assert by_first is not None
            lst = by_first[n.tokens[0]]
            lst.remove(n)
            if not lst:
                del by_first[n.tokens[0]]
            del self.nodes[n.hash]
            self.num_pageless -= 1
            n.parent = None
            n = parent
        # empty roots stay: cheap, and a replica keeps its roots too

    # ------------------------------------------------------------------ matching
    def match(
        self,
        root_key: RootKey,
        tokens: Sequence[TokenIdExt],
        hashes: list[int],
        t: int,
        groups: dict[int, LayerGroup],
        partial_reuse: bool,
    ) -> tuple[int, RNode | None, RNode | None]:
        """The match's length (the replica's ``probe_reuse`` rule), its last full block's node and
        its partial block's node (None: none)."""
        root = self.roots.get(root_key)
        if root is None or not tokens:
            return 0, None, None
        n_full = len(tokens) // t
        if n_full > len(hashes):
            n_full = len(hashes)
        simple = len(groups) <= 1 and self.num_pageless == 0
        for lc in groups.values():
            simple = simple and not lc.keeps_live_state and lc.window_size is None
        if simple:
            return self._match_simple(root, tokens, hashes, t, n_full, partial_reuse)
        return self._match_general(root, tokens, hashes, t, n_full, groups, partial_reuse)

    def _match_simple(
        self, root: RNode, tokens: Sequence[TokenIdExt], hashes: list[int], t: int, n_full: int, partial_reuse: bool
    ) -> tuple[int, RNode | None, RNode | None]:
        """One full-attention group, every node holding its page: the deepest node of the chain
        (binary search), then the partial block."""
        nodes = self.nodes
        lo = 0  # hashes[:lo] are all present
        hi = n_full
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            node = nodes.get(hashes[mid - 1])
            if node is not None and node.depth == mid:
                lo = mid
            else:
                hi = mid - 1
        last = nodes[hashes[lo - 1]] if lo > 0 else root
        part: RNode | None = None
        part_len = 0
        if partial_reuse and lo * t < len(tokens) and last.by_first is not None:
            rest = list(tokens[lo * t : (lo + 1) * t])
            cands = last.by_first.get(rest[0])
            if cands is not None:
                for c in cands:
                    n = _common_prefix_len(c.tokens, rest)
                    if n > part_len and c.groups:
                        part, part_len = c, n
        return lo * t + part_len, last if lo > 0 else None, part

    def _match_general(
        self,
        root: RNode,
        tokens: Sequence[TokenIdExt],
        hashes: list[int],
        t: int,
        n_full: int,
        groups: dict[int, LayerGroup],
        partial_reuse: bool,
    ) -> tuple[int, RNode | None, RNode | None]:
        """Any layer groups: walk full blocks by hash, pick a partial child, then shorten until every
        group holds the pages the match needs (the reuse tree's ``Walk``)."""
        walk = Walk(t, list(groups.items()))
        chain: list[RNode] = []
        gap = walk.descend(root, hashes, 0, n_full, cast("list[ChainNode]", chain))
        node = chain[-1] if chain else root
        part: RNode | None = None
        part_len = 0
        # recurrent groups: a match ends at a block with a snapshot of each (never partial)
        state_groups = walk.state_groups
        if partial_reuse and not state_groups and len(chain) * t < len(tokens) and node.by_first is not None:
            # the child sharing the most tokens among those with a page of every attention group
            needed = walk.partial_groups
            rest = list(tokens[len(chain) * t : (len(chain) + 1) * t])
            cands = node.by_first.get(rest[0])
            for c in cands if cands is not None else []:
                n = _common_prefix_len(c.tokens, rest)
                if n > part_len and all(g in c.groups for g in needed):
                    part, part_len = c, n
        num_full, part_len = walk.shorten(chain, len(chain), part, part_len, gap)
        if state_groups:
            num_full = walk.snapshot_cut(chain, num_full)
        del chain[num_full:]
        return num_full * t + part_len, chain[-1] if chain else None, part if part_len else None

    def media(self, length: int, last: RNode | None, part: RNode | None, t: int) -> dict[str | None, int]:
        """The tokens of a match (``match``'s answer) by the medium of their block (its slowest page;
        a block holding no page, outside every window, counts as GPU)."""
        out: dict[str | None, int] = {}
        if length <= 0:
            return out
        if self.num_off_gpu == 0:
            out[_GPU] = length
            return out
        tail = length - (last.depth if last is not None else 0) * t
        if part is not None and tail > 0:
            m = _slowest(part)
            out[m] = out.get(m, 0) + tail
        node = last
        while node is not None and node.depth > 0:
            m = _slowest(node)
            out[m] = out.get(m, 0) + t
            node = node.parent
        return out


def _cut(node: RNode) -> None:
    node.parent = None
    node.children = None
    node.by_first = None


def prompt_block_hashes(tokens: Sequence[TokenIdExt], tokens_per_block: int, root: bytes) -> list[int]:
    """The 64-bit hashes of the blocks of ``tokens`` (the last may be partial) under the scope
    key ``root``."""
    return [_block_hash(k) for k in BlockHasher(tokens, tokens_per_block, "tokens").chain(root)]


def _slowest(node: RNode) -> str | None:
    worst: str | None = _GPU
    rank = -1
    for m in node.groups.values():
        r = MEDIA_RANK.get(m, 4) if m is not None else 4
        if r > rank:
            worst, rank = m, r
    return worst


def _common_prefix_len(a: tuple[TokenIdExt, ...], b: list[TokenIdExt]) -> int:
    n = len(a) if len(a) < len(b) else len(b)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
