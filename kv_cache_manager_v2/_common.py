"""Typed ids, enums, constants and small public value types shared by every module."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, NewType

LayerId = NewType("LayerId", int)
LayerGroupId = NewType("LayerGroupId", int)
PoolGroupIndex = NewType("PoolGroupIndex", int)
PoolIndex = NewType("PoolIndex", int)
SlotId = NewType("SlotId", int)
BlockOrdinal = NewType("BlockOrdinal", int)
CacheLevel = NewType("CacheLevel", int)
BeamIndex = NewType("BeamIndex", int)
MemAddress = NewType("MemAddress", int)
Priority = NewType("Priority", int)
TokenId = NewType("TokenId", int)
#: A conversation or agent the engine names (``create_kv_cache(session_id=...)``): a non-empty str.
SessionId = NewType("SessionId", str)
#: One per request (``KVCache``), in creation order: use counting counts a request once per page.
RequestSerial = NewType("RequestSerial", int)
#: A token position is a plain id, or a digest standing for a position whose id is ambiguous.
TokenIdExt = TokenId | bytes
#: A committed block's tokens: a tuple, or a slice of an ``array('I')`` for a block committed from
#: one (one object, no int per token). Compare two with ``same_tokens`` (a tuple never equals an array).
BlockTokens = Sequence[TokenIdExt]


class BufferId(NamedTuple):
    """One buffer of one layer; equal to the plain tuple ``(layer_id, role)``."""

    layer_id: LayerId
    role: str


BAD_PAGE_INDEX: Final = -1
GPU_LEVEL: Final = CacheLevel(0)
DEFAULT_PRIORITY: Final = Priority(35)
MAX_PRIORITY: Final = Priority(100)
MAX_TOKEN_ID: Final = (1 << 32) - 1
#: Largest capacity of one request, in tokens: positions are int32 for kernels.
MAX_CAPACITY: Final = (1 << 31) - 1
#: Largest beam width of one request.
MAX_BEAM_WIDTH: Final = 256


class CacheTier(enum.Enum):
    """Kind of memory of one cache level."""

    GPU_MEM = 0
    HOST_MEM = 1
    DISK = 2
    #: a content-addressed store shared by many managers (Redis); not slot-based, always the last level
    REMOTE = 3


class PageStatus(enum.Enum):
    """Ownership of a page: who may move or drop it."""

    LOCKED = 0  #: used by an active request; stays in GPU memory
    HELD = 1  #: owned by a suspended request (or one that may still commit it); never dropped
    DROPPABLE = 2  #: reusable cache only; may be evicted and finally dropped


class KVCacheStatus(enum.Enum):
    """Life-cycle state of a :class:`KVCache`."""

    ACTIVE = 0
    SUSPENDED = 1
    CLOSED = 2


class PageIndexMode(enum.Enum):
    """How kernels address a buffer's pages (``PageIndexConverter``)."""

    SHARED = 0  #: base address includes the buffer's offset in the slot
    PER_LAYER = 1  #: base address is the pool base; the layer offset is in the index


@dataclass(frozen=True)
class ReuseScope:
    """KV is only reused between requests with equal scope (LoRA adapter, tenant salt)."""

    lora_id: int | None = None
    salt: int | None = None

    def __post_init__(self) -> None:
        for name in ("lora_id", "salt"):
            # as stored (compiled, a typed read narrowed to int would have made a bool an int)
            value: object = getattr(self, name)
            if value is None:
                continue
            if type(value) is not int:
                raise TypeError(f"ReuseScope.{name} must be None or an int, got {type(value).__name__}")
            if not 0 <= value < 1 << 64:
                raise ValueError(f"ReuseScope.{name} must be in [0, 2**64), got {value}")


#: The scope of requests that name none.
DEFAULT_REUSE_SCOPE: Final = ReuseScope()


@dataclass(frozen=True)
class HalfOpenRange:
    """Integers ``beg <= x < end``."""

    beg: int
    end: int

    def __len__(self) -> int:
        return max(0, self.end - self.beg)

    def __contains__(self, x: int) -> bool:
        return self.beg <= x < self.end


