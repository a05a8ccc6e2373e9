"""Configuration dataclasses (README.md, "API in short"); each validates itself in ``__post_init__``.

They stay Python classes when compiled (``native_class=False``): a native int field would turn a
bool into an int before ``__post_init__`` could refuse it, and validation is the same in both modes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from mypy_extensions import mypyc_attr

from ._common import MAX_BEAM_WIDTH, CacheTier, LayerId
from ._remote_url import CLUSTER_URL_SCHEMES as CLUSTER_URL_SCHEMES
from ._remote_url import REMOTE_URL_SCHEMES as REMOTE_URL_SCHEMES
from ._remote_url import check_backend_url
from ._remote_url import cluster_seed_nodes as cluster_seed_nodes
from ._remote_url import redact_url as redact_url
from ._storage._policy_registry import EVICTION_POLICIES as EVICTION_POLICIES
from ._utils import check_int, check_number, check_type, is_power_of_two, raw_field

BackendName = Literal["auto", "cuda", "host"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "cuda", "host")
BACKEND_ENV_VAR = "KV_CACHE_MANAGER_V2_BACKEND"
#: How reusable pages are chosen for eviction within a priority (docs/design.md, "Eviction"): a
#: name in ``EVICTION_POLICIES``, the registry's (``_storage/_policy_registry.py``: ``"lru"``
#: least recently released first; ``"frequency"`` lowest use rate first, ...).
EvictionPolicy = Annotated[str, "a name in EVICTION_POLICIES"]
SnapshotPolicy = Literal["interval", "branch", "auto"]
#: where hybrid models keep recurrent-state snapshots (``ssm_snapshot_policy``)
SNAPSHOT_POLICIES: tuple[str, ...] = ("interval", "branch", "auto")
#: which matched blocks a request loads from the tiers below the GPU (``load_policy``)
LoadPolicy = Literal["auto", "always", "never"]
LOAD_POLICIES: tuple[str, ...] = ("auto", "always", "never")


def _check_quota(cls_name: str, quota: object) -> None:
    check_int(f"{cls_name}.quota (bytes)", quota, 1)


def _check_link(n: str, obj: object) -> None:
    for f in ("read_bytes_per_s", "read_latency_s", "write_bytes_per_s")[: 2 + hasattr(obj, "write_bytes_per_s")]:
        lat = f == "read_latency_s"  # (a remote tier has no write speed: its writer's queue is bounded)
        check_number(f"{n}.{f}", raw_field(obj, f), not lat, "seconds a transfer" if lat else "bytes per second")


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class GpuCacheTierConfig:
    """GPU memory tier (level 0): ``quota`` bytes for KV pools."""

    quota: int

    def __post_init__(self) -> None:
        _check_quota("GpuCacheTierConfig", raw_field(self, "quota"))

    @property
    def tier(self) -> CacheTier:
        """The medium this tier keeps pages in."""
        return CacheTier.GPU_MEM


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class HostCacheTierConfig:
    """Host memory tier: ``quota`` bytes of (pinned) host memory.

    ``read_bytes_per_s``, ``read_latency_s``, ``write_bytes_per_s``: a copy's cost each way (priors): pinned
    copies reach ~50 of PCIe Gen5 x16's 64 GB/s on an H100 (~25 on Gen4; nvbandwidth), ~10 us a launch.
    """

    quota: int
    read_bytes_per_s: float = 50e9
    read_latency_s: float = 10e-6
    write_bytes_per_s: float = 50e9

    def __post_init__(self) -> None:
        _check_quota("HostCacheTierConfig", raw_field(self, "quota"))
        _check_link("HostCacheTierConfig", self)

    @property
    def tier(self) -> CacheTier:
        """The medium this tier keeps pages in."""
        return CacheTier.HOST_MEM


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class DiskCacheTierConfig:
    """Disk tier: ``quota`` bytes in files under the existing writable directory ``path``.

    Every page is checksummed when written and verified when read (a damaged page is a miss).

    - ``persistent``: keep the files (and a record of which slots hold which published blocks) in
      ``path``, so the next manager with the same layout, ``namespace`` and ``dtype`` adopts them as
      reusable blocks at start-up. One manager at a time per directory (a lock).
    - ``namespace``: names the model (and anything else that must never share KV with another);
      files of another namespace, layout or format version are ignored and overwritten.
    - ``dtype``: the KV data type (e.g. ``"bf16"``), part of the layout fingerprint.
    - ``read_bytes_per_s``, ``read_latency_s``, ``write_bytes_per_s``: a PCIe Gen4 NVMe SSD (datasheets: Samsung
      PM9A3, Kioxia CM6): ~6.5-7 GB/s read, ~80-100 us a read, ~3.5-4.5 GB/s written (see the host's).
    """

    quota: int
    path: str
    persistent: bool = False
    namespace: str = ""
    dtype: str = ""
    read_bytes_per_s: float = 6.5e9
    read_latency_s: float = 100e-6
    write_bytes_per_s: float = 3.5e9

    def __post_init__(self) -> None:
        _check_quota("DiskCacheTierConfig", raw_field(self, "quota"))
        check_type("DiskCacheTierConfig.path", self.path, str)
        if not os.path.isdir(self.path):
            raise ValueError(f"DiskCacheTierConfig.path must be an existing directory, got {self.path!r}")
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"DiskCacheTierConfig.path {self.path!r} is not writable")
        check_type("DiskCacheTierConfig.persistent", self.persistent, bool)
        check_type("DiskCacheTierConfig.namespace", self.namespace, str)
        if len(self.namespace) > 256 or not self.namespace.isprintable():
            raise ValueError(
                f"DiskCacheTierConfig.namespace must be at most 256 printable characters, got {self.namespace!r}"
            )
        check_type("DiskCacheTierConfig.dtype", self.dtype, str)
        _check_link("DiskCacheTierConfig", self)

    @property
    def tier(self) -> CacheTier:
        """The medium this tier keeps pages in."""
        return CacheTier.DISK


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class RemoteCacheTierConfig:
    """A remote tier on Redis (or Valkey), a Redis Cluster or a Mooncake Store, shared by every manager
    on the same store and ``namespace``: below the local tiers, content-addressed by each page's reuse key.

    - ``url``: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://path`` for one
      server; ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``: TLS)
      for a Redis Cluster or Valkey cluster, given by one or more seed nodes (the client reads the slot
      map from them, and again when a node answers ``MOVED``); ``mooncake://host:port?metadata=...`` for
      a Mooncake Store's master (README). A URL its backend refuses is a ValueError here. The password
      never appears in logs, ``repr`` or error messages.
    - ``namespace``: names the model (and anything else that must never share KV with another);
      keys also carry a fingerprint of the layout (layers, buffers, sizes, tokens per block, ``dtype``).
    - ``quota``: bytes; when given, the manager sets the server's ``maxmemory`` to it (with
      ``maxmemory-policy allkeys-lru``) on start-up and on ``resize``. Leave None for a server its
      operator configures (several managers share it: give them all the same quota, or none).
    - ``timeout_ms``: deadline of each call on the scheduler's thread (a lookup, a fetch: all its
      replies; with a cluster, per node), and of each connect; a slow, dead or trickling server
      turns into misses after it.
    - ``dtype``: the KV data type (e.g. ``"bf16"``), part of the layout fingerprint.
    - ``write_through``: also write every published full block (not only pages dropped locally),
      handed to the background writer at the next page allocation, at the latest when the request
      that published it closes.
    - ``ttl_s``: expiry of written keys (None: keys stay until the server evicts them).
    - ``max_pending_bytes``: bound of the background write queue, a ring of this many bytes mapped
      (resident) at start-up; writes beyond it are dropped (counted). A last local tier below
      the GPU also keeps up to this many bytes of headroom slots beyond its quota (a dropped
      page is sent from its slot), so budget up to twice this. Size it for a burst of
      evictions: at least a few dozen pages of the largest pool group.
    - ``max_lookup_blocks``: blocks past a local match one lookup asks about.
    - ``retry_interval_ms``: after a failed round trip the server counts as down this long (misses
      without network traffic), then the next operation tries again.
    - ``read_bytes_per_s``, ``read_latency_s``: a fetch's cost, ``load_policy="auto"``'s prior: a
      25 Gb/s network (3.125 GB/s), ~0.5 ms a round trip with the server's command.
    """

    url: str
    namespace: str
    quota: int | None = None
    timeout_ms: int = 100
    dtype: str = ""
    write_through: bool = False
    ttl_s: int | None = None
    max_pending_bytes: int = 64 << 20
    max_lookup_blocks: int = 1024
    retry_interval_ms: int = 1000
    read_bytes_per_s: float = 3.125e9
    read_latency_s: float = 0.5e-3

    def __post_init__(self) -> None:
        n = "RemoteCacheTierConfig"
        check_type(f"{n}.url", self.url, str)
        if not self.url.startswith(REMOTE_URL_SCHEMES):
            raise ValueError(f"{n}.url must start with one of {REMOTE_URL_SCHEMES}, got {redact_url(self.url)!r}")
        check_backend_url(f"{n}.url", self.url)
        check_type(f"{n}.namespace", self.namespace, str)
        if not self.namespace or len(self.namespace) > 256 or not self.namespace.isprintable():
            raise ValueError(f"{n}.namespace must be 1 to 256 printable characters, got {self.namespace!r}")
        if self.quota is not None:
            _check_quota(n, raw_field(self, "quota"))
        check_int(f"{n}.timeout_ms", raw_field(self, "timeout_ms"), 1)
        check_type(f"{n}.dtype", self.dtype, str)
        check_type(f"{n}.write_through", self.write_through, bool)
        if self.ttl_s is not None:
            check_int(f"{n}.ttl_s", raw_field(self, "ttl_s"), 1)
        check_int(f"{n}.max_pending_bytes", raw_field(self, "max_pending_bytes"), 1)
        check_int(f"{n}.max_lookup_blocks", raw_field(self, "max_lookup_blocks"), 1)
        check_int(f"{n}.retry_interval_ms", raw_field(self, "retry_interval_ms"))
        _check_link(n, self)

    @property
    def tier(self) -> CacheTier:
        """The medium this tier keeps pages in."""
        return CacheTier.REMOTE

    @property
    def cluster(self) -> bool:
        """Whether ``url`` names a cluster (``redis+cluster://``, ``rediss+cluster://``)."""
        return self.url.startswith(CLUSTER_URL_SCHEMES)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={redact_url(self.url) if f.name == 'url' else getattr(self, f.name)!r}" for f in fields(self)
        )
        return f"RemoteCacheTierConfig({shown})"


