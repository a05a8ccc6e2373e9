"""Disk-tier pools: one preallocated private file per pool, read with pread and written with pwrite.

Every slot written is checksummed (CRC-32C where the ``crc32c`` package is installed, else zlib's
CRC-32) and every read is verified against the checksum of what was last written there: a slot
whose bytes changed behind the manager's back (a truncated, zeroed or overwritten file) reads as
an ``OSError``, which callers turn into a miss like any other disk error.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import zlib
from array import array
from collections.abc import Callable
from typing import Final

from .._exceptions import OutOfMemoryError
from ._backend import FILE, Pool

#: ``DiskPool.error_hook(op, offset, nbytes)``: return True to make that read/write fail (tests).
ErrorHook = Callable[[str, int, int], bool]
Checksum = Callable[[memoryview], int]


def _load_checksum() -> tuple[str, Checksum]:
    """The fastest well-kept checksum installed: CRC-32C (hardware-accelerated, ~20 GB/s) from the
    ``crc32c`` package, else zlib's CRC-32 (~4 GB/s)."""
    try:
        import crc32c
    except ImportError:
        return "crc32", zlib.crc32
    return "crc32c", crc32c.crc32c


CHECKSUM_NAME, checksum = _load_checksum()
#: checksum algorithm ids recorded with persisted pages
CHECKSUM_IDS: Final = {"crc32c": 1, "crc32": 2}
#: a slot that holds no verified data (never written, or its last write failed)
NO_CHECKSUM: Final = -1
#: ``DiskPool.read_checked`` outcomes
READ_OK: Final = 0
READ_FAILED: Final = 1
READ_CORRUPT: Final = 2


def refuse_unusable(name: str) -> None:
    """``ValueError`` naming ``name`` when it exists and is not a regular file of ours alone (a
    symbolic link, a directory, a FIFO, a socket, a device, a file with other hard links): a
    persistent tier never follows, truncates nor replaces such a path."""
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        return
    mode = st.st_mode
    if stat.S_ISREG(mode) and st.st_nlink <= 1:
        return
    if stat.S_ISREG(mode):
        what = f"a file with {st.st_nlink - 1} other hard link(s)"
    elif stat.S_ISLNK(mode):
        what = "a symbolic link"
    elif stat.S_ISDIR(mode):
        what = "a directory"
    elif stat.S_ISFIFO(mode):
        what = "a FIFO"
    elif stat.S_ISSOCK(mode):
        what = "a socket"
    else:
        what = "a device"
    raise ValueError(
        f"the persistent disk tier's path {name} is {what}, not a regular file: it is never followed, "
        "truncated nor replaced; remove it or choose another directory"
    )


def open_file(name: str) -> int:
    """Open ``name`` read-write for a persistent disk tier, creating it (mode 0600): never through
    a symbolic link, and only a regular file of ours alone (``ValueError`` naming it otherwise)."""
    refuse_unusable(name)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        refuse_unusable(name)  # (replaced since it was checked)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        refuse_unusable(name)
        raise ValueError(f"the persistent disk tier's path {name} is not a regular file of its own")
    return fd


