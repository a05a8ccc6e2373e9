"""A tiny decoder-only model in numpy: random weights from a seed, GQA, RoPE, some
sliding-window layers (optionally with sink tokens), and optionally recurrent layers (a
Mamba2-like state-space layer) alone or side by side with attention. float64 throughout.

Layer kinds (``LayerSpec.kind``):

* ``"attention"``: softmax attention, full or sliding window with sink tokens; per-token K/V.
* ``"recurrent"``: a short causal depthwise convolution then a gated linear recurrence with a
  per-head scalar decay (Mamba2-like). No per-token K/V: a sequence carries one fixed-size
  ``RecurrentState`` per layer (``conv_state``: the last ``conv_width - 1`` conv inputs;
  ``ssm_state``: ``[heads, head_dim, state_dim]``).
* ``"parallel"``: attention and the recurrence read the same normalized input and their
  outputs are summed (Falcon-H1 style); the layer has K/V and a recurrent state.

The same math serves the paged engine (``engine.py``: K/V live in the manager's pages; attention
only), the incremental hybrid runner (``hybrid.py``: explicit per-sequence state) and the dense
reference (``dense_logits``: recomputes every K/V, the whole attention and the whole recurrence,
in its quadratic closed form, from scratch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

import kv_cache_manager_v2 as kvm

Array = Any  # numpy arrays (kept loose: this is example code)


LAYER_KINDS = ("attention", "recurrent", "parallel")


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its kind (see the module docstring) and, where it attends, its attention shape:
    full (window None) or sliding window with sink tokens."""

    window: int | None = None
    sink_tokens: int = 0
    kind: str = "attention"

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer kind {self.kind!r} is not one of {LAYER_KINDS}")
        if self.kind == "recurrent" and (self.window is not None or self.sink_tokens):
            raise ValueError("a recurrent layer has no attention window or sink tokens")

    @property
    def has_attention(self) -> bool:
        return self.kind != "recurrent"

    @property
    def has_recurrence(self) -> bool:
        return self.kind != "attention"


@dataclass(frozen=True)
class RecurrentShape:
    """Shape of a Mamba2-like recurrent layer: ``num_heads`` heads of ``head_dim`` channels, each
    with a ``state_dim``-wide state per channel; B and C are shared by the heads of one of
    ``num_groups`` groups; a causal depthwise convolution of width ``conv_width`` over x, B and C."""

    num_heads: int = 4
    head_dim: int = 8
    state_dim: int = 6
    num_groups: int = 2
    conv_width: int = 4

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_dim", "num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.conv_width < 2:
            raise ValueError(f"conv_width must be >= 2 (a width-1 convolution keeps no state), got {self.conv_width}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_groups {self.num_groups}")

    @property
    def inner_dim(self) -> int:
        """Channels of x (and of the gate z): ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: x, then B and C of every group."""
        return self.inner_dim + 2 * self.num_groups * self.state_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_width - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_dim)

    def state_bytes(self, conv_dtype_bytes: int = 8, ssm_dtype_bytes: int = 8) -> dict[str, int]:
        """Bytes of each state buffer of one layer for one sequence (``conv_state``, ``ssm_state``)."""
        return mamba2_state_bytes(
            self.num_heads,
            self.head_dim,
            self.state_dim,
            self.num_groups,
            self.conv_width,
            conv_dtype_bytes=conv_dtype_bytes,
            ssm_dtype_bytes=ssm_dtype_bytes,
        )


# ---------------------------------------------------------------- state sizes
# Bytes per layer per buffer of one sequence's recurrent state, for the three layer families the
# published hybrids use. A recurrent layer's state does not grow with the sequence: these are the
# sizes of the manager's live slots and snapshots. The conv state usually has the model's dtype;
# engines often keep the ssm state in float32 for accuracy.


def conv_state_bytes(conv_dim: int, conv_width: int, dtype_bytes: int) -> int:
    """A causal depthwise convolution of width ``conv_width`` keeps its last ``conv_width - 1`` inputs."""
    return (conv_width - 1) * conv_dim * dtype_bytes


def mamba1_state_bytes(
    inner_dim: int, state_dim: int, conv_width: int, *, conv_dtype_bytes: int, ssm_dtype_bytes: int
) -> dict[str, int]:
    """Mamba (Jamba): the convolution runs over x only; every channel has its own ``state_dim`` state."""
    return {
        "conv_state": conv_state_bytes(inner_dim, conv_width, conv_dtype_bytes),
        "ssm_state": inner_dim * state_dim * ssm_dtype_bytes,
    }