@dataclass(frozen=True, init=False)
class StorageStatistics:
    """Slot accounting of one pool group at one cache level."""

    pool_group_index: PoolGroupIndex
    slot_sizes: tuple[int, ...]
    total: int
    free: int
    evictable: int
    #: pinned pages (never evicted) and pages under retention (a priority until an expiry time, or
    #: a close-time hint), held or evictable
    pinned: int = 0
    retained: int = 0

    def __init__(
        self,
        pool_group_index: PoolGroupIndex,
        slot_sizes: tuple[int, ...],
        total: int,
        free: int,
        evictable: int,
        pinned: int = 0,
        retained: int = 0,
    ) -> None:
        # written out: compiled, object.__setattr__ on self is a plain field store, while the
        # __init__ dataclass generates stays interpreted (an engine may ask every step)
        object.__setattr__(self, "pool_group_index", pool_group_index)
        object.__setattr__(self, "slot_sizes", slot_sizes)
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "free", free)
        object.__setattr__(self, "evictable", evictable)
        object.__setattr__(self, "pinned", pinned)
        object.__setattr__(self, "retained", retained)

    @property
    def pinned_bytes(self) -> int:
        return self.pinned * sum(self.slot_sizes)

    @property
    def retained_bytes(self) -> int:
        return self.retained * sum(self.slot_sizes)

    @property
    def available(self) -> int:
        """Slots a new page can take: free ones plus those of evictable pages."""
        return self.free + self.evictable

    @property
    def unavailable(self) -> int:
        """Slots held by pages in use (total - available)."""
        return self.total - self.available


@dataclass(frozen=True, init=False)
class TierStatistics:
    """Usage and traffic of one cache level, summed over its pool groups.

    A page is one block of one layer group. Counters cover the interval asked for: since the
    manager was created (``KVCacheManager.get_tier_statistics``) or since the previous
    ``take_iteration_stats()``. ``peak_used_bytes`` adds up each pool group's own peak.
    """

    level: CacheLevel
    tier: CacheTier
    total_bytes: int
    used_bytes: int
    peak_used_bytes: int
    #: pages evicted into this level from the level above (0 at the GPU level)
    offloaded_pages: int
    offloaded_bytes: int
    #: pages copied from this level to a higher one: reuse, resume, prefetch, copy-on-partial
    onboarded_pages: int
    onboarded_bytes: int
    #: pages dropped for good at this level: reusable pages evicted from the last level, garbage,
    #: and pages whose data a disk error destroyed
    dropped_pages: int
    dropped_bytes: int
    #: pages a disk read or write failed for (each also counts as dropped)
    io_errors: int
    #: hybrid models: bytes in use by recurrent states at this level now (requests' live states
    #: and the reuse tree's snapshots; part of ``used_bytes``)
    state_bytes: int = 0
    #: write admission: reusable pages evicted from the level above that were dropped instead of
    #: written here, its link's queued writes being at ``KVCacheManagerConfig.max_write_backlog_s``
    #: (each also counts as dropped at the level it left)
    declined_pages: int = 0
    declined_bytes: int = 0

    def __init__(
        self,
        level: CacheLevel,
        tier: CacheTier,
        total_bytes: int,
        used_bytes: int,
        peak_used_bytes: int,
        offloaded_pages: int,
        offloaded_bytes: int,
        onboarded_pages: int,
        onboarded_bytes: int,
        dropped_pages: int,
        dropped_bytes: int,
        io_errors: int,
        state_bytes: int = 0,
        declined_pages: int = 0,
        declined_bytes: int = 0,
    ) -> None:
        # written out, as StorageStatistics' (take_iteration_stats builds one per level every step)
        object.__setattr__(self, "level", level)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "total_bytes", total_bytes)
        object.__setattr__(self, "used_bytes", used_bytes)
        object.__setattr__(self, "peak_used_bytes", peak_used_bytes)
        object.__setattr__(self, "offloaded_pages", offloaded_pages)
        object.__setattr__(self, "offloaded_bytes", offloaded_bytes)
        object.__setattr__(self, "onboarded_pages", onboarded_pages)
        object.__setattr__(self, "onboarded_bytes", onboarded_bytes)
        object.__setattr__(self, "dropped_pages", dropped_pages)
        object.__setattr__(self, "dropped_bytes", dropped_bytes)
        object.__setattr__(self, "io_errors", io_errors)
        object.__setattr__(self, "state_bytes", state_bytes)
        object.__setattr__(self, "declined_pages", declined_pages)
        object.__setattr__(self, "declined_bytes", declined_bytes)


