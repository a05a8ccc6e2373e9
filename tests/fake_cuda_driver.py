"""A stand-in for ``cuda.bindings.driver`` backed by host memory, so the CUDA backend's own
logic (VMM growth, copies, error conversion, release order, stream ordering) runs on machines
without a GPU.

It reuses the real module's types and enums; only the calls are emulated. Set
``fail_next[name] = status`` to make the next call of ``name`` fail with that status.
Host memory must be registered (page-locked) before an async copy touches it, device memory
must be mapped, and everything must be released at the end: the fake asserts all of it.
``FakeDriver(batch=False)`` has no ``cuMemcpyBatchAsync`` (an older driver).

Streams and events: async copies are *deferred*: their bytes move only when the CPU waits for
their stream (``cuStreamSynchronize``, ``cuEventSynchronize``, ``cuCtxSynchronize``, a synchronous
copy), so a CPU access of host memory an issued copy still uses sees stale bytes (and unlocking
or unmapping memory a pending copy uses fails). Every stream keeps a vector clock (events carry
the clock of their record, ``cuStreamWaitEvent`` merges it), so the fake knows which operations
are ordered: ``kernel(stream, reads, writes)`` declares the engine's kernel accesses (the fake
engine does, given the driver), and any copy and kernel that touch the same bytes (one writing)
without being ordered fail at once. An event waited for or synchronised before it was recorded
fails too. ``log`` lists the ordering calls and copies: ``(call, stream, event)``.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Iterable
from typing import Any

from cuda.bindings import driver as real

GRANULARITY = 2 << 20
#: shadow-memory unit of the ordering checks (accesses are kept per unit they touch)
_UNIT = 4096
#: handles of the streams ``cuStreamCreate`` makes (engine streams in tests are small ints; 0 legacy)
FIRST_STREAM = 0x10000

Clock = dict[int, int]
#: one access: (start, end, stream, its sequence number on the stream, writes)
Access = tuple[int, int, int, int, bool]


def _ordered(stream: int, seq: int, clock: Clock) -> bool:
    """Whether operation ``seq`` of ``stream`` happens before an operation with vector clock ``clock``."""
    return clock.get(stream, 0) >= seq


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
        self.CUevent = real.CUevent
        self.CUevent_flags = real.CUevent_flags
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
        #: (call, stream, event) of every event call, stream wait, synchronisation and async copy
        self.log: list[tuple[str, int, int]] = []
        self.streams_made = 0
        self.live_streams: set[int] = set()
        self.clocks: dict[int, Clock] = {}  # stream -> vector clock
        self.events: dict[int, Clock | None] = {}  # live event -> clock of its last record (None: never)
        self.next_event = 1
        self.pending: list[tuple[int, int, int, int]] = []  # deferred copies: (dst, src, n, stream)
        self.copies: dict[int, list[Access]] = {}  # unit -> async copy accesses
        self.kernels: dict[int, list[Access]] = {}  # unit -> declared kernel accesses

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
        self.log.append(("cuCtxSynchronize", -1, 0))
        self._flush()
        return self._ret("cuCtxSynchronize")

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        return self._ret("cuMemGetAllocationGranularity", GRANULARITY)

    def cuStreamCreate(self, flags: Any) -> tuple[Any, ...]:
        handle = FIRST_STREAM + self.streams_made
        self.streams_made += 1
        res = self._ret("cuStreamCreate", real.CUstream(handle))
        if res[0] == self.ok:
            self.live_streams.add(handle)
        return res

    def cuStreamDestroy(self, stream: Any) -> tuple[Any, ...]:
        handle = int(stream)
        assert handle in self.live_streams, "destroying a stream never created"
        assert not any(p[3] == handle for p in self.pending), "destroying a stream with copies pending"
        self.live_streams.remove(handle)
        return self._ret("cuStreamDestroy")

    def cuStreamSynchronize(self, stream: Any) -> tuple[Any, ...]:
        self.log.append(("cuStreamSynchronize", int(stream), 0))
        self._flush()
        return self._ret("cuStreamSynchronize")

    # ---------------------------------------------------------------- streams, events, ordering
    def _stream(self, stream: Any) -> int:
        handle = int(stream)
        assert handle < FIRST_STREAM or handle in self.live_streams, f"stream {handle:#x} was destroyed"
        return handle

    def _tick(self, stream: int) -> tuple[int, Clock]:
        """A new operation on ``stream``: its sequence number and the stream's clock after it."""
        clock = self.clocks.setdefault(stream, {})
        seq = clock[stream] = clock.get(stream, 0) + 1
        return seq, clock

    def cuEventCreate(self, flags: Any) -> tuple[Any, ...]:
        event = self.next_event
        self.next_event += 1
        res = self._ret("cuEventCreate", real.CUevent(event))
        if res[0] == self.ok:
            self.events[event] = None
        return res

    def cuEventDestroy(self, event: Any) -> tuple[Any, ...]:
        assert self.events.pop(int(event), 0) != 0, "destroying an event never created (or twice)"
        return self._ret("cuEventDestroy")

    def cuEventRecord(self, event: Any, stream: Any) -> tuple[Any, ...]:
        e, s = int(event), self._stream(stream)
        assert e in self.events, f"recording event {e}, never created or destroyed"
        self.log.append(("cuEventRecord", s, e))
        res = self._ret("cuEventRecord")
        if res[0] == self.ok:
            self.events[e] = dict(self.clocks.setdefault(s, {}))
        return res

    def cuStreamWaitEvent(self, stream: Any, event: Any, flags: int) -> tuple[Any, ...]:
        e, s = int(event), self._stream(stream)
        recorded = self.events.get(e)
        assert recorded is not None, f"stream {s:#x} waits for event {e}, never recorded"
        self.log.append(("cuStreamWaitEvent", s, e))
        res = self._ret("cuStreamWaitEvent")
        if res[0] == self.ok:
            clock = self.clocks.setdefault(s, {})
            for k, v in recorded.items():
                if clock.get(k, 0) < v:
                    clock[k] = v
        return res

    def cuEventSynchronize(self, event: Any) -> tuple[Any, ...]:
        assert self.events.get(int(event)) is not None, "synchronising an event never recorded"
        self.log.append(("cuEventSynchronize", -1, int(event)))
        self._flush()
        return self._ret("cuEventSynchronize")

    def _flush(self) -> None:
        """The CPU waits: the deferred copies land (in issue order: consistent with every ordering)."""
        pending, self.pending = self.pending, []
        for d, s, n, _ in pending:
            ctypes.memmove(d, s, n)

    def _touches_pending(self, addr: int, n: int) -> bool:
        return any((d < addr + n and addr < d + m) or (s < addr + n and addr < s + m) for d, s, m, _ in self.pending)

    def _check_order(self, new: Access, clock: Clock, against: dict[int, list[Access]], what: str) -> None:
        lo, hi, _, _, writes = new
        for unit in range(lo // _UNIT, (hi - 1) // _UNIT + 1):
            for a_lo, a_hi, a_stream, a_seq, a_writes in against.get(unit, ()):
                if a_lo < hi and lo < a_hi and (writes or a_writes):
                    assert _ordered(a_stream, a_seq, clock), (
                        f"{what} [{lo:#x}, {hi:#x}) on stream {new[2]:#x} is not ordered after the "
                        f"{'write' if a_writes else 'read'} of [{a_lo:#x}, {a_hi:#x}) on stream {a_stream:#x}"
                    )

    @staticmethod
    def _add(accesses: dict[int, list[Access]], access: Access) -> None:
        for unit in range(access[0] // _UNIT, (access[1] - 1) // _UNIT + 1):
            accesses.setdefault(unit, []).append(access)

    def _async_copy(self, name: str, stream: Any, d: int, s: int, n: int) -> None:
        """An async copy on ``stream``: deferred, and checked against the kernels' accesses."""
        handle = self._stream(stream)
        seq, clock = self._tick(handle)
        self.log.append((name, handle, 0))
        for access in ((s, s + n, handle, seq, False), (d, d + n, handle, seq, True)):
            self._check_order(access, clock, self.kernels, "copy")
            self._add(self.copies, access)
        self.pending.append((d, s, n, handle))

    def kernel(
        self, stream: int, reads: Iterable[tuple[int, int]] = (), writes: Iterable[tuple[int, int]] = ()
    ) -> None:
        """The engine launches a kernel on ``stream`` reading and writing ``(address, bytes)`` ranges
        (its data moves are the caller's): it must be ordered after every copy touching them."""
        seq, clock = self._tick(self._stream(stream))
        for ranges, writes_ in ((reads, False), (writes, True)):
            for addr, n in ranges:
                access = (addr, addr + n, stream, seq, writes_)
                self._check_order(access, clock, self.copies, "kernel")
                self._add(self.kernels, access)

    def kernels_on(self, stream: int) -> Callable[[int, int, bool], None]:
        """A hook for the fake engine: each record it writes or reads is a kernel on ``stream``."""

        def hook(addr: int, n: int, writes: bool) -> None:
            if writes:
                self.kernel(stream, writes=[(addr, n)])
            else:
                self.kernel(stream, reads=[(addr, n)])

        return hook

    def stream_calls(self) -> list[tuple[str, int, int]]:
        """``log`` without the copies (the ordering calls only)."""
        return [entry for entry in self.log if entry[0].startswith(("cuEvent", "cuStream", "cuCtx"))]

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
        assert not self._touches_pending(int(ptr), size), "unmapping memory a pending copy uses"
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
        res = self._ret("cuMemcpyAsync")
        if res[0] == self.ok:
            self._async_copy("cuMemcpyAsync", stream, int(dst), int(src), n)
            self.bytes_copied["DtoD"] += n
        return res

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
        size = self.registered.get(int(ptr), 0)
        assert not self._touches_pending(int(ptr), size), "unlocking host memory a pending copy uses"
        assert self.registered.pop(int(ptr), None) is not None, "unregistering memory never registered"
        return self._ret("cuMemHostUnregister")

    def cuMemcpyHtoDAsync(self, dst: Any, src: int, n: int, stream: Any) -> tuple[Any, ...]:
        self._check_mapped(int(dst), n)
        assert self._is_registered(int(src), n), f"async copy from pageable host memory {int(src):#x}+{n}"
        res = self._ret("cuMemcpyHtoDAsync")
        if res[0] == self.ok:
            self._async_copy("cuMemcpyHtoDAsync", stream, int(dst), int(src), n)
            self.bytes_copied["HtoD"] += n
        return res

    def cuMemcpyDtoHAsync(self, dst: int, src: Any, n: int, stream: Any) -> tuple[Any, ...]:
        self._check_mapped(int(src), n)
        assert self._is_registered(int(dst), n), f"async copy to pageable host memory {int(dst):#x}+{n}"
        res = self._ret("cuMemcpyDtoHAsync")
        if res[0] == self.ok:
            self._async_copy("cuMemcpyDtoHAsync", stream, int(dst), int(src), n)
            self.bytes_copied["DtoH"] += n
        return res

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
            self._async_copy("cuMemcpyBatchAsync", stream, d, s, n)
            self.bytes_copied["DtoD" if d_dev and s_dev else ("HtoD" if d_dev else "DtoH")] += n
        return res

    def cuGetErrorName(self, status: Any) -> tuple[Any, ...]:
        return (self.ok, real.CUresult(status).name.encode())

    def cuGetErrorString(self, status: Any) -> tuple[Any, ...]:
        return (self.ok, b"emulated failure")