#: the tiers backed by slots of this machine's memory or disk
LocalCacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig
CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig | RemoteCacheTierConfig


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class BufferConfig:
    """One buffer of a layer: ``size`` bytes per kernel page.

    A kernel page holds ``tokens_per_block`` tokens, or ``tokens_per_block_override`` tokens
    when given (it must divide ``tokens_per_block``; the buffer then takes several pages per block).
    """

    role: str
    size: int
    tokens_per_block_override: int | None = None

    def __post_init__(self) -> None:
        check_type("BufferConfig.role", self.role, str)
        if not self.role:
            raise ValueError("BufferConfig.role must be a non-empty str")
        check_int("BufferConfig.size (bytes)", raw_field(self, "size"), 1)
        if self.tokens_per_block_override is not None:
            check_int("BufferConfig.tokens_per_block_override", raw_field(self, "tokens_per_block_override"), 1)


def _check_buffers(layer_id: LayerId, buffers: Sequence[BufferConfig]) -> None:
    """A layer's buffers: at least one, each a BufferConfig, roles unique."""
    if len(buffers) == 0:
        raise ValueError(f"layer {layer_id}: buffers must not be empty")
    roles: set[str] = set()
    for b in buffers:
        check_type(f"layer {layer_id}: each buffer", b, BufferConfig)
        if b.role in roles:
            raise ValueError(f"layer {layer_id}: buffer role {b.role!r} appears twice; roles must be unique")
        roles.add(b.role)


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class AttentionLayerConfig:
    """One attention layer: its buffers and optional sliding window with sink tokens."""

    layer_id: LayerId
    buffers: Sequence[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("AttentionLayerConfig.layer_id", raw_field(self, "layer_id"))
        _check_buffers(self.layer_id, self.buffers)
        w = self.sliding_window_size
        if w is not None:
            check_int(f"layer {self.layer_id}: sliding_window_size", raw_field(self, "sliding_window_size"), 1)
        s = self.num_sink_tokens
        if s is not None:
            if w is None:
                raise ValueError(f"layer {self.layer_id}: num_sink_tokens needs a sliding_window_size")
            check_int(f"layer {self.layer_id}: num_sink_tokens", raw_field(self, "num_sink_tokens"))

    @property
    def window_size(self) -> int | None:
        """Tokens of history the layer attends to (None: all of them)."""
        return self.sliding_window_size


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class SsmLayerConfig:
    """One recurrent-state layer (Mamba, SSM, gated delta-net): no per-token KV, one fixed-size
    state per sequence. ``buffers``: its state roles (e.g. ``"conv_state"``, ``"ssm_state"``), each
    ``size`` bytes for ONE sequence in this layer (``tokens_per_block_override`` is refused).
    Recurrent layers with the same buffer roles and sizes share one layer group."""

    layer_id: LayerId
    buffers: Sequence[BufferConfig]

    def __post_init__(self) -> None:
        check_int("SsmLayerConfig.layer_id", raw_field(self, "layer_id"))
        _check_buffers(self.layer_id, self.buffers)
        for b in self.buffers:
            if b.tokens_per_block_override is not None:
                raise ValueError(
                    f"layer {self.layer_id} buffer {b.role!r}: a recurrent layer's state is per sequence, not per "
                    f"token; tokens_per_block_override must be None, got {b.tokens_per_block_override}"
                )

    @property
    def window_size(self) -> int | None:
        """None: a recurrent layer keeps one state, not a window of blocks."""
        return None


#: any layer a model may have
LayerConfig = AttentionLayerConfig | SsmLayerConfig

#: tokens between recurrent-state snapshots when ``ssm_reuse_interval`` is None (rounded up to
#: a multiple of ``tokens_per_block``)
DEFAULT_SSM_REUSE_INTERVAL = 512
#: ``lower_tier_state_share`` None: a tier below the GPU gives its recurrent-state pool groups the
#: share that holds one state per this many tokens of the tier's KV (capped at their GPU share):
#: snapshots there serve only while the KV of their path is cached too (README, "Snapshot
#: policy", measured; Qwen3-Next: 0.13, Nemotron-H, whose state is twice as heavy: 0.22)
LOWER_TIER_TOKENS_PER_STATE = 11_000
#: under "auto" with a tier below the GPU, the periodic snapshots written there are spaced so
#: that the KV of the span one covers weighs at least this many times the snapshot
#: (``ssm_lower_tier_interval`` None; README, "Snapshot policy", measured)
LOWER_TIER_SPAN_PER_STATE = 2


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class KVCacheDesc:
    """Shape of one request for sizing: ``capacity`` tokens, of which ``history_length`` are history.

    ``beam_width``: the request's beams, each with its own live recurrent state (hybrid models;
    blocks are counted once, as beams share them until they fork)."""

    capacity: int
    history_length: int
    beam_width: int = 1

    def __post_init__(self) -> None:
        check_int("KVCacheDesc.capacity", raw_field(self, "capacity"))
        check_int("KVCacheDesc.history_length", raw_field(self, "history_length"))
        check_int("KVCacheDesc.beam_width", raw_field(self, "beam_width"), 1, MAX_BEAM_WIDTH)
        if self.history_length > self.capacity:
            raise ValueError(
                f"KVCacheDesc.history_length ({self.history_length}) must not exceed capacity ({self.capacity})"
            )


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class BatchDesc:
    """A batch of requests used for sizing (``typical_step``, ``constraints``)."""

    kv_caches: Sequence[KVCacheDesc]
    system_prompt_length: int = 0

    def __post_init__(self) -> None:
        check_int("BatchDesc.system_prompt_length", raw_field(self, "system_prompt_length"))
        for d in self.kv_caches:
            check_type("each of BatchDesc.kv_caches", d, KVCacheDesc)


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class SwaScratchReuseConfig:
    """Enables SWA prefill scratch-slot reuse (docs/design.md, "SWA prefill scratch slots")."""

    max_rewind_len: int = 0

    def __post_init__(self) -> None:
        check_int("SwaScratchReuseConfig.max_rewind_len", raw_field(self, "max_rewind_len"))


_TIER_ORDER = {CacheTier.GPU_MEM: 0, CacheTier.HOST_MEM: 1, CacheTier.DISK: 2, CacheTier.REMOTE: 3}


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class KVCacheManagerConfig:
    """Everything a :class:`KVCacheManager` needs to know up front."""

    tokens_per_block: int
    cache_tiers: Sequence[CacheTierConfig]
    layers: Sequence[LayerConfig]
    max_util_for_resume: float = 0.97
    enable_partial_reuse: bool = True
    constraints: Sequence[BatchDesc] = field(default_factory=list)
    typical_step: BatchDesc | None = None
    initial_pool_ratio: Sequence[float] | None = None
    swa_scratch_reuse: SwaScratchReuseConfig | None = None
    enable_stats: bool = True
    backend: BackendName = "auto"
    eviction_policy: EvictionPolicy = "lru"
    #: tokens between recurrent-state snapshots (prefix reuse of hybrid models): a multiple of
    #: ``tokens_per_block``; None: ``max(512, tokens_per_block)`` rounded up to a multiple of it
    ssm_reuse_interval: int | None = None
    #: extra snapshot positions of every request, in tokens from its start (e.g. the end of a
    #: shared system prompt); each a positive multiple of ``tokens_per_block``
    ssm_snapshots_from_start: Sequence[int] = ()
    #: extra snapshot positions before each request's prompt end (rounded down to a block), in
    #: tokens (e.g. ``[T]``: the prompt without its last block, for a re-sent prompt whose last
    #: message changed); each a positive multiple of ``tokens_per_block``
    ssm_snapshots_from_end: Sequence[int] = ()
    #: seconds for retention and pin durations (``Retention``, ``RequestRetention``, ``pin``); a
    #: simulator passes its own. It must return a finite number of seconds (any real number, numpy
    #: scalars too; a bool will not do), never more than 1 s below an earlier reading (a smaller step back reads as no time
    #: passing). Construction reads it once and refuses a reading that is no finite number (it cannot
    #: see a clock going back); ``pin`` with a duration refuses any bad reading (raising, changing
    #: nothing); elsewhere a bad reading counts as the last good one (logged)
    clock: Callable[[], float] = time.monotonic
    #: at most this share of each tier's slots (per pool group) may be pinned (``KVCacheManager.pin``)
    max_pinned_share: float = 0.5
    #: which recurrent-state snapshots a request keeps (besides the configured positions):
    #: "interval": every ``ssm_reuse_interval`` tokens and at the prompt's last full block;
    #: "branch": where the prompt leaves a cached path, at its last full block, and where the
    #: attention layers matched at least an interval more than the snapshots did (demand);
    #: "auto": both, the interval snapshots at the lowest priority unless the request has its own
    #: priority callback, whose priority wins (evicted first; with a host or disk tier, the first
    #: pages moved down there)
    ssm_snapshot_policy: SnapshotPolicy = "auto"
    #: hybrid models: the share of each tier below the GPU (host, disk) that the pool groups of
    #: recurrent states take together (snapshots there; the KV pool groups share the rest in the
    #: GPU's proportions); None: derived from bytes, one state per ``LOWER_TIER_TOKENS_PER_STATE``
    #: tokens of the tier's KV, at most the GPU's own share (under "interval": the GPU's share)
    lower_tier_state_share: float | None = None
    #: hybrid models, policy "auto" with a host or disk tier: tokens between the periodic
    #: snapshots written there (a positive multiple of ``tokens_per_block``); None: the smallest
    #: power-of-two multiple of the interval whose span's KV weighs at least
    #: ``LOWER_TIER_SPAN_PER_STATE`` times a snapshot (the interval itself for small states)
    ssm_lower_tier_interval: int | None = None
    #: matched blocks below the GPU a request loads (docs/design.md, "Load or recompute"): "auto": the prefix
    #: saving the most time ("always" while no rate is known); "always"; "never": only what is in GPU memory
    load_policy: LoadPolicy = "auto"
    #: the engine's prefill rate (tokens/s) for "auto"; None: unknown until ``set_prefill_rate``/``observe_step``
    prefill_tokens_per_s: float | None = None
    #: refine the disk and remote tiers' read costs from timed reads (False: e.g. a simulator's)
    refine_tier_costs: bool = True
    #: "auto": a recomputed token costs ``1 + w * waiting`` times its time (``set_engine_queue``: they wait too)
    recompute_queue_weight: float = 0.1
    #: threads reading disk and remote pages for ``KVCache.prefetch``/``KVCacheManager.prefetch`` (docs/design.md,
    #: "Background loads"); 0: those read synchronously, as ``resume`` always does (the simulator's choice)
    load_workers: int = 2
    #: write admission (docs/design.md): seconds of writes a host/disk link may queue (its ``write_bytes_per_s``);
    #: an evicted reusable page beyond is dropped (``TierStatistics.declined_pages``); None: no bound
    max_write_backlog_s: float | None = 1.0

    def __post_init__(self) -> None:
        t = check_int("tokens_per_block", raw_field(self, "tokens_per_block"))
        check_int("load_workers", raw_field(self, "load_workers"), 0, 64)
        if not callable(self.clock):
            raise TypeError(f"clock must be a callable returning seconds (like time.monotonic), got {self.clock!r}")
        s = raw_field(self, "max_pinned_share")
        if type(s) is bool or not isinstance(s, (int, float)):
            raise TypeError(f"max_pinned_share must be a number, got {s!r}")
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"max_pinned_share must be in [0, 1] (a share of each tier's slots), got {s!r}")
        h = raw_field(self, "lower_tier_state_share")
        if h is not None:
            if type(h) is bool or not isinstance(h, (int, float)):
                raise TypeError(f"lower_tier_state_share must be a number or None, got {h!r}")
            if not 0.0 <= h <= 1.0:
                raise ValueError(
                    f"lower_tier_state_share must be in [0, 1] (a share of each lower tier's bytes) or None, got {h!r}"
                )
        if not is_power_of_two(t):
            raise ValueError(f"tokens_per_block must be a positive power of two, got {t!r}")
        self._validate_tiers()
        if len(self.layers) == 0:
            raise ValueError("layers must not be empty")
        seen: set[int] = set()
        for layer in self.layers:
            check_type("each of layers", layer, (AttentionLayerConfig, SsmLayerConfig))
            if layer.layer_id in seen:
                raise ValueError(f"layer_id {layer.layer_id} appears twice; layer ids must be unique")
            seen.add(layer.layer_id)
            for b in layer.buffers:
                o = b.tokens_per_block_override
                if o is not None and (o > t or t % o != 0):
                    raise ValueError(
                        f"layer {layer.layer_id} buffer {b.role!r}: tokens_per_block_override {o} "
                        f"must divide tokens_per_block {t}"
                    )
        for name in ("ssm_reuse_interval", "ssm_lower_tier_interval"):
            raw = raw_field(self, name)  # (checked before any typed read: compiled, that would raise first)
            if raw is not None:
                i = check_int(name, raw, -(1 << 62))
                if i <= 0 or i % t != 0:
                    raise ValueError(f"{name} must be a positive multiple of tokens_per_block ({t}), got {i}")
        for name in ("ssm_snapshots_from_start", "ssm_snapshots_from_end"):
            offsets = getattr(self, name)
            if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
                raise TypeError(f"{name} must be a sequence of ints, got {type(offsets).__name__}")
            for offset in offsets:
                check_int(f"each of {name}", offset, -(1 << 62))
                if offset <= 0 or offset % t != 0:
                    raise ValueError(
                        f"{name} entries must be positive multiples of tokens_per_block ({t}), got {offset}"
                    )
        policy = raw_field(self, "ssm_snapshot_policy")
        check_type("ssm_snapshot_policy", policy, str)
        if policy not in SNAPSHOT_POLICIES:
            raise ValueError(
                f"ssm_snapshot_policy must be one of {', '.join(map(repr, SNAPSHOT_POLICIES))}, got {policy!r}"
            )
        u = self.max_util_for_resume
        check_type("max_util_for_resume", u, (int, float))
        if not 0.0 < u <= 1.0:
            raise ValueError(f"max_util_for_resume must be in (0, 1], got {u!r}")
        for c in self.constraints:
            check_type("each of constraints", c, BatchDesc)
        if self.typical_step is not None:
            check_type("typical_step", self.typical_step, BatchDesc)
        r = self.initial_pool_ratio
        if r is not None:
            if len(r) == 0 or any(not isinstance(x, (int, float)) or not 0 < x <= 1 for x in r):
                raise ValueError(f"initial_pool_ratio must be a non-empty sequence of numbers in (0, 1], got {r!r}")
            if abs(sum(r) - 1.0) > 1e-6:
                raise ValueError(
                    f"initial_pool_ratio must sum to 1 (one share of the GPU quota per pool group), got {r!r} "
                    f"(sum {sum(r)})"
                )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        lp = raw_field(self, "load_policy")
        check_type("load_policy", lp, str)
        if lp not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {', '.join(map(repr, LOAD_POLICIES))}, got {lp!r}")
        for f in ("prefill_tokens_per_s", "max_write_backlog_s"):
            if raw_field(self, f) is not None:
                check_number(f, raw_field(self, f), f[0] == "p", "tokens per second or seconds, or None")
        check_type("refine_tier_costs", raw_field(self, "refine_tier_costs"), bool)
        check_number("recompute_queue_weight", raw_field(self, "recompute_queue_weight"), False, "a weight")
        check_type("eviction_policy", self.eviction_policy, str)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(map(repr, EVICTION_POLICIES))}, "
                f"got {self.eviction_policy!r}"
            )

    def _validate_tiers(self) -> None:
        tiers = self.cache_tiers
        if len(tiers) == 0 or not isinstance(tiers[0], GpuCacheTierConfig):
            raise ValueError("cache_tiers must start with a GpuCacheTierConfig")
        prev = -1
        for tier in tiers:
            check_type(
                "each of cache_tiers",
                tier,
                (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig, RemoteCacheTierConfig),
            )
            order = _TIER_ORDER[tier.tier]
            if order <= prev:
                raise ValueError(
                    "cache_tiers must be GPU, then optionally host, then optionally disk, then optionally "
                    f"remote, each at most once; got {[x.tier.name for x in tiers]}"
                )
            prev = order

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layer is a recurrent-state (``SsmLayerConfig``) layer."""
        return any(isinstance(layer, SsmLayerConfig) for layer in self.layers)

    @property
    def snapshot_interval(self) -> int:
        """Tokens between recurrent-state snapshots: ``ssm_reuse_interval``, else its default;
        0 without recurrent layers."""
        if not self.has_recurrent_layers:
            return 0
        i = self.ssm_reuse_interval
        if i is not None:
            return i
        t = self.tokens_per_block
        return (max(DEFAULT_SSM_REUSE_INTERVAL, t) + t - 1) // t * t

    @property
    def local_tiers(self) -> list[LocalCacheTierConfig]:
        """The tiers backed by this machine (GPU, host, disk): the slot-based cache levels."""
        out: list[LocalCacheTierConfig] = []
        for t in self.cache_tiers:
            if not isinstance(t, RemoteCacheTierConfig):
                out.append(t)
        return out

    @property
    def remote_tier(self) -> RemoteCacheTierConfig | None:
        """The remote tier, when configured (always the last level)."""
        last = self.cache_tiers[-1]
        return last if isinstance(last, RemoteCacheTierConfig) else None