@dataclass
class ReuseStatistics:
    """What prefix reuse did, counted since the manager was created (all zero with ``enable_stats=False``).

    Blocks count token positions (a block of the input is reused when its KV need not be
    computed, whatever the layer groups); pages count memory (one per block and layer group).
    With sliding-window layers a reused block needs pages only in the window, so
    ``reused_pages`` can be smaller than ``reused_blocks`` times the number of layer groups.
    """

    #: input blocks of ``create_kv_cache`` whose KV was found (a partially matched block counts)
    reused_blocks: int = 0
    #: input blocks of ``create_kv_cache`` not found
    missed_blocks: int = 0
    #: pages the matches took from the reuse cache
    reused_pages: int = 0
    #: new pages allocated (``resize`` growth and copy-on-partial copies)
    allocated_pages: int = 0
    #: input tokens of ``create_kv_cache`` (looked up in the reuse cache), and of those reused
    queried_tokens: int = 0
    reused_tokens: int = 0
    #: recurrent-state snapshots copied into the reuse tree (one page per recurrent layer group),
    #: skipped for want of a free slot at any level, taken by a match (copied into a request's live
    #: state at its first resume), and evicted from the reuse cache
    snapshots_taken: int = 0
    snapshots_skipped: int = 0
    snapshots_reused: int = 0
    snapshots_evicted: int = 0
    #: hybrid models: input tokens of ``create_kv_cache`` the attention layers alone matched (the
    #: bound a snapshot at every block would reach; compare with ``reused_tokens``)
    attention_matched_tokens: int = 0
    #: snapshots taken by kind: a multiple of the interval or a configured position, where a
    #: prompt left a cached path (branch), at a prompt's last full block, where the attention
    #: match exceeded the hybrid one by an interval (demand)
    snapshots_interval: int = 0
    snapshots_branch: int = 0
    snapshots_last: int = 0
    snapshots_demand: int = 0
    #: snapshots evicted (of ``snapshots_evicted``) that no match ever took
    snapshots_evicted_unused: int = 0

    @property
    def hit_rate(self) -> float:
        """reused / (reused + missed) input blocks; 0 when nothing was looked up."""
        n = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / n if n else 0.0


