"""``--check-data``: writes and checks one record per token, layer and buffer through the pages the adapter hands out.

A record is a 32-bit mix of (token, position, buffer): a page that holds another request's
tokens, another position, another layer's data or nothing is caught. Each step checks the
positions the step attends to (all of them at a request's first step and after a resume; the
last block otherwise), writes the step's records and reads them back. A step with SWA scratch
blocks runs layer by layer, as a model does (the next layer reuses scratch sub-pages), through
the adapter's kernel page indices; other steps do all buffers of a layer group at once with
the same index arithmetic (``base * scale + layer_offset``), which is what makes it affordable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from .._common import LayerGroupId, LayerId, PageIndexMode
from .._config import AttentionLayerConfig
from ..engine import EngineRequest, KVCacheResourceManager


@mypyc_attr(native_class=False)
class DataCheckError(AssertionError):
    """A page did not hold the record the checker wrote for that token (a manager bug)."""


class _Buffer:
    def __init__(self, layer: LayerId, role: str, index: int, window: int | None, sinks: int, view: Any) -> None:
        self.layer = layer
        self.role = role
        self.salt = np.uint32((index + 1) * 0xC2B2AE3D & 0xFFFF_FFFF)
        self.window = window
        self.sinks = sinks
        self.view = view  #: (num_pages, tokens_per_block) uint32 over the pool


class _Group:
    """The buffers of one layer group, for the vectorized path (one pool view, one index formula)."""

    def __init__(self, lg: LayerGroupId, first: _Buffer) -> None:
        self.lg = lg
        self.window = first.window
        self.sinks = first.sinks
        self.view = first.view
        self.address = 0
        self.scale = 0
        self.buffers: list[_Buffer] = []
        self.offsets: Any = None  #: layer_offset per buffer (int64 column)
        self.salts: Any = None  #: salt per buffer (uint32 column)


def _mix(tokens: Any, positions: Any, salt: Any) -> Any:
    """murmur3's finalizer over token * golden ^ position * c ^ salt (uint32 arrays)."""
    x = (tokens * np.uint32(0x9E3779B1)) ^ (positions.astype(np.uint32) * np.uint32(0x85EBCA77)) ^ salt
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


