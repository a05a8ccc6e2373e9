"""A tiny decoder-only transformer in numpy: random weights from a seed, GQA, RoPE, some
sliding-window layers (optionally with sink tokens). float64 throughout.

The same math serves the paged engine (``engine.py``: K/V live in the manager's pages) and the
dense reference (``dense_logits``: recomputes every K/V and the whole attention from scratch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kv_cache_manager_v2 as kvm

Array = Any  # numpy arrays (kept loose: this is example code)


@dataclass(frozen=True)
class LayerSpec:
    """Attention shape of one layer: full (window None) or sliding window with sink tokens."""

    window: int | None = None
    sink_tokens: int = 0


def _default_layers() -> tuple[LayerSpec, ...]:
    return (LayerSpec(), LayerSpec(window=12), LayerSpec(), LayerSpec(window=10, sink_tokens=3))


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

    @property
    def kv_page_shape(self) -> tuple[int, int, int]:
        """One K (or V) page: ``tokens_per_block`` tokens of ``num_kv_heads x head_dim`` float64."""
        return (self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def kv_page_bytes(self) -> int:
        t, h, d = self.kv_page_shape
        return t * h * d * 8

    def layer_configs(self) -> list[kvm.AttentionLayerConfig]:
        """The manager's view of the model: per layer a key and a value buffer, windows as configured."""
        return [
            kvm.AttentionLayerConfig(
                kvm.LayerId(i),
                [kvm.BufferConfig("key", self.kv_page_bytes), kvm.BufferConfig("value", self.kv_page_bytes)],
                sliding_window_size=spec.window,
                num_sink_tokens=spec.sink_tokens if spec.window is not None and spec.sink_tokens else None,
            )
            for i, spec in enumerate(self.layers)
        ]


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
        self.layers = []
        for _ in cfg.layers:
            self.layers.append(
                {
                    "norm1": 1.0 + 0.1 * rng.standard_normal(d),
                    "wq": w(d, h * hd),
                    "wk": w(d, kvh * hd),
                    "wv": w(d, kvh * hd),
                    "wo": w(h * hd, d),
                    "norm2": 1.0 + 0.1 * rng.standard_normal(d),
                    "w1": w(d, cfg.d_ff),
                    "w2": w(cfg.d_ff, d),
                }
            )
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

    def finish_layer(self, layer: int, x: Array, attn: Array) -> Array:
        p = self.layers[layer]
        x = x + attn @ p["wo"]
        hx = self._rms(x, p["norm2"])
        hidden = hx @ p["w1"]
        hidden = hidden / (1.0 + np.exp(-hidden))  # SiLU
        return x + hidden @ p["w2"]

    def logits(self, x: Array) -> Array:
        return self._rms(x, self.final_norm) @ self.lm_head

    # ---------------------------------------------------------------- the dense reference
    def dense_logits(self, tokens: Sequence[kvm.TokenIdExt]) -> Array:
        """Logits at every position, recomputing all keys/values and full attention from scratch."""
        pos = np.arange(len(tokens))
        x = self.embed(tokens)
        for layer in range(len(self.cfg.layers)):
            q, k, v = self.qkv(layer, x, pos)
            x = self.finish_layer(layer, x, self.attend(layer, q, pos, k, v, pos))
        return self.logits(x)
