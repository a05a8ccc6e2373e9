"""KVCacheManager: the top-level object an inference engine talks to (README.md; docs/design.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import rawref

from .._common import (
    DEFAULT_REUSE_SCOPE,
    GPU_LEVEL,
    MAX_BEAM_WIDTH,
    CacheLevel,
    KVCacheStatus,
    LayerGroupId,
    ReuseScope,
    SessionId,
    TokenIdExt,
)
from .._config import (
    DiskCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
)
from .._events import MEDIUM_OF_TIER, KVCacheEvent, KVCacheEventManager, LayerGroupSpec
from .._exceptions import LogicError
from .._life_cycle_registry import LayerGroupRegistry
from .._retention import RequestRetention, checked_prompt_end
from .._reuse._adopt import adopt_records
from .._reuse._node import Node
from .._reuse._remote_fill import RemoteFill
from .._reuse._tree import ReuseTree
from .._sessions import check_session_id
from .._storage._layout import StorageLayout
from .._storage._quota import split_like, split_quota
from .._storage._remote._store import RemoteStore
from .._storage._remote._value import layout_fingerprint
from .._storage._select import select_backend
from .._storage._storage_manager import StorageManager
from .._storage._tier_costs import TierCosts
from .._utils import check_int, check_type
from ._batch import commit_batch, resize_batch
from ._context import CacheContext, OpenCache, derived_lower_tier_state_share
from ._directives import Directives
from ._introspection import check_invariants
from ._kv_cache import KVCache
from ._load_plan import LoadPlanner
from ._manager_queries import ManagerQueries
from ._matching import PrefixMatcher, match_length, match_levels
from ._pins import pin_prefix, unpin_prefix
from ._pools import live_pages, longest_decode_that_fits
from ._prefetch import Prefetch, RemoteReads, start_prefetch
from ._request_state import PriorityCallback, default_priority
from ._residency import adopt
from ._snapshot_plan import plan_snapshots


class KVCacheManager(ManagerQueries):
    """Owns the KV memory pools and hands pages to per-request :class:`KVCache` objects."""

    def __init__(self, config: KVCacheManagerConfig, event_manager: KVCacheEventManager | None = None) -> None:
        if not isinstance(config, KVCacheManagerConfig):
            raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
        if event_manager is not None:
            if not isinstance(event_manager, KVCacheEventManager):
                raise TypeError(
                    f"event_manager must be a KVCacheEventManager or None, got {type(event_manager).__name__}"
                )
            if event_manager.is_attached:
                raise ValueError("event_manager is already attached to another KVCacheManager; use one per manager")
        self._config = config
        self._num_tiers = len(config.cache_tiers)
        self.tokens_per_block = config.tokens_per_block
        self._registry = LayerGroupRegistry(config.layers, config.tokens_per_block, config.snapshot_interval)
        self._layout = StorageLayout(list(config.layers), self._registry, config.tokens_per_block)
        self.num_layer_groups = len(self._registry)
        local = config.local_tiers
        remote_cfg = config.remote_tier
        #: byte quota per level (the remote tier: 0 when it has none)
        self._quotas = [tier.quota for tier in local] + ([remote_cfg.quota or 0] if remote_cfg is not None else [])
        gpu_slots = self._split_gpu_quota(self._quotas[0])
        slots = [gpu_slots] + [
            self._split_lower_quota(tier.quota, gpu_slots, type(tier).__name__) for tier in local[1:]
        ]
        self._backend = select_backend(config.backend)
        disk = local[-1]
        disk_fingerprint = layout_fingerprint(config, disk.dtype) if isinstance(disk, DiskCacheTierConfig) else b""
        try:
            self._storage = StorageManager(
                self._layout,
                slots,
                self._backend,
                local,
                config.eviction_policy,
                disk_fingerprint,
                self.tokens_per_block,
                config.clock,
                config.max_pinned_share,
            )
        except BaseException:
            self._backend.shutdown()
            raise
        self._tree = ReuseTree(self._registry.layer_groups, self.tokens_per_block)
        self._tree.reports_leaves = config.eviction_policy == "frequency"  # its evictors park pages
        self._storage.drop_listener = self._tree
        #: the remote tier (issue #17): writes of dropped (and, with write-through, published) pages,
        #: and match extension
        self._remote = None
        self._remote_fill: RemoteFill | None = None
        try:
            if remote_cfg is not None:
                page_bytes = max(group.slot_bytes for group in self._layout.pool_groups)
                self._remote = RemoteStore(remote_cfg, layout_fingerprint(config, remote_cfg.dtype), page_bytes)
                self._storage.attach_remote(self._remote, self.tokens_per_block)
                if remote_cfg.write_through:
                    self._tree.write_through = self._storage
                target = CacheLevel(1) if len(local) > 1 and isinstance(local[1], HostCacheTierConfig) else GPU_LEVEL
                # (hybrid models: an extension ends at a block whose snapshot is local or remote)
                self._remote_fill = RemoteFill(
                    self._tree, self._storage, self._remote, self._registry.layer_groups, self.tokens_per_block, target
                )
            self._event_manager = event_manager
            if event_manager is not None:
                groups = [
                    LayerGroupSpec(i, policy.window_size, policy.num_sink_blocks, policy.kind)
                    for i, policy in enumerate(self._registry.layer_groups)
                ]
                media = [MEDIUM_OF_TIER[t.tier] for t in config.cache_tiers]
                event_manager._attach(self._tree, self.tokens_per_block, groups, media)
                self._tree.event_sink = event_manager
            persist = self._storage.persist
            #: pages a persistent disk tier kept from a previous manager, adopted at start-up
            self.num_adopted_pages = 0
            if persist is not None:
                records, persist.records = persist.records, []
                self.num_adopted_pages, ignored, superseded = adopt_records(
                    self._tree, records, self._storage, self._layout.pool_group_of_layer_group
                )
                persist.ignore(ignored)
                persist.forget_records(superseded)
        except BaseException:  # e.g. an event manager already attached elsewhere: release what was made
            if self._remote is not None:
                self._remote.close(0.0)
            self._storage.release()
            self._backend.shutdown()
            raise
        self._ctx = CacheContext(config, self._registry, self._storage, self._tree)
        # a match of a hybrid model ends at a snapshot: never inside a block
        partial = config.enable_partial_reuse and not self._registry.state_layer_groups
        self._matcher = PrefixMatcher(self._tree, self._remote_fill, self.tokens_per_block, partial)
        costs = TierCosts.of(config, self._storage.expiries.now)
        self._storage.set_costs(costs)
        lg_bytes = [
            self._layout.pool_groups[self._layout.pool_group_of_layer_group[LayerGroupId(i)]].slot_bytes
            for i in range(self.num_layer_groups)
        ]
        self._planner = LoadPlanner(
            config.load_policy,
            config.prefill_tokens_per_s,
            costs,
            self._registry.layer_groups,
            lg_bytes,
            self.tokens_per_block,
            self._num_tiers,
            float(config.recompute_queue_weight),
        )
        if self._num_tiers > 1:  # (the GPU alone: every match is in GPU memory)
            self._matcher.planner = self._planner
        self._matcher.counts = config.enable_stats
        #: prefetches' remote round trips, batched (None: the create looks up and fetches itself)
        self._remote_reads: RemoteReads | None = None
        if self._remote is not None and self._ctx.loader is not None and self._remote.reads_in_background:
            self._remote_reads = RemoteReads(self._remote, self._ctx.loader, self._ctx.backlog, costs)
        self._is_shut_down = False
        self._batch_serial = 0

    def _split_lower_quota(self, quota: int, gpu_slots: list[int], what: str) -> list[int]:
        """A lower tier's slots: the KV pool groups in the GPU's proportions, the recurrent states'
        share from ``lower_tier_state_share`` (None: derived from the bytes of a state and of the
        KV, at most the GPU's share; under "interval", whose snapshots all reach lower tiers by
        eviction, the GPU's proportions)."""
        share = self._config.lower_tier_state_share
        if share is None and self._config.ssm_snapshot_policy == "interval":
            return split_like(quota, gpu_slots, self._layout, what)
        if share is None:
            groups = self._layout.pool_groups
            gpu_bytes = [n * g.slot_bytes for n, g in zip(gpu_slots, groups)]
            gpu_share = sum(b for b, g in zip(gpu_bytes, groups) if g.holds_states) / sum(gpu_bytes)
            share = min(derived_lower_tier_state_share(self._config, self._registry, self._layout), gpu_share)
        return split_like(quota, gpu_slots, self._layout, what, float(share))  # (an int is accepted)

    def _split_gpu_quota(self, quota: int) -> list[int]:
        config = self._config
        scratch = config.swa_scratch_reuse
        return split_quota(
            quota,
            self._registry,
            self._layout,
            config.initial_pool_ratio,
            config.typical_step,
            config.constraints,
            scratch.max_rewind_len if scratch is not None else -1,
        )

    def __repr__(self) -> str:
        storage = self._storage
        groups = ", ".join(f"{g.num_slots - storage.available(0, g.index)}/{g.num_slots}" for g in storage.gpu)
        return (
            f"KVCacheManager(backend={self._backend.name!r}, layers={self.num_layers}, "
            f"layer_groups={self.num_layer_groups}, gpu_slots_unavailable=[{groups}], "
            f"open_caches={self.num_open_caches})"
        )

    # ------------------------------------------------------------------ requests
    def create_kv_cache(
        self,
        reuse_scope: ReuseScope | None = None,
        input_tokens: Sequence[TokenIdExt] | None = None,
        id: object = None,
        custom_priority_callback: PriorityCallback = default_priority,
        beam_width: object = 1,
        retention: RequestRetention | None = None,
        prompt_length: int | None = None,
        session_id: SessionId | None = None,
    ) -> KVCache:
        """A new SUSPENDED cache for one request; call ``resume()`` before ``resize()``.

        ``beam_width`` (fixed for the request's life): beams share every page until the first
        ``commit`` with ``beam_search_indices``; then each has its own generated blocks.
        ``retention``: of the blocks it publishes (decode blocks: from ``prompt_length``, by
        default ``len(input_tokens)``). ``custom_priority_callback``: the eviction priority of each
        new page, snapshots included (under ``ssm_snapshot_policy="auto"`` too, whose priority 0
        for interval and prompt-end snapshots applies only without a callback). ``session_id``: the
        conversation or agent it belongs to (``directives`` by session; KV-cache events)."""
        self._check_alive()
        width = check_int("beam_width", beam_width, 1, MAX_BEAM_WIDTH)
        prompt_end = checked_prompt_end(retention, prompt_length, input_tokens)
        session = check_session_id("session_id", session_id)
        if reuse_scope is not None:
            check_type("reuse_scope", reuse_scope, ReuseScope)
        if not callable(custom_priority_callback):
            raise TypeError("custom_priority_callback must be callable (block_ordinal, layer_group) -> priority")
        scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
        ctx = self._ctx
        ctx.enter("create_kv_cache()")
        try:
            ctx.poll_loads()
            kv = KVCache(ctx, scope, id, custom_priority_callback, width)
            kv._retention, kv._prompt_length = retention, prompt_end
            kv._session = session
            num_input_tokens = len(input_tokens) if input_tokens is not None else 0
            nodes: list[Node] = []
            if input_tokens is not None and num_input_tokens > 0:
                nodes, part, part_len, _ = self._matcher.match(
                    scope, input_tokens, True
                )  # may raise: kv is not open yet
                adopt(kv, nodes, part, part_len, input_tokens)
                if session is not None:
                    ctx.sessions.record(session, nodes[-1] if nodes else None)
            if ctx.state_layer_groups:
                tree = self._tree
                attention_blocks = max(tree.attention_blocks, len(nodes)) if num_input_tokens else 0
                plan_snapshots(kv, num_input_tokens, len(nodes), attention_blocks, tree.branches)
                if ctx.enable_stats:
                    ctx.stats.attention_matched_tokens += attention_blocks * self.tokens_per_block
            handle: rawref.ref[OpenCache] = rawref.ref(kv)
            ctx.open_caches.add(handle)
        finally:
            ctx.leave()
        return kv

    @property
    def directives(self) -> Directives:
        """Directives by session or prefix (retain, pin/unpin, prefetch, demote, end), each answering a ``DirectiveOutcome``."""
        self._check_alive()
        return Directives(self._ctx, self._matcher, self._check_alive)

    def prefetch(
        self,
        input_tokens: Sequence[TokenIdExt],
        target_level: object = GPU_LEVEL,
        reuse_scope: ReuseScope | None = None,
    ) -> Prefetch:
        """Start bringing the reusable prefix of ``input_tokens`` (queued, not admitted yet) up in the
        background and return at once: the disk pages of the prefix the create's load plan takes are
        read, and with a remote tier (not under ``load_policy="never"``) the blocks after the local
        match are looked up and fetched, into the host tier when ``target_level`` is the GPU and a
        host tier exists (else ``target_level``). The create of the same tokens then finds them
        locally once the returned ``Prefetch`` is ``done``; ``cancel`` it if the request goes away.
        Takes no page. Without ``load_workers`` it starts nothing (the create reads what it takes);
        with a remote cluster the remote part is left to the create."""
        self._check_alive()
        return start_prefetch(self._ctx, self._matcher, self._remote_reads, input_tokens, target_level, reuse_scope)

    def poll_loads(self) -> int:
        """Install the background loads that finished (``prefetch``, ``KVCache.prefetch``); returns
        the disk pages installed. Every call that matches or resumes does this itself; an engine
        calls it once a step (the adapter does) so that loads land while nothing else runs."""
        self._check_alive()
        return self._ctx.poll_due_loads()

    def pin(
        self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None = None, duration_s: float | None = None
    ) -> int:
        """Keep the cached full blocks of ``tokens`` cached (never evicted while their tier holds the
        pin: within ``max_pinned_share``; beyond it, after a shrink or a pull up, an ordinary page
        until held again) until ``unpin`` (or for ``duration_s`` seconds); returns the tokens pinned (0: none cached, nothing pinned; a pin
        of the same tokens before is replaced). ``ValueError`` beyond ``max_pinned_share``."""
        self._check_alive()
        return pin_prefix(self._ctx, self._matcher, reuse_scope, tokens, duration_s)

    def unpin(self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None = None) -> bool:
        """End the pin of ``tokens`` (the tokens given to ``pin``, as any sequence ``pin`` takes;
        False: none); its pages are evicted as usual again."""
        self._check_alive()
        return unpin_prefix(self._ctx, reuse_scope, tokens)

    def probe_reuse(
        self, reuse_scope: ReuseScope | None = None, input_tokens: Sequence[TokenIdExt] | None = None
    ) -> int:
        """Length of the reusable prefix of ``input_tokens``; takes nothing.

        With a remote tier, the blocks after the local match are looked up there (one round trip,
        no data moved): a ``create_kv_cache`` of the same tokens right after reuses exactly this
        many tokens when the values found are still intact and the host tier (else GPU memory) has
        room for them, else fewer (never wrong data). A hybrid model's match (recurrent layers)
        ends at the last block holding a state snapshot, local or (extended remotely) in Redis."""
        self._check_alive()
        self._ctx.poll_due_loads()
        found = self._matcher.probe(self._ctx, "probe_reuse()", reuse_scope, input_tokens)
        if found is None:
            return 0
        return match_length(found, self.tokens_per_block)

    def probe_reuse_levels(
        self, reuse_scope: ReuseScope | None = None, input_tokens: Sequence[TokenIdExt] | None = None
    ) -> list[CacheLevel]:
        """Where the reusable prefix of ``input_tokens`` lives; takes nothing.

        One entry per block of the prefix ``probe_reuse`` reports (the last may be partial): the
        deepest cache level among the pages a match needs for that block (``GPU_LEVEL`` when it
        needs none: outside every sliding window). ``resume()`` copies the others up. A following
        ``create_kv_cache`` of the same tokens reuses this call's hashing, like after ``probe_reuse``.
        """
        self._check_alive()
        self._ctx.poll_due_loads()
        found = self._matcher.probe(self._ctx, "probe_reuse_levels()", reuse_scope, input_tokens)
        if found is None:
            return []
        return match_levels(found, self._registry.layer_groups, self.tokens_per_block, self._planner.costs.remote_level)

    def set_prefill_rate(self, tokens_per_s: object, step_s: object = None) -> None:
        """The engine's prefill rate, tokens per second, for ``load_policy="auto"`` (None: unknown, matches load whole),
        and its step time, seconds (``step_s``; None: unknown; known, a disk or remote read a request waits for apart,
        ``load_workers`` > 0, costs at least a step). Each call sets both: ``step_s`` left out is unknown again."""
        self._check_alive()
        self._planner.set_rate(tokens_per_s, step_s)

    def set_tier_wait(self, level: object, seconds: object) -> None:
        """How long cache level ``level``'s link (below the GPU) is busy from now, for ``load_policy="auto"``
        and write admission (``max_write_backlog_s``): it drains as ``clock`` runs, the manager's own
        queued writes (tracked anyway) go on top; a plan waits once per level it reads from."""
        self._check_alive()
        self._planner.set_wait(level, seconds)

    def set_engine_queue(self, waiting_requests: object) -> None:
        """How many requests wait for the engine now (their prefill not started), for
        ``load_policy="auto"``: a recomputed token costs ``1 + recompute_queue_weight * waiting_requests``
        times its own time (they wait for it), a load only the request's; from the next match on."""
        self._check_alive()
        self._planner.waiting = check_int("waiting_requests", waiting_requests)

    def flush_remote_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every page queued for the remote tier is written (or dropped); False on
        timeout. Writes never need this (they are sent in the background); tests and a graceful
        hand-over do. True at once without a remote tier."""
        remote = self._remote
        if remote is None:
            return True
        self._check_alive()
        self._ctx.enter("flush_remote_writes()")
        try:
            self._storage.flush_write_through()
        finally:
            self._ctx.leave()
        return remote.flush(timeout_s)

    @property
    def event_manager(self) -> KVCacheEventManager | None:
        """The KV-cache event queue given at construction (None: no events are recorded)."""
        return self._event_manager

    def get_latest_events(self) -> list[KVCacheEvent]:
        """Drain the KV-cache events recorded since the last call (empty without an event manager)."""
        em = self._event_manager
        return em.get_latest_events() if em is not None else []

    @property
    def num_open_caches(self) -> int:
        """Caches created and not closed yet."""
        return len(self._ctx.open_caches)

    def open_caches(self) -> list[KVCache]:
        """The caches created and not closed yet."""
        out: list[KVCache] = []
        for ref in self._ctx.open_caches:
            kv = ref()
            if kv is not None:
                out.append(cast(KVCache, kv))
        return out

    def check_invariants(self) -> None:
        """Verify every internal invariant (slot ownership, accounting, tree, indices); raise
        ``AssertionError`` naming the first violation. Costs a walk over all state: for tests and
        debugging (the fake engine calls it after each step when ``KV_CACHE_MANAGER_V2_CHECK=1``)."""
        check_invariants(self._storage, self._tree, self.open_caches())

    def clear_reusable_blocks(self) -> None:
        """Drop every reusable page (and every pin). Refused while caches are open."""
        self._check_alive()
        self._check_no_open_caches("clear_reusable_blocks")
        self._ctx.enter("clear_reusable_blocks()")
        try:
            self._storage.flush_write_through()  # published pages still owe the remote tier a copy
            self._storage.pins.clear()
            self._tree.clear()
            self._ctx.sessions.clear()
            self._matcher.forget()
            self._storage.drop_all_evictable()  # garbage of subtrees removed earlier
            if self._storage.persist is not None:
                self._storage.persist.forget_all()  # nor are they adopted after a restart
        finally:
            self._ctx.leave()

    def shutdown(self) -> None:
        """Release all memory; refused while caches are open. Idempotent."""
        if self._is_shut_down:
            return
        self._check_no_open_caches("shutdown")
        self._ctx.enter("shutdown()")
        try:
            self._ctx.release_memory()
            self._matcher.forget()
            self._is_shut_down = True
        finally:
            self._ctx.leave()

    def __del__(self) -> None:
        # Tree nodes and pages are invisible to the cyclic GC: a manager dropped without
        # shutdown() releases them (and the pools) now, or when its last open cache closes.
        if self._is_shut_down:
            return
        ctx = self._ctx
        if ctx.open_caches:
            ctx.orphaned = True
        elif not ctx.busy:
            self._is_shut_down = True
            ctx.release_memory()

    # ------------------------------------------------------------------ batched decode steps
    def resize_batch(self, caches: Sequence[KVCache], num_new_tokens: object = 1) -> list[int]:
        """Room for ``num_new_tokens`` more tokens in every cache: the decode step's ``resize`` for a
        whole batch in one call (before the forward pass).

        Each cache's capacity becomes at least ``num_committed_tokens + num_new_tokens`` (never
        less than it was; history is unchanged), exactly as ``kv.resize(...)`` would make it,
        pages and index arrays included. All or nothing per cache: returns the positions in
        ``caches`` of those that did not get the room because memory is short (each of them is
        unchanged; suspend or close one and retry). Misuse (a cache that is not ACTIVE or not
        this manager's) raises before anything changes.
        """
        self._check_alive()
        return resize_batch(self._ctx, caches, check_int("num_new_tokens", num_new_tokens))

    def commit_batch(self, caches: Sequence[KVCache], tokens: Sequence[TokenIdExt]) -> None:
        """Commit ``tokens[i]``, one accepted token, to ``caches[i]`` for every i: the decode step's
        ``commit`` for a whole batch in one call (after the forward pass).

        The same as ``caches[i].commit([tokens[i]])`` for each cache: full blocks are published
        and sliding windows move. Every cache and token is checked first (ACTIVE, committing,
        within capacity, listed once, a valid token), so misuse raises with nothing changed.
        A custom priority callback that raises (hybrid models ask it when a token completes a
        block at a recurrent-state snapshot position) stops the batch at that cache: the caches
        before it are committed, it and the rest are not.
        Several tokens per request (speculative decoding) and forked beams use ``KVCache.commit``.
        """
        self._check_alive()
        self._batch_serial += 1
        commit_batch(self._ctx, self._batch_serial, caches, tokens)

    # ------------------------------------------------------------------ capacity
    def get_quota(self, level: object) -> int:
        """The byte quota of cache ``level`` (as configured, or as last set by ``resize``)."""
        self._check_alive()
        return self._quotas[self._check_level(level)]

    def resize(self, cache_level: object, quota: object) -> bool:
        """Set the byte quota of one cache level; every open cache must be SUSPENDED.

        Growing maps more memory in place (base addresses do not move; a memory tier grows to at
        most 4x its configured quota). Shrinking moves what no longer fits: reusable pages go down
        a level or are dropped, suspended requests' pages go down a level, and pages above the
        new end move into free slots below it; pinned pages beyond ``max_pinned_share`` of the
        slots left are ordinary pages there (the oldest pins' first; still pinned: held again
        where they move to room in a share). Returns False, changing nothing, when what must be
        kept does not fit. GPU slot counts change: query ``pool_group_descs`` and
        ``get_page_index_upper_bound`` again. The remote tier's quota is the server's ``maxmemory``
        (no cache needs to be suspended): False when the server is unreachable or refuses.
        """
        self._check_alive()
        level = self._check_level(cache_level)
        size = check_int("quota (bytes)", quota, 1)
        if level == self._storage.num_levels:  # the remote tier: the server's maxmemory
            assert self._remote is not None
            if not self._remote.apply_quota(size):
                return False
            self._quotas[level] = size
            return True
        active = [kv for kv in self.open_caches() if kv.status is KVCacheStatus.ACTIVE]
        if active:
            raise LogicError(
                f"resize(cache_level, quota) needs every KVCache suspended or closed; {len(active)} are ACTIVE "
                "(suspend() them first)"
            )
        tier = self._config.cache_tiers[level]
        if level == GPU_LEVEL:
            slots = self._split_gpu_quota(size)
        else:
            gpu_slots = [g.num_slots for g in self._storage.gpu]
            slots = self._split_lower_quota(size, gpu_slots, type(tier).__name__)
        self._storage.check_resize(level, slots)
        live = live_pages(list(self.open_caches()), self._tree, self._storage)  # every page holding a slot
        if not self._storage.resize_level(level, slots, live):
            return False
        self._quotas[level] = size
        return True

    def clamp_max_seq_len_for_mem(
        self, batch_size: object, token_num_upper_bound: object, beam_width: object = 1
    ) -> int:
        """Longest sequence length (<= the bound) that ``batch_size`` requests can each reach by
        decoding in GPU memory: every length on the way must fit, since a sliding-window request
        needs more pages just past a block boundary than at the next one. Each request has
        ``beam_width`` beams, each with its own live recurrent state (hybrid models); blocks are
        counted once, as beams share them until they fork."""
        self._check_alive()
        batch = check_int("batch_size", batch_size, 1)
        bound = check_int("token_num_upper_bound", token_num_upper_bound)
        width = check_int("beam_width", beam_width, 1, MAX_BEAM_WIDTH)
        totals = [pool_group.num_slots for pool_group in self._storage.gpu]
        return longest_decode_that_fits(self._registry, self._layout, totals, batch, bound, width)

    # ------------------------------------------------------------------ checks
    def _check_no_open_caches(self, what: str) -> None:
        if self._ctx.open_caches:
            raise LogicError(f"{what}() refused: {self.num_open_caches} KVCache(s) still open; close() them first")
