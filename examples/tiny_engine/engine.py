"""Paged attention for the tiny model: K/V live only in the KV-cache manager's pages.

For every layer and step, the engine writes the new tokens' keys/values into the pages the
manager handed out and reads back every position the layer attends to (the whole context for
full attention; the window and the sink tokens for sliding-window layers) through

    address = get_mem_pool_base_address(layer, role, PER_LAYER) + page_index * get_page_stride(layer, role)

with ``page_index`` from the adapter's ``get_kernel_page_indices(request, layer, role)`` (the
request's base page indices through ``get_page_index_converter(layer, role)``, with the step's
``ScratchDesc`` when SWA scratch slots are on: then a layer's out-of-window blocks of the step live
in sub-pages of a few scratch slots that the next layer overwrites). On the host backend pool memory
is host memory, so numpy views it through ctypes.

Recurrent layers (hybrid models) keep no K/V: each request has one live state slot per recurrent
layer group, and the layer reads and overwrites its ``conv_state`` and ``ssm_state`` there, at

    get_buffers(state_layer_id, role)[converter([kv.get_ssm_state_index(layer_group, beam)])[0]]

(the same base-index -> kernel-index conversion as K/V pages). Nothing else holds the state between
steps: suspend/resume, spilling to the host tier and back, prefix reuse (the manager copies the
matched snapshot into the live slot at the first resume) all go through the manager. A request that
starts at position 0 has no state yet: the engine zeroes its slot first (the manager hands out slots
as they are).
"""

from __future__ import annotations

import ctypes

import numpy as np

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

from .model import Array, RecurrentState, TinyModel


class MissingPage(AssertionError):
    """The engine needed a position whose block has no page (a manager or engine bug)."""


def pool_view(address: int, num_pages: int, page_shape: tuple[int, ...]) -> Array:
    """float64 array ``[num_pages, *page_shape]`` over memory at ``address`` (no copy)."""
    count = num_pages * int(np.prod(page_shape))
    raw = (ctypes.c_double * count).from_address(address)
    return np.ctypeslib.as_array(raw).reshape((num_pages,) + page_shape)


class _LayerBuffers:
    def __init__(self, adapter: KVCacheResourceManager, layer: int, page_shape: tuple[int, ...]) -> None:
        m = adapter.manager
        lid = kvm.LayerId(layer)
        self.layer_id = lid
        self.views: dict[str, Array] = {}
        for role in ("key", "value"):
            base = m.get_mem_pool_base_address(lid, role, kvm.PageIndexMode.PER_LAYER)
            stride = m.get_page_stride(lid, role)
            assert stride == int(np.prod(page_shape)) * 8, (stride, page_shape)
            self.views[role] = pool_view(int(base), m.get_page_index_upper_bound(lid, role), page_shape)


class _StateBuffers:
    """The pool views of one recurrent layer's state buffers (indexed by kernel page index)."""

    def __init__(self, adapter: KVCacheResourceManager, model: TinyModel, layer: int) -> None:
        m = adapter.manager
        rs = model.cfg.recurrent
        self.layer_id = kvm.LayerId(model.cfg.state_layer_id(layer))
        self.layer_group = m.get_layer_group_id(self.layer_id)
        self.views: dict[str, Array] = {}
        self.converters: dict[str, kvm.PageIndexConverter] = {}
        for role, shape in (("conv_state", rs.conv_state_shape), ("ssm_state", rs.ssm_state_shape)):
            stride = m.get_page_stride(self.layer_id, role)
            assert stride == int(np.prod(shape)) * 8, (stride, shape)
            self.views[role] = adapter.get_buffers(self.layer_id, role, np.float64, shape)
            self.converters[role] = m.get_page_index_converter(self.layer_id, role)

    def slot(self, kv: kvm.KVCache, role: str, beam: int = 0) -> int:
        """Kernel page index of the request's live state for ``role``."""
        base = kv.get_ssm_state_index(self.layer_group, kvm.BeamIndex(beam))
        if base < 0:
            raise MissingPage(f"layer {self.layer_id}: the request has no live state slot")
        return int(self.converters[role]([base], kvm.PageIndexMode.PER_LAYER, None)[0])

    def state(self, kv: kvm.KVCache, beam: int = 0) -> RecurrentState:
        """Views (no copy) of the request's live state in the pools."""
        return RecurrentState(
            self.views["conv_state"][self.slot(kv, "conv_state", beam)],
            self.views["ssm_state"][self.slot(kv, "ssm_state", beam)],
        )