def allocate(fd: int, offset: int, nbytes: int, directory: str) -> None:
    """Reserve ``nbytes`` of file ``fd`` from ``offset`` on (``posix_fallocate``; extended without
    reserving on a file system that cannot): ``OutOfMemoryError`` when the disk cannot hold them."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OutOfMemoryError(
                f"the disk tier could not allocate {offset + nbytes} bytes in {directory} ({e.strerror}); "
                "lower the tier's quota or free space there"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        if os.fstat(fd).st_size < offset + nbytes:
            os.ftruncate(fd, offset + nbytes)  # no fallocate here (e.g. some network file systems)


class DiskPool(Pool):
    """A file created owner-only (mode 0600) in ``directory`` and unlinked at once: nobody else can
    open it, and it disappears with the process (a persistent tier passes ``file_path``: that file is
    kept). Space is allocated up front (``posix_fallocate`` where the file system supports it), so a
    write never finds the disk full. ``sums`` holds each slot's checksum (see the module doc).

    ``error_hook`` (None by default) is consulted before every I/O; tests use it to inject
    failures, which behave exactly like an ``OSError`` from the file system.
    """

    def __init__(self, directory: str, nbytes: int, slot_size: int, file_path: str | None = None) -> None:
        if file_path is None:
            fd, path = tempfile.mkstemp(prefix="kv-cache-", suffix=".pool", dir=directory)
            os.unlink(path)
        else:  # a persistent tier's file: kept, its bytes read back by the next manager
            fd = open_file(file_path)
        self.fd = fd
        self.medium = FILE
        self.directory = directory
        self.reserved_bytes = 1 << 62  # a file can always grow; only the disk limits it
        self._size = 0
        #: bytes of one slot: the unit checksummed
        self.slot_size = slot_size
        #: per slot, the checksum of the bytes last written there (``NO_CHECKSUM``: nothing valid)
        self.sums = array("q")
        #: per slot, the pool's write count when it was last written (a background read planned
        #: before a write is stale); drawn from ``num_writes``, so a slot dropped by ``shrink`` and
        #: mapped again never repeats a value it had before
        self.generations = array("q")
        #: writes to the pool so far (the source of ``generations``)
        self.num_writes = 0
        self.error_hook: ErrorHook | None = None
        #: failed reads and writes (retries included)
        self.num_errors = 0
        #: slots whose bytes did not match their checksum when read
        self.num_corrupt = 0
        #: detached slots another thread could not read or verify (``FileSlot``)
        self.num_detached_errors = 0
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
        allocate(self.fd, self._size, nbytes - self._size, self.directory)
        self._size = nbytes
        slots = nbytes // self.slot_size
        if slots > len(self.sums):
            self.sums.extend([NO_CHECKSUM] * (slots - len(self.sums)))
            self.generations.extend([0] * (slots - len(self.generations)))

    def shrink(self, nbytes: int) -> None:
        if nbytes < self._size:
            os.ftruncate(self.fd, nbytes)
            self._size = nbytes
            del self.sums[nbytes // self.slot_size :]
            del self.generations[nbytes // self.slot_size :]

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

    def _slots(self, view: memoryview, offset: int) -> tuple[int, int]:
        """First slot and number of slots of an I/O of ``view`` at ``offset`` (whole slots only)."""
        size = self.slot_size
        if offset % size or len(view) % size:
            raise OSError(errno.EINVAL, f"disk pool I/O of {len(view)} bytes at {offset} is not whole slots of {size}")
        return offset // size, len(view) // size

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` (whole slots) from the file at ``offset`` and verify every slot's checksum;
        raises ``OSError`` on any failure, short read or checksum mismatch."""
        try:
            first, count = self._slots(view, offset)
            self._pread(view, offset)
            size = self.slot_size
            sums = self.sums
            for k in range(count):
                want = sums[first + k]
                if want == NO_CHECKSUM or checksum(view[k * size : (k + 1) * size]) != want:
                    self.num_corrupt += 1
                    raise OSError(errno.EBADMSG, f"disk pool slot {first + k} does not match its checksum")
        except OSError:
            self.num_errors += 1
            raise

    def _pread(self, view: memoryview, offset: int) -> None:
        n = len(view)
        self._check("read", offset, n)
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"short read from the disk pool at offset {offset + done}")
            done += got

    def read_checked(self, view: memoryview, offset: int, want: int) -> int:
        """A background read (any thread): fill ``view`` (one slot) from ``offset`` and verify it
        against ``want``, the slot's checksum when the read was planned. Touches no counter and
        raises nothing: returns ``READ_OK``, ``READ_FAILED`` or ``READ_CORRUPT`` (the scheduler's
        thread counts them with ``count_failed_read``)."""
        try:
            self._pread(view, offset)
        except (OSError, ValueError):  # (ValueError: the descriptor was closed meanwhile)
            return READ_FAILED
        return READ_OK if want != NO_CHECKSUM and checksum(view) == want else READ_CORRUPT

    def count_failed_read(self, outcome: int) -> None:
        """Count a background read's failure like ``read_into`` counts its own."""
        if outcome == READ_CORRUPT:
            self.num_corrupt += 1
        if outcome != READ_OK:
            self.num_errors += 1

    def write_from(self, view: memoryview, offset: int) -> None:
        """Write ``view`` (whole slots) to the file at ``offset`` and record each slot's checksum;
        raises ``OSError`` on any failure (the slots written then hold nothing valid)."""
        n = len(view)
        try:
            first, count = self._slots(view, offset)
            self._check("write", offset, n)
            size = self.slot_size
            sums = self.sums
            generations = self.generations
            self.num_writes += 1
            generation = self.num_writes
            for k in range(count):
                sums[first + k] = NO_CHECKSUM
                generations[first + k] = generation
            done = 0
            while done < n:
                put = os.pwrite(self.fd, view[done:], offset + done)
                if put <= 0:
                    raise OSError(errno.EIO, f"short write to the disk pool at offset {offset + done}")
                done += put
            for k in range(count):
                sums[first + k] = checksum(view[k * size : (k + 1) * size])
        except OSError:
            self.num_errors += 1
            raise
