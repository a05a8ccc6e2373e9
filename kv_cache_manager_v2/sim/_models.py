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
from typing import Any

from mypy_extensions import mypyc_attr

from .._common import LayerId
from .._config import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    LayerConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)

#: bytes of a proxy buffer page per token with --check-data (one uint32 record per token), else per page
PROXY_RECORD_BYTES = 4
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
GIB = 1 << 30
#: the largest tier quota the simulator takes (1 EiB; the proxy pools are far smaller, but the
#: arithmetic and the messages stay sane)
MAX_QUOTA_BYTES = 1 << 60
#: the largest bare-number quota (GiB): a bigger one is more likely a missing unit than a real tier
MAX_BARE_GIB = 1024
#: bounds of a model's shape (the largest published models are far below them): the manager
#: builds one layer config per layer, so an absurd count would only exhaust memory
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 16384
#: a sliding window or sink count is a number of token positions (32-bit)
MAX_WINDOW = 1 << 31

#: the tiers --sweep can vary, in their order
SWEEP_KEYS = ("gpu", "host", "disk")
#: the --sweep key over the snapshot interval of a hybrid model, and its two special values
SSM_SWEEP_KEY = "ssm-interval"
#: snapshots at prompt ends only (an interval longer than any request)
SSM_PROMPT_ONLY = "prompt"
#: the attention layers alone: the hit rate a snapshot at every block would allow
SSM_KV_ONLY = "kv"


@mypyc_attr(native_class=False)
class SimUserError(ValueError):
    """A mistake in the simulator's input (options, trace, model/quota combination): one line, exit code 2."""


