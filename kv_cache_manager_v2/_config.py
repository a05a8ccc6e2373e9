"""Configuration dataclasses (SPEC 4.1); each validates itself in ``__post_init__``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ._common import CacheTier, LayerId
from ._utils import check_int, check_type, is_power_of_two

BackendName = Literal["auto", "cuda", "host"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "cuda", "host")
BACKEND_ENV_VAR = "KV_CACHE_MANAGER_V2_BACKEND"
#: How reusable pages are chosen for eviction within a priority (docs/design.md, "Eviction"):
#: ``"lru"`` least recently released first; ``"frequency"`` lowest use rate first (use-rate
#: GreedyDual with a ghost table of evicted blocks' uses; descendants before their anchors).
EvictionPolicy = Literal["lru", "frequency"]
EVICTION_POLICIES: tuple[str, ...] = ("lru", "frequency")


def _check_quota(cls_name: str, quota: int) -> None:
    check_int(f"{cls_name}.quota (bytes)", quota, 1)


@dataclass(frozen=True)
class GpuCacheTierConfig:
    """GPU memory tier (level 0): ``quota`` bytes for KV pools."""

    quota: int

    def __post_init__(self) -> None:
        _check_quota("GpuCacheTierConfig", self.quota)

    @property
    def tier(self) -> CacheTier:
        return CacheTier.GPU_MEM


@dataclass(frozen=True)
class HostCacheTierConfig:
    """Host memory tier: ``quota`` bytes of (pinned) host memory."""

    quota: int

    def __post_init__(self) -> None:
        _check_quota("HostCacheTierConfig", self.quota)

    @property
    def tier(self) -> CacheTier:
        return CacheTier.HOST_MEM


@dataclass(frozen=True)
class DiskCacheTierConfig:
    """Disk tier: ``quota`` bytes in files under the existing writable directory ``path``."""

    quota: int
    path: str

    def __post_init__(self) -> None:
        _check_quota("DiskCacheTierConfig", self.quota)
        check_type("DiskCacheTierConfig.path", self.path, str)
        if not os.path.isdir(self.path):
            raise ValueError(f"DiskCacheTierConfig.path must be an existing directory, got {self.path!r}")
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"DiskCacheTierConfig.path {self.path!r} is not writable")

    @property
    def tier(self) -> CacheTier:
        return CacheTier.DISK


CacheTierConfig = GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig


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
        check_int("BufferConfig.size (bytes)", self.size, 1)
        if self.tokens_per_block_override is not None:
            check_int("BufferConfig.tokens_per_block_override", self.tokens_per_block_override, 1)


@dataclass(frozen=True)
class AttentionLayerConfig:
    """One attention layer: its buffers and optional sliding window with sink tokens."""

    layer_id: LayerId
    buffers: Sequence[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("AttentionLayerConfig.layer_id", self.layer_id)
        if len(self.buffers) == 0:
            raise ValueError(f"layer {self.layer_id}: buffers must not be empty")
        roles: set[str] = set()
        for b in self.buffers:
            check_type(f"layer {self.layer_id}: each buffer", b, BufferConfig)
            if b.role in roles:
                raise ValueError(f"layer {self.layer_id}: buffer role {b.role!r} appears twice; roles must be unique")
            roles.add(b.role)
        w = self.sliding_window_size
        if w is not None:
            check_int(f"layer {self.layer_id}: sliding_window_size", w, 1)
        s = self.num_sink_tokens
        if s is not None:
            if w is None:
                raise ValueError(f"layer {self.layer_id}: num_sink_tokens needs a sliding_window_size")
            check_int(f"layer {self.layer_id}: num_sink_tokens", s)

    @property
    def window_size(self) -> int | None:
        return self.sliding_window_size


@dataclass(frozen=True)
class KVCacheDesc:
    """Shape of one request for sizing: ``capacity`` tokens, of which ``history_length`` are history."""

    capacity: int
    history_length: int

    def __post_init__(self) -> None:
        check_int("KVCacheDesc.capacity", self.capacity)
        check_int("KVCacheDesc.history_length", self.history_length)
        if self.history_length > self.capacity:
            raise ValueError(
                f"KVCacheDesc.history_length ({self.history_length}) must not exceed capacity ({self.capacity})"
            )


@dataclass(frozen=True)
class BatchDesc:
    """A batch of requests used for sizing (``typical_step``, ``constraints``)."""

    kv_caches: Sequence[KVCacheDesc]
    system_prompt_length: int = 0

    def __post_init__(self) -> None:
        check_int("BatchDesc.system_prompt_length", self.system_prompt_length)
        for d in self.kv_caches:
            check_type("each of BatchDesc.kv_caches", d, KVCacheDesc)


@dataclass(frozen=True)
class SwaScratchReuseConfig:
    """Enables SWA prefill scratch-slot reuse (SPEC 5.7)."""

    max_rewind_len: int = 0

    def __post_init__(self) -> None:
        check_int("SwaScratchReuseConfig.max_rewind_len", self.max_rewind_len)


_TIER_ORDER = {CacheTier.GPU_MEM: 0, CacheTier.HOST_MEM: 1, CacheTier.DISK: 2}


@dataclass(frozen=True)
class KVCacheManagerConfig:
    """Everything a :class:`KVCacheManager` needs to know up front."""

    tokens_per_block: int
    cache_tiers: Sequence[CacheTierConfig]
    layers: Sequence[AttentionLayerConfig]
    max_util_for_resume: float = 0.97
    enable_partial_reuse: bool = True
    constraints: Sequence[BatchDesc] = field(default_factory=list)
    typical_step: BatchDesc | None = None
    initial_pool_ratio: Sequence[float] | None = None
    swa_scratch_reuse: SwaScratchReuseConfig | None = None
    enable_stats: bool = True
    backend: BackendName = "auto"
    eviction_policy: EvictionPolicy = "lru"

    def __post_init__(self) -> None:
        t = self.tokens_per_block
        check_int("tokens_per_block", t)
        if not is_power_of_two(t):
            raise ValueError(f"tokens_per_block must be a positive power of two, got {t!r}")
        self._validate_tiers()
        if len(self.layers) == 0:
            raise ValueError("layers must not be empty")
        seen: set[int] = set()
        for layer in self.layers:
            check_type("each of layers", layer, AttentionLayerConfig)
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
            check_type("each of cache_tiers", tier, (GpuCacheTierConfig, HostCacheTierConfig, DiskCacheTierConfig))
            order = _TIER_ORDER[tier.tier]
            if order <= prev:
                raise ValueError(
                    "cache_tiers must be GPU, then optionally host, then optionally disk, each at most once; "
                    f"got {[x.tier.name for x in tiers]}"
                )
            prev = order
