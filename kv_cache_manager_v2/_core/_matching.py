"""Prefix matching: how much of a request's tokens the reuse tree (and the remote tier) holds,
and where the pages a match needs live (SPEC 4.4, 5.3)."""

from __future__ import annotations

from collections.abc import Sequence

from .._common import DEFAULT_REUSE_SCOPE, CacheLevel, LayerGroupId, ReuseScope, TokenIdExt
from .._layers._policy import LayerGroup
from .._reuse._keys import BlockHasher, BlockKey, check_token_sequence
from .._reuse._node import Node
from .._reuse._remote_fill import Found, Projection, RemoteFill
from .._reuse._tree import ReuseTree
from .._typed import TypedList
from .._utils import check_type
from ._context import CacheContext

#: a match: the matched full blocks' nodes, the partially matched node and its length, and the
#: projected remote extension (None: the remote tier does not extend it)
Match = tuple[list[Node], Node | None, int, Projection | None]


class PrefixMatcher:
    """Matches token sequences against the reuse tree; keeps the block keys a probe hashed for
    the create of the same tokens that usually follows, so each block is hashed once."""

    def __init__(
        self, tree: ReuseTree, remote_fill: RemoteFill | None, tokens_per_block: int, enable_partial_reuse: bool
    ) -> None:
        self.tree = tree
        self.remote_fill = remote_fill
        self.tokens_per_block = tokens_per_block
        self.enable_partial_reuse = enable_partial_reuse
        #: what the last probe learned (scope, tokens, block keys, remote lookup) for the next create
        self.probe_keys: tuple[ReuseScope, Sequence[TokenIdExt], list[BlockKey], Found | None] | None = None

    def probe(
        self, ctx: CacheContext, what: str, reuse_scope: ReuseScope | None, input_tokens: Sequence[TokenIdExt] | None
    ) -> Match | None:
        """The match for a query ``what`` that takes nothing (None: no tokens to match)."""
        if reuse_scope is not None:
            check_type("reuse_scope", reuse_scope, ReuseScope)
        if input_tokens is None or len(input_tokens) == 0:
            return None
        ctx.enter(what)
        try:
            return self.match(reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE, input_tokens, False)
        finally:
            ctx.leave()

    def match(self, scope: ReuseScope, input_tokens: Sequence[TokenIdExt], for_create: bool) -> Match:
        """Match ``input_tokens`` (all of them are validated). With a remote tier the match is
        extended there: a create fetches the pages into the tree and matches again; a probe only
        projects the match the create would make (``RemoteFill.project``)."""
        check_type("reuse_scope", scope, ReuseScope)
        check_token_sequence(input_tokens, "input_tokens")
        cached = self.probe_keys
        self.probe_keys = None
        keys: list[BlockKey] | None = None
        known: Found | None = None
        validated = 0
        if cached is not None and (cached[0] is scope or cached[0] == scope):
            probed = cached[1]
            n = len(probed)
            # the last probed token first: a different prompt (a probe per request) is not copied and compared
            if len(input_tokens) >= n and input_tokens[n - 1] == probed[n - 1] and input_tokens[:n] == probed:
                keys = cached[2]
                validated = len(probed)
                if len(input_tokens) == len(probed):
                    known = cached[3]
        hasher = BlockHasher(input_tokens, self.tokens_per_block, "input_tokens", keys, validated)
        partial = self.enable_partial_reuse
        tree = self.tree
        tree.attention_blocks, tree.branches = 0, False  # (set by a hybrid model's tree.match)
        root = tree.root(scope, False)
        nodes: list[Node] = []
        part: Node | None = None
        part_len = 0
        if root is not None:
            nodes, part, part_len = tree.match(root, hasher, partial)
        projection: Projection | None = None
        found: Found | None = None
        fill = self.remote_fill
        if fill is not None:
            hasher.validate_rest()  # a bad token raises before any network call
            remote_blocks, found, projection = fill.extend(scope, hasher, nodes, for_create, known, partial)
            if for_create and remote_blocks > len(nodes):  # the fetched pages are in the tree now
                root = tree.root(scope, False)
                assert root is not None
                nodes, part, part_len = tree.match(root, hasher, partial)
        hasher.validate_rest()
        if not for_create:
            # the probed tokens, copied with their own type so == is exact
            self.probe_keys = (scope, input_tokens[:], hasher.keys, found)
        return nodes, part, part_len, projection


def match_length(match: Match, tokens_per_block: int) -> int:
    """Tokens a match reuses (its remote projection included)."""
    nodes, _, part_len, projection = match
    if projection is not None:
        return len(projection[0]) * tokens_per_block + projection[2]
    return len(nodes) * tokens_per_block + part_len


def match_levels(
    match: Match, layer_groups: TypedList[LayerGroupId, LayerGroup], tokens_per_block: int, remote_level: int
) -> list[CacheLevel]:
    """Per block of a match, the deepest cache level among the pages it needs (``remote_level``
    for those the remote tier supplies; ``GPU_LEVEL`` where it needs none)."""
    local_nodes, part, part_len, projection = match
    nodes: Sequence[Node | None] = local_nodes
    fetched: set[tuple[int, int]] = set()
    if projection is not None:  # part of the prefix is fetched from the remote tier
        nodes, part, part_len, fetched = projection
    length = len(nodes) * tokens_per_block + part_len
    num_blocks = (length + tokens_per_block - 1) // tokens_per_block
    levels = [0] * num_blocks
    for i, policy in enumerate(layer_groups):
        beg, end = policy.stale_range(length)
        for ordinal in range(num_blocks):
            if beg <= ordinal < end:
                continue
            if (ordinal, i) in fetched:
                levels[ordinal] = remote_level
                continue
            node = nodes[ordinal] if ordinal < len(nodes) else part
            page = node.page(LayerGroupId(i)) if node is not None else None
            if page is not None and page.level > levels[ordinal]:
                levels[ordinal] = page.level
        if not (policy.keeps_live_state and nodes and part is None):
            continue
        # the snapshot a hybrid match ends at (copied at resume): local, or fetched from the remote tier
        last = nodes[-1]
        if (len(nodes) - 1, i) in fetched:
            levels[-1] = remote_level
        elif last is not None:
            snapshot = last.page(LayerGroupId(i))
            if snapshot is not None and snapshot.level > levels[-1]:
                levels[-1] = snapshot.level
    return [CacheLevel(level) for level in levels]
