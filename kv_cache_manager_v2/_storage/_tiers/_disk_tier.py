"""The disk tier: one preallocated, checksummed file per pool (``DiskPool``), read with pread and
written with pwrite. A failed read or write of a run is retried slot by slot, and the slots that
still fail are reported (never raised), so callers turn exactly those pages into misses. Device
memory reaches the file through the backend's staging buffer."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..._common import CacheTier
from ..._config import DiskCacheTierConfig
from ..._exceptions import OutOfMemoryError
from .._backend import MemoryBackend, Pool
from .._disk import DiskPool
from .._layout import PoolGroupLayout, StorageLayout
from .._persist import PersistentDisk, pool_file
from ._base import Batches, DetachedSlot, MediumAccess, Route, Run, Tier, file
from ._gpu_tier import read_device, write_device
from ._host_tier import host_view


def transfer(disk: DiskPool, slot: int, view: memoryview, size: int, run: Run, failed: set[int], read: bool) -> None:
    """One run (``run[2]`` slots) between ``view`` and the file from ``slot`` on; on failure each
    slot alone, so only the slots that really fail are reported (their pair indices: ``run[3]``)."""
    count, indices = run[2], run[3]
    try:
        if read:
            disk.read_into(view, slot * size)
        else:
            disk.write_from(view, slot * size)
        return
    except OSError:
        if count == 1:
            failed.add(indices[0])
            return
    for k in range(count):
        try:
            part = view[k * size : (k + 1) * size]
            if read:
                disk.read_into(part, (slot + k) * size)
            else:
                disk.write_from(part, (slot + k) * size)
        except OSError:
            failed.add(indices[k])


class FileSlot(DetachedSlot):
    """A detached slot in a disk tier's file: read (and verified) on the reading thread; the kernel
    copies with the GIL released."""

    def __init__(self, disk: DiskPool, offset: int, size: int) -> None:
        self.disk = disk
        self.offset = offset
        self.size = size

    def read(self) -> memoryview:
        buf = memoryview(bytearray(self.size))
        self.disk.read_into(buf, self.offset)
        return buf

    def failed(self) -> None:
        self.disk.num_detached_errors += 1  # the disk tier's io_errors


class FileAccess(MediumAccess):
    """A disk tier's file: one pread / pwrite per slot."""

    def to_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], views: list[memoryview], failed: set[int]
    ) -> None:
        disk = file(pool)
        for i, slot in enumerate(slots):
            try:
                disk.read_into(views[i], slot * size)
            except OSError:
                failed.add(i)

    def from_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], parts: list[memoryview], failed: set[int]
    ) -> None:
        disk = file(pool)
        for i, slot in enumerate(slots):
            try:
                disk.write_from(parts[i], slot * size)
            except OSError:
                failed.add(i)

    def can_detach(self) -> bool:
        return True

    def detach(self, pool: Pool, slot: int, size: int) -> DetachedSlot:
        return FileSlot(file(pool), slot * size, size)

    def num_detached_errors(self, pool: Pool) -> int:
        return file(pool).num_detached_errors


class FileCopy(Route):
    """File -> file, through a bounce buffer per run."""

    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        source, target = file(src), file(dst)
        for run in runs:
            buf = memoryview(bytearray(run[2] * size))
            transfer(source, run[0], buf, size, run, failed, True)
            transfer(target, run[1], buf, size, run, failed, False)


class HostToFile(Route):
    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        source, target = host_view(src), file(dst)
        for run in runs:
            s, d, n, _ = run
            transfer(target, d, source[s * size : (s + n) * size], size, run, failed, False)


class FileToHost(Route):
    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        source, target = file(src), host_view(dst)
        for run in runs:
            s, d, n, _ = run
            transfer(source, s, target[d * size : (d + n) * size], size, run, failed, True)


class StagedRoute(Route):
    """A route through the backend's staging buffer (at least ``staging_bytes``)."""

    def __init__(self, backend: MemoryBackend, staging_bytes: int) -> None:
        self.backend = backend
        self.staging_bytes = staging_bytes