@dataclass(frozen=True)
class ModelShape:
    """The shape that decides cache memory. Every attention layer holds a key and a value buffer of
    ``kv_heads * head_dim`` elements per token; attention layers ``i % swa_every == 0`` (when
    ``window``) slide. A hybrid model also has recurrent layers (Mamba / gated delta-net): each holds
    one fixed-size state per request, ``conv_state_elems + ssm_state_elems`` elements of ``state_dtype``.

    ``attention_layers`` (None: ``0 .. num_layers-1``) and ``recurrent_layers`` are the model's layer
    numbers. A layer in both (Falcon-H1's parallel attention + Mamba2) is two layers for the manager:
    its attention keeps layer id ``i``, its recurrence gets ``num_layers + i``.
    """

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    window: int | None = None  #: sliding-window size of the SWA layers (None: all layers full attention)
    swa_every: int = 0  #: layer i is a sliding-window layer when window and i % swa_every == 0
    sinks: int = 0  #: sink tokens the sliding-window layers keep
    attention_layers: tuple[int, ...] | None = None  #: layers with KV (None: every layer)
    recurrent_layers: tuple[int, ...] = ()  #: layers with a recurrent state
    conv_state_elems: int = 0  #: elements of one recurrent layer's conv_state (per request)
    ssm_state_elems: int = 0  #: elements of one recurrent layer's ssm_state (per request)
    state_dtype: str = "bf16"  #: dtype of the recurrent states

    @property
    def kv_layers(self) -> list[int]:
        """The layers that hold KV."""
        if self.attention_layers is None:
            return list(range(self.num_layers))
        return list(self.attention_layers)

    @property
    def buffer_bytes_per_token(self) -> int:
        """Bytes of one layer's key (or value) buffer per token."""
        return self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all attention layers (key + value), as if every layer kept it."""
        return 2 * len(self.kv_layers) * self.buffer_bytes_per_token

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def conv_state_bytes(self) -> int:
        """Bytes of one recurrent layer's conv_state (one request)."""
        return self.conv_state_elems * DTYPE_BYTES[self.state_dtype]

    @property
    def ssm_state_bytes(self) -> int:
        """Bytes of one recurrent layer's ssm_state (one request)."""
        return self.ssm_state_elems * DTYPE_BYTES[self.state_dtype]

    @property
    def state_bytes_per_request(self) -> int:
        """Recurrent state bytes of one request (one beam) across all recurrent layers."""
        return len(self.recurrent_layers) * (self.conv_state_bytes + self.ssm_state_bytes)

    def recurrent_layer_id(self, layer: int) -> int:
        """The manager's layer id of recurrent layer ``layer`` (see the class doc)."""
        return self.num_layers + layer if layer in self.kv_layers else layer

    def is_swa_layer(self, i: int) -> bool:
        return self.window is not None and self.swa_every > 0 and i % self.swa_every == 0

    @property
    def num_swa_layers(self) -> int:
        return sum(1 for i in self.kv_layers if self.is_swa_layer(i))

    def describe(self) -> str:
        kib = self.bytes_per_token / 1024
        n = len(self.kv_layers)
        layers = f"{n} layers" if not self.is_hybrid else f"{n} attention layers"
        s = f"{self.name} ({layers}, {self.kv_heads} KV heads x {self.head_dim}, {self.dtype}: {kib:g} KiB/token"
        if self.window is not None and self.num_swa_layers:
            s += f"; {self.num_swa_layers} sliding-window layers, window {self.window}"
            if self.sinks:
                s += f", {self.sinks} sinks"
        if self.is_hybrid:
            s += (
                f"; {len(self.recurrent_layers)} recurrent layers, {self.state_dtype} state "
                f"{format_bytes(self.state_bytes_per_request)}/request"
            )
        return s + ")"

    def validate(self) -> None:
        for what, v, lo, hi in (
            ("--layers", self.num_layers, 1, MAX_LAYERS),
            ("--kv-heads", self.kv_heads, 1, MAX_KV_HEADS),
            ("--head-dim", self.head_dim, 1, MAX_HEAD_DIM),
            ("--sinks", self.sinks, 0, MAX_WINDOW),
            ("--swa-every", self.swa_every, 0, MAX_LAYERS),
        ):
            if v < lo:
                raise SimUserError(f"{what} must be >= {lo}, got {v}")
            if v > hi:
                raise SimUserError(f"{what} must be at most {hi:,}, got {v:,}")
        for what, dt in (("--dtype", self.dtype), ("--state-dtype", self.state_dtype)):
            if dt not in DTYPE_BYTES:
                raise SimUserError(f"unknown {what} {dt!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.window is not None and not 1 <= self.window <= MAX_WINDOW:
            raise SimUserError(f"--window must be in [1, {MAX_WINDOW:,}], got {self.window:,}")
        if self.sinks and self.window is None:
            raise SimUserError("--sinks needs a --window (sink tokens belong to sliding-window layers)")
        if any(not 0 <= i < self.num_layers for i in (*self.kv_layers, *self.recurrent_layers)):
            raise SimUserError(
                f"--layers {self.num_layers}: {self.name} has layers up to "
                f"{max((*self.kv_layers, *self.recurrent_layers))}; a hybrid preset keeps its layer count"
            )
        if not self.kv_layers:
            raise SimUserError(f"{self.name} has no attention layer; the simulator needs at least one")


# ---------------------------------------------------------------------- hybrid presets
# Recurrent state per layer and request, in elements (conv_state keeps the last d_conv - 1 inputs
# of every convolved channel, as vLLM and SGLang store it):
def mamba1_state(d_inner: int, d_state: int, d_conv: int) -> tuple[int, int]:
    """Mamba (v1): conv_state = (d_conv - 1) x d_inner, ssm_state = d_inner x d_state."""
    return (d_conv - 1) * d_inner, d_inner * d_state


def mamba2_state(heads: int, head_dim: int, d_state: int, n_groups: int, d_conv: int) -> tuple[int, int]:
    """Mamba2: the convolution runs over x, B and C, so conv_state = (d_conv - 1) x (heads * head_dim
    + 2 * n_groups * d_state); ssm_state = heads x head_dim x d_state."""
    return (d_conv - 1) * (heads * head_dim + 2 * n_groups * d_state), heads * head_dim * d_state


def gated_delta_net_state(k_heads: int, k_head_dim: int, v_heads: int, v_head_dim: int, d_conv: int) -> tuple[int, int]:
    """Gated delta-net: the convolution runs over q, k and v, so conv_state = (d_conv - 1) x
    (2 * k_heads * k_head_dim + v_heads * v_head_dim); ssm_state (the delta-rule matrix) =
    v_heads x k_head_dim x v_head_dim."""
    return (d_conv - 1) * (2 * k_heads * k_head_dim + v_heads * v_head_dim), v_heads * k_head_dim * v_head_dim


def qwen3_next_80b_a3b() -> ModelShape:
    """Qwen/Qwen3-Next-80B-A3B (config.json): ``num_hidden_layers`` 48, ``full_attention_interval`` 4
    (layers 3, 7, .., 47 attend: 12; the other 36 are gated delta-nets), ``num_key_value_heads`` 2,
    ``head_dim`` 256; ``linear_num_key_heads`` 16, ``linear_key_head_dim`` 128,
    ``linear_num_value_heads`` 32, ``linear_value_head_dim`` 128, ``linear_conv_kernel_dim`` 4;
    ``torch_dtype`` bfloat16. Per recurrent layer: conv 3 x 8192, ssm 32 x 128 x 128."""
    conv, ssm = gated_delta_net_state(16, 128, 32, 128, 4)
    attn = tuple(i for i in range(48) if (i + 1) % 4 == 0)
    rec = tuple(i for i in range(48) if i not in attn)
    return ModelShape("qwen3-next-80b-a3b", 48, 2, 256, attention_layers=attn, recurrent_layers=rec,
                      conv_state_elems=conv, ssm_state_elems=ssm)  # fmt: skip


def nemotron_h_8b() -> ModelShape:
    """nvidia/Nemotron-H-8B-Base-8K (config.json): ``hybrid_override_pattern``
    ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` (52 layers: 24 Mamba2 ``M``, 4 attention
    ``*`` at 7, 18, 29, 40, 24 MLP ``-``), ``num_key_value_heads`` 8, ``head_dim`` 128;
    ``mamba_num_heads`` 128, ``mamba_head_dim`` 64, ``ssm_state_size`` 128, ``n_groups`` 8,
    ``conv_kernel`` 4; ``torch_dtype`` bfloat16. Per Mamba2 layer: conv 3 x 10240, ssm 128 x 64 x 128."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    conv, ssm = mamba2_state(128, 64, 128, 8, 4)
    attn = tuple(i for i, c in enumerate(pattern) if c == "*")
    rec = tuple(i for i, c in enumerate(pattern) if c == "M")
    return ModelShape("nemotron-h-8b", len(pattern), 8, 128, attention_layers=attn, recurrent_layers=rec,
                      conv_state_elems=conv, ssm_state_elems=ssm)  # fmt: skip


def jamba_v0_1() -> ModelShape:
    """ai21labs/Jamba-v0.1 (config.json): ``num_hidden_layers`` 32, ``attn_layer_period`` 8,
    ``attn_layer_offset`` 4 (layers 4, 12, 20, 28 attend; the other 28 are Mamba),
    ``num_key_value_heads`` 8, head dim ``hidden_size`` 4096 / ``num_attention_heads`` 32 = 128;
    ``mamba_expand`` 2 (d_inner 8192), ``mamba_d_state`` 16, ``mamba_d_conv`` 4; ``torch_dtype``
    bfloat16. Per Mamba layer: conv 3 x 8192, ssm 8192 x 16."""
    conv, ssm = mamba1_state(2 * 4096, 16, 4)
    attn = tuple(range(4, 32, 8))
    rec = tuple(i for i in range(32) if i not in attn)
    return ModelShape("jamba-v0.1", 32, 8, 128, attention_layers=attn, recurrent_layers=rec,
                      conv_state_elems=conv, ssm_state_elems=ssm)  # fmt: skip


def falcon_h1_7b() -> ModelShape:
    """tiiuae/Falcon-H1-7B (config.json): ``num_hidden_layers`` 44, every layer runs attention and
    Mamba2 side by side; ``num_key_value_heads`` 2, ``head_dim`` 128; ``mamba_n_heads`` 24,
    ``mamba_d_head`` 128 (``mamba_d_ssm`` 3072), ``mamba_d_state`` 256, ``mamba_n_groups`` 1,
    ``mamba_d_conv`` 4; ``torch_dtype`` bfloat16. Per Mamba2 layer: conv 3 x 3584, ssm 24 x 128 x 256.
    The manager sees 88 layers: attention ids 0..43, recurrent ids 44..87."""
    conv, ssm = mamba2_state(24, 128, 256, 1, 4)
    every = tuple(range(44))
    return ModelShape("falcon-h1-7b", 44, 2, 128, attention_layers=every, recurrent_layers=every,
                      conv_state_elems=conv, ssm_state_elems=ssm)  # fmt: skip


def granite_4_0_h_small() -> ModelShape:
    """ibm-granite/granite-4.0-h-small (config.json): ``num_hidden_layers`` 40, ``layer_types``
    ``attention`` at 5, 15, 25, 35 and ``mamba`` elsewhere (36), ``num_key_value_heads`` 8, head dim
    ``hidden_size`` 4096 / ``num_attention_heads`` 32 = 128; ``mamba_n_heads`` 128, ``mamba_d_head``
    64, ``mamba_d_state`` 128, ``mamba_n_groups`` 1, ``mamba_d_conv`` 4; ``torch_dtype`` bfloat16.
    Per Mamba2 layer: conv 3 x 8448, ssm 128 x 64 x 128."""
    conv, ssm = mamba2_state(128, 64, 128, 1, 4)
    attn = (5, 15, 25, 35)
    rec = tuple(i for i in range(40) if i not in attn)
    return ModelShape("granite-4.0-h-small", 40, 8, 128, attention_layers=attn, recurrent_layers=rec,
                      conv_state_elems=conv, ssm_state_elems=ssm)  # fmt: skip


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
        # hybrids: attention + recurrent layers (docstrings: the published config fields and formulas)
        qwen3_next_80b_a3b(),
        nemotron_h_8b(),
        jamba_v0_1(),
        falcon_h1_7b(),
        granite_4_0_h_small(),
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
    state_dtype: str | None = None,
) -> ModelShape:
    """A preset with optional overrides (``preset="custom"``: ``layers``, ``kv_heads`` and ``head_dim``
    given, the rest as llama-3-8b)."""
    if preset == "custom":
        missing = [
            f for f, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)) if v is None
        ]
        if missing:
            raise SimUserError(f"--model custom needs its shape: give {', '.join(missing)} (or choose a preset)")
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
        ("state_dtype", state_dtype),
    ):
        if value is not None:
            changes[key] = value
    if window is not None:
        if window < 0:
            raise SimUserError(f"--window must be >= 0 (0: no sliding-window layers), got {window}")
        changes["window"] = window if window > 0 else None  # --window 0: no sliding-window layers
        if swa_every is None and base.swa_every == 0:
            changes["swa_every"] = 2
    if swa_every is not None:
        if swa_every < 1:
            raise SimUserError(f"--swa-every must be >= 1 (1: every layer slides), got {swa_every}")
        if changes.get("window", base.window) is None:
            raise SimUserError(f"--swa-every: {base.name} has no sliding window; give --window too")
        changes["swa_every"] = swa_every
    if state_dtype is not None and not base.is_hybrid:
        raise SimUserError(f"--state-dtype: {base.name} has no recurrent layers (choose a hybrid preset)")
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
    if not unit and number > MAX_BARE_GIB:
        raise SimUserError(
            f"{option}: {text.strip()!r} is {format_bytes(value)} (a bare number is GiB); write the unit "
            f"(e.g. {m.group(1)}MiB or {m.group(1)}tok), or up to {MAX_BARE_GIB} for GiB"
        )
    return Quota(float(int(value)), False, text.strip() + ("GiB" if not unit else ""))


def swept_tier(rep: dict[str, Any], key: str) -> dict[str, Any]:
    """The tier row of ``key`` (gpu, host, disk) in a quota sweep's report; a point without that
    tier (``--sweep host=0,...``): quota "0", no capacity."""
    for tier in rep["tiers"]:
        if tier["tier"] == key:
            return dict(tier)
    return {"tier": key, "quota": "0", "capacity_tokens": 0, "peak_occupied_fraction": 0.0}


def is_zero_quota(text: str) -> bool:
    """``0`` (a bare zero): in ``--sweep host=`` or ``disk=``, a point without that tier."""
    m = _QUOTA_RE.match(text)
    return m is not None and not m.group(2) and float(m.group(1)) == 0.0


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


def proxy_page_bytes(tokens_per_block: int, check_data: bool, shape: ModelShape | None = None) -> int:
    """Bytes of one proxy buffer page: a record per token for the data checker, else 4. For a hybrid
    ``shape`` the least multiple of that large enough that every recurrent state buffer
    scales to a whole number of proxy bytes (see ``proxy_state_bytes``)."""
    page = PROXY_RECORD_BYTES * tokens_per_block if check_data else PROXY_RECORD_BYTES
    if shape is None or not shape.is_hybrid:
        return page
    real_page = shape.buffer_bytes_per_token * tokens_per_block
    g = math.gcd(real_page, shape.conv_state_bytes, shape.ssm_state_bytes)
    return math.lcm(page, real_page // g)


def proxy_state_bytes(shape: ModelShape, tokens_per_block: int, page_bytes: int, real_bytes: int) -> int:
    """A recurrent state buffer of ``real_bytes`` scaled like the KV pages (exact with the page
    bytes of ``proxy_page_bytes``, rounded up otherwise)."""
    real_page = shape.buffer_bytes_per_token * tokens_per_block
    return max(1, -(-real_bytes * page_bytes // real_page))


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
    ssm_reuse_interval: int | None = None,
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
    layers: list[LayerConfig] = [
        AttentionLayerConfig(
            LayerId(i),
            [BufferConfig("key", page_bytes), BufferConfig("value", page_bytes)],
            sliding_window_size=shape.window if shape.is_swa_layer(i) else None,
            num_sink_tokens=shape.sinks if shape.is_swa_layer(i) and shape.sinks else None,
        )
        for i in shape.kv_layers
    ]
    state = [
        BufferConfig(role, proxy_state_bytes(shape, t, page_bytes, real))
        for role, real in (("conv_state", shape.conv_state_bytes), ("ssm_state", shape.ssm_state_bytes))
    ]
    layers += [SsmLayerConfig(LayerId(shape.recurrent_layer_id(i)), state) for i in shape.recurrent_layers]
    real_page = shape.buffer_bytes_per_token * t
    gpu = tiers[0]
    # one block of every layer (both layer groups of a SWA model) and one live state per recurrent
    # layer is the least any request needs
    min_bytes = shape.bytes_per_token * t + shape.state_bytes_per_request
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
        eviction_policy=eviction_policy,
        ssm_reuse_interval=ssm_reuse_interval if shape.is_hybrid else None,
        load_workers=0,  # deterministic: the simulator's own clock models load time (no worker threads)
    )
