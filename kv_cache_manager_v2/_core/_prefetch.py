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

from collections.abc import Sequence
from typing import Any

from .._common import CacheLevel, LayerGroupId, ReuseScope, TokenIdExt
from .._page import Page
from .._reuse._keys import BlockHasher, BlockKey
from .._reuse._node import Node
from .._reuse._remote_fill import Fetched, Found, RemoteFill
from .._storage._loader import LoadJob
from .._storage._page_reads import PageRead
from .._storage._remote._store import RemoteStore
from ._context import CacheContext
from ._matching import PrefixMatcher


class RemoteRead(LoadJob):
    """A lookup (lengths) or fetch (values) round trip of a prefetch, on a worker."""

    def __init__(self, owner: Prefetch, remote: RemoteStore, keys: list[bytes], values: bool) -> None:
        super().__init__()
        self.owner = owner
        self.remote = remote
        self.keys = keys
        self.values = values
        self.outcome: list[Any] | BaseException = []

    def run(self) -> None:
        self.outcome = self.remote.background_read(self.keys, self.values)

    def land(self) -> None:
        self.owner._landed(self)


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
        #: the lookup or fetch in flight (None: none)
        self._remote: RemoteRead | None = None
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
        the remote tier for them, unless their pages were evicted again meanwhile."""
        if not self._pending():
            return True
        ctx = self._ctx
        ctx.enter("Prefetch.done")
        try:
            ctx.poll_loads()
        finally:
            ctx.leave()
        return not self._pending()

    @property
    def waits_for_remote(self) -> bool:
        """Whether a round trip to the remote tier (its lookup or fetch) is still in flight."""
        return self._remote is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def reused_tokens(self) -> int:
        """Tokens of its tokens the cache holds once it is done, as far as known now: the local
        match at the call, then as far as the remote tier's lookup reaches (a value that turns out
        missing or corrupt, or no room for it, makes it less; never wrong data)."""
        return self._reused_tokens

    @property
    def num_disk_pages(self) -> int:
        """Pages of the local match it reads from a disk tier."""
        return self._num_disk_pages

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
            reads.cancel(self._reads)
        self._reads = []
        if self._remote is not None:
            self._remote.cancelled = True
            self._remote = None

    # ------------------------------------------------------------------ the stages
    def _pending(self) -> bool:
        if self._remote is not None:
            return True
        for job in self._reads:
            if not job.settled:
                return True
        self._reads = []
        return False

    def start(self, fill: RemoteFill | None, partial: bool) -> None:
        """At the call: the local match's disk reads and the remote lookup (the caller entered the context)."""
        ctx = self._ctx
        hasher = BlockHasher(self._tokens, ctx.tokens_per_block, "tokens")
        hasher.validate_rest()  # every token valid before anything starts
        nodes, part, part_len = self._local_match(hasher, partial)
        self._reused_tokens = len(nodes) * ctx.tokens_per_block + part_len
        reads = ctx.reads
        if reads is not None:
            self._reads = reads.read(match_pages(ctx, nodes, part, part_len), reads.background_target(self._target))
            self._num_disk_pages = len(self._reads)
        if fill is None or ctx.loader is None or not fill.remote.reads_in_background:
            return  # (a cluster: the create looks up and fetches, as without a prefetch)
        plan = fill.lookup_plan(self._scope, hasher, len(nodes), None)
        if plan is None:
            return
        keys = plan[1]
        ask = plan[2]
        if not ask:
            return
        self._needed = ask
        remote = fill.remote
        self._submit(remote, [remote.page_key(keys[o], lg) for o, lg in ask], False)

    def _local_match(self, hasher: BlockHasher, partial: bool) -> tuple[list[Node], Node | None, int]:
        tree = self._ctx.tree
        tree.attention_blocks, tree.branches = 0, False
        root = tree.root(self._scope, False)
        if root is None:
            return [], None, 0
        return tree.match(root, hasher, partial)

    def _submit(self, remote: RemoteStore, keys: list[bytes], values: bool) -> None:
        loader = self._ctx.loader
        assert loader is not None
        job = RemoteRead(self, remote, keys, values)
        self._remote = job
        loader.submit(job)

    def _landed(self, job: RemoteRead) -> None:
        """A round trip finished (the scheduler's thread, in the manager's poll)."""
        if job is not self._remote or self._cancelled:
            return
        self._remote = None
        remote = job.remote
        if not remote.account_background(job.keys, job.values, job.outcome):
            return  # the server is down or failing: the create finds what is local (a miss)
        outcome = job.outcome
        assert not isinstance(outcome, BaseException)
        fill = self._fill()
        ctx = self._ctx
        hasher = BlockHasher(self._tokens, ctx.tokens_per_block, "tokens")
        partial = self._matcher.enable_partial_reuse
        nodes, _, _ = self._local_match(hasher, partial)
        if not job.values:  # the lookup: fetch what a create would
            fill.record_lookup(self._needed, outcome, self._found)
            plan = fill.lookup_plan(self._scope, hasher, len(nodes), self._found, False)
            if plan is None:
                return
            chain: list[Node | None] = plan[0]
            keys: list[BlockKey] = plan[1]
            matched_blocks, needed = fill.fetch_plan(chain, len(nodes), self._found)
            self._reused_tokens = max(self._reused_tokens, matched_blocks * ctx.tokens_per_block)
            if not needed:
                self._remember()
                return
            self._needed = needed
            self._num_remote_pages = len(needed)
            self._submit(remote, [remote.page_key(keys[o], lg) for o, lg in needed], True)
            return
        fetched: Fetched = {}
        for x, value in zip(self._needed, outcome):
            fetched[x] = value if isinstance(value, bytes) else None
        fill.extend(self._scope, hasher, nodes, True, self._found, partial, fetched)
        self._remember()

    def _remember(self) -> None:
        self._looked_up = True
        self._matcher.remember_prefetch(self._scope, self._tokens, self._found)

    def _fill(self) -> RemoteFill:
        fill = self._matcher.remote_fill
        assert fill is not None
        return fill


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
