"""What the requests of one manager share: layer-group policies, storage, the reuse tree, statistics."""

from __future__ import annotations

import logging
from typing import Final, Protocol

import rawref

from .._common import DEFAULT_PRIORITY, CacheLevel, LayerGroupId, PoolGroupIndex, Priority, ReuseStatistics
from .._config import LOWER_TIER_SPAN_PER_STATE, LOWER_TIER_TOKENS_PER_STATE, KVCacheManagerConfig
from .._exceptions import LogicError
from .._layers._policy import LayerGroup
from .._life_cycle_registry import LayerGroupRegistry
from .._reuse._tree import ReuseTree
from .._storage._layout import StorageLayout
from .._storage._loader import BackgroundLoader, LoadJob
from .._storage._page_reads import PageRead, PageReads, is_disk
from .._storage._quota import constraint_floors
from .._storage._storage_manager import StorageManager
from .._typed import TypedList
from ._sessions import SessionTable


class OpenCache(Protocol):
    """What the context needs of the caches it tracks (a ``KVCache``, which it cannot import):
    closing them."""

    def close(self) -> None: ...


#: how long shutdown lets queued remote writes drain
_SHUTDOWN_DRAIN_S = 1.0
#: landed results installed per poll at most (``CacheContext.backlog``)
BACKLOG_PER_POLL: Final = 4


def state_and_block_bytes(registry: LayerGroupRegistry, layout: StorageLayout) -> tuple[int, int]:
    """The bytes of one request's recurrent states (all state layer groups) and of one block's
    KV (all other layer groups)."""
    pool_groups = layout.pool_groups
    group_of = layout.pool_group_of_layer_group
    state_bytes = 0
    block_bytes = 0
    for layer_group in range(len(registry)):
        slot_bytes = pool_groups[group_of[LayerGroupId(layer_group)]].slot_bytes
        if layer_group in registry.state_layer_groups:
            state_bytes += slot_bytes
        else:
            block_bytes += slot_bytes
    return state_bytes, block_bytes


def derived_lower_tier_state_share(
    config: KVCacheManagerConfig, registry: LayerGroupRegistry, layout: StorageLayout
) -> float:
    """The share of a tier below the GPU that holds one state per ``LOWER_TIER_TOKENS_PER_STATE``
    tokens of that tier's KV: ``(1 - s) / s * state_bytes / kv_bytes_per_token = N``. A snapshot
    there serves only while the KV of its path is cached too, so states are rationed by what they
    weigh against the KV they need (README, "Snapshot policy", measured)."""
    state_bytes, block_bytes = state_and_block_bytes(registry, layout)
    per_state = LOWER_TIER_TOKENS_PER_STATE * block_bytes / config.tokens_per_block  # KV bytes per state
    return state_bytes / (state_bytes + per_state) if state_bytes > 0 else 0.0


def lower_tier_interval(config: KVCacheManagerConfig, registry: LayerGroupRegistry, layout: StorageLayout) -> int:
    """Tokens between the periodic snapshots written to a tier below the GPU ("auto"):
    ``ssm_lower_tier_interval``, else the smallest power-of-two multiple of the interval whose
    span's KV weighs at least ``LOWER_TIER_SPAN_PER_STATE`` snapshots. A snapshot is worth its
    bytes by the prefill it saves; a state as heavy as thousands of tokens of KV, written every
    interval, would fill the tier with snapshots that evict each other (and the KV they need)."""
    given = config.ssm_lower_tier_interval
    if given is not None:
        return given
    state_bytes, block_bytes = state_and_block_bytes(registry, layout)
    interval = config.snapshot_interval
    if block_bytes == 0:
        return interval
    while interval // config.tokens_per_block * block_bytes < LOWER_TIER_SPAN_PER_STATE * state_bytes:
        interval *= 2
    return interval


