"""``--check-data``: writes and checks one record per token, layer and buffer through the pages the adapter hands out.

A record is a 32-bit mix of (token, position, buffer): a page that holds another request's
tokens, another position, another layer's data or nothing is caught. Each step, layer by layer
(as a model runs, so SWA scratch sub-pages that the next layer reuses are checked in time), it
checks the positions the step attends to (all of them at a request's first step and after a
resume; the last block otherwise), writes the step's records and reads them back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from .._common import LayerId
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
        i = 0
        for layer in m.config.layers:
            row: list[_Buffer] = []
            for b in layer.buffers:
                if m.get_page_stride(layer.layer_id, b.role) != 4 * t:
                    raise ValueError("the data checker needs buffers of 4 bytes per token (the simulator's proxy)")
                view = rm.get_buffers(layer.layer_id, b.role, np.uint32, (t,))
                w = layer.sliding_window_size
                row.append(_Buffer(layer.layer_id, b.role, i, w, (layer.num_sink_tokens or 0) if w else 0, view))
                i += 1
            self.buffers.append(row)
        self.records_written = 0
        self.records_checked = 0

    def _attended(self, buf: _Buffer, start: int, full: bool) -> Any:
        """Positions before ``start`` the step attends to (``full`` False: only those of the last block)."""
        lo = 0 if buf.window is None else max(0, start + 1 - buf.window)
        recent = max(lo, start - self.tokens_per_block)
        pos = np.arange(lo if full else recent, start, dtype=np.int64)
        if buf.window is not None and buf.sinks and lo > 0 and full:
            pos = np.concatenate([np.arange(0, min(buf.sinks, lo), dtype=np.int64), pos])
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
        start = req.num_cached_tokens
        end = start + req.num_scheduled_tokens
        new = np.arange(start, end, dtype=np.int64)
        t = self.tokens_per_block
        for row in self.buffers:
            pages_of = [np.asarray(self.rm.get_kernel_page_indices(req, b.layer, b.role), dtype=np.int64) for b in row]
            for buf, pages in zip(row, pages_of):
                self._check(req, buf, pages, tokens, self._attended(buf, start, full))
            for buf, pages in zip(row, pages_of):
                buf.view[self._pages(req, buf, pages, new), new % t] = _mix(tokens[new], new, buf.salt)
                self.records_written += int(new.size)
            for buf, pages in zip(row, pages_of):
                self._check(req, buf, pages, tokens, new)

    def corrupt(self, req: EngineRequest, position: int) -> None:
        """Overwrite one record of ``req`` (tests prove the checker can fail)."""
        buf = self.buffers[0][0]
        pages = np.asarray(self.rm.get_kernel_page_indices(req, buf.layer, buf.role), dtype=np.int64)
        t = self.tokens_per_block
        buf.view[int(pages[position // t]), position % t] ^= np.uint32(0xDEADBEEF)
