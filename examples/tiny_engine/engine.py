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
"""

from __future__ import annotations

import ctypes

import numpy as np

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

from .model import Array, TinyModel


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


class PagedEngine:
    """Runs forward steps for a batch prepared by the adapter."""

    def __init__(self, model: TinyModel, adapter: KVCacheResourceManager) -> None:
        if adapter.manager.backend_name != "host":
            raise ValueError("the tiny engine reads pool memory with numpy: it needs the host backend")
        if model.cfg.recurrent_layers:
            raise ValueError(
                f"layers {model.cfg.recurrent_layers} are recurrent: the paged engine runs attention-only models "
                "(hybrid models run through tiny_engine.hybrid)"
            )
        self.model = model
        self.adapter = adapter
        self.tokens_per_block = adapter.tokens_per_block
        self.buffers = [_LayerBuffers(adapter, i, model.cfg.kv_page_shape) for i in range(len(model.cfg.layers))]
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
        t = self.tokens_per_block
        model = self.model
        ranges = [(r.num_cached_tokens, r.num_cached_tokens + r.num_scheduled_tokens) for r in batch]
        for r, (b, e) in zip(batch, ranges):
            if e <= b:
                raise ValueError(f"request {r.request_id} has no prepared step")
        xs = [model.embed(r.tokens(b, e)) for r, (b, e) in zip(batch, ranges)]
        qpos = [np.arange(b, e) for b, e in ranges]
        for layer, bufs in enumerate(self.buffers):
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
                        raise MissingPage(
                            f"request {r.request_id} layer {layer}: no page to write positions {pos[pg < 0]}"
                        )
                    bufs.views[role][pg, pos % t] = val
            for i, (r, (b, e)) in enumerate(zip(batch, ranges)):
                kpos = self.needed_positions(layer, b, e)
                kv_read = []
                for role in ("key", "value"):
                    pg = pages[role][i][kpos // t]
                    if (pg < 0).any():
                        raise MissingPage(f"request {r.request_id} layer {layer}: no page for positions {kpos[pg < 0]}")
                    kv_read.append(bufs.views[role][pg, kpos % t])
                self.positions_read += len(kpos)
                attn = model.attend(layer, qs[i], qpos[i], kv_read[0], kv_read[1], kpos)
                xs[i] = model.finish_layer(layer, xs[i], attn)
        return {r.request_id: model.logits(xs[i][-1]) for i, r in enumerate(batch) if r.samples_this_step}