class DataChecker:
    """Checks the KV pages of every step (see the module doc); needs buffers of 4 bytes per token."""

    def __init__(self, rm: KVCacheResourceManager) -> None:
        self.rm = rm
        m = rm.manager
        t = m.tokens_per_block
        self.tokens_per_block = t
        self.buffers: list[list[_Buffer]] = []
        groups: dict[int, _Group] = {}
        offsets: dict[int, list[int]] = {}
        self.vectorized = True  #: every layer group's buffers share one pool view and expansion 1
        i = 0
        for layer in m.config.layers:
            row: list[_Buffer] = []
            lg = m.get_layer_group_id(layer.layer_id)
            if not isinstance(layer, AttentionLayerConfig):
                raise ValueError("the data checker handles attention layers only (no recurrent layers)")
            for b in layer.buffers:
                if m.get_page_stride(layer.layer_id, b.role) != 4 * t:
                    raise ValueError("the data checker needs buffers of 4 bytes per token (the simulator's proxy)")
                view = rm.get_buffers(layer.layer_id, b.role, np.uint32, (t,))
                w = layer.sliding_window_size
                buf = _Buffer(layer.layer_id, b.role, i, w, (layer.num_sink_tokens or 0) if w else 0, view)
                row.append(buf)
                i += 1
                conv = m.get_page_index_converter(layer.layer_id, b.role)
                address = int(m.get_mem_pool_base_address(layer.layer_id, b.role, PageIndexMode.PER_LAYER))
                g = groups.get(lg)
                if g is None:
                    g = groups[lg] = _Group(lg, buf)
                    g.address = address
                    g.scale = conv.scale
                    offsets[lg] = []
                if conv.expansion != 1 or address != g.address or conv.scale != g.scale:
                    self.vectorized = False
                g.buffers.append(buf)
                offsets[lg].append(conv.layer_offset)
            self.buffers.append(row)
        for key, g in groups.items():
            g.offsets = np.array(offsets[key], dtype=np.int64)[:, None]
            g.salts = np.array([b.salt for b in g.buffers], dtype=np.uint32)[:, None]
        self.groups = [groups[k] for k in sorted(groups)]
        self.records_written = 0
        self.records_checked = 0
        self.layer_by_layer_steps = 0  #: steps that took the scratch-aware path

    def _attended(self, window: int | None, sinks: int, start: int, full: bool) -> Any:
        """Positions before ``start`` the step attends to (``full`` False: only those of the last block)."""
        lo = 0 if window is None else max(0, start + 1 - window)
        recent = max(lo, start - self.tokens_per_block)
        pos = np.arange(lo if full else recent, start, dtype=np.int64)
        if window is not None and sinks and lo > 0 and full:
            pos = np.concatenate([np.arange(0, min(sinks, lo), dtype=np.int64), pos])
        return pos

    def _pages(self, req: EngineRequest, buf: _Buffer, pages: Any, pos: Any) -> Any:
        t = self.tokens_per_block
        p = pages[pos // t]
        if p.size and int(p.min()) < 0:
            bad = int(pos[int(np.argmin(p))])
            raise DataCheckError(
                f"request {req.request_id}: layer {buf.layer} {buf.role} position {bad} (block {bad // t}) has no page"
            )
        return p

    def _check(self, req: EngineRequest, buf: _Buffer, pages: Any, tokens: Any, pos: Any) -> None:
        if pos.size == 0:
            return
        got = buf.view[self._pages(req, buf, pages, pos), pos % self.tokens_per_block]
        want = _mix(tokens[pos], pos, buf.salt)
        bad = np.nonzero(got != want)[0]
        if bad.size:
            k = int(bad[0])
            raise DataCheckError(
                f"request {req.request_id}: layer {buf.layer} {buf.role} position {int(pos[k])}: page "
                f"{int(pages[int(pos[k]) // self.tokens_per_block])} holds {int(got[k]):#010x}, expected "
                f"{int(want[k]):#010x} (another token's KV, or none)"
            )
        self.records_checked += int(pos.size)

    def step(self, req: EngineRequest, tokens: Any, full: bool) -> None:
        """Run the prepared step of ``req`` (positions ``[num_cached, num_cached + num_scheduled)``);
        ``tokens``: the request's prompt + output tokens as a uint32 array."""
        kv = self.rm.get_kv_cache(req)
        if self.vectorized and not kv.has_scratch_slots:
            self._step_groups(req, tokens, full)
            return
        self.layer_by_layer_steps += 1
        start = req.num_cached_tokens
        end = start + req.num_scheduled_tokens
        new = np.arange(start, end, dtype=np.int64)
        t = self.tokens_per_block
        for row in self.buffers:
            pages_of = [np.asarray(self.rm.get_kernel_page_indices(req, b.layer, b.role), dtype=np.int64) for b in row]
            for buf, pages in zip(row, pages_of):
                self._check(req, buf, pages, tokens, self._attended(buf.window, buf.sinks, start, full))
            for buf, pages in zip(row, pages_of):
                buf.view[self._pages(req, buf, pages, new), new % t] = _mix(tokens[new], new, buf.salt)
                self.records_written += int(new.size)
            for buf, pages in zip(row, pages_of):
                self._check(req, buf, pages, tokens, new)

    def _step_groups(self, req: EngineRequest, tokens: Any, full: bool) -> None:
        kv = self.rm.get_kv_cache(req)
        t = self.tokens_per_block
        start = req.num_cached_tokens
        new = np.arange(start, start + req.num_scheduled_tokens, dtype=np.int64)
        for g in self.groups:
            base = np.array(kv.get_base_page_indices(g.lg), dtype=np.int64)[None, :]
            pages = np.where(base >= 0, base * g.scale + g.offsets, -1)  # (buffers, blocks)
            self._check_group(req, g, pages, tokens, self._attended(g.window, g.sinks, start, full))
            p = self._group_pages(req, g, pages, new)
            g.view[p, (new % t)[None, :]] = _mix(tokens[new][None, :], new[None, :], g.salts)
            self.records_written += int(p.size)
            self._check_group(req, g, pages, tokens, new)

    def _group_pages(self, req: EngineRequest, g: _Group, pages: Any, pos: Any) -> Any:
        p = pages[:, pos // self.tokens_per_block]
        if p.size and int(p.min()) < 0:
            b, k = np.argwhere(p < 0)[0]
            bad = int(pos[int(k)])
            buf = g.buffers[int(b)]
            raise DataCheckError(
                f"request {req.request_id}: layer {buf.layer} {buf.role} position {bad} "
                f"(block {bad // self.tokens_per_block}) has no page"
            )
        return p

    def _check_group(self, req: EngineRequest, g: _Group, pages: Any, tokens: Any, pos: Any) -> None:
        if pos.size == 0:
            return
        p = self._group_pages(req, g, pages, pos)
        got = g.view[p, (pos % self.tokens_per_block)[None, :]]
        want = _mix(tokens[pos][None, :], pos[None, :], g.salts)
        bad = np.argwhere(got != want)
        if bad.size:
            b, k = int(bad[0][0]), int(bad[0][1])
            buf = g.buffers[b]
            raise DataCheckError(
                f"request {req.request_id}: layer {buf.layer} {buf.role} position {int(pos[k])}: page "
                f"{int(p[b, k])} holds {int(got[b, k]):#010x}, expected {int(want[b, k]):#010x} "
                "(another token's KV, or none)"
            )
        self.records_checked += int(p.size)

    def corrupt(self, req: EngineRequest, position: int) -> None:
        """Overwrite one record of ``req`` (tests prove the checker can fail)."""
        buf = self.buffers[0][0]
        pages = np.asarray(self.rm.get_kernel_page_indices(req, buf.layer, buf.role), dtype=np.int64)
        t = self.tokens_per_block
        buf.view[int(pages[position // t]), position % t] ^= np.uint32(0xDEADBEEF)
