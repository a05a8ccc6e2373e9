"""Prefix matching: how much of a request's tokens the reuse tree (and the remote tier) holds,
and where the pages a match needs live (docs/design.md, "Reuse")."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final, cast

import rawref
from blockhash import same_block

from .._common import DEFAULT_REUSE_SCOPE, CacheLevel, LayerGroupId, ReuseScope, TokenIdExt
from .._layers._policy import LayerGroup
from .._reuse._keys import BlockHasher, BlockKey, check_token_sequence
from .._reuse._node import Node
from .._reuse._remote_fill import Found, Projection, RemoteFill
from .._reuse._tree import ReuseTree
from .._typed import TypedList
from .._utils import check_type
from ._context import CacheContext
from ._load_plan import NOTHING_FETCHED, LoadPlanner

#: a match: the matched full blocks' nodes, the partially matched node and its length, and the
#: projected remote extension (None: the remote tier does not extend it)
Match = tuple[list[Node], Node | None, int, Projection | None]


#: what a match learned of its tokens for a later match of the same ones: the scope, the tokens
#: (a copy of their own type), their full blocks' keys, the nodes its walk passed, the remote lookup
Kept = tuple[ReuseScope, Sequence[TokenIdExt], list[BlockKey], list[Node], Found | None]
#: where a probe is kept: scope (LoRA id, salt), length, the last and the middle token
Fingerprint = tuple[int | None, int | None, int, object, object]

#: bound once: mypyc looks a module's attribute up at every call
_untrack: Final = rawref.untrack
_same_block: Final = same_block

#: bounds of the kept probes (entries and tokens in all): a few MiB of references
KEPT_ENTRIES: Final = 1024
KEPT_TOKENS: Final = 1 << 20


class PrefixMatcher:
    """Matches token sequences against the reuse tree. Keeps what a probe learned (block keys,
    the nodes its walk passed) for a later match of the same tokens: the create that usually
    follows, or another probe of them, hashes and walks nothing again; a sliding window then
    looks only at the pages of the blocks it needs."""

    def __init__(
        self, tree: ReuseTree, remote_fill: RemoteFill | None, tokens_per_block: int, enable_partial_reuse: bool
    ) -> None:
        self.tree = tree
        self.remote_fill = remote_fill
        self.tokens_per_block = tokens_per_block
        self.enable_partial_reuse = enable_partial_reuse
        #: the last probe's, for the next create (also of longer tokens starting with them)
        self.last: Kept | None = None
        #: recent probes by ``_fingerprint``, oldest first (bounded by ``KEPT_ENTRIES`` and ``KEPT_TOKENS``)
        self.kept: dict[Fingerprint, Kept] = {}
        self.kept_tokens = 0
        #: the load plan (None: every match is taken whole, e.g. a manager with the GPU tier only)
        self.planner: LoadPlanner | None = None
        #: whether creates count the plan's statistics (``enable_stats``)
        self.counts = True
        #: what finished prefetches (``KVCacheManager.prefetch``) learned of the remote tier, by
        #: ``_fingerprint``, for the create of the same tokens (used once; at most ``KEPT_ENTRIES``)
        self.prefetched: dict[Fingerprint, tuple[ReuseScope, Sequence[TokenIdExt], Found]] = {}

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
        # (a create with no probe kept, as when the engine never probes, looks nothing up)
        fingerprint = _fingerprint(scope, input_tokens) if self.kept or not for_create else None
        kept = (
            self._recall(scope, input_tokens, fingerprint) if fingerprint is not None or self.last is not None else None
        )
        keys: list[BlockKey] | None = None
        walked: list[Node] | None = None
        known: Found | None = None
        validated = 0
        if kept is not None:  # its tokens start ours, token for token (so ours are valid there)
            validated = len(kept[1])
            n_full = validated // self.tokens_per_block  # (a partial block of the probe may be full here)
            keys = kept[2][:n_full]
            walked = kept[3][:n_full]
            if walked and walked[-1].parent is None:  # it left the tree (and everything under it)
                walked = None
            last = self.last
            # the last probe's (compared by its keys' list: compiled, a tuple is unboxed, not the same object)
            if last is not None and kept[2] is last[2] and validated == len(input_tokens):
                known = kept[4]
        self.last = None
        if known is None and self.prefetched:  # (a probe leaves it for the create)
            known = self._prefetched(scope, input_tokens, for_create)
        hasher = BlockHasher(input_tokens, self.tokens_per_block, "input_tokens", keys, validated)
        partial = self.enable_partial_reuse
        tree = self.tree
        tree.attention_blocks, tree.branches = 0, False  # (set by a hybrid model's tree.match)
        root = tree.root(scope, False)
        nodes: list[Node] = []
        part: Node | None = None
        part_len = 0
        tree.walked = []
        if root is not None:
            nodes, part, part_len = tree.match(root, hasher, partial, walked, not for_create)
        projection: Projection | None = None
        found: Found | None = None
        fill = self.remote_fill
        planner = self.planner
        counting = for_create and planner is not None and not planner.active and self.counts  # (whole matches)
        if planner is not None and planner.active:
            nodes, part, part_len, projection, found = self._plan(
                planner, scope, hasher, nodes, part, part_len, for_create, known
            )
        elif fill is not None:
            hasher.validate_rest()  # a bad token raises before any network call
            remote_blocks, found, projection = fill.extend(
                scope, hasher, nodes, for_create and not counting, known, partial
            )
            if counting and projection is not None:  # counted before the fetch: its blocks as the remote tier's
                assert planner is not None
                planner.count_taken_whole(projection)
                remote_blocks = fill.extend(scope, hasher, nodes, True, found, partial)[0]
                projection = None
                counting = False
            if for_create and remote_blocks > len(nodes):  # the fetched pages are in the tree now
                nodes, part, part_len = self._rematch(scope, hasher)
        if counting and planner is not None:
            planner.count_whole(nodes, part, part_len)
        hasher.validate_rest()
        if not for_create:
            # (valid tokens, keys and untracked nodes, never changed: untracked by the cyclic GC)
            same = kept is not None and validated == len(input_tokens)
            copy = kept[1] if kept is not None and same else _copy(input_tokens)
            self._keep(fingerprint, (scope, copy, _untrack(hasher.keys), _untrack(tree.walked), found))
        return nodes, part, part_len, projection

    def _rematch(self, scope: ReuseScope, hasher: BlockHasher) -> tuple[list[Node], Node | None, int]:
        """The local match again (after a fetch placed pages in the tree)."""
        root = self.tree.root(scope, False)
        assert root is not None
        return self.tree.match(root, hasher, self.enable_partial_reuse)

    def _plan(
        self,
        planner: LoadPlanner,
        scope: ReuseScope,
        hasher: BlockHasher,
        nodes: list[Node],
        part: Node | None,
        part_len: int,
        for_create: bool,
        known: Found | None,
    ) -> tuple[list[Node], Node | None, int, Projection | None, Found | None]:
        """The match cut by the load plan (``_load_plan``). With a remote tier (not under "never")
        the plan sees what the remote tier would add (the probe's projection) before anything is
        fetched; a create fetches only up to the cut, a probe projects only up to it, so a probe
        reports what the create of the same tokens takes. A cut ends where the tree lets a
        match end (``ReuseTree.cut``)."""
        fill = self.remote_fill if planner.policy != "never" else None
        partial = self.enable_partial_reuse
        projection: Projection | None = None
        found: Found | None = known
        if fill is not None:
            hasher.validate_rest()  # a bad token raises before any network call
            _, found, projection = fill.extend(scope, hasher, nodes, False, known, partial)
        seen: Sequence[Node | None] = nodes
        fetched: frozenset[tuple[int, int]] | set[tuple[int, int]] = NOTHING_FETCHED
        seen_part, seen_len = part, part_len
        if projection is not None:
            seen, seen_part, seen_len, fetched = projection
        elif planner.in_gpu_memory(nodes, part):  # (the common case: nothing to weigh)
            if for_create and self.counts:
                planner.loaded_tokens[0] += len(nodes) * self.tokens_per_block + part_len
            return nodes, part, part_len, None, found
        levels = planner.levels(seen, seen_part, seen_len, fetched)
        t = self.tokens_per_block
        length = len(seen) * t + seen_len
        taken, saved, whole_saving = planner.plan(levels, len(seen), seen_len)
        if for_create and self.counts:
            planner.count(levels, length, taken, saved, whole_saving)
            if taken < length:
                planner.cuts += 1
        keep = taken // t  # (a cut takes full blocks only)
        if taken == length:
            if projection is not None and fill is not None and for_create:
                fill.extend(scope, hasher, nodes, True, found, partial)
                nodes, part, part_len = self._rematch(scope, hasher)
                projection = None
            return nodes, part, part_len, projection, found
        if keep <= len(nodes) or fill is None:
            self.tree.cut(nodes, keep)
            return nodes, None, 0, None, found
        if for_create:  # some fetched blocks are worth it: fetch up to the cut
            fill.extend(scope, hasher, nodes, True, found, partial, limit=keep)
            nodes, part, part_len = self._rematch(scope, hasher)
            return nodes, part, part_len, None, found
        return nodes, part, part_len, fill.extend(scope, hasher, nodes, False, found, partial, limit=keep)[2], found

    def remember_prefetch(self, scope: ReuseScope, tokens: Sequence[TokenIdExt], found: Found) -> None:
        """Keep what a prefetch of (valid) ``tokens`` learned of the remote tier for their create."""
        fingerprint = _fingerprint(scope, tokens)
        if fingerprint is None:
            return
        table = self.prefetched
        table.pop(fingerprint, None)
        table[fingerprint] = (scope, _copy(tokens), found)
        if len(table) > KEPT_ENTRIES:
            del table[next(iter(table))]

    def _prefetched(self, scope: ReuseScope, tokens: Sequence[TokenIdExt], take: bool) -> Found | None:
        """What a prefetch of exactly ``tokens`` learned of the remote tier (``take``: used once)."""
        fingerprint = _fingerprint(scope, tokens)
        if fingerprint is None:
            return None
        entry = self.prefetched.pop(fingerprint, None) if take else self.prefetched.get(fingerprint)
        if entry is None or not (entry[0] is scope or entry[0] == scope) or not _starts_with(tokens, entry[1]):
            return None
        return entry[2]

    def _recall(self, scope: ReuseScope, tokens: Sequence[TokenIdExt], fingerprint: Fingerprint | None) -> Kept | None:
        """The kept probe of ``tokens``, else the last probe when its tokens start ``tokens``."""
        kept = self.kept.get(fingerprint) if fingerprint is not None else None
        if kept is not None and (kept[0] is scope or kept[0] == scope) and _starts_with(tokens, kept[1]):
            return kept
        last = self.last
        if last is not None and (last[0] is scope or last[0] == scope) and _starts_with(tokens, last[1]):
            return last
        return None

    def _keep(self, fingerprint: Fingerprint | None, kept: Kept) -> None:
        """Keep a probe's result (the last probe; and by fingerprint, the oldest going past the bounds)."""
        self.last = kept
        if fingerprint is None:
            return
        table = self.kept
        old = table.pop(fingerprint, None)
        if old is not None:
            self.kept_tokens -= len(old[1])
        table[fingerprint] = kept
        self.kept_tokens += len(kept[1])
        while len(table) > KEPT_ENTRIES or self.kept_tokens > KEPT_TOKENS:
            oldest = next(iter(table))
            self.kept_tokens -= len(table.pop(oldest)[1])

    def forget(self) -> None:
        """Drop every kept probe (the tree was cleared: their nodes are gone)."""
        self.last = None
        self.kept = {}
        self.kept_tokens = 0
        self.prefetched = {}


def _fingerprint(scope: ReuseScope, tokens: Sequence[TokenIdExt]) -> Fingerprint | None:
    """Where a probe of ``tokens`` is kept: scope, length and two tokens (None: a token there is
    neither an int nor bytes, so nothing is kept or looked up)."""
    items = cast("Sequence[object]", tokens)  # (not validated yet: compiled, no cast to a token type)
    n = len(items)
    last = items[n - 1]
    middle = items[n // 2]
    if (type(last) is not int and type(last) is not bytes) or (type(middle) is not int and type(middle) is not bytes):
        return None
    return (scope.lora_id, scope.salt, n, last, middle)


def _copy(tokens: Sequence[TokenIdExt]) -> Sequence[TokenIdExt]:
    """A copy of valid tokens to keep: a tuple (untracked), or an array of the same type code."""
    if isinstance(tokens, array):
        return tokens[:]
    return _untrack(tuple(tokens))


def _starts_with(tokens: Sequence[TokenIdExt], prefix: Sequence[TokenIdExt]) -> bool:
    """Whether ``tokens`` starts with the kept ``prefix`` token for token, each exactly an int or
    bytes as there (``True == 1``, yet a bool is no token), in one native pass; an array prefix only
    starts an array of its type code. The last token is compared first: cheap when it differs."""
    n = len(prefix)
    if len(tokens) < n or cast("Sequence[object]", tokens)[n - 1] != prefix[n - 1]:
        return False
    if isinstance(prefix, array):
        return isinstance(tokens, array) and tokens.typecode == prefix.typecode and tokens[:n] == prefix
    return _same_block(prefix, tokens, 0, n) is True


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