@dataclass(frozen=True)
class LoadPlanStatistics:
    """What the load plan (``load_policy``) did, counted since the manager was created (token
    counts: all zero with ``enable_stats=False``); per cache level, the configured tiers' order.

    A matched block counts at the deepest level among the pages it needs (level 0: all in GPU
    memory). Savings are the plan's estimates (0 while no prefill rate is known)."""

    #: ``load_policy``, and the prefill rate it uses (tokens/s; None: unknown)
    policy: str
    prefill_tokens_per_s: float | None
    #: matched tokens the requests took (loaded from that level; level 0: already in GPU memory)
    loaded_tokens: tuple[int, ...]
    #: matched tokens the plan left to recompute (their blocks' pages were on that level)
    recomputed_tokens: tuple[int, ...]
    #: estimated seconds the taken matches saved against recomputing them
    saved_s: float
    #: estimated seconds the plan's cuts saved against loading every matched block
    cut_saved_s: float
    #: matches the plan shortened
    cut_matches: int
    #: the read cost estimates per level (refined from timed copies): bytes per second (inf: the
    #: GPU) and seconds per transfer
    read_bytes_per_s: tuple[float, ...]
    read_latency_s: tuple[float, ...]
    #: per level, seconds a read queued now waits behind its link's backlog: the manager's own
    #: queued writes there (evicted pages, at the tier's ``write_bytes_per_s``) on top of what
    #: ``set_tier_wait`` last said, drained as the clock runs (0 at the GPU)
    link_wait_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class RemoteStatistics:
    """What the remote tier did for one manager since it was created (pages: one block of one layer group).

    Reads happen on the scheduler's thread inside ``probe_reuse`` / ``create_kv_cache``; writes on a
    background thread. Nothing here is authoritative: the server may evict or lose any key.
    """

    #: round trips that looked up block keys (one per ``probe_reuse``/``create_kv_cache`` that went remote)
    lookups: int
    #: pages looked up, and of those found with the right length
    looked_up_pages: int
    found_pages: int
    #: pages fetched and placed in the local cache (then reused like pages of a lower tier), and their bytes
    fetched_pages: int
    fetched_bytes: int
    #: blocks matches were extended by thanks to the remote tier (``create_kv_cache`` only)
    hit_blocks: int
    #: fetched values refused: truncated, foreign (other layout or key), or failing their checksum
    corrupt_pages: int
    #: pages queued for writing, written (acknowledged by the server), and their bytes
    queued_writes: int
    written_pages: int
    written_bytes: int
    #: writes given up: queue full, server down or refusing them
    dropped_writes: int
    #: failed round trips (timeouts, connection errors); each made the server count as down for a while
    errors: int
    #: lookups skipped because the server counted as down (misses without a round trip)
    skipped_lookups: int
    #: bytes waiting in the write queue now
    pending_bytes: int
    #: whether the last round trip succeeded
    connected: bool


@dataclass(frozen=True)
class PoolDesc:
    """One memory region of a pool group: slot ``s`` starts at ``base_address + s * slot_bytes``."""

    pool_index: PoolIndex
    base_address: MemAddress
    slot_bytes: int


@dataclass(frozen=True)
class PoolGroupDesc:
    """A pool group: ``num_slots`` slots mirrored across ``pools``."""

    pool_group_index: PoolGroupIndex
    num_slots: int
    pools: tuple[PoolDesc, ...]


@dataclass(frozen=True)
class AggregatedPageDesc:
    """A byte-contiguous run of requested buffers inside each slot of one pool.

    Slot ``s`` of the run starts at ``base_address + s * stride`` and is ``size`` bytes long.
    """

    buffer_ids: tuple[BufferId, ...]
    layer_group_id: LayerGroupId
    pool_group_index: PoolGroupIndex
    pool_index: PoolIndex
    base_address: MemAddress
    size: int
    stride: int
    num_slots: int

    @property
    def base(self) -> MemAddress:
        """``base_address`` under the reference system's name."""
        return self.base_address

    @property
    def buffers(self) -> tuple[BufferId, ...]:
        """``buffer_ids`` under the reference system's name."""
        return self.buffer_ids


@dataclass(frozen=True)
class ScratchDesc:
    """Scratch blocks of one layer group for the current step (docs/design.md, "SWA prefill scratch slots")."""

    range: HalfOpenRange
    slot_ids: tuple[SlotId, ...]


@dataclass(frozen=True)
class LayerGroupInfo:
    """One layer group: its layers, layer kind and attention shape, and the pool group of its slots."""

    layer_group_id: LayerGroupId
    layer_ids: tuple[LayerId, ...]
    #: sliding window in tokens; None for full attention
    window_size: int | None
    #: blocks of sink tokens a sliding window keeps (0 for full attention)
    num_sink_blocks: int
    #: the pool group whose slots hold this layer group's blocks
    pool_group_index: PoolGroupIndex
    #: its layer kind: ``"full_attention"``, ``"sliding_window"`` or ``"recurrent"`` (the same name KV
    #: events announce)
    kind: str = "full_attention"
