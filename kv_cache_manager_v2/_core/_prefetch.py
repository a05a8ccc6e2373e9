"""``KVCacheManager.prefetch``: bring the match of a queued request's tokens up in the background,
so that the ``create_kv_cache`` (and ``resume``) of the same tokens later finds its pages in memory
(docs/design.md, "Background loads").

At the call (the scheduler's thread) the tokens are matched against the local tree and a read of
each matched page on a disk tier starts (``PageReads``); with a remote tier the blocks after the
local match are looked up in the background. When the lookup lands (the manager's poll), the
pages a create would fetch are fetched in the background; when those land, they are checked and
placed exactly as a synchronous fetch places them (``RemoteFill.extend`` with the values read), and
what the lookup found is kept for the create of the same tokens, which then asks the server
nothing more. Workers only do the round trips and the reads, into buffers of their own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .._common import DEFAULT_REUSE_SCOPE, CacheLevel, LayerGroupId, ReuseScope, TokenIdExt
from .._page import Page
from .._reuse._keys import BlockHasher, BlockKey, check_token_sequence
from .._reuse._node import Node
from .._reuse._remote_fill import Fetched, Found, RemoteFill
from .._storage._loader import BackgroundLoader, LoadJob
from .._storage._page_reads import PageRead, ReadGroup
from .._storage._remote._store import RemoteStore
from .._storage._shelf import Shelf
from .._storage._tier_costs import TierCosts
from .._utils import check_int, check_type
from ._context import CacheContext
from ._load_plan import NOTHING_FETCHED
from ._matching import PrefixMatcher, _copy


class RemoteBatch(LoadJob):
    """One lookup (lengths) or fetch (values) round trip on a worker, for the parts of several
    prefetches (``RemoteReads``)."""

    def __init__(
        self, reads: RemoteReads, values: bool, parts: list[tuple[Prefetch, int]], keys: list[bytes], nbytes: list[int]
    ) -> None:
        super().__init__()
        self.reads = reads
        self.values = values
        #: each prefetch and how many of ``keys`` (in order) are its
        self.parts = parts
        self.keys = keys
        #: each key's whole value length
        self.nbytes = nbytes
        self.outcome: list[Any] | BaseException = []
        #: seconds the round trip took on its worker (a fetch refines the remote tier's cost)
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        self.outcome = self.reads.remote.background_read(self.keys, self.nbytes, self.values)
        self.seconds = time.perf_counter() - t0

    def land(self) -> None:
        self.reads.landed(self)


class RemoteReads:
    """The remote round trips of one manager's prefetches, batched: at most one lookup and one
    fetch in flight; what prefetches ask meanwhile goes out together in the next one (one round
    trip for all the requests that arrived during the last, however far the server is)."""

    def __init__(
        self, remote: RemoteStore, loader: BackgroundLoader, backlog: list[LoadJob], costs: TierCosts | None = None
    ) -> None:
        self.remote = remote
        #: the read costs a timed fetch refines (the remote tier's level: after the local ones)
        self.costs = costs
        self.loader = loader
        #: the manager's ``CacheContext.backlog``: fetched values are placed from there, a few a poll
        self.backlog = backlog
        #: per kind (0: lookups, 1: fetches), the parts waiting for the next round trip
        self.pending: list[list[tuple[Prefetch, list[bytes], list[int]]]] = [[], []]
        self.busy = [False, False]

    def ask(self, prefetch: Prefetch, keys: list[bytes], nbytes: list[int], values: bool) -> None:
        kind = 1 if values else 0
        self.pending[kind].append((prefetch, keys, nbytes))
        if not self.busy[kind]:
            self._send(kind)

    def _send(self, kind: int) -> None:
        parts: list[tuple[Prefetch, int]] = []
        keys: list[bytes] = []
        nbytes: list[int] = []
        for prefetch, its, sizes in self.pending[kind]:
            if not prefetch._cancelled:
                parts.append((prefetch, len(its)))
                keys.extend(its)
                nbytes.extend(sizes)
        self.pending[kind] = []
        if not parts:
            return
        self.busy[kind] = True
        self.loader.submit(RemoteBatch(self, kind == 1, parts, keys, nbytes))

    def landed(self, job: RemoteBatch) -> None:
        """A round trip finished (the scheduler's thread): count it, hand each prefetch its part."""
        kind = 1 if job.values else 0
        self.busy[kind] = False
        outcome = job.outcome
        ok = self.remote.account_background(job.keys, job.values, outcome)
        costs = self.costs
        if ok and job.values and costs is not None:
            assert not isinstance(outcome, BaseException)
            costs.observe(costs.remote_level, sum(len(v) for v in outcome if isinstance(v, bytes)), job.seconds)
        at = 0
        for prefetch, n in job.parts:
            part: list[Any] | None = None
            if ok:
                assert not isinstance(outcome, BaseException)
                part = outcome[at : at + n]
            at += n
            if job.values:
                self.backlog.append(Landed(prefetch, part))
            else:
                prefetch._landed(False, part)
        self._send(kind)


class Landed(LoadJob):
    """A prefetch's fetched values, waiting in the backlog to be placed."""

    def __init__(self, prefetch: Prefetch, values: list[Any] | None) -> None:
        super().__init__()
        self.prefetch = prefetch
        self.values = values

    def run(self) -> None:
        pass

    def land(self) -> None:
        self.prefetch._landed(True, self.values)


class Prefetch:
    """What one ``KVCacheManager.prefetch`` call started (see its doc): ``done`` once every read
    has been installed (or discarded), ``cancel`` to stop wanting them."""

    def __init__(
        self,
        ctx: CacheContext,
        matcher: PrefixMatcher,
        scope: ReuseScope,
        tokens: Sequence[TokenIdExt],
        target: CacheLevel,
    ) -> None:
        self._ctx = ctx
        self._matcher = matcher
        self._scope = scope
        self._tokens = tokens
        self._target = target
        self._reads: list[PageRead] = []
        #: the pages they installed and its fetch placed (placing another never evicts them)
        self._group = ReadGroup()
        #: a lookup or fetch of it is in flight (``RemoteReads``)
        self._waiting = False
        self._remote_reads: RemoteReads | None = None
        #: the pages the fetch in flight asks for, in its keys' order
        self._needed: list[tuple[int, int]] = []
        self._found: Found = {}
        #: the remote tier answered every round trip: what it found is kept for the create
        self._looked_up = False
        self._cancelled = False
        #: tokens the match reaches as far as known (local at the call; then with the remote tier)
        self._reused_tokens = 0
        #: pages being brought up: disk reads, then remote values
        self._num_disk_pages = 0
        self._num_remote_pages = 0

    def __repr__(self) -> str:
        state = "cancelled" if self._cancelled else "done" if not self._pending() else "loading"
        return (
            f"Prefetch({state}, reused_tokens={self._reused_tokens}, disk_pages={self._num_disk_pages}, "
            f"remote_pages={self._num_remote_pages})"
        )

    # ------------------------------------------------------------------ public
    @property
    def done(self) -> bool:
        """Whether every read it started is installed, discarded or cancelled (finished ones are
        installed now): a ``create_kv_cache`` of the same tokens then reads nothing from disk or
        the remote tier for them, unless their pages were evicted again meanwhile or the target
        level could not hold them all (``num_installed_pages``)."""
        if not self._pending():
            return True
        ctx = self._ctx
        if ctx.loader is None or ctx.loader.closed:  # the manager was shut down: nothing lands any more
            return True
        ctx.enter("Prefetch.done")
        try:
            ctx.poll_loads()
        finally:
            ctx.leave()
        return not self._pending()

    @property
    def waits_for_remote(self) -> bool:
        """Whether a round trip to the remote tier (its lookup or fetch) is still in flight."""
        return self._waiting

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` was called (its reads not installed by then are discarded)."""
        return self._cancelled

    @property
    def reused_tokens(self) -> int:
        """Tokens of its tokens the cache holds once it is done, as far as known now: the local
        match at the call (as far as the load plan takes it), then as far as the remote tier's
        lookup reaches within the plan (a value that turns out missing or corrupt, or no room for
        it, makes it less; never wrong data)."""
        return self._reused_tokens

    @property
    def num_disk_pages(self) -> int:
        """Pages of the local match it reads from a disk tier."""
        return self._num_disk_pages

    @property
    def num_installed_pages(self) -> int:
        """Pages its disk reads placed so far (``num_disk_pages`` once done, unless the target
        level could not hold them all: placing a read never evicts a page it brought itself, so
        such a read is discarded and its page stays on disk, read by the create)."""
        return self._group.num_installed

    @property
    def num_remote_pages(self) -> int:
        """Pages it fetches from the remote tier (known once the lookup has answered)."""
        return self._num_remote_pages

    def cancel(self) -> None:
        """Stop wanting its reads: those not installed yet are discarded (nothing was allocated
        for them). Idempotent; pages already installed stay (as reusable pages)."""
        if self._cancelled:
            return
        self._cancelled = True
        reads = self._ctx.reads
        if reads is not None:
            reads.cancel(self._reads, self._group)
        self._reads = []
        self._waiting = False  # (its part of a round trip in flight is ignored when it lands)

    # ------------------------------------------------------------------ the stages
    def _pending(self) -> bool:
        if self._waiting:
            return True
        for job in self._reads:
            if not job.settled:
                return True
        self._reads = []
        return False

    def start(self, remote_reads: RemoteReads | None, partial: bool) -> None:
        """At the call: the local match's disk reads and the remote lookup (the caller entered the context)."""
        ctx = self._ctx
        hasher = BlockHasher(self._tokens, ctx.tokens_per_block, "tokens")
        hasher.validate_rest()  # every token valid before anything starts
        nodes, part, part_len = self._local_match(hasher, partial)
        local_blocks = len(nodes)
        planner = self._matcher.planner
        if planner is not None and planner.active and not planner.in_gpu_memory(nodes, part):
            # only what the create's plan takes from the pages' levels now (the rest is recomputed)
            length = len(nodes) * ctx.tokens_per_block + part_len
            taken = planner.plan(planner.levels(nodes, part, part_len, NOTHING_FETCHED), len(nodes), part_len)[0]
            if taken < length:
                ctx.tree.cut(nodes, taken // ctx.tokens_per_block)
                part, part_len = None, 0
        self._reused_tokens = len(nodes) * ctx.tokens_per_block + part_len
        reads = ctx.reads
        if reads is not None:
            target = reads.background_target(self._target)
            self._reads = reads.read(match_pages(ctx, nodes, part, part_len), target, self._group)
            self._num_disk_pages = len(self._reads)
        self._remote_reads = remote_reads
        if remote_reads is None or (planner is not None and planner.policy == "never"):
            return  # (without workers, or with a cluster: the create looks up and fetches itself)
        fill = self._fill()
        plan = fill.lookup_plan(self._scope, hasher, local_blocks, None)
        if plan is None:
            return
        keys = plan[1]
        ask = plan[2]
        if not ask:
            return
        self._needed = ask
        self._ask(remote_reads, [fill.remote.page_key(keys[o], lg) for o, lg in ask], fill.value_bytes(ask), False)

    def _local_match(self, hasher: BlockHasher, partial: bool) -> tuple[list[Node], Node | None, int]:
        tree = self._ctx.tree
        tree.attention_blocks, tree.branches = 0, False
        root = tree.root(self._scope, False)
        if root is None:
            return [], None, 0
        return tree.match(root, hasher, partial)

    def _ask(self, remote_reads: RemoteReads, keys: list[bytes], nbytes: list[int], values: bool) -> None:
        self._waiting = True
        remote_reads.ask(self, keys, nbytes, values)

    def _landed(self, values: bool, outcome: list[Any] | None) -> None:
        """Its part of a round trip (None: the round trip failed) came back (the scheduler's thread,
        in the manager's poll)."""
        if not self._waiting or self._cancelled:
            return
        self._waiting = False
        if outcome is None:
            return  # the server is down or failing: the create finds what is local (a miss)
        fill = self._fill()
        ctx = self._ctx
        hasher = BlockHasher(self._tokens, ctx.tokens_per_block, "tokens")
        partial = self._matcher.enable_partial_reuse
        nodes, _, _ = self._local_match(hasher, partial)
        if not values:  # the lookup: fetch what a create would
            fill.record_lookup(self._needed, outcome, self._found)
            plan = fill.lookup_plan(self._scope, hasher, len(nodes), self._found, False)
            if plan is None:
                return
            chain: list[Node | None] = plan[0]
            keys: list[BlockKey] = plan[1]
            matched_blocks, needed = fill.fetch_plan(chain, len(nodes), self._found)
            keep = self._planned_blocks(fill, chain, hasher, len(nodes), matched_blocks)
            if keep < matched_blocks:  # the create's plan recomputes the rest: fetch only up to its cut
                matched_blocks, needed = fill.fetch_plan(chain[:keep], len(nodes), self._found)
            if not needed:  # (the local match, as the plan took it at the call)
                self._remember()
                return
            self._reused_tokens = max(self._reused_tokens, matched_blocks * ctx.tokens_per_block)
            self._needed = needed
            self._num_remote_pages = len(needed)
            remote_reads = self._remote_reads
            assert remote_reads is not None
            self._ask(
                remote_reads, [fill.remote.page_key(keys[o], lg) for o, lg in needed], fill.value_bytes(needed), True
            )
            return
        fetched: Fetched = {}
        for x, value in zip(self._needed, outcome):
            fetched[x] = value if isinstance(value, bytes) else None
        group = self._group
        shelf = Shelf()  # placing the values never evicts what its disk reads brought or are bringing
        try:
            shelf.put(group.owned())
            fill.extend(self._scope, hasher, nodes, True, self._found, partial, fetched)
        finally:
            shelf.restore()
        group.pages.extend(fill.take_placed())  # (nor does placing its disk reads evict these)
        self._remember()

    def _planned_blocks(
        self, fill: RemoteFill, chain: list[Node | None], hasher: BlockHasher, local_blocks: int, matched_blocks: int
    ) -> int:
        """The blocks the create's load plan takes of the match the remote tier extends to
        ``matched_blocks`` (as ``PrefixMatcher._plan`` weighs it): ``matched_blocks`` when it takes it whole."""
        planner = self._matcher.planner
        if planner is None or not planner.active or matched_blocks <= local_blocks:
            return matched_blocks
        seen, part, part_len, fetched = fill.project(
            chain, hasher, local_blocks, matched_blocks, self._matcher.enable_partial_reuse
        )
        length = len(seen) * self._ctx.tokens_per_block + part_len
        taken = planner.plan(planner.levels(seen, part, part_len, fetched), len(seen), part_len)[0]
        return matched_blocks if taken == length else taken // self._ctx.tokens_per_block

    def _remember(self) -> None:
        self._looked_up = True
        self._matcher.remember_prefetch(self._scope, self._tokens, self._found)

    def _fill(self) -> RemoteFill:
        fill = self._matcher.remote_fill
        assert fill is not None
        return fill


def start_prefetch(
    ctx: CacheContext,
    matcher: PrefixMatcher,
    remote_reads: RemoteReads | None,
    input_tokens: Sequence[TokenIdExt],
    target_level: object,
    reuse_scope: ReuseScope | None,
) -> Prefetch:
    """``KVCacheManager.prefetch``: its arguments checked, then ``Prefetch.start``."""
    level = check_int("target_level", target_level)
    num_levels = ctx.storage.num_levels
    if level >= num_levels:
        raise ValueError(
            f"target_level must be in [0, {num_levels}) ({num_levels} local tiers configured), got {level}"
        )
    if reuse_scope is not None:
        check_type("reuse_scope", reuse_scope, ReuseScope)
    check_token_sequence(input_tokens, "input_tokens")
    if not isinstance(input_tokens, Sequence):
        raise TypeError(f"input_tokens must be a sequence of tokens, got {type(input_tokens).__name__}")
    if len(input_tokens) == 0:
        raise ValueError("input_tokens must not be empty")
    scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
    ctx.enter("prefetch()")
    try:
        ctx.poll_loads()
        handle = Prefetch(ctx, matcher, scope, _copy(input_tokens), CacheLevel(level))
        handle.start(remote_reads, matcher.enable_partial_reuse)
    finally:
        ctx.leave()
    return handle


def match_pages(ctx: CacheContext, nodes: list[Node], part: Node | None, part_len: int) -> list[Page]:
    """The pages a create with this match takes (``adopt``): per layer group those outside its
    stale range, the partial block's sources, and (hybrid models) the snapshots it ends at."""
    tokens_per_block = ctx.tokens_per_block
    length = len(nodes) * tokens_per_block + part_len
    num_blocks = (length + tokens_per_block - 1) // tokens_per_block
    out: list[Page] = []
    for i, policy in enumerate(ctx.layer_groups):
        layer_group = LayerGroupId(i)
        if policy.keeps_live_state:
            if nodes:
                page = nodes[-1].page(layer_group)
                if page is not None:
                    out.append(page)
            continue
        beg, end = policy.stale_range(length)
        for ordinal in range(num_blocks):
            if beg <= ordinal < end:
                continue
            node = nodes[ordinal] if ordinal < len(nodes) else part
            page = node.page(layer_group) if node is not None else None
            if page is not None:
                out.append(page)
    return out
