"""Copy engine: moves the slot data of many pages between two levels (or within one) in one batch.

Every pair of media is handled: GPU <-> GPU, host <-> GPU, host <-> host (memory copies: a CPU
copy where both sides are CPU-addressable, else the backend's batched async copies), host <->
disk and disk <-> disk (pread/pwrite), GPU <-> disk through the backend's page-locked staging
buffer when the GPU is not CPU-addressable. Runs of consecutive slots on both sides are merged
into one copy. A failed disk read or write is retried slot by slot; the pairs that still fail
are reported, never raised, so callers can turn exactly those pages into misses.

``read_slots`` / ``write_slots`` move whole slots (every pool of a group, in pool order) between a
level and plain byte buffers: the remote tier's values.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._backend import D2D, D2H, H2D, MemoryBackend, MemoryPool, Pool
from ._disk import DiskPool

#: smallest staging buffer for GPU <-> disk copies (grown to one slot when slots are larger)
STAGING_BYTES = 32 << 20

# A run: (first source slot, first destination slot, number of slots, pair indices in slot order).
Run = tuple[int, int, int, list[int]]


def coalesce(pairs: Sequence[tuple[int, int]]) -> list[Run]:
    """Merge ``(src_slot, dst_slot)`` pairs into runs consecutive on both sides."""
    order = sorted(range(len(pairs)), key=lambda i: pairs[i])
    runs: list[Run] = []
    src0 = dst0 = count = -1
    idxs: list[int] = []
    for i in order:
        s, d = pairs[i]
        if count > 0 and s == src0 + count and d == dst0 + count:
            count += 1
            idxs.append(i)
            continue
        if count > 0:
            runs.append((src0, dst0, count, idxs))
        src0, dst0, count, idxs = s, d, 1, [i]
    if count > 0:
        runs.append((src0, dst0, count, idxs))
    return runs


def _split(runs: list[Run], max_slots: int) -> list[Run]:
    """Runs cut so none is longer than ``max_slots``."""
    out: list[Run] = []
    for s, d, n, idxs in runs:
        for k in range(0, n, max_slots):
            m = min(max_slots, n - k)
            out.append((s + k, d + k, m, idxs[k : k + m]))
    return out


def _is_device(pool: Pool) -> bool:
    return isinstance(pool, MemoryPool) and pool.host_view is None


class CopyEngine:
    """Batched slot copies for one backend. Not thread-safe (like the manager)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        #: copies issued (runs), for statistics and tests
        self.num_runs = 0

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
        touches_device = _is_device(src_pools[0]) or _is_device(dst_pools[0])
        if touches_device:
            backend.synchronize_device()
        batches: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for p, size in enumerate(slot_sizes):
            src, dst = src_pools[p], dst_pools[p]
            if isinstance(src, DiskPool) or isinstance(dst, DiskPool):
                self._copy_disk(src, dst, size, runs, failed)
            else:
                assert isinstance(src, MemoryPool) and isinstance(dst, MemoryPool)
                self._copy_memory(src, dst, size, runs, batches)
        for kind, (dsts, srcs, sizes) in batches.items():
            backend.copy_batch(kind, dsts, srcs, sizes)
        if touches_device:
            backend.synchronize()
        return failed

    def _copy_memory(
        self,
        src: MemoryPool,
        dst: MemoryPool,
        size: int,
        runs: list[Run],
        batches: dict[int, tuple[list[int], list[int], list[int]]],
    ) -> None:
        sv, dv = src.host_view, dst.host_view
        self.num_runs += len(runs)
        if sv is not None and dv is not None:
            for s, d, n, _ in runs:
                dv[d * size : (d + n) * size] = sv[s * size : (s + n) * size]
            return
        kind = D2D if sv is None and dv is None else (H2D if dv is None else D2H)
        batch = batches.get(kind)
        if batch is None:
            batch = batches[kind] = ([], [], [])
        sb, db = src.base_address, dst.base_address
        for s, d, n, _ in runs:
            batch[0].append(db + d * size)
            batch[1].append(sb + s * size)
            batch[2].append(n * size)

    def _copy_disk(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int]) -> None:
        self.num_runs += len(runs)
        if isinstance(src, DiskPool) and isinstance(dst, DiskPool):
            for s, d, n, idxs in runs:
                buf = memoryview(bytearray(n * size))
                self._transfer(src, s, buf, size, n, idxs, failed, True)
                self._transfer(dst, d, buf, size, n, idxs, failed, False)
            return
        if isinstance(dst, DiskPool):
            assert isinstance(src, MemoryPool)
            if src.host_view is not None:
                for s, d, n, idxs in runs:
                    self._transfer(dst, d, src.host_view[s * size : (s + n) * size], size, n, idxs, failed, False)
            else:
                self._device_to_disk(src, dst, size, runs, failed)
            return
        assert isinstance(src, DiskPool) and isinstance(dst, MemoryPool)
        if dst.host_view is not None:
            for s, d, n, idxs in runs:
                self._transfer(src, s, dst.host_view[d * size : (d + n) * size], size, n, idxs, failed, True)
        else:
            self._disk_to_device(src, dst, size, runs, failed)

    @staticmethod
    def _transfer(
        disk: DiskPool,
        slot: int,
        view: memoryview,
        size: int,
        n: int,
        idxs: list[int],
        failed: set[int],
        read: bool,
    ) -> None:
        """One run between ``view`` and the file at ``slot``; on failure each slot alone, so
        only the slots that really fail are reported."""
        try:
            if read:
                disk.read_into(view, slot * size)
            else:
                disk.write_from(view, slot * size)
            return
        except OSError:
            if n == 1:
                failed.add(idxs[0])
                return
        for k in range(n):
            try:
                part = view[k * size : (k + 1) * size]
                if read:
                    disk.read_into(part, (slot + k) * size)
                else:
                    disk.write_from(part, (slot + k) * size)
            except OSError:
                failed.add(idxs[k])

    def _staging(self, size: int) -> MemoryPool:
        staging = self.backend.staging_buffer(max(STAGING_BYTES, size))
        assert staging is not None and staging.host_view is not None
        return staging

    def _device_to_disk(self, src: MemoryPool, dst: DiskPool, size: int, runs: list[Run], failed: set[int]) -> None:
        staging = self._staging(size)
        view = staging.host_view
        assert view is not None
        per = staging.mapped_bytes // size
        pieces = _split(runs, per)
        i = 0
        while i < len(pieces):
            # fill the staging buffer with as many pieces as fit, copy them down, then write them
            batch: list[tuple[int, Run]] = []
            used = 0
            while i < len(pieces) and used + pieces[i][2] <= per:
                batch.append((used, pieces[i]))
                used += pieces[i][2]
                i += 1
            self.backend.copy_batch(
                D2H,
                [staging.base_address + at * size for at, _ in batch],
                [src.base_address + piece[0] * size for _, piece in batch],
                [piece[2] * size for _, piece in batch],
            )
            self.backend.synchronize()
            for at, (_, d, n, idxs) in batch:
                self._transfer(dst, d, view[at * size : (at + n) * size], size, n, idxs, failed, False)

    def _disk_to_device(self, src: DiskPool, dst: MemoryPool, size: int, runs: list[Run], failed: set[int]) -> None:
        staging = self._staging(size)
        view = staging.host_view
        assert view is not None
        per = staging.mapped_bytes // size
        pieces = _split(runs, per)
        i = 0
        while i < len(pieces):
            dsts: list[int] = []
            srcs: list[int] = []
            sizes: list[int] = []
            used = 0
            while i < len(pieces) and used + pieces[i][2] <= per:
                s, d, n, idxs = pieces[i]
                self._transfer(src, s, view[used * size : (used + n) * size], size, n, idxs, failed, True)
                dsts.append(dst.base_address + d * size)
                srcs.append(staging.base_address + used * size)
                sizes.append(n * size)
                used += n
                i += 1
            # slots that failed to read carry garbage to pages their callers will drop
            self.backend.copy_batch(H2D, dsts, srcs, sizes)
            self.backend.synchronize()

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
        views = bufs
        failed: set[int] = set()
        if slots and _is_device(pools[0]):
            self.backend.synchronize_device()  # the pages may have been written by any stream
        at = offset
        for p, size in enumerate(slot_sizes):
            pool = pools[p]
            if isinstance(pool, DiskPool):
                for i, s in enumerate(slots):
                    try:
                        pool.read_into(views[i][at : at + size], s * size)
                    except OSError:
                        failed.add(i)
            else:
                assert isinstance(pool, MemoryPool)
                hv = pool.host_view
                if hv is not None:
                    for i, s in enumerate(slots):
                        views[i][at : at + size] = hv[s * size : (s + 1) * size]
                else:
                    self._device_to_buffers(pool, size, slots, [v[at : at + size] for v in views])
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
            parts = [d[at : at + size] for d in data]
            if isinstance(pool, DiskPool):
                for i, s in enumerate(slots):
                    try:
                        pool.write_from(parts[i], s * size)
                    except OSError:
                        failed.add(i)
            else:
                assert isinstance(pool, MemoryPool)
                hv = pool.host_view
                if hv is not None:
                    for i, s in enumerate(slots):
                        hv[s * size : (s + 1) * size] = parts[i]
                else:
                    self._buffers_to_device(pool, size, slots, parts)
            at += size
        self.num_runs += len(slots) * len(slot_sizes)
        return failed

    def _device_to_buffers(self, pool: MemoryPool, size: int, slots: Sequence[int], out: list[memoryview]) -> None:
        """GPU slots -> host buffers through the page-locked staging buffer, as many per batch as fit."""
        staging = self._staging(size)
        view = staging.host_view
        assert view is not None
        per = staging.mapped_bytes // size
        for beg in range(0, len(slots), per):
            chunk = slots[beg : beg + per]
            self.backend.copy_batch(
                D2H,
                [staging.base_address + j * size for j in range(len(chunk))],
                [pool.base_address + s * size for s in chunk],
                [size] * len(chunk),
            )
            self.backend.synchronize()
            for j in range(len(chunk)):
                out[beg + j][:] = view[j * size : (j + 1) * size]

    def _buffers_to_device(self, pool: MemoryPool, size: int, slots: Sequence[int], data: list[memoryview]) -> None:
        staging = self._staging(size)
        view = staging.host_view
        assert view is not None
        per = staging.mapped_bytes // size
        self.backend.synchronize_device()  # nobody may still read the slots being overwritten
        for beg in range(0, len(slots), per):
            chunk = slots[beg : beg + per]
            for j in range(len(chunk)):
                view[j * size : (j + 1) * size] = data[beg + j]
            self.backend.copy_batch(
                H2D,
                [pool.base_address + s * size for s in chunk],
                [staging.base_address + j * size for j in range(len(chunk))],
                [size] * len(chunk),
            )
            self.backend.synchronize()
