"""The host tier: CPU memory (page-locked where the backend copies by DMA), and the host-memory
medium every CPU-addressable pool shares (a GPU tier the host emulates too)."""

from __future__ import annotations

from collections.abc import Sequence

from ..._common import CacheTier
from .._backend import MemoryBackend, Pool
from .._layout import PoolGroupLayout
from ._base import Batches, DetachedSlot, MediumAccess, Route, Run, Tier, memory


def host_view(pool: Pool) -> memoryview:
    """The bytes of a host-memory pool."""
    view = memory(pool).host_view
    assert view is not None
    return view


class HostSlot(DetachedSlot):
    """A detached slot in host memory: read in place."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def read(self) -> memoryview:
        return self.view


class HostAccess(MediumAccess):
    """Host memory: plain memory copies, each after the backend's issued copies (which may still
    read or write those slots: ``wait_copies``)."""

    def to_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], views: list[memoryview], failed: set[int]
    ) -> None:
        self.backend.wait_copies()
        source = host_view(pool)
        for i, slot in enumerate(slots):
            views[i][:] = source[slot * size : (slot + 1) * size]

    def from_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], parts: list[memoryview], failed: set[int]
    ) -> None:
        self.backend.wait_copies()
        target = host_view(pool)
        for i, slot in enumerate(slots):
            target[slot * size : (slot + 1) * size] = parts[i]

    def can_detach(self) -> bool:
        return True

    def detach(self, pool: Pool, slot: int, size: int) -> DetachedSlot:
        self.backend.wait_copies()  # another thread reads it
        return HostSlot(host_view(pool)[slot * size : (slot + 1) * size])

    def host_bytes(self, pool: Pool, slot: int, size: int) -> memoryview | None:
        self.backend.wait_copies()
        return host_view(pool)[slot * size : (slot + 1) * size]


class HostCopy(Route):
    """Host memory -> host memory: one memory copy per run."""

    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        source, target = host_view(src), host_view(dst)
        for s, d, n, _ in runs:
            target[d * size : (d + n) * size] = source[s * size : (s + n) * size]


class HostTier(Tier):
    """Host memory backed in full up front (so eviction never fails to find memory)."""

    def __init__(self, backend: MemoryBackend) -> None:
        super().__init__(backend, CacheTier.HOST_MEM)

    def make_pool(self, group: PoolGroupLayout, pool: int, num_bytes: int, max_bytes: int) -> Pool:
        made = self.backend.reserve_host_pool(max_bytes)
        try:
            made.ensure_mapped(num_bytes)
        except BaseException:
            made.release()
            raise
        return made
