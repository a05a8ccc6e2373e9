"""A stand-in for attention kernels (SPEC 8): writes and checks KV records through the
addresses, strides and converted page indices the manager hands out, and nothing else.

Every token position of a page holds a record ``(MAGIC, token, position, layer, buffer, beam)``
of int32s. A step computing positions ``[start, end)`` runs layer by layer, as a model does:
for each layer it checks that every earlier position the step attends to holds exactly the
record written when that token was computed, writes the step's records for all the layer's
buffers, then checks them back (each token attends to itself and the step's earlier tokens).
So pages shared across layers are caught, and so are two blocks of one layer colliding in an
SWA scratch slot (scratch sub-pages are reused by the next layer; PER_LAYER mode with the
request's ``ScratchDesc`` addresses them).

A recurrent layer (``SsmLayerConfig``) keeps one record per buffer in the live state of the
request's beam (``get_ssm_state_index``): ``(MAGIC, prefix digest, position, layer, buffer,
beam)``, the state after the first ``position`` tokens. A step ``[start, end)`` checks that the
state holds exactly the record of position ``start`` (unless ``start`` is 0: a fresh state),
then writes the record of ``end``. So a reused snapshot must hold the state of its position.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    BeamIndex,
    KVCache,
    KVCacheManager,
    LayerId,
    PageIndexConverter,
    PageIndexMode,
    SsmLayerConfig,
    TokenId,
    TokenIdExt,
)
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

MAGIC = 0x4B56_4B56
#: With this environment variable set to 1, every step also runs the manager's invariant checker.
CHECK_ENV_VAR = "KV_CACHE_MANAGER_V2_CHECK"
RECORD_INTS = 6
RECORD_BYTES = RECORD_INTS * 4


def token_value(tok: TokenIdExt) -> int:
    """An int32 standing for a token (bytes tokens are hashed)."""
    if isinstance(tok, bytes):
        return zlib.crc32(tok) & 0x7FFF_FFFF
    return int(tok) & 0x7FFF_FFFF


@dataclass
class _Buffer:
    layer: LayerId
    role: str
    index: int
    layer_group: int
    window: int | None
    sink_tokens: int
    base: int
    stride: int
    upper_bound: int
    converter: PageIndexConverter
    tokens_per_page: int
    expansion: int
    recurrent: bool = False


class KVMismatch(AssertionError):
    pass


class FakeEngine:
    """Reads/writes KV records for requests of one manager through its public layout API."""

    def __init__(
        self, manager: KVCacheManager, index_mode: PageIndexMode = PageIndexMode.PER_LAYER, driver: Any = None
    ) -> None:
        self.mgr = manager
        #: the emulated CUDA driver (``fake_cuda_driver.FakeDriver``), told of each record read or
        #: written as a kernel on the request's ``cuda_stream`` (it checks their order with copies)
        self.driver = driver
        self._kernel: Callable[[int, int, bool], None] | None = None
        self.mode = index_mode
        self.backend = manager.backend
        t = manager.tokens_per_block
        self.tokens_per_block = t
        self.buffers: list[_Buffer] = []
        cfg_layers = {layer.layer_id: layer for layer in manager.config.layers}
        for i, (layer_id, role) in enumerate(manager.all_buffer_ids):
            conv = manager.get_page_index_converter(layer_id, role)
            stride = manager.get_page_stride(layer_id, role)
            tpp = t // conv.expansion
            lc_cfg = cfg_layers[layer_id]
            recurrent = isinstance(lc_cfg, SsmLayerConfig)
            if recurrent:
                tpp = 1
                if stride < RECORD_BYTES:
                    raise ValueError(f"buffer {layer_id}/{role}: {stride} bytes of state are too small for a record")
            elif stride // tpp < RECORD_BYTES:
                raise ValueError(f"buffer {layer_id}/{role}: {stride} bytes per page is too small for records")
            self.buffers.append(
                _Buffer(
                    layer=layer_id,
                    role=role,
                    index=i,
                    layer_group=manager.get_layer_group_id(layer_id),
                    window=None if recurrent else lc_cfg.sliding_window_size,  # type: ignore[union-attr]
                    sink_tokens=0 if recurrent else lc_cfg.num_sink_tokens or 0,  # type: ignore[union-attr]
                    base=manager.get_mem_pool_base_address(layer_id, role, index_mode),
                    stride=stride,
                    upper_bound=manager.get_page_index_upper_bound(layer_id, role),
                    converter=conv,
                    tokens_per_page=tpp,
                    expansion=conv.expansion,
                    recurrent=recurrent,
                )
            )
        self.layers: list[list[_Buffer]] = []
        for buf in self.buffers:  # config order: layer by layer, role by role
            if self.layers and self.layers[-1][0].layer == buf.layer:
                self.layers[-1].append(buf)
            else:
                self.layers.append([buf])
        self.pages_checked = 0
        self.records_written = 0
        self.check_invariants = os.environ.get(CHECK_ENV_VAR, "0") == "1"
        #: compare the writer-beam field of records (off for beam search, where history is inherited)
        self.check_beam_field = True

    def needed_positions(self, buf: _Buffer, start: int) -> list[int]:
        """Positions a step starting at ``start`` attends to for this buffer's layer."""
        if buf.recurrent:
            return []
        if buf.window is None:
            return list(range(start))
        lo = max(0, start + 1 - buf.window)
        return list(range(min(buf.sink_tokens, lo))) + list(range(lo, start))

    def _address(self, buf: _Buffer, kernel_indices: list[int], pos: int) -> int:
        t = self.tokens_per_block
        o, r = divmod(pos, t)
        i, j = divmod(r, buf.tokens_per_page)
        x = kernel_indices[o * buf.expansion + i]
        if x == BAD_PAGE_INDEX:
            raise KVMismatch(f"layer {buf.layer} {buf.role}: position {pos} (block {o}) has no page")
        if not 0 <= x < buf.upper_bound:
            raise KVMismatch(f"layer {buf.layer} {buf.role}: page index {x} outside [0, {buf.upper_bound})")
        return buf.base + x * buf.stride + j * (buf.stride // buf.tokens_per_page)

    def kernel_indices(self, kv: KVCache, buf: _Buffer, beam: int = 0) -> list[int]:
        """The buffer's page indices for this step (of one beam), scratch blocks included."""
        scratch = kv.get_scratch_desc(buf.layer_group)
        if scratch is not None and not kv.supports_index_mode(self.mode):
            raise KVMismatch(f"{self.mode.name} cannot address the scratch blocks of this step")
        return buf.converter(kv.get_base_page_indices(buf.layer_group, BeamIndex(beam)), self.mode, scratch)

    def step(
        self, kv: KVCache, tokens: Sequence[TokenIdExt], start: int, end: int, beam: int = 0, check: bool = True
    ) -> None:
        """Run one step over positions ``[start, end)``, layer by layer (see the module doc).

        ``tokens`` is the request's full sequence (at least ``end`` long).
        """
        assert 0 <= start <= end <= kv.capacity, (start, end, kv.capacity)
        self._on_stream(kv)
        for layer_buffers in self.layers:
            if layer_buffers[0].recurrent:
                for buf in layer_buffers:
                    address = self.state_address(kv, buf, beam)
                    if check and start > 0:
                        self._check_state(buf, address, tokens, start, beam)
                    self._write(address, self.state_record(buf, tokens, end, beam))
                    self.records_written += 1
                    if check:
                        self._check_state(buf, address, tokens, end, beam)
                continue
            indices = [self.kernel_indices(kv, buf, beam) for buf in layer_buffers]
            if check:
                for buf, idx in zip(layer_buffers, indices):
                    for pos in self.needed_positions(buf, start):
                        self._check(buf, idx, pos, tokens[pos], beam)
            for buf, idx in zip(layer_buffers, indices):
                for pos in range(start, end):
                    rec = np.array(
                        [MAGIC, token_value(tokens[pos]), pos, buf.layer, buf.index, beam], dtype=np.int32
                    ).tobytes()
                    self._write(self._address(buf, idx, pos), rec)
                    self.records_written += 1
            if check:
                for buf, idx in zip(layer_buffers, indices):
                    for pos in range(start, end):
                        self._check(buf, idx, pos, tokens[pos], beam)
        if self.check_invariants:
            self.mgr.check_invariants()

    def _on_stream(self, kv: KVCache) -> None:
        """The records read and written from now on are kernels on ``kv``'s stream."""
        if self.driver is not None:
            self._kernel = self.driver.kernels_on(kv.cuda_stream)

    def _write(self, address: int, data: bytes) -> None:
        self.backend.write(address, data)
        if self._kernel is not None:
            self._kernel(address, len(data), True)

    def _read(self, address: int) -> bytes:
        if self._kernel is not None:
            self._kernel(address, RECORD_BYTES, False)
        return self.backend.read(address, RECORD_BYTES)

    def state_address(self, kv: KVCache, buf: _Buffer, beam: int = 0) -> int:
        """Where ``buf``'s record of the live state of ``beam`` lives."""
        index = kv.get_ssm_state_index(buf.layer_group, BeamIndex(beam))
        x = buf.converter([index], self.mode, None)[0]
        if not 0 <= x < buf.upper_bound:
            raise KVMismatch(f"layer {buf.layer} {buf.role}: state page index {x} outside [0, {buf.upper_bound})")
        return buf.base + x * buf.stride

    def state_record(self, buf: _Buffer, tokens: Sequence[TokenIdExt], position: int, beam: int) -> bytes:
        digest = zlib.crc32(np.array([token_value(tok) for tok in tokens[:position]], dtype=np.int64).tobytes())
        return np.array([MAGIC, digest & 0x7FFF_FFFF, position, buf.layer, buf.index, beam], dtype=np.int32).tobytes()

    def _check_state(self, buf: _Buffer, address: int, tokens: Sequence[TokenIdExt], position: int, beam: int) -> None:
        got = list(np.frombuffer(self._read(address), dtype=np.int32))
        want = list(np.frombuffer(self.state_record(buf, tokens, position, beam), dtype=np.int32))
        if not self.check_beam_field:
            got, want = got[:5], want[:5]
        if got != want:
            raise KVMismatch(
                f"layer {buf.layer} {buf.role}: the state holds {got}, expected the state at position {position}: {want}"
            )
        self.pages_checked += 1

    def check_all(self, kv: KVCache, tokens: Sequence[TokenIdExt], upto: int, beam: int = 0) -> None:
        """Check every position below ``upto`` that a step starting there would need (and the
        live state of recurrent layers: the state at ``upto``, unless ``upto`` is 0)."""
        self._on_stream(kv)
        for buf in self.buffers:
            if buf.recurrent:
                if upto > 0:
                    self._check_state(buf, self.state_address(kv, buf, beam), tokens, upto, beam)
                continue
            indices = self.kernel_indices(kv, buf, beam)
            for pos in self.needed_positions(buf, upto):
                self._check(buf, indices, pos, tokens[pos], beam)
        if self.check_invariants:
            self.mgr.check_invariants()

    def _check(self, buf: _Buffer, indices: list[int], pos: int, tok: TokenIdExt, beam: int) -> None:
        got = np.frombuffer(self._read(self._address(buf, indices, pos)), dtype=np.int32)
        want = [MAGIC, token_value(tok), pos, buf.layer, buf.index, beam]
        if not self.check_beam_field:  # beams that share history share the records their ancestor wrote
            got = got[:5]
            want = want[:5]
        if list(got) != want:
            raise KVMismatch(f"layer {buf.layer} {buf.role} position {pos}: found record {list(got)}, expected {want}")
        self.pages_checked += 1

    def corrupt(self, kv: KVCache, pos: int) -> None:
        """Overwrite one record (tests use it to prove the checker can fail)."""
        buf = self.buffers[0]
        indices = self.kernel_indices(kv, buf)
        self._on_stream(kv)
        self._write(self._address(buf, indices, pos), b"\0" * RECORD_BYTES)


def next_token(r: EngineRequest) -> TokenId:
    """The token a request samples next: distinct per request and position."""
    return TokenId(5000 + 97 * r.request_id + len(r.generated_tokens))


def adapter_step(
    adapter: KVCacheResourceManager, engine: FakeEngine, batch: list[EngineRequest]
) -> list[EngineRequest]:
    """One step of the adapter's loop: prepare, write/check KV records with ``engine``, sample
    (``next_token``), update; returns the requests prepare left unserved."""
    unserved = adapter.prepare_resources(batch)
    served = [r for r in batch if r not in unserved]
    for r in served:
        b = r.num_cached_tokens
        engine.step(adapter.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
        if r.samples_this_step:
            r.generated_tokens.append(next_token(r))
    adapter.update_resources(served)
    return unserved