class CacheContext:
    """Built once by :class:`KVCacheManager`; every :class:`KVCache` it creates refers to it."""

    __slots__ = (
        "config",
        "default_priorities",
        "no_gain",
        "pages_per_block",
        "enable_stats",
        "has_releasing_groups",
        "initial_stale_ends",
        "pool_group_of",
        "max_rewind_len",
        "layer_groups",
        "num_layer_groups",
        "num_pool_groups",
        "num_requests",
        "open_caches",
        "orphaned",
        "busy",
        "backlog",
        "loader",
        "reads",
        "deferred_closes",
        "scratch_util",
        "sessions",
        "block_layer_groups",
        "registry",
        "resume_floor",
        "stats",
        "storage",
        "releasing_layer_groups",
        "snapshot_interval",
        "periodic_interval",
        "periodic_priority",
        "periodic_level",
        "plans_branches",
        "state_layer_groups",
        "tokens_per_block",
        "tree",
    )

    def __init__(
        self, config: KVCacheManagerConfig, registry: LayerGroupRegistry, storage: StorageManager, tree: ReuseTree
    ) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        #: the blocks each session reused or published (``create_kv_cache(session_id=...)``)
        self.sessions = SessionTable()
        self.registry = registry
        self.layer_groups: TypedList[LayerGroupId, LayerGroup] = registry.layer_groups
        self.num_layer_groups = len(registry)
        #: layer groups whose blocks go stale as history grows (sliding windows)
        self.releasing_layer_groups = registry.releasing_layer_groups
        self.has_releasing_groups = len(self.releasing_layer_groups) > 0
        #: layer groups holding one live-state page per request and beam (recurrent layers)
        self.state_layer_groups = registry.state_layer_groups
        #: tokens between recurrent-state snapshots (0 without recurrent layers)
        self.snapshot_interval = config.snapshot_interval
        policy = config.ssm_snapshot_policy
        #: the periodic snapshots' priority ("auto": the lowest, evicted before the other
        #: snapshots and any KV), or -1: the callback's
        self.periodic_priority = 0 if policy == "auto" else -1
        #: the cache level a periodic snapshot is written to first ("auto": the first tier below
        #: the GPU when there is one, so they never evict GPU pages; a hit brings one up)
        self.periodic_level = CacheLevel(1 if policy == "auto" and storage.num_levels > 1 else 0)
        #: tokens between the periodic snapshots a request takes (0: none; ``ssm_snapshot_policy``;
        #: written to a lower tier: ``lower_tier_interval``)
        self.periodic_interval = self.snapshot_interval if policy != "branch" else 0
        if self.periodic_level > 0 and self.periodic_interval > 0:
            self.periodic_interval = lower_tier_interval(config, registry, storage.layout)
        #: snapshots are planned where the prompt leaves a cached path, and on demand
        self.plans_branches = policy != "interval"
        #: per layer group, the stale end at history 0: where a new block table starts (blocks
        #: ``[stale_end(0), table.stale_end)`` are the released ones)
        self.initial_stale_ends = [layer_group.stale_end(0) for layer_group in self.layer_groups]
        #: per layer group, the pool group of its slots
        self.pool_group_of: TypedList[LayerGroupId, PoolGroupIndex] = storage.layout.pool_group_of_layer_group
        self.num_pool_groups = storage.num_pool_groups
        #: layer groups whose requests hold pages per block (all but the live-state ones)
        self.block_layer_groups = [
            LayerGroupId(i) for i in range(self.num_layer_groups) if i not in registry.state_layer_groups
        ]
        #: per pool group, the pages one more block takes (one per layer group in the group)
        self.pages_per_block = [0] * self.num_pool_groups
        for layer_group in self.block_layer_groups:
            self.pages_per_block[self.pool_group_of[layer_group]] += 1
        self.no_gain = [0] * self.num_pool_groups
        #: a new block's page priorities (one per ``block_layer_groups`` entry)
        self.default_priorities: list[Priority] = [DEFAULT_PRIORITY] * len(self.block_layer_groups)
        self.storage = storage
        self.tree = tree
        #: SWA scratch reuse (docs/design.md, "SWA prefill scratch slots"): -1 when not configured
        scratch = config.swa_scratch_reuse
        self.max_rewind_len = scratch.max_rewind_len if scratch is not None else -1
        #: per layer group, slot_util_frac_max as (numerator, denominator): slots per scratch block
        self.scratch_util: TypedList[LayerGroupId, tuple[int, int]] = TypedList(
            [(f.numerator, f.denominator) for f in storage.layout.slot_util_frac_max]
        )
        #: per pool group, the slots the constraints guarantee: the resume gate admits below them
        self.resume_floor = constraint_floors(registry, storage.layout, config.constraints, self.max_rewind_len)
        self.stats = ReuseStatistics()
        self.enable_stats = config.enable_stats
        #: open caches as non-owning refs: a cache dropped by its owner closes itself
        self.open_caches: set[rawref.ref[OpenCache]] = set()
        #: the manager was dropped while caches were open: the last one to close releases the memory
        self.orphaned = False
        #: a state-changing call is in progress (calls must not overlap: see ``enter``)
        self.busy = False
        #: caches the garbage collector dropped during a call; closed when it ends
        self.deferred_closes: list[OpenCache] = []
        #: caches created so far (each gets the next ``RequestSerial``)
        self.num_requests = 0
        #: background reads (``load_workers`` > 0 and a disk or remote tier): None reads synchronously
        self.loader: BackgroundLoader | None = None
        self.reads: PageReads | None = None
        if config.load_workers > 0 and (
            storage.remote is not None or any(is_disk(level.items[0]) for level in storage.levels.items)
        ):
            self.loader = BackgroundLoader(config.load_workers)
            self.reads = PageReads(storage, self.loader)
        #: landed results waiting to be installed, at most ``BACKLOG_PER_POLL`` a poll (a round
        #: trip that answered many prefetches at once is installed over the following steps)
        self.backlog: list[LoadJob] = []

    def poll_due_loads(self) -> int:
        """``poll_loads`` (entered as ``poll_loads()``) when a load is in flight or waiting; else 0."""
        loader = self.loader
        if loader is None or (loader.in_flight == 0 and not self.backlog):
            return 0
        self.enter("poll_loads()")
        try:
            return self.poll_loads()
        finally:
            self.leave()

    def poll_loads(self) -> int:
        """Install the background loads that finished (the caller entered the context); returns
        the pages installed from disk."""
        loader = self.loader
        if loader is None or loader.closed or (loader.in_flight == 0 and not self.backlog):
            return 0  # (closed: the memory is gone, nothing lands any more)
        jobs = loader.finished()
        reads: list[PageRead] = []
        for job in jobs:
            if isinstance(job, PageRead):
                reads.append(job)
        reads_ = self.reads
        assert reads_ is not None
        try:
            n = reads_.install(reads) if reads else 0
        finally:  # (even if placing raised, e.g. a CuError mapping host memory: a round trip not
            for job in jobs:  # landed would keep its prefetches, and every later one, waiting)
                if not isinstance(job, PageRead) and not job.cancelled:
                    job.land()
        backlog = self.backlog
        if backlog:
            todo = backlog[:BACKLOG_PER_POLL]
            del backlog[:BACKLOG_PER_POLL]
            for job in todo:
                job.land()
        return n

    def enter(self, what: str) -> None:
        """Start a state-changing call; refuse one that overlaps another (a priority callback
        calling back into the manager, or two threads using it at once)."""
        self.check_idle(what)
        self.busy = True

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` while another call is in progress (see ``enter``)."""
        if self.busy:
            raise LogicError(
                f"{what} was called while another call into this manager is in progress (from a "
                "custom_priority_callback, or from another thread); a manager and its caches take one "
                "call at a time"
            )

    def release_memory(self) -> None:
        """Empty the tree and the evictors, give the pools back (no cache may be open).

        Tree nodes and pages are not tracked by the cyclic garbage collector (see ``Node``), so
        this is also what breaks their reference cycles when a manager goes away."""
        storage = self.storage
        if self.loader is not None:  # no worker reads a file or socket released below
            self.loader.close(_SHUTDOWN_DRAIN_S)
        if storage.persist is not None and storage.persist.owned:  # (not in a forked child)
            try:
                storage.write_back()  # what the GPU and host tiers hold survives the restart too
            except Exception as e:  # (a driver error): the memory must still be given back
                logging.getLogger("kv_cache_manager_v2").warning(
                    "persistent disk tier: writing the upper tiers' blocks back failed (%s: %s)", type(e).__name__, e
                )
        storage.flush_write_through()
        # queued remote writes get a moment to reach the server; the writer must be done with
        # handed-off slots before their memory goes (if it hangs, the memory is kept: logged)
        stopped = storage.remote.close(_SHUTDOWN_DRAIN_S) if storage.remote is not None else True
        self.tree.clear()
        self.sessions.clear()
        storage.drop_all_evictable()
        if stopped:
            storage.release()
            storage.backend.shutdown()

    def cache_closed(self, ref: rawref.ref[OpenCache]) -> None:
        """A cache closed; the last one of a dropped manager releases its memory."""
        self.open_caches.discard(ref)
        if self.orphaned and not self.open_caches:
            self.orphaned = False
            self.release_memory()

    def leave(self) -> None:
        self.busy = False
        if self.deferred_closes:
            caches = self.deferred_closes
            self.deferred_closes = []
            for kv in caches:
                kv.close()
