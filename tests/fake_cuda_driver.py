"""A stand-in for ``cuda.bindings.driver`` backed by host memory, so the CUDA backend's own
logic (VMM growth, copies, error conversion, release order) runs on machines without a GPU.

It reuses the real module's types and enums; only the calls are emulated. Set
``fail_next[name] = status`` to make the next call of ``name`` fail with that status.
Host memory must be registered (page-locked) before an async copy touches it, device memory
must be mapped, and everything must be released at the end: the fake asserts all of it.
``FakeDriver(batch=False)`` has no ``cuMemcpyBatchAsync`` (an older driver).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

from cuda.bindings import driver as real

GRANULARITY = 2 << 20


class FakeDriver:
    def __init__(self, batch: bool = True) -> None:
        self.CUresult = real.CUresult
        self.CUmemAllocationProp = real.CUmemAllocationProp
        self.CUmemAllocationType = real.CUmemAllocationType
        self.CUmemLocationType = real.CUmemLocationType
        self.CUmemAccessDesc = real.CUmemAccessDesc
        self.CUmemAccess_flags = real.CUmemAccess_flags
        self.CUmemAllocationGranularity_flags = real.CUmemAllocationGranularity_flags
        self.CUstream_flags = real.CUstream_flags
        self.CUdeviceptr = real.CUdeviceptr
        self.CUstream = real.CUstream
        self.CUmemcpyAttributes = real.CUmemcpyAttributes
        self.CUmemcpySrcAccessOrder = real.CUmemcpySrcAccessOrder
        self.ok = real.CUresult.CUDA_SUCCESS
        self.registered: dict[int, int] = {}  # host address -> size of page-locked ranges
        self.bytes_copied = {"HtoD": 0, "DtoH": 0, "DtoD": 0}
        if batch:
            self.cuMemcpyBatchAsync = self._memcpy_batch_async
        self.reservations: dict[int, mmap.mmap] = {}
        self.mapped: dict[int, int] = {}  # address -> size of live mappings
        self.handles: set[int] = set()
        self.next_handle = 1
        self.calls: list[str] = []
        self.fail_next: dict[str, Any] = {}

    def _ret(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        status = self.fail_next.pop(name, None)
        if status is not None:
            return (status,) + tuple(None for _ in values)
        return (self.ok,) + values

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._ret("cuInit")

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return self._ret("cuDeviceGetCount", 1)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        return self._ret("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:
        return self._ret("cuDevicePrimaryCtxRetain", "ctx")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[Any, ...]:
        return self._ret("cuDevicePrimaryCtxRelease")

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        return self._ret("cuCtxSetCurrent")

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        return self._ret("cuCtxSynchronize")

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        return self._ret("cuMemGetAllocationGranularity", GRANULARITY)

    def cuStreamCreate(self, flags: Any) -> tuple[Any, ...]:
        return self._ret("cuStreamCreate", real.CUstream(0))

    def cuStreamDestroy(self, stream: Any) -> tuple[Any, ...]:
        return self._ret("cuStreamDestroy")

    def cuStreamSynchronize(self, stream: Any) -> tuple[Any, ...]:
        return self._ret("cuStreamSynchronize")

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[Any, ...]:
        assert size % GRANULARITY == 0, "reservations must be granularity-aligned"
        mm = mmap.mmap(-1, size + GRANULARITY)  # over-reserve to align like the driver does
        view = ctypes.c_char.from_buffer(mm)
        base = -(-ctypes.addressof(view) // GRANULARITY) * GRANULARITY
        del view
        self.reservations[base] = mm
        return self._ret("cuMemAddressReserve", real.CUdeviceptr(base))

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple[Any, ...]:
        mm = self.reservations.pop(int(ptr))
        assert len(mm) == size + GRANULARITY
        assert not any(int(ptr) <= a < int(ptr) + size for a in self.mapped), "free before unmap"
        mm.close()
        return self._ret("cuMemAddressFree")

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        assert size % GRANULARITY == 0
        h = self.next_handle
        self.next_handle += 1
        res = self._ret("cuMemCreate", h)
        if res[0] == self.ok:
            self.handles.add(h)
        return res

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        self.handles.remove(handle)
        return self._ret("cuMemRelease")

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:
        res = self._ret("cuMemMap")
        if res[0] == self.ok:
            assert int(ptr) % GRANULARITY == 0 and size % GRANULARITY == 0
            self.mapped[int(ptr)] = size
        return res

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[Any, ...]:
        assert self.mapped.pop(int(ptr)) == size
        return self._ret("cuMemUnmap")

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> tuple[Any, ...]:
        return self._ret("cuMemSetAccess")

    def _check_mapped(self, addr: int, n: int) -> None:
        assert any(a <= addr and addr + n <= a + s for a, s in self.mapped.items()), f"{addr:#x}+{n} not mapped"

    def cuMemcpyDtoH(self, dst: bytearray, src: Any, n: int) -> tuple[Any, ...]:
        self._check_mapped(int(src), n)
        ctypes.memmove((ctypes.c_char * n).from_buffer(dst), int(src), n)
        return self._ret("cuMemcpyDtoH")

    def cuMemcpyHtoD(self, dst: Any, src: bytes, n: int) -> tuple[Any, ...]:
        self._check_mapped(int(dst), n)
        ctypes.memmove(int(dst), src, n)
        return self._ret("cuMemcpyHtoD")

    def cuMemcpyAsync(self, dst: Any, src: Any, n: int, stream: Any) -> tuple[Any, ...]:
        self._check_mapped(int(dst), n)
        self._check_mapped(int(src), n)
        ctypes.memmove(int(dst), int(src), n)
        self.bytes_copied["DtoD"] += n
        return self._ret("cuMemcpyAsync")

    def _is_mapped(self, addr: int, n: int) -> bool:
        return any(a <= addr and addr + n <= a + s for a, s in self.mapped.items())

    def _is_registered(self, addr: int, n: int) -> bool:
        return any(a <= addr and addr + n <= a + s for a, s in self.registered.items())

    def cuMemHostRegister(self, ptr: int, size: int, flags: int) -> tuple[Any, ...]:
        assert isinstance(ptr, int) and ptr % mmap.PAGESIZE == 0 and size > 0
        assert not any(a < ptr + size and ptr < a + s for a, s in self.registered.items()), "registered twice"
        res = self._ret("cuMemHostRegister")
        if res[0] == self.ok:
            self.registered[ptr] = size
        return res

    def cuMemHostUnregister(self, ptr: int) -> tuple[Any, ...]:
        assert self.registered.pop(int(ptr), None) is not None, "unregistering memory never registered"
        return self._ret("cuMemHostUnregister")

    def cuMemcpyHtoDAsync(self, dst: Any, src: int, n: int, stream: Any) -> tuple[Any, ...]:
        self._check_mapped(int(dst), n)
        assert self._is_registered(int(src), n), f"async copy from pageable host memory {int(src):#x}+{n}"
        ctypes.memmove(int(dst), int(src), n)
        self.bytes_copied["HtoD"] += n
        return self._ret("cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(self, dst: int, src: Any, n: int, stream: Any) -> tuple[Any, ...]:
        self._check_mapped(int(src), n)
        assert self._is_registered(int(dst), n), f"async copy to pageable host memory {int(dst):#x}+{n}"
        ctypes.memmove(int(dst), int(src), n)
        self.bytes_copied["DtoH"] += n
        return self._ret("cuMemcpyDtoHAsync")

    def _memcpy_batch_async(
        self,
        dsts: list[Any],
        srcs: list[Any],
        sizes: list[int],
        count: int,
        attrs: list[Any],
        attr_idxs: list[int],
        num_attrs: int,
        stream: Any,
    ) -> tuple[Any, ...]:
        assert len(dsts) == len(srcs) == len(sizes) == count and len(attrs) == len(attr_idxs) == num_attrs >= 1
        assert attr_idxs[0] == 0
        assert all(a.srcAccessOrder != real.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_INVALID for a in attrs)
        res = self._ret("cuMemcpyBatchAsync")
        if res[0] != self.ok:
            return res
        for d, s, n in zip(dsts, srcs, sizes):
            d, s = int(d), int(s)
            d_dev, s_dev = self._is_mapped(d, n), self._is_mapped(s, n)
            assert d_dev or self._is_registered(d, n), f"batch copy to unregistered memory {d:#x}+{n}"
            assert s_dev or self._is_registered(s, n), f"batch copy from unregistered memory {s:#x}+{n}"
            ctypes.memmove(d, s, n)
            self.bytes_copied["DtoD" if d_dev and s_dev else ("HtoD" if d_dev else "DtoH")] += n
        return res

    def cuGetErrorName(self, status: Any) -> tuple[Any, ...]:
        return (self.ok, real.CUresult(status).name.encode())

    def cuGetErrorString(self, status: Any) -> tuple[Any, ...]:
        return (self.ok, b"emulated failure")
