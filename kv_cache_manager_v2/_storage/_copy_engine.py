"""Copy engine: moves the slot data of many pages between two levels (or within one) in one batch.

Every pair of media is handled by a route of the tier modules (``_tiers/``), picked by the two
pools' ``medium``: memory copies where both sides are CPU-addressable, the backend's batched async
copies where device memory is involved, pread/pwrite for disk (through the backend's page-locked
staging buffer when the GPU is not CPU-addressable). Runs of consecutive slots on both sides are
merged into one copy. Copies touching GPU memory are ordered against the engine's streams with
events (``StreamOrder``: ``before`` and ``after`` each batch) and may still run on return; a copy
the CPU makes into or out of host memory first waits for the issued ones (``wait_copies``: the
backend's stream, never the device). A failed disk read or write is retried slot by slot; the
pairs that still fail are reported, never raised, so callers can turn exactly those pages into
misses.

``read_slots`` / ``write_slots`` move whole slots (every pool of a group, in pool order) between a
level and plain byte buffers: the remote tier's values.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._backend import DEVICE_MEMORY, HOST_MEMORY, NUM_MEDIA, MemoryBackend, Pool
from ._streams import StreamOrder
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
        #: the engine streams in use and the events that order our copies against them
        self.streams = StreamOrder(backend)

    def copy(
        self,
        src_pools: Sequence[Pool],
        dst_pools: Sequence[Pool],
        slot_sizes: Sequence[int],
        pairs: Sequence[tuple[int, int]],
    ) -> set[int]:
        """Copy slot ``src`` of every source pool to slot ``dst`` of the matching destination pool,
        for each ``(src, dst)`` of ``pairs``. Returns the indices of the pairs whose data could not
        be copied (disk errors). Copies touching GPU memory start after the kernels queued on the
        engine's streams, and those streams' next kernels after them (they may still be running on
        return); host memory is safe to reuse for the CPU only after ``backend.wait_copies()``."""
        failed: set[int] = set()
        if not pairs:
            return failed
        runs = coalesce(pairs)
        backend = self.backend
        src_medium, dst_medium = src_pools[0].medium, dst_pools[0].medium
        touches_device = src_medium == DEVICE_MEMORY or dst_medium == DEVICE_MEMORY
        if touches_device:
            self.streams.before()
        elif src_medium == HOST_MEMORY or dst_medium == HOST_MEMORY:
            backend.wait_copies()  # the CPU copies: an issued copy may still use those host slots
        batches: Batches = {}
        for p, size in enumerate(slot_sizes):
            src, dst = src_pools[p], dst_pools[p]
            self._routes[src.medium * NUM_MEDIA + dst.medium].copy(src, dst, size, runs, failed, batches)
            self.num_runs += len(runs)
        for kind, (dsts, srcs, sizes) in batches.items():
            backend.copy_batch(kind, dsts, srcs, sizes)
        if touches_device:
            self.streams.after()
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
        read failed for. The bytes are in place on return (GPU slots: after the kernels queued on
        the engine's streams)."""
        failed: set[int] = set()
        if slots and pools[0].medium == DEVICE_MEMORY:
            self.streams.before()  # (then copied out through the staging buffer and waited for)
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
        ``slots[i]``. Returns the indices a disk write failed for. The data is in place on return,
        except in GPU slots, where it lands before any kernel queued afterwards on a stream in use."""
        failed: set[int] = set()
        if not slots:
            return failed
        device = pools[0].medium == DEVICE_MEMORY
        if device:
            self.streams.before()  # kernels queued so far may still read the slots' old data
        at = 0
        for p, size in enumerate(slot_sizes):
            pool = pools[p]
            self.media[pool.medium].from_buffers(pool, size, slots, [d[at : at + size] for d in data], failed)
            at += size
        self.num_runs += len(slots) * len(slot_sizes)
        if device:
            self.streams.after()
        return failed
