"""Model shapes (presets and custom), tier quotas, and the manager configuration the simulator replays against.

The simulator builds the manager with the model's real layer structure (layers, sliding-window
layers, sinks) but with *proxy* buffers: 4 bytes per page (metadata only) or 4 bytes per token
(``--check-data``: one record per token). Every byte quota is scaled by the same factor (real
page bytes / proxy page bytes), so the manager gets the slot counts of the real shape while a
replay reserves, copies and writes only a few bytes per block.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import cast

from mypy_extensions import mypyc_attr

from .._common import LayerId
from .._config import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    EvictionPolicy,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    SwaScratchReuseConfig,
)

#: bytes of a proxy buffer page per token with --check-data (one uint32 record per token), else per page
PROXY_RECORD_BYTES = 4
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
GIB = 1 << 30
#: the largest tier quota the simulator takes (1 EiB; the proxy pools are far smaller, but the
#: arithmetic and the messages stay sane)
MAX_QUOTA_BYTES = 1 << 60


@mypyc_attr(native_class=False)
class SimUserError(ValueError):
    """A mistake in the simulator's input (options, trace, model/quota combination): one line, exit code 2."""


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that decides KV memory: every layer holds a key and a value buffer of
    ``kv_heads * head_dim`` elements per token; layers ``i % swa_every == 0`` (when ``window``) slide."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    window: int | None = None  #: sliding-window size of the SWA layers (None: all layers full attention)
    swa_every: int = 0  #: layer i is a sliding-window layer when window and i % swa_every == 0
    sinks: int = 0  #: sink tokens the sliding-window layers keep

    @property
    def buffer_bytes_per_token(self) -> int:
        """Bytes of one layer's key (or value) buffer per token."""
        return self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (key + value), as if every layer kept it."""
        return 2 * self.num_layers * self.buffer_bytes_per_token

    def is_swa_layer(self, i: int) -> bool:
        return self.window is not None and self.swa_every > 0 and i % self.swa_every == 0

    @property
    def num_swa_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if self.is_swa_layer(i))

    def describe(self) -> str:
        kib = self.bytes_per_token / 1024
        s = (
            f"{self.name} ({self.num_layers} layers, {self.kv_heads} KV heads x {self.head_dim}, {self.dtype}: "
            f"{kib:g} KiB/token"
        )
        if self.window is not None and self.num_swa_layers:
            s += f"; {self.num_swa_layers} sliding-window layers, window {self.window}"
            if self.sinks:
                s += f", {self.sinks} sinks"
        return s + ")"

    def validate(self) -> None:
        for what, v, lo in (
            ("--layers", self.num_layers, 1),
            ("--kv-heads", self.kv_heads, 1),
            ("--head-dim", self.head_dim, 1),
            ("--sinks", self.sinks, 0),
            ("--swa-every", self.swa_every, 0),
        ):
            if v < lo:
                raise SimUserError(f"{what} must be >= {lo}, got {v}")
        if self.dtype not in DTYPE_BYTES:
            raise SimUserError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.window is not None and self.window < 1:
            raise SimUserError(f"--window must be >= 1, got {self.window}")
        if self.sinks and self.window is None:
            raise SimUserError("--sinks needs a --window (sink tokens belong to sliding-window layers)")


PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 8, 128),
        ModelShape("llama-3-70b", 80, 8, 128),
        ModelShape("qwen2.5-7b", 28, 4, 128),
        ModelShape("qwen3-32b", 64, 8, 128),
        # gpt-oss: alternating sliding-window (128) and full-attention layers, GQA with 8 KV heads of 64
        ModelShape("gpt-oss-20b", 24, 8, 64, window=128, swa_every=2),
        ModelShape("gpt-oss-120b", 36, 8, 64, window=128, swa_every=2),
    )
}


def model_shape(
    preset: str,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    window: int | None = None,
    swa_every: int | None = None,
    sinks: int | None = None,
) -> ModelShape:
    """A preset with optional overrides (``preset="custom"`` starts from llama-3-8b's shape)."""
    if preset == "custom":
        base = replace(PRESETS["llama-3-8b"], name="custom")
    elif preset in PRESETS:
        base = PRESETS[preset]
    else:
        raise SimUserError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}, or custom")
    changes: dict[str, object] = {}
    for key, value in (
        ("num_layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("dtype", dtype),
        ("sinks", sinks),
    ):
        if value is not None:
            changes[key] = value
    if window is not None:
        changes["window"] = window if window > 0 else None  # --window 0: no sliding-window layers
        if swa_every is None and base.swa_every == 0:
            changes["swa_every"] = 2
    if swa_every is not None:
        changes["swa_every"] = swa_every
    shape = replace(base, **changes) if changes else base  # type: ignore[arg-type]
    if changes and preset != "custom":
        shape = replace(shape, name=f"{preset} (modified)")
    shape.validate()
    return shape


# ---------------------------------------------------------------------- quotas
_BYTE_UNITS = {"": GIB, "kib": 1 << 10, "mib": 1 << 20, "gib": GIB, "tib": 1 << 40}
_BYTE_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1})
_TOKEN_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_QUOTA_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z ]*?)\s*$")


