"""CUDA backend through cuda-python's driver API.

GPU pools reserve a virtual address range up front and map physical chunks as they grow
(VMM), so a pool's base address never moves. Host-tier pools are anonymous mappings whose
used part is page-locked with ``cuMemHostRegister`` (DMA-able, and they can grow in place).
Copies run on the backend's own non-blocking stream, batched with ``cuMemcpyBatchAsync`` where the
driver has it, ordered against the engine's streams by events (``StreamOrder``); nothing here
synchronises the device. Every failing driver call raises ``CuError``. Importing this module never touches
the driver; only constructing ``CudaBackend`` does.
"""

from __future__ import annotations

import ctypes
import mmap
from bisect import bisect_right, insort
from typing import Any, Final

from .._common import MemAddress
from .._exceptions import CuError
from .._utils import round_up
from ._backend import COPY_STREAM, D2D, D2H, DEVICE_MEMORY, H2D, H2H, HOST_MEMORY, MemoryBackend, MemoryPool

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: host memory is registered in chunks of this size (so a pool can shrink chunk by chunk)
_HOST_CHUNK = 64 << 20


#: greater than any address (sorts a probe ``(address, _NO_END)`` after every range starting there)
_NO_END: Final = 1 << 64


class HostRegistrations:
    """A backend's host ranges page-locked by ``cuMemHostRegister``. A copy to or from page-locked
    memory must lie within one registration: the driver refuses one that spans two, even adjacent
    ones (``CUDA_ERROR_INVALID_VALUE``), so ``copy_batch`` cuts copies at their ends."""

    def __init__(self) -> None:
        #: ``(start, end)`` by start; replaced whole on every change, so a copy on another thread
        #: (the remote tier's writer) reads one consistent list
        self.ranges: list[tuple[int, int]] = []

    def add(self, start: int, size: int) -> None:
        ranges = list(self.ranges)
        insort(ranges, (start, start + size))
        self.ranges = ranges

    def remove(self, start: int) -> None:
        self.ranges = [r for r in self.ranges if r[0] != start]

    def cut(self, host_is_dst: bool, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        """Cut in place every copy whose host side (the destination or the source) runs past the
        end of its registration into pieces that each lie within one."""
        ranges = self.ranges
        i = 0
        while i < len(sizes):
            d, s, n = dsts[i], srcs[i], sizes[i]
            h = d if host_is_dst else s
            j = bisect_right(ranges, (h, _NO_END)) - 1  # the last registration starting at or before h
            if j >= 0 and h < ranges[j][1] < h + n:
                k = ranges[j][1] - h
                sizes[i] = k
                dsts.insert(i + 1, d + k)
                srcs.insert(i + 1, s + k)
                sizes.insert(i + 1, n - k)
            i += 1


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(result: Any, call: str) -> Any:
    """Unpack a driver call's ``(status, *values)`` tuple; raise ``CuError`` on failure."""
    cu = _driver()
    status = result[0] if isinstance(result, tuple) else result
    if status != cu.CUresult.CUDA_SUCCESS:
        name_res = cu.cuGetErrorName(status)
        text_res = cu.cuGetErrorString(status)
        name = name_res[1].decode() if name_res[0] == cu.CUresult.CUDA_SUCCESS else str(status)
        text = text_res[1].decode() if text_res[0] == cu.CUresult.CUDA_SUCCESS else "unknown error"
        raise CuError(int(status), name, text, call)
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def cuda_device_count() -> int:
    """Number of CUDA devices; raises when the driver cannot be loaded."""
    cu = _driver()
    _check(cu.cuInit(0), "cuInit")
    return int(_check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


class CudaDevicePool(MemoryPool):
    """Virtual range of ``reserved_bytes``; physical chunks of ``granularity`` mapped on demand.

    Deeper because: ``MemoryPool`` is the interface of the pools in addressable memory, a kind of
    ``Pool`` (the other kind, ``DiskPool``, is a file)."""

    def __init__(self, backend: CudaBackend, max_bytes: int) -> None:
        cu = _driver()
        self._backend = backend
        self._granularity = backend.granularity
        self.medium = DEVICE_MEMORY
        self.reserved_bytes = round_up(max(max_bytes, 1), self._granularity)
        ptr = _check(cu.cuMemAddressReserve(self.reserved_bytes, 0, 0, 0), "cuMemAddressReserve")
        self.base_address = MemAddress(int(ptr))
        self._handles: list[tuple[int, int, Any]] = []
        self._mapped = 0
        self._released = False
        self.host_view = None

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def _map(self, nbytes: int) -> None:
        cu = _driver()
        target = round_up(nbytes, self._granularity)
        size = target - self._mapped
        handle = _check(cu.cuMemCreate(size, self._backend.alloc_prop, 0), "cuMemCreate")
        ptr = cu.CUdeviceptr(self.base_address + self._mapped)
        try:
            _check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            try:
                _check(cu.cuMemSetAccess(ptr, size, [self._backend.access_desc], 1), "cuMemSetAccess")
            except CuError:
                cu.cuMemUnmap(ptr, size)
                raise
        except CuError:
            cu.cuMemRelease(handle)
            raise
        self._handles.append((self._mapped, size, handle))
        self._mapped = target

    def shrink(self, nbytes: int) -> None:
        """Unmap and release the physical chunks that lie wholly beyond ``nbytes``."""
        cu = _driver()
        self._backend.synchronize()
        while self._handles and self._handles[-1][0] >= nbytes:
            entry = self._handles.pop()
            _check(cu.cuMemUnmap(cu.CUdeviceptr(self.base_address + entry[0]), entry[1]), "cuMemUnmap")
            _check(cu.cuMemRelease(entry[2]), "cuMemRelease")
            self._mapped = entry[0]

    def release(self) -> None:
        if self._released:
            return
        cu = _driver()
        self._backend.synchronize()
        for i in range(len(self._handles) - 1, -1, -1):
            entry = self._handles[i]
            _check(cu.cuMemUnmap(cu.CUdeviceptr(self.base_address + entry[0]), entry[1]), "cuMemUnmap")
            _check(cu.cuMemRelease(entry[2]), "cuMemRelease")
        self._handles = []
        _check(cu.cuMemAddressFree(cu.CUdeviceptr(self.base_address), self.reserved_bytes), "cuMemAddressFree")
        self._mapped = 0
        self._released = True


class PinnedHostPool(MemoryPool):
    """Host memory reserved as an anonymous mapping; its used part is page-locked chunk by chunk
    (unlocked only once ``backend``'s copies, which may still use it, are done).

    Deeper because: ``MemoryPool`` is the interface of the pools in addressable memory, a kind of
    ``Pool`` (the other kind, ``DiskPool``, is a file)."""

    def __init__(self, max_bytes: int, backend: CudaBackend) -> None:
        self.medium = HOST_MEMORY
        self._backend = backend
        self._registrations = backend.host_registrations
        self.reserved_bytes = round_up(max(max_bytes, 1), mmap.PAGESIZE)
        self._mapping: mmap.mmap | None = mmap.mmap(
            -1,
            self.reserved_bytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        view = ctypes.c_char.from_buffer(self._mapping)
        self.base_address = MemAddress(ctypes.addressof(view))
        del view
        self.host_view = memoryview(self._mapping)
        self._chunks: list[tuple[int, int]] = []  # (offset, size) of registered ranges
        self._mapped = 0

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def _map(self, nbytes: int) -> None:
        cu = _driver()
        target = min(round_up(nbytes, mmap.PAGESIZE), self.reserved_bytes)
        done: list[tuple[int, int]] = []
        off = self._mapped
        try:
            while off < target:
                size = min(_HOST_CHUNK, target - off)
                _check(cu.cuMemHostRegister(self.base_address + off, size, 0), "cuMemHostRegister")
                self._registrations.add(self.base_address + off, size)
                done.append((off, size))
                off += size
        except CuError:
            for chunk in done:  # nothing changed
                cu.cuMemHostUnregister(self.base_address + chunk[0])
                self._registrations.remove(self.base_address + chunk[0])
            raise
        self._chunks.extend(done)
        self._mapped = target

    def shrink(self, nbytes: int) -> None:
        cu = _driver()
        if self._chunks and self._chunks[-1][0] >= nbytes:
            self._backend.wait_copies()
        while self._chunks and self._chunks[-1][0] >= nbytes:
            chunk = self._chunks.pop()
            _check(cu.cuMemHostUnregister(self.base_address + chunk[0]), "cuMemHostUnregister")
            self._registrations.remove(self.base_address + chunk[0])
            if self._mapping is not None and _MADV_DONTNEED is not None:
                self._mapping.madvise(_MADV_DONTNEED, chunk[0], chunk[1])
            self._mapped = chunk[0]

    def release(self) -> None:
        if self._mapping is None:
            return
        cu = _driver()
        self._backend.wait_copies()
        for i in range(len(self._chunks) - 1, -1, -1):
            _check(cu.cuMemHostUnregister(self.base_address + self._chunks[i][0]), "cuMemHostUnregister")
            self._registrations.remove(self.base_address + self._chunks[i][0])
        self._chunks = []
        self._mapped = 0
        view = self.host_view
        if view is not None:
            view.release()
            self.host_view = None
        self._mapping.close()
        self._mapping = None


class CudaBackend(MemoryBackend):
    """Device 0's primary context; one non-blocking stream for the manager's own copies (so the
    legacy default stream does not order them either: only events do)."""

    def __init__(self, device_ordinal: int = 0) -> None:
        cu = _driver()
        self.name = "cuda"
        _check(cu.cuInit(0), "cuInit")
        self.device = _check(cu.cuDeviceGet(device_ordinal), "cuDeviceGet")
        self.context = _check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_ordinal
        self.alloc_prop = prop
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device_ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access_desc = desc
        self.granularity = int(
            _check(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        self.stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.asynchronous = True
        #: copies issued on ``stream`` since the CPU last waited for them (``wait_copies``)
        self.copies_pending = False
        self._device_ordinal = device_ordinal
        self._closed = False
        #: cuMemcpyBatchAsync is used while the driver has it and accepts it
        self.use_batch_copies = hasattr(cu, "cuMemcpyBatchAsync")
        self._batch_attrs: Any = None
        self._staging: PinnedHostPool | None = None
        self.host_registrations = HostRegistrations()

    def reserve_pool(self, max_bytes: int) -> MemoryPool:
        return CudaDevicePool(self, max_bytes)

    def reserve_host_pool(self, max_bytes: int) -> MemoryPool:
        return PinnedHostPool(max_bytes, self)

    def staging_buffer(self, min_bytes: int) -> MemoryPool | None:
        staging = self._staging
        if staging is None or staging.mapped_bytes < min_bytes:
            if staging is not None:
                staging.release()  # (after our copies)
                self._staging = None
            staging = PinnedHostPool(min_bytes, self)
            staging.ensure_mapped(min_bytes)
            self._staging = staging
        return staging

    def read(self, address: MemAddress, nbytes: int) -> bytes:
        cu = _driver()
        out = bytearray(nbytes)
        self.synchronize()
        _check(cu.cuMemcpyDtoH(out, cu.CUdeviceptr(address), nbytes), "cuMemcpyDtoH")
        return bytes(out)

    def write(self, address: MemAddress, data: bytes) -> None:
        cu = _driver()
        self.synchronize()
        _check(cu.cuMemcpyHtoD(cu.CUdeviceptr(address), data, len(data)), "cuMemcpyHtoD")

    def copy(self, dst: MemAddress, src: MemAddress, nbytes: int, stream: int) -> None:
        cu = _driver()
        s = cu.CUstream(stream) if stream else self.stream
        _check(cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, s), "cuMemcpyAsync")

    def copy_batch(self, kind: int, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        if not dsts:
            return
        cu = _driver()
        stream = self.stream
        if kind == H2H:
            self.wait_copies()  # earlier DMA into or out of these pages must be done first
            for d, s, n in zip(dsts, srcs, sizes):
                ctypes.memmove(d, s, n)
            return
        self.copies_pending = True  # (also when a call below fails: some copies may have been queued)
        if kind != D2D:  # a page-locked host range: within one registration per copy
            self.host_registrations.cut(kind == D2H, dsts, srcs, sizes)
        if self.use_batch_copies and len(dsts) > 1:
            if self._batch_attrs is None:
                attr = cu.CUmemcpyAttributes()
                attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                self._batch_attrs = [attr]
            try:
                _check(
                    cu.cuMemcpyBatchAsync(
                        [cu.CUdeviceptr(d) for d in dsts],
                        [cu.CUdeviceptr(s) for s in srcs],
                        sizes,
                        len(dsts),
                        self._batch_attrs,
                        [0],
                        1,
                        stream,
                    ),
                    "cuMemcpyBatchAsync",
                )
                return
            except CuError:
                self.use_batch_copies = False  # older driver: one call per copy from now on
        for d, s, n in zip(dsts, srcs, sizes):
            if kind == H2D:
                _check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(d), s, n, stream), "cuMemcpyHtoDAsync")
            elif kind == D2H:
                _check(cu.cuMemcpyDtoHAsync(d, cu.CUdeviceptr(s), n, stream), "cuMemcpyDtoHAsync")
            else:
                assert kind == D2D
                _check(cu.cuMemcpyAsync(cu.CUdeviceptr(d), cu.CUdeviceptr(s), n, stream), "cuMemcpyAsync")

    def synchronize(self) -> None:
        _check(_driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        self.copies_pending = False

    def wait_copies(self) -> None:
        if self.copies_pending:
            self.synchronize()

    def create_event(self) -> object:
        cu = _driver()
        return _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def destroy_event(self, event: object) -> None:
        _check(_driver().cuEventDestroy(event), "cuEventDestroy")

    def record_event(self, event: object, stream: int) -> None:
        cu = _driver()
        s = self.stream if stream == COPY_STREAM else cu.CUstream(stream)
        _check(cu.cuEventRecord(event, s), "cuEventRecord")

    def wait_event(self, stream: int, event: object) -> None:
        cu = _driver()
        s = self.stream if stream == COPY_STREAM else cu.CUstream(stream)
        _check(cu.cuStreamWaitEvent(s, event, 0), "cuStreamWaitEvent")

    def shutdown(self) -> None:
        if self._closed:
            return
        cu = _driver()
        self.synchronize()
        if self._staging is not None:
            self._staging.release()
            self._staging = None
        _check(cu.cuStreamDestroy(self.stream), "cuStreamDestroy")
        _check(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
        self._closed = True