def mamba2_state_bytes(
    num_heads: int,
    head_dim: int,
    state_dim: int,
    num_groups: int,
    conv_width: int,
    *,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int,
) -> dict[str, int]:
    """Mamba2 (Nemotron-H, Granite-4.0-H, Falcon-H1, this model): the convolution runs over x, B and
    C (``heads * head_dim + 2 * groups * state_dim`` channels); the state is ``[heads, head_dim, state_dim]``."""
    return {
        "conv_state": conv_state_bytes(num_heads * head_dim + 2 * num_groups * state_dim, conv_width, conv_dtype_bytes),
        "ssm_state": num_heads * head_dim * state_dim * ssm_dtype_bytes,
    }


def gated_delta_net_state_bytes(
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    conv_width: int,
    *,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int,
) -> dict[str, int]:
    """Gated delta-net (Qwen3-Next's linear attention): the convolution runs over q, k and v; the state is
    one ``key_head_dim x value_head_dim`` matrix per value head."""
    conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
    return {
        "conv_state": conv_state_bytes(conv_dim, conv_width, conv_dtype_bytes),
        "ssm_state": num_value_heads * key_head_dim * value_head_dim * ssm_dtype_bytes,
    }


def _default_layers() -> tuple[LayerSpec, ...]:
    return (LayerSpec(), LayerSpec(window=12), LayerSpec(), LayerSpec(window=10, sink_tokens=3))


def hybrid_layers(groups: int = 2, recurrent_per_attention: int = 3) -> tuple[LayerSpec, ...]:
    """Interleaved hybrid (Jamba / Nemotron-H / Qwen3-Next style): ``recurrent_per_attention`` recurrent
    layers then one attention layer, ``groups`` times; every other attention layer is a sliding window
    with sink tokens."""
    layers: list[LayerSpec] = []
    for g in range(groups):
        layers += [LayerSpec(kind="recurrent")] * recurrent_per_attention
        layers.append(LayerSpec(window=10, sink_tokens=3) if g % 2 else LayerSpec())
    return tuple(layers)


def parallel_layers() -> tuple[LayerSpec, ...]:
    """Attention and recurrence side by side in every layer (Falcon-H1 style), one layer recurrent only."""
    return (
        LayerSpec(kind="parallel"),
        LayerSpec(window=12, kind="parallel"),
        LayerSpec(kind="recurrent"),
        LayerSpec(kind="parallel"),
    )