@dataclass(frozen=True)
class Quota:
    """A tier size as the user gave it: bytes, or tokens (converted with the model's bytes per token)."""

    amount: float
    tokens: bool  #: True: ``amount`` counts tokens
    text: str

    def bytes_for(self, shape: ModelShape) -> int:
        if self.tokens:
            return int(self.amount) * shape.bytes_per_token
        return int(self.amount)


def parse_quota(option: str, text: str) -> Quota:
    """``16`` or ``16GiB`` (GiB), ``512MiB``, ``2GB``, or tokens: ``3Mtok``, ``300k tokens``, ``65536tok``."""
    if text.strip().startswith("-"):
        raise SimUserError(f"{option}: {text.strip()!r} is negative; give a size such as 16GiB or 3Mtok")
    m = _QUOTA_RE.match(text)
    if m is None:
        raise SimUserError(f"{option}: cannot read {text!r}; write e.g. 16GiB, 512MiB or 3Mtok (tokens)")
    number = float(m.group(1))
    unit = m.group(2).replace(" ", "").lower()
    for suffix in ("tokens", "token", "tok"):
        if unit.endswith(suffix):
            mult = _TOKEN_MULT.get(unit[: -len(suffix)])
            if mult is None:
                break
            value = number * mult
            if value < 1:
                raise SimUserError(f"{option}: {text!r} is less than one token")
            return Quota(float(int(value)), True, text.strip())
    if unit in ("k", "m", "g", "t"):
        raise SimUserError(
            f"{option}: {text!r} is ambiguous; write {m.group(1)}{unit.upper()}iB for bytes or {m.group(1)}{unit.upper()}tok for tokens"
        )
    mult = _BYTE_UNITS.get(unit)
    if mult is None:
        raise SimUserError(
            f"{option}: unknown unit {m.group(2)!r} in {text!r}; use KiB/MiB/GiB/TiB, KB/MB/GB/TB or tok"
        )
    value = number * mult
    if value < 1:
        raise SimUserError(f"{option}: {text!r} is less than one byte")
    if value > MAX_QUOTA_BYTES:
        raise SimUserError(f"{option}: {text!r} is more than the 1 EiB a tier can have")
    return Quota(float(int(value)), False, text.strip() + ("GiB" if not unit else ""))


def quota_bytes(option: str, quota: Quota, shape: ModelShape) -> int:
    """``quota`` in the model's bytes; SimUserError beyond MAX_QUOTA_BYTES (e.g. a huge token count)."""
    n = quota.bytes_for(shape)
    if n > MAX_QUOTA_BYTES:
        raise SimUserError(
            f"{option}: {quota.text!r} of {shape.name} ({format_bytes(shape.bytes_per_token)} a token) is more "
            "than the 1 EiB a tier can have"
        )
    return n


def is_token_quota(text: str) -> bool:
    """Whether a quota as the user wrote it counts tokens (``3Mtok``, ``300k tokens``)."""
    return text.replace(" ", "").lower().rstrip("s").endswith(("tok", "token"))


def _round_up(value: float) -> str:
    """``value`` rounded up to two significant digits (at least 1), as a short number."""
    if value <= 1:
        return "1"
    digits = 1 - math.floor(math.log10(value))  # decimals that keep two significant digits
    step = 10.0**-digits
    return f"{round(math.ceil(round(value / step, 6)) * step, max(digits, 0)):g}"


