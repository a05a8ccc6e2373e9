"""CUDA backend through cuda-python's driver API.

GPU pools reserve a virtual address range up front and map physical chunks as they grow
(VMM), so a pool's base address never moves. Every failing driver call raises ``CuError``.
Importing this module never touches the driver; only constructing ``CudaBackend`` does.
"""

from __future__ import annotations

from typing import Any

from .._common import MemAddress
from .._exceptions import CuError
from .._utils import round_up
from ._backend import DevicePool, MemoryBackend


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


class CudaDevicePool(DevicePool):
    """Virtual range of ``reserved_bytes``; physical chunks of ``granularity`` mapped on demand."""

    def __init__(self, backend: CudaBackend, max_bytes: int) -> None:
        cu = _driver()
        self._backend = backend
        self._granularity = backend.granularity
        self.reserved_bytes = round_up(max(max_bytes, 1), self._granularity)
        ptr = _check(cu.cuMemAddressReserve(self.reserved_bytes, 0, 0, 0), "cuMemAddressReserve")
        self.base_address = MemAddress(int(ptr))
        self._handles: list[tuple[int, int, Any]] = []
        self._mapped = 0
        self._released = False

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def ensure_mapped(self, nbytes: int) -> None:
        if nbytes <= self._mapped:
            return
        if nbytes > self.reserved_bytes:
            raise ValueError(f"pool needs {nbytes} bytes but only {self.reserved_bytes} are reserved")
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


class CudaBackend(MemoryBackend):
    """Device 0's primary context; one non-blocking stream for the manager's own copies."""

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
        self._device_ordinal = device_ordinal
        self._closed = False

    def reserve_pool(self, max_bytes: int) -> DevicePool:
        return CudaDevicePool(self, max_bytes)

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

    def synchronize(self) -> None:
        _check(_driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def synchronize_device(self) -> None:
        _check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")

    def shutdown(self) -> None:
        if self._closed:
            return
        cu = _driver()
        self.synchronize()
        _check(cu.cuStreamDestroy(self.stream), "cuStreamDestroy")
        _check(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
        self._closed = True
