"""Copy engine: moves the slot data of many pages between two levels (or within one) in one batch.

Every pair of media is handled by a route of the tier modules (``_tiers/``), picked by the two
pools' ``medium``: memory copies where both sides are CPU-addressable, the backend's batched async
copies where device memory is involved, pread/pwrite for disk (through the backend's page-locked
staging buffer when the GPU is not CPU-addressable). Runs of consecutive slots on both sides are
merged into one copy. A failed disk read or write is retried slot by slot; the pairs that still
fail are reported, never raised, so callers can turn exactly those pages into misses.

``read_slots`` / ``write_slots`` move whole slots (every pool of a group, in pool order) between a
level and plain byte buffers: the remote tier's values.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._backend import DEVICE_MEMORY, NUM_MEDIA, MemoryBackend, Pool
from ._tiers._base import Batches, coalesce
from ._tiers._gpu_tier import STAGING_BYTES
from ._tiers._registry import media, routes

__all__ = ["STAGING_BYTES", "CopyEngine", "coalesce"]


class CopyEngine:
    """Batched slot copies for one backend. Not thread-safe (like the manager)."""

    def __init__(self, backend: MemoryBackend, staging_bytes: int = STAGING_BYTES) -> None:
        self.backend = backend
        #: copies issued (runs), for statistics and tests
        self.num_runs = 0
        #: the access object of each pool medium (``_tiers``)
        self.media = media(backend, staging_bytes)
        self._routes = routes(backend, staging_bytes)

    def copy(
        self,
        src_pools: Sequence[Pool],
        dst_pools: Sequence[Pool],
        slot_sizes: Sequence[int],
        pairs: Sequence[tuple[int, int]],
    ) -> set[int]:
        """Copy slot ``src`` of every source pool to slot ``dst`` of the matching destination pool,
        for each ``(src, dst)`` of ``pairs``. Returns the indices of the pairs whose data could not
        be copied (disk errors). GPU memory is synchronized before (the pages may have been written
        by any stream) and the copies are complete on return."""
        failed: set[int] = set()
        if not pairs:
            return failed
        runs = coalesce(pairs)
        backend = self.backend
        touches_device = src_pools[0].medium == DEVICE_MEMORY or dst_pools[0].medium == DEVICE_MEMORY
        if touches_device:
            backend.synchronize_device()
        batches: Batches = {}
        for p, size in enumerate(slot_sizes):
            src, dst = src_pools[p], dst_pools[p]
            self._routes[src.medium * NUM_MEDIA + dst.medium].copy(src, dst, size, runs, failed, batches)
            self.num_runs += len(runs)
        for kind, (dsts, srcs, sizes) in batches.items():
            backend.copy_batch(kind, dsts, srcs, sizes)
        if touches_device:
            backend.synchronize()
        return failed

    # ------------------------------------------------------------------ slots <-> byte buffers
    def read_slots(
        self,
        pools: Sequence[Pool],
        slot_sizes: Sequence[int],
        slots: Sequence[int],
        bufs: list[memoryview],
        offset: int,
    ) -> set[int]:
        """Fill ``bufs[i]`` from byte ``offset`` on with slot ``slots[i]``'s bytes of every pool, in
        order (each buffer ``offset + sum(slot_sizes)`` long). Returns the indices of the slots a disk
        read failed for."""
        failed: set[int] = set()
        if slots and pools[0].medium == DEVICE_MEMORY:
            self.backend.synchronize_device()  # the pages may have been written by any stream
        at = offset
        for p, size in enumerate(slot_sizes):
            pool = pools[p]
            self.media[pool.medium].to_buffers(pool, size, slots, [v[at : at + size] for v in bufs], failed)
            at += size
        self.num_runs += len(slots) * len(slot_sizes)
        return failed

    def write_slots(
        self, pools: Sequence[Pool], slot_sizes: Sequence[int], slots: Sequence[int], data: Sequence[memoryview]
    ) -> set[int]:
        """Write ``data[i]`` (the bytes of every pool in order, ``sum(slot_sizes)`` long) into slot
        ``slots[i]``. Returns the indices a disk write failed for; the data is in place on return."""
        failed: set[int] = set()
        at = 0
        for p, size in enumerate(slot_sizes):
            pool = pools[p]
            self.media[pool.medium].from_buffers(pool, size, slots, [d[at : at + size] for d in data], failed)
            at += size
        self.num_runs += len(slots) * len(slot_sizes)
        return failed