def format_quota(nbytes: float, shape: ModelShape, tokens: bool) -> str:
    """A quota of at least ``nbytes`` in the units the user writes: tokens (``1.3Mtok``) or bytes
    (``53GiB``, ``640MiB``), rounded up to two significant digits."""
    if tokens:
        n = math.ceil(nbytes / shape.bytes_per_token)
        for suffix, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
            if n >= size:
                return f"{_round_up(n / size)}{suffix}tok"
        return f"{_round_up(n)}tok"
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{_round_up(nbytes / size)}{unit}"
    return f"{_round_up(nbytes)}B"


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """1234 -> '1,234'; 2_500_000 -> '2.5M'."""
    a = abs(n)
    if a >= 10**9:
        return f"{n / 10**9:.3g}G"
    if a >= 10**6:
        return f"{n / 10**6:.3g}M"
    if a == int(a):
        return f"{int(n):,}"
    return f"{n:.3g}"


@dataclass(frozen=True)
class TierSpec:
    """One cache tier: ``kind`` is gpu, host or disk; ``quota`` in real bytes of the model."""

    kind: str
    quota_bytes: int
    text: str
    path: str | None = None
    persistent: bool = False  #: a disk tier kept across a restart (``--restart-at``)


def proxy_page_bytes(tokens_per_block: int, check_data: bool) -> int:
    """Bytes of one proxy buffer page: a record per token for the data checker, else 4."""
    return PROXY_RECORD_BYTES * tokens_per_block if check_data else PROXY_RECORD_BYTES


def real_bytes_per_proxy_byte(shape: ModelShape, tokens_per_block: int, page_bytes: int) -> float:
    """The scale between the proxy manager's bytes and the model's."""
    return shape.buffer_bytes_per_token * tokens_per_block / page_bytes


def manager_config(
    shape: ModelShape,
    tokens_per_block: int,
    tiers: list[TierSpec],
    swa_scratch: bool,
    page_bytes: int,
    eviction_policy: str = "lru",
) -> KVCacheManagerConfig:
    """The manager configuration of the replay: real layer structure, proxy buffers of ``page_bytes``
    per page, quotas scaled to match (so the slot counts are those of the real shape).

    Raises :class:`SimUserError` when the GPU quota cannot hold one block of every layer group.
    """
    t = tokens_per_block
    if eviction_policy not in EVICTION_POLICIES:
        raise SimUserError(
            f"unknown --eviction-policy {eviction_policy!r}; choose one of {', '.join(EVICTION_POLICIES)}"
        )
    layers = [
        AttentionLayerConfig(
            LayerId(i),
            [BufferConfig("key", page_bytes), BufferConfig("value", page_bytes)],
            sliding_window_size=shape.window if shape.is_swa_layer(i) else None,
            num_sink_tokens=shape.sinks if shape.is_swa_layer(i) and shape.sinks else None,
        )
        for i in range(shape.num_layers)
    ]
    real_page = shape.buffer_bytes_per_token * t
    gpu = tiers[0]
    # one block of every layer (both layer groups of a SWA model) is the least any request needs
    min_bytes = shape.bytes_per_token * t
    if gpu.quota_bytes < min_bytes:
        raise SimUserError(
            f"--gpu {gpu.text} cannot hold one block of {shape.name}: one block of {t} tokens takes "
            f"{format_quota(min_bytes, shape, is_token_quota(gpu.text))}; raise --gpu or lower --tokens-per-block"
        )
    for tier in tiers[1:]:  # a lower tier must hold one page of every pool group: one block of every layer
        if tier.quota_bytes < min_bytes:
            raise SimUserError(
                f"--{tier.kind} {tier.text} cannot hold one block of {shape.name}: one block of {t} tokens "
                f"takes {format_quota(min_bytes, shape, is_token_quota(tier.text))}; raise --{tier.kind}"
            )
    configs: list[CacheTierConfig] = []
    for tier in tiers:
        proxy = tier.quota_bytes * page_bytes // real_page
        if tier.kind == "gpu":
            configs.append(GpuCacheTierConfig(proxy))
        elif tier.kind == "host":
            configs.append(HostCacheTierConfig(max(proxy, 1)))
        else:
            assert tier.path is not None
            configs.append(DiskCacheTierConfig(max(proxy, 1), tier.path, persistent=tier.persistent))
    return KVCacheManagerConfig(
        tokens_per_block=t,
        cache_tiers=configs,
        layers=layers,
        swa_scratch_reuse=SwaScratchReuseConfig() if swa_scratch else None,
        backend="host",
        eviction_policy=cast(EvictionPolicy, eviction_policy),
    )
