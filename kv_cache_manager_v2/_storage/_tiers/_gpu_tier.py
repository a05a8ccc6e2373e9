"""The GPU tier: device memory mapped on demand, copied by the backend (batched async copies), and
reached by the CPU through the backend's page-locked staging buffer (the CPU touches that buffer
only once the copies out of or into it are done: ``wait_copies``). The caller orders the copies
against the engine's streams (``StreamOrder``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from ..._common import CacheTier
from .._backend import D2H, H2D, MemoryBackend, Pool
from .._layout import PoolGroupLayout
from ._base import Batches, MediumAccess, Route, Run, Tier, add_batch, memory

#: smallest staging buffer for copies between the GPU and the CPU's buffers or files (grown to one
#: slot when slots are larger)
STAGING_BYTES: Final = 32 << 20


def _staging_batches(runs: list[Run], per: int) -> list[list[tuple[int, Run]]]:
    """``runs`` cut to at most ``per`` slots each and grouped so each group fills the staging buffer
    at most once; each piece with its slot offset in the buffer."""
    out: list[list[tuple[int, Run]]] = []
    batch: list[tuple[int, Run]] = []
    used = 0
    for s, d, n, indices in runs:
        for k in range(0, n, per):
            m = min(per, n - k)
            if used + m > per:
                out.append(batch)
                batch, used = [], 0
            batch.append((used, (s + k, d + k, m, indices[k : k + m])))
            used += m
    if batch:
        out.append(batch)
    return out


def read_device(
    backend: MemoryBackend,
    staging_bytes: int,
    pool: Pool,
    size: int,
    runs: list[Run],
    take: Callable[[memoryview, Run], None],
) -> None:
    """Bring the source slots of ``runs`` (in ``pool``, device memory) to the CPU through the staging
    buffer (at least ``staging_bytes``), as many per batch as fit; ``take(bytes, run)`` consumes each
    run's bytes (each batch waited for: the CPU reads it)."""
    staging = backend.staging_buffer(max(staging_bytes, size))
    assert staging is not None and staging.host_view is not None
    view = staging.host_view
    base = memory(pool).base_address
    for batch in _staging_batches(runs, staging.mapped_bytes // size):
        backend.copy_batch(
            D2H,
            [staging.base_address + at * size for at, _ in batch],
            [base + run[0] * size for _, run in batch],
            [run[2] * size for _, run in batch],
        )
        backend.wait_copies()
        for at, run in batch:
            take(view[at * size : (at + run[2]) * size], run)


def write_device(
    backend: MemoryBackend,
    staging_bytes: int,
    pool: Pool,
    size: int,
    runs: list[Run],
    fill: Callable[[memoryview, Run], None],
) -> None:
    """Fill the destination slots of ``runs`` (in ``pool``, device memory) through the staging buffer
    (at least ``staging_bytes``): ``fill(bytes, run)`` writes each run's bytes there, then one batch
    of copies per buffer-full. The last batch may still be copying on return (the next use of the
    buffer waits for it)."""
    staging = backend.staging_buffer(max(staging_bytes, size))
    assert staging is not None and staging.host_view is not None
    view = staging.host_view
    base = memory(pool).base_address
    for batch in _staging_batches(runs, staging.mapped_bytes // size):
        backend.wait_copies()  # the previous batch (or another copy) may still read the buffer
        for at, run in batch:
            fill(view[at * size : (at + run[2]) * size], run)
        backend.copy_batch(
            H2D,
            [base + run[1] * size for _, run in batch],
            [staging.base_address + at * size for at, _ in batch],
            [run[2] * size for _, run in batch],
        )


class DeviceAccess(MediumAccess):
    """Device memory: through the staging buffer (at least ``staging_bytes``)."""

    def __init__(self, backend: MemoryBackend, staging_bytes: int) -> None:
        super().__init__(backend)
        self.staging_bytes = staging_bytes

    def to_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], views: list[memoryview], failed: set[int]
    ) -> None:
        def take(data: memoryview, run: Run) -> None:
            views[run[1]][:] = data

        read_device(
            self.backend, self.staging_bytes, pool, size, [(slot, i, 1, [i]) for i, slot in enumerate(slots)], take
        )

    def from_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], parts: list[memoryview], failed: set[int]
    ) -> None:
        def fill(data: memoryview, run: Run) -> None:
            data[:] = parts[run[0]]

        write_device(
            self.backend, self.staging_bytes, pool, size, [(i, slot, 1, [i]) for i, slot in enumerate(slots)], fill
        )


class DeviceCopy(Route):
    """Copies with device memory on one side or both: queued for the backend's batched call."""

    def __init__(self, kind: int) -> None:
        #: the direction (``D2D``, ``H2D``, ``D2H``)
        self.kind = kind

    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        src_base, dst_base = memory(src).base_address, memory(dst).base_address
        for s, d, n, _ in runs:
            add_batch(batches, self.kind, dst_base + d * size, src_base + s * size, n * size)


class GpuTier(Tier):
    """GPU memory: address space reserved up front, mapped as slots are first handed out."""

    def __init__(self, backend: MemoryBackend) -> None:
        super().__init__(backend, CacheTier.GPU_MEM)

    def make_pool(self, group: PoolGroupLayout, pool: int, num_bytes: int, max_bytes: int) -> Pool:
        return self.backend.reserve_pool(max_bytes)

    def grow(self, pools: list[Pool], slot_sizes: Sequence[int], num_slots: int) -> None:
        """Nothing to do: the allocator maps GPU memory when it hands slots out (``prepare``)."""