class PagedEngine:
    """Runs forward steps for a batch prepared by the adapter: K/V in the manager's pages, recurrent
    states in its live state slots."""

    def __init__(self, model: TinyModel, adapter: KVCacheResourceManager) -> None:
        if adapter.manager.backend_name != "host":
            raise ValueError("the tiny engine reads pool memory with numpy: it needs the host backend")
        kinds = {layer.layer_id: type(layer) for layer in adapter.manager.config.layers}
        for layer in model.cfg.layer_configs():  # the manager must know the model's layers, of the same kinds
            if kinds.get(layer.layer_id) is not type(layer):
                raise ValueError(
                    f"the adapter's manager has no layer {layer.layer_id}: build it from model.cfg.layer_configs()"
                )
        self.model = model
        self.adapter = adapter
        self.tokens_per_block = adapter.tokens_per_block
        self.buffers: dict[int, _LayerBuffers] = {
            i: _LayerBuffers(adapter, i, model.cfg.kv_page_shape)
            for i, spec in enumerate(model.cfg.layers)
            if spec.has_attention
        }
        self.states: dict[int, _StateBuffers] = {
            i: _StateBuffers(adapter, model, i) for i in model.cfg.recurrent_layers
        }
        self.positions_read = 0

    def _pages(self, r: EngineRequest, layer: kvm.LayerId, role: str) -> Array:
        return np.asarray(self.adapter.get_kernel_page_indices(r, layer, role), dtype=np.int64)

    def needed_positions(self, layer: int, begin: int, end: int) -> Array:
        """Positions the queries ``[begin, end)`` of this layer attend to."""
        spec = self.model.cfg.layers[layer]
        if spec.window is None:
            return np.arange(end)
        lo = max(0, begin - spec.window + 1)
        sinks = np.arange(min(spec.sink_tokens, lo))
        return np.concatenate([sinks, np.arange(lo, end)])

    def forward(self, batch: list[EngineRequest]) -> dict[int, Array]:
        """One step for every request of ``batch`` (all prepared); logits of those that sample."""
        model = self.model
        ranges = [(r.num_cached_tokens, r.num_cached_tokens + r.num_scheduled_tokens) for r in batch]
        for r, (b, e) in zip(batch, ranges):
            if e <= b:
                raise ValueError(f"request {r.request_id} has no prepared step")
        xs = [model.embed(r.tokens(b, e)) for r, (b, e) in zip(batch, ranges)]
        qpos = [np.arange(b, e) for b, e in ranges]
        kvs = [self.adapter.get_kv_cache(r) for r in batch] if self.states else []
        for layer, spec in enumerate(model.cfg.layers):
            attn: list[Array | None] = [None] * len(batch)
            rec: list[Array | None] = [None] * len(batch)
            if spec.has_attention:
                attn = self._attention(batch, ranges, layer, xs, qpos)
            if spec.has_recurrence:
                st = self.states[layer]
                for i, (b, _) in enumerate(ranges):
                    live = st.state(kvs[i])
                    if b == 0:  # the first step of a sequence: no state yet
                        live.conv_state[...] = 0.0
                        live.ssm_state[...] = 0.0
                    rec[i], new = model.recurrent(layer, xs[i], live)
                    np.copyto(live.conv_state, new.conv_state)
                    np.copyto(live.ssm_state, new.ssm_state)
            xs = [model.finish_layer(layer, xs[i], attn[i], rec[i]) for i in range(len(batch))]
        return {r.request_id: model.logits(xs[i][-1]) for i, r in enumerate(batch) if r.samples_this_step}

    def _attention(
        self, batch: list[EngineRequest], ranges: list[tuple[int, int]], layer: int, xs: list[Array], qpos: list[Array]
    ) -> list[Array | None]:
        """One attention layer for the batch: writes the step's K/V into the pages, reads back what
        every query attends to; the attention outputs (before the output projection)."""
        t = self.tokens_per_block
        model = self.model
        bufs = self.buffers[layer]
        pages = {role: [self._pages(r, bufs.layer_id, role) for r in batch] for role in bufs.views}
        # write every request's new K/V first, then attend: a page wrongly shared within the
        # step would show up as a wrong read
        qs = []
        for i, r in enumerate(batch):
            q, k, v = model.qkv(layer, xs[i], qpos[i])
            qs.append(q)
            pos = qpos[i]
            for role, val in (("key", k), ("value", v)):
                pg = pages[role][i][pos // t]
                if (pg < 0).any():
                    raise MissingPage(f"request {r.request_id} layer {layer}: no page to write positions {pos[pg < 0]}")
                bufs.views[role][pg, pos % t] = val
        out: list[Array | None] = []
        for i, (r, (b, e)) in enumerate(zip(batch, ranges)):
            kpos = self.needed_positions(layer, b, e)
            kv_read = []
            for role in ("key", "value"):
                pg = pages[role][i][kpos // t]
                if (pg < 0).any():
                    raise MissingPage(f"request {r.request_id} layer {layer}: no page for positions {kpos[pg < 0]}")
                kv_read.append(bufs.views[role][pg, kpos % t])
            self.positions_read += len(kpos)
            out.append(model.attend(layer, qs[i], qpos[i], kv_read[0], kv_read[1], kpos))
        return out

    def step_sequence(
        self, kv: kvm.KVCache, tokens: list[kvm.TokenIdExt], begin: int, end: int, beam: int = 0
    ) -> Array:
        """Run positions ``[begin, end)`` of one beam of a cache driven directly (``KVCache``, e.g. beam
        search: ``tokens`` is that beam's sequence): K/V through the beam's base page indices, the
        recurrent states in the beam's live slots. Returns the logits of those positions."""
        t = self.tokens_per_block
        model = self.model
        m = self.adapter.manager
        pos = np.arange(begin, end)
        x = model.embed(tokens[begin:end])
        for layer, spec in enumerate(model.cfg.layers):
            attn = rec = None
            if spec.has_attention:
                bufs = self.buffers[layer]
                lg = m.get_layer_group_id(bufs.layer_id)
                base = list(kv.get_base_page_indices(lg, kvm.BeamIndex(beam)))
                q, k, v = model.qkv(layer, x, pos)
                kpos = self.needed_positions(layer, begin, end)
                read = []
                for role, val in (("key", k), ("value", v)):
                    pages = np.asarray(
                        m.get_page_index_converter(bufs.layer_id, role)(base, kvm.PageIndexMode.PER_LAYER, None),
                        dtype=np.int64,
                    )
                    if (pages[pos // t] < 0).any() or (pages[kpos // t] < 0).any():
                        raise MissingPage(f"beam {beam} layer {layer}: a needed block has no page")
                    bufs.views[role][pages[pos // t], pos % t] = val
                    read.append(bufs.views[role][pages[kpos // t], kpos % t])
                attn = model.attend(layer, q, pos, read[0], read[1], kpos)
            if spec.has_recurrence:
                live = self.states[layer].state(kv, beam)
                if begin == 0:
                    live.conv_state[...] = 0.0
                    live.ssm_state[...] = 0.0
                rec, new = model.recurrent(layer, x, live)
                np.copyto(live.conv_state, new.conv_state)
                np.copyto(live.ssm_state, new.ssm_state)
            x = model.finish_layer(layer, x, attn, rec)
        return model.logits(x)