class RecurrentState(NamedTuple):
    """One sequence's state of one recurrent layer (fixed shapes: see ``RecurrentShape``)."""

    conv_state: Array  #: ``[conv_width - 1, conv_dim]``: the last conv inputs, oldest first (zeros before the start)
    ssm_state: Array  #: ``[num_heads, head_dim, state_dim]``


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 97
    d_model: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    d_ff: int = 64
    layers: tuple[LayerSpec, ...] = field(default_factory=_default_layers)
    tokens_per_block: int = 4
    seed: int = 0
    rope_base: float = 10_000.0
    recurrent: RecurrentShape = field(default_factory=RecurrentShape)  #: shape of every recurrent layer

    @property
    def recurrent_layers(self) -> list[int]:
        """Indices of the layers with a recurrent state (``"recurrent"`` and ``"parallel"``)."""
        return [i for i, spec in enumerate(self.layers) if spec.has_recurrence]

    def recurrent_state_bytes(self) -> dict[str, int]:
        """Bytes of each recurrent state buffer of one layer for one sequence (float64)."""
        return self.recurrent.state_bytes(8, 8)

    @property
    def kv_page_shape(self) -> tuple[int, int, int]:
        """One K (or V) page: ``tokens_per_block`` tokens of ``num_kv_heads x head_dim`` float64."""
        return (self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def kv_page_bytes(self) -> int:
        t, h, d = self.kv_page_shape
        return t * h * d * 8

    def state_layer_id(self, layer: int) -> int:
        """The manager's layer id of layer ``layer``'s recurrent state: the layer's own id, or for a
        ``"parallel"`` layer (whose attention keeps that id) ``len(layers) + layer``."""
        if not self.layers[layer].has_recurrence:
            raise ValueError(f"layer {layer} has no recurrent state")
        return len(self.layers) + layer if self.layers[layer].has_attention else layer

    def layer_configs(self) -> list[kvm.AttentionLayerConfig | kvm.SsmLayerConfig]:
        """The manager's view of the model: per attention layer a key and a value buffer, windows as
        configured; per recurrent state (its id: ``state_layer_id``) a ``conv_state`` and an
        ``ssm_state`` buffer of one sequence's state."""
        out: list[kvm.AttentionLayerConfig | kvm.SsmLayerConfig] = [
            kvm.AttentionLayerConfig(
                kvm.LayerId(i),
                [kvm.BufferConfig("key", self.kv_page_bytes), kvm.BufferConfig("value", self.kv_page_bytes)],
                sliding_window_size=spec.window,
                num_sink_tokens=spec.sink_tokens if spec.window is not None and spec.sink_tokens else None,
            )
            for i, spec in enumerate(self.layers)
            if spec.has_attention
        ]
        state = self.recurrent_state_bytes()
        out += [
            kvm.SsmLayerConfig(
                kvm.LayerId(self.state_layer_id(i)),
                [kvm.BufferConfig(role, size) for role, size in state.items()],
            )
            for i in self.recurrent_layers
        ]
        return out


def attention_mask(spec: LayerSpec, q_pos: Array, k_pos: Array) -> Array:
    """Which keys each query attends to: causal, and within the window or a sink token."""
    q = q_pos[:, None]
    k = k_pos[None, :]
    allowed = k <= q
    if spec.window is not None:
        allowed &= (k > q - spec.window) | (k < spec.sink_tokens)
    return allowed


class TinyModel:
    """Weights and the per-layer math; no KV storage of its own."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        d, h, kvh, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def w(*shape: int) -> Array:
            return rng.standard_normal(shape) / np.sqrt(shape[0])

        self.embedding = rng.standard_normal((cfg.vocab_size, d))
        rs = cfg.recurrent
        self.layers: list[dict[str, Array]] = []
        # weights are drawn in a fixed order per layer kind, so an attention-only model's weights do
        # not depend on whether the recurrent kind exists
        for spec in cfg.layers:
            p: dict[str, Array] = {"norm1": 1.0 + 0.1 * rng.standard_normal(d)}
            if spec.has_attention:
                p["wq"] = w(d, h * hd)
                p["wk"] = w(d, kvh * hd)
                p["wv"] = w(d, kvh * hd)
                p["wo"] = w(h * hd, d)
            if spec.has_recurrence:
                p["w_z"] = w(d, rs.inner_dim)  # the gate
                p["w_xbc"] = w(d, rs.conv_dim)  # x, B, C (before the convolution)
                p["w_dt"] = w(d, rs.num_heads)
                p["conv_w"] = rng.standard_normal((rs.conv_width, rs.conv_dim)) / np.sqrt(rs.conv_width)
                p["conv_b"] = 0.1 * rng.standard_normal(rs.conv_dim)
                p["dt_bias"] = rng.uniform(-2.0, 0.0, rs.num_heads)
                # decay rates from slow (0.02: the state remembers ~100 tokens) to fast (1)
                p["a"] = -np.exp(rng.uniform(np.log(0.02), 0.0, rs.num_heads))
                p["d_skip"] = rng.uniform(0.5, 1.5, rs.num_heads)
                p["norm_y"] = 1.0 + 0.1 * rng.standard_normal(rs.inner_dim)
                p["w_out"] = w(rs.inner_dim, d)
            p["norm2"] = 1.0 + 0.1 * rng.standard_normal(d)
            p["w1"] = w(d, cfg.d_ff)
            p["w2"] = w(cfg.d_ff, d)
            self.layers.append(p)
        self.final_norm = 1.0 + 0.1 * rng.standard_normal(d)
        self.lm_head = w(d, cfg.vocab_size)
        self.inv_freq = cfg.rope_base ** (-np.arange(0, hd // 2) * 2.0 / hd)

    # ---------------------------------------------------------------- pieces
    def embed(self, tokens: Sequence[kvm.TokenIdExt]) -> Array:
        ids = [t for t in tokens if not isinstance(t, bytes)]
        if len(ids) != len(tokens):
            raise ValueError("the tiny model embeds plain token ids only (no bytes digests)")
        return self.embedding[np.asarray(ids, dtype=np.int64)]

    @staticmethod
    def _rms(x: Array, g: Array) -> Array:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def _rope(self, x: Array, pos: Array) -> Array:
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def qkv(self, layer: int, x: Array, pos: Array) -> tuple[Array, Array, Array]:
        """Queries ``[n, H, hd]`` and this step's keys/values ``[n, KVH, hd]`` (keys rotated)."""
        c, p = self.cfg, self.layers[layer]
        hx = self._rms(x, p["norm1"])
        q = (hx @ p["wq"]).reshape(-1, c.num_heads, c.head_dim)
        k = (hx @ p["wk"]).reshape(-1, c.num_kv_heads, c.head_dim)
        v = (hx @ p["wv"]).reshape(-1, c.num_kv_heads, c.head_dim)
        return self._rope(q, pos), self._rope(k, pos), v

    def attend(self, layer: int, q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array) -> Array:
        """Softmax attention of ``q`` over the given keys/values (GQA), masked per the layer's shape."""
        c = self.cfg
        group = c.num_heads // c.num_kv_heads
        kk = np.repeat(k, group, axis=1)  # [m, H, hd]
        vv = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(c.head_dim)
        mask = attention_mask(c.layers[layer], q_pos, k_pos)
        scores = np.where(mask[None, :, :], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", probs, vv).reshape(q.shape[0], -1)

    # ---------------------------------------------------------------- the recurrent layer
    def initial_state(self) -> RecurrentState:
        """A recurrent layer's state before the first token (zeros)."""
        rs = self.cfg.recurrent
        return RecurrentState(np.zeros(rs.conv_state_shape), np.zeros(rs.ssm_state_shape))

    def _recurrent_inputs(self, layer: int, x: Array) -> tuple[Array, Array, Array]:
        """Per token: the gate z ``[n, inner]``, the conv input ``[n, conv_dim]`` and dt ``[n, H]``."""
        p = self.layers[layer]
        hx = self._rms(x, p["norm1"])
        dt_raw = hx @ p["w_dt"] + p["dt_bias"]
        dt = np.logaddexp(0.0, dt_raw)  # softplus, without overflow
        return hx @ p["w_z"], hx @ p["w_xbc"], dt

    def _conv(self, layer: int, window: Array, n: int) -> Array:
        """Causal depthwise convolution of the last ``n`` rows of ``window`` (which holds ``conv_width
        - 1`` rows of history before them), then SiLU; split into x ``[n, H, P]``, B and C ``[n, G, N]``."""
        rs, p = self.cfg.recurrent, self.layers[layer]
        width = rs.conv_width
        out = np.broadcast_to(p["conv_b"], (n, rs.conv_dim)).copy()
        for k in range(width):
            out += window[k : k + n] * p["conv_w"][k]
        out = out / (1.0 + np.exp(-out))
        g, ns = rs.num_groups, rs.state_dim
        xs = out[:, : rs.inner_dim].reshape(n, rs.num_heads, rs.head_dim)
        b = out[:, rs.inner_dim : rs.inner_dim + g * ns].reshape(n, g, ns)
        c = out[:, rs.inner_dim + g * ns :].reshape(n, g, ns)
        return xs, b, c

    def _recurrent_output(self, layer: int, y: Array, z: Array) -> Array:
        """Gate ``y`` ``[n, H, P]`` with SiLU(z), normalize, project back to the model width."""
        p = self.layers[layer]
        y = y.reshape(y.shape[0], -1) * (z / (1.0 + np.exp(-z)))
        return self._rms(y, p["norm_y"]) @ p["w_out"]

    def recurrent(self, layer: int, x: Array, state: RecurrentState) -> tuple[Array, RecurrentState]:
        """The recurrent mixer over the next ``n`` tokens ``x`` ``[n, d]`` of a sequence whose layer state is
        ``state`` (left untouched): its output ``[n, d]`` and the state after the last of the tokens.

        Per head h, with ``a_t = exp(dt_t * A_h)``: ``S_t = a_t S_{t-1} + dt_t x_t B_t^T`` (``[P, N]``) and
        ``y_t = S_t C_t + D_h x_t``."""
        rs, p = self.cfg.recurrent, self.layers[layer]
        if state.conv_state.shape != rs.conv_state_shape or state.ssm_state.shape != rs.ssm_state_shape:
            raise ValueError(
                f"layer {layer}: state shapes {state.conv_state.shape}, {state.ssm_state.shape} are not "
                f"{rs.conv_state_shape}, {rs.ssm_state_shape}"
            )
        n = x.shape[0]
        z, xbc, dt = self._recurrent_inputs(layer, x)
        window = np.concatenate([state.conv_state, xbc])
        xs, b, c = self._conv(layer, window, n)
        heads_per_group = rs.num_heads // rs.num_groups
        b = np.repeat(b, heads_per_group, axis=1)  # [n, H, N]
        c = np.repeat(c, heads_per_group, axis=1)
        decay = np.exp(dt * p["a"])  # [n, H]
        s = state.ssm_state.copy()
        y = np.empty_like(xs)
        for t in range(n):
            s = decay[t][:, None, None] * s + (dt[t][:, None] * xs[t])[:, :, None] * b[t][:, None, :]
            y[t] = np.einsum("hpn,hn->hp", s, c[t]) + p["d_skip"][:, None] * xs[t]
        new_state = RecurrentState(window[window.shape[0] - (rs.conv_width - 1) :].copy(), s)
        return self._recurrent_output(layer, y, z), new_state

    def dense_recurrent(self, layer: int, x: Array) -> tuple[Array, RecurrentState]:
        """The recurrent mixer over a whole sequence ``x`` from the start, in the quadratic closed form
        ``y_t = sum_{s<=t} (prod_{s<r<=t} a_r) (C_t . B_s) dt_s x_s + D x_t`` (no state carried from
        token to token), and the state after the last token, ``S_T = sum_s (prod_{s<r<=T} a_r) dt_s x_s B_s^T``."""
        rs, p = self.cfg.recurrent, self.layers[layer]
        n = x.shape[0]
        z, xbc, dt = self._recurrent_inputs(layer, x)
        window = np.concatenate([np.zeros(rs.conv_state_shape), xbc])
        xs, b, c = self._conv(layer, window, n)
        heads_per_group = rs.num_heads // rs.num_groups
        b = np.repeat(b, heads_per_group, axis=1)  # [n, H, N]
        c = np.repeat(c, heads_per_group, axis=1)
        log_decay = dt * p["a"]  # [n, H]
        # seg[h, t, s] = sum of log_decay[r] over s < r <= t, summed along t so every entry is exact
        after = np.arange(n)[:, None] > np.arange(n)[None, :]  # [r, s]: r > s
        seg = np.cumsum(np.where(after[None], log_decay.T[:, :, None], 0.0), axis=1)  # [H, t, s]
        causal = np.tril(np.ones((n, n), dtype=bool))
        weights = np.where(causal[None], np.exp(seg), 0.0) * np.einsum("thn,shn->hts", c, b)
        y = np.einsum("hts,sh,shp->thp", weights, dt, xs) + p["d_skip"][None, :, None] * xs
        last = np.exp(seg[:, n - 1, :]) if n else np.zeros((rs.num_heads, 0))  # [H, s]
        ssm = np.einsum("hs,sh,shp,shn->hpn", last, dt, xs, b)
        conv = window[window.shape[0] - (rs.conv_width - 1) :].copy()
        return self._recurrent_output(layer, y, z), RecurrentState(conv, ssm)

    def finish_layer(self, layer: int, x: Array, attn: Array | None, recurrent: Array | None = None) -> Array:
        """Add the layer's mixer outputs to the residual (attention before its output projection, the
        recurrent mixer's as returned), then the MLP."""
        p = self.layers[layer]
        if attn is not None:
            x = x + attn @ p["wo"]
        if recurrent is not None:
            x = x + recurrent
        hx = self._rms(x, p["norm2"])
        hidden = hx @ p["w1"]
        hidden = hidden / (1.0 + np.exp(-hidden))  # SiLU
        return x + hidden @ p["w2"]

    def logits(self, x: Array) -> Array:
        return self._rms(x, self.final_norm) @ self.lm_head

    # ---------------------------------------------------------------- the dense reference
    def dense_logits(self, tokens: Sequence[kvm.TokenIdExt]) -> Array:
        """Logits at every position, recomputing all keys/values, full attention and every recurrence
        from scratch."""
        return self.dense(tokens)[0]

    def dense_states(self, tokens: Sequence[kvm.TokenIdExt]) -> dict[int, RecurrentState]:
        """Every recurrent layer's state after ``tokens`` (from the closed form, not stepped)."""
        return self.dense(tokens)[1]

    def dense(self, tokens: Sequence[kvm.TokenIdExt]) -> tuple[Array, dict[int, RecurrentState]]:
        """Logits at every position and every recurrent layer's state after the last token."""
        pos = np.arange(len(tokens))
        x = self.embed(tokens)
        states: dict[int, RecurrentState] = {}
        for layer, spec in enumerate(self.cfg.layers):
            attn = rec = None
            if spec.has_attention:
                q, k, v = self.qkv(layer, x, pos)
                attn = self.attend(layer, q, pos, k, v, pos)
            if spec.has_recurrence:
                rec, states[layer] = self.dense_recurrent(layer, x)
            x = self.finish_layer(layer, x, attn, rec)
        return self.logits(x), states
