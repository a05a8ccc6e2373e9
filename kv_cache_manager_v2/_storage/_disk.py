"""Disk-tier pools: one preallocated private file per pool, read with pread and written with pwrite."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable

from .._exceptions import OutOfMemoryError
from ._backend import Pool

#: ``DiskPool.error_hook(op, offset, nbytes)``: return True to make that read/write fail (tests).
ErrorHook = Callable[[str, int, int], bool]


class DiskPool(Pool):
    """A file created owner-only (mode 0600) in ``directory`` and unlinked at once: nobody else can
    open it, and it disappears with the process. Space is allocated up front (``posix_fallocate``
    where the file system supports it), so a write never finds the disk full.

    ``error_hook`` (None by default) is consulted before every I/O; tests use it to inject
    failures, which behave exactly like an ``OSError`` from the file system.
    """

    def __init__(self, directory: str, nbytes: int) -> None:
        fd, path = tempfile.mkstemp(prefix="kv-cache-", suffix=".pool", dir=directory)
        os.unlink(path)
        self.fd = fd
        self.directory = directory
        self.reserved_bytes = 1 << 62  # a file can always grow; only the disk limits it
        self._size = 0
        self.error_hook: ErrorHook | None = None
        self.num_errors = 0
        try:
            self.ensure_mapped(nbytes)
        except BaseException:
            os.close(fd)
            raise

    @property
    def mapped_bytes(self) -> int:
        return self._size

    def ensure_mapped(self, nbytes: int) -> None:
        if nbytes <= self._size:
            return
        try:
            os.posix_fallocate(self.fd, self._size, nbytes - self._size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OutOfMemoryError(
                    f"the disk tier could not allocate {nbytes} bytes in {self.directory} ({e.strerror}); "
                    "lower the tier's quota or free space there"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, nbytes)  # no fallocate here (e.g. some network file systems)
        self._size = nbytes

    def shrink(self, nbytes: int) -> None:
        if nbytes < self._size:
            os.ftruncate(self.fd, nbytes)
            self._size = nbytes

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _check(self, op: str, offset: int, nbytes: int) -> None:
        hook = self.error_hook
        if offset < 0 or offset + nbytes > self._size:
            raise OSError(errno.EINVAL, f"disk pool {op} of {nbytes} bytes at {offset} is outside the file")
        if hook is not None and hook(op, offset, nbytes):
            raise OSError(errno.EIO, f"injected disk {op} error at offset {offset}")

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from the file at ``offset``; raises ``OSError`` on any failure or short read."""
        n = len(view)
        try:
            self._check("read", offset, n)
            done = 0
            while done < n:
                got = os.preadv(self.fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(errno.EIO, f"short read from the disk pool at offset {offset + done}")
                done += got
        except OSError:
            self.num_errors += 1
            raise

    def write_from(self, view: memoryview, offset: int) -> None:
        """Write ``view`` to the file at ``offset``; raises ``OSError`` on any failure."""
        n = len(view)
        try:
            self._check("write", offset, n)
            done = 0
            while done < n:
                put = os.pwrite(self.fd, view[done:], offset + done)
                if put <= 0:
                    raise OSError(errno.EIO, f"short write to the disk pool at offset {offset + done}")
                done += put
        except OSError:
            self.num_errors += 1
            raise