class DeviceToFile(StagedRoute):
    """Device memory -> file through the staging buffer.

    Deeper because: ``StagedRoute`` is the ``Route`` part both staged routes share (the backend and
    the staging buffer's size)."""

    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        target = file(dst)

        def take(data: memoryview, run: Run) -> None:
            transfer(target, run[1], data, size, run, failed, False)

        read_device(self.backend, self.staging_bytes, src, size, runs, take)


class FileToDevice(StagedRoute):
    """File -> device memory through the staging buffer (a slot that fails to read carries garbage
    to a page its caller drops).

    Deeper because: ``StagedRoute`` is the ``Route`` part both staged routes share (the backend and
    the staging buffer's size)."""

    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        source = file(src)

        def fill(data: memoryview, run: Run) -> None:
            transfer(source, run[0], data, size, run, failed, True)

        write_device(self.backend, self.staging_bytes, dst, size, runs, fill)


class DiskTier(Tier):
    """Files under ``cfg.path`` for ``slots[g]`` slots of each pool group of ``layout``; named and
    kept, with their records, when the tier is persistent (``disk_fingerprint``: the layout's, in
    the records). Refuses (``OutOfMemoryError``) a file system that cannot hold them."""

    def __init__(
        self,
        backend: MemoryBackend,
        cfg: DiskCacheTierConfig,
        layout: StorageLayout,
        slots: list[int],
        disk_fingerprint: bytes,
        tokens_per_block: int,
    ) -> None:
        super().__init__(backend, CacheTier.DISK)
        self.cfg = cfg
        check_disk_space(cfg, layout, slots)
        self.persist: PersistentDisk | None = None
        if cfg.persistent:
            groups = [(group.slot_sizes, n) for group, n in zip(layout.pool_groups, slots)]
            self.persist = PersistentDisk(cfg, disk_fingerprint, groups, tokens_per_block)

    def persistent(self) -> PersistentDisk | None:
        return self.persist

    def make_pool(self, group: PoolGroupLayout, pool: int, num_bytes: int, max_bytes: int) -> Pool:
        persist = self.persist
        path = persist.pool_path(int(group.index), pool) if persist is not None else None
        return DiskPool(self.cfg.path, num_bytes, group.slot_sizes[pool], path)


def slot_sums(pools: list[Pool], slot: int) -> list[int]:
    """The checksums of ``slot`` in each of a disk level's ``pools``."""
    return [file(pool).sums[slot] for pool in pools]


def arm_sums(pools: list[Pool], slots: list[int], sums: list[bytes]) -> None:
    """Set each of ``slots``' checksums in a disk level's ``pools`` from its record's checksums
    (``sums[i]``: 4 little-endian bytes per pool)."""
    for p, pool in enumerate(pools):
        table = file(pool).sums
        for slot, packed in zip(slots, sums):
            table[slot] = int.from_bytes(packed[4 * p : 4 * p + 4], "little")


def check_disk_space(cfg: DiskCacheTierConfig, layout: StorageLayout, slots: list[int]) -> None:
    """Raise ``OutOfMemoryError`` naming the tier, its path and the bytes needed when the file system
    cannot hold the disk tier's files (a persistent tier's existing files count as room)."""
    need = sum(n * group.slot_bytes for group, n in zip(layout.pool_groups, slots))
    have = 0
    if cfg.persistent:
        for g, group in enumerate(layout.pool_groups):
            for p in range(len(group.slot_sizes)):
                try:
                    info = os.lstat(pool_file(cfg.path, g, p))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):  # (a link or device named like it is refused later)
                    have += info.st_blocks * 512
    st = os.statvfs(cfg.path)
    free = st.f_bavail * st.f_frsize
    if need > free + have:
        advice = "lower the tier's quota or free space there" if free + have else "choose a directory on a real disk"
        raise OutOfMemoryError(
            f"the disk tier could not allocate {need} bytes in {cfg.path} (the file system has {free + have} "
            f"bytes available, DiskCacheTierConfig.quota={cfg.quota}); {advice}"
        )
