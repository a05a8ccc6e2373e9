"""Host-emulated device: pools in anonymous mmap memory (GPU tier and host tier), synchronous copies
(so its streams and events are no-ops: ``MemoryBackend.asynchronous`` is False)."""

from __future__ import annotations

import ctypes
import mmap
import sys

from .._common import MemAddress
from .._exceptions import OutOfMemoryError
from .._utils import round_up
from ._backend import DEVICE_MEMORY, HOST_MEMORY, MemoryBackend, MemoryPool

# Python exposes MAP_NORESERVE only from 3.13; Linux's value: reserve address space, commit
# memory page by page as it is touched (so a pool sized like a real GPU costs nothing up front).
_MAP_NORESERVE: int = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class HostMemoryPool(MemoryPool):
    """An anonymous private mapping; the OS backs pages lazily, so reserving is cheap. With
    ``addressable`` False it plays device memory: no ``host_view``, reached by address only.

    Deeper because: ``MemoryPool`` is the interface of the pools in addressable memory, a kind of
    ``Pool`` (the other kind, ``DiskPool``, is a file)."""

    def __init__(self, max_bytes: int, addressable: bool = True) -> None:
        self.medium = HOST_MEMORY if addressable else DEVICE_MEMORY
        self.reserved_bytes = round_up(max(max_bytes, 1), mmap.PAGESIZE)
        try:
            self._mapping: mmap.mmap | None = mmap.mmap(
                -1,
                self.reserved_bytes,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as e:
            raise OutOfMemoryError(
                f"the host-emulated device could not reserve {self.reserved_bytes} bytes for a pool ({e}); "
                "lower the tier's quota"
            ) from e
        view = ctypes.c_char.from_buffer(self._mapping)
        self.base_address = MemAddress(ctypes.addressof(view))
        del view  # drop the buffer export so the mapping can be closed later
        self._view: memoryview | None = memoryview(self._mapping)
        self.host_view = self._view if addressable else None
        self._mapped = 0

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def _map(self, nbytes: int) -> None:
        self._mapped = nbytes

    def shrink(self, nbytes: int) -> None:
        beg = round_up(nbytes, mmap.PAGESIZE)
        if self._mapping is not None and _MADV_DONTNEED is not None and beg < self._mapped:
            self._mapping.madvise(_MADV_DONTNEED, beg, round_up(self._mapped, mmap.PAGESIZE) - beg)
        self._mapped = min(self._mapped, nbytes)

    def release(self) -> None:
        if self._mapping is not None:
            view = self._view
            if view is not None:
                view.release()
                self._view = self.host_view = None
            self._mapping.close()
            self._mapping = None


class HostBackend(MemoryBackend):
    """Stands in for a GPU: addresses are plain host addresses, streams and events are no-ops.

    ``addressable=False`` makes its GPU pools act like real device memory (no CPU view: copies by
    address, the CPU reaches them through a staging buffer), to exercise those routes without a GPU.
    """

    def __init__(self, addressable: bool = True) -> None:
        self.name = "host"
        self.addressable = addressable
        self._staging: HostMemoryPool | None = None

    def reserve_pool(self, max_bytes: int) -> MemoryPool:
        return HostMemoryPool(max_bytes, self.addressable)

    def reserve_host_pool(self, max_bytes: int) -> MemoryPool:
        return HostMemoryPool(max_bytes)

    def read(self, address: MemAddress, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def write(self, address: MemAddress, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def copy(self, dst: MemAddress, src: MemAddress, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy_batch(self, kind: int, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        for d, s, n in zip(dsts, srcs, sizes):
            ctypes.memmove(d, s, n)

    def synchronize(self) -> None:
        return None

    def staging_buffer(self, min_bytes: int) -> MemoryPool | None:
        if self.addressable:
            return None
        staging = self._staging
        if staging is None or staging.mapped_bytes < min_bytes:
            if staging is not None:
                staging.release()
            staging = HostMemoryPool(min_bytes)
            staging.ensure_mapped(min_bytes)
            self._staging = staging
        return staging

    def shutdown(self) -> None:
        if self._staging is not None:
            self._staging.release()
            self._staging = None
