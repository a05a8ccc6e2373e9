"""Memory backend interface: pools that grow in place (GPU, host memory, disk), byte access, copies,
and the events that order the backend's copy stream against the engine's streams."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Final

from .._common import MemAddress

#: Copy directions of ``MemoryBackend.copy_batch`` ("device" = GPU memory, "host" = CPU memory).
D2D: Final = 0
H2D: Final = 1
D2H: Final = 2
H2H: Final = 3

#: ``Pool.medium``: how the CPU reaches a pool's bytes (the copy engine's routes are keyed by it).
HOST_MEMORY: Final = 0  # CPU-addressable memory (host tier, or a GPU tier the host emulates)
DEVICE_MEMORY: Final = 1  # GPU memory: addresses only, copied by the backend
FILE: Final = 2  # a disk tier's file: pread / pwrite
NUM_MEDIA: Final = 3

#: ``stream`` of ``record_event`` / ``wait_event`` naming the backend's own copy stream (engine
#: streams are ``CUstream`` handles, never negative; 0 is the legacy default stream)
COPY_STREAM: Final = -1

#: Memory pools reserve address space for this many times their initial size, so a tier can
#: grow in place (``KVCacheManager.resize``) up to this factor of its configured quota.
MAX_GROWTH: Final = 4


class Pool(ABC):
    """One region of one pool group at one cache level: slot ``s`` starts at byte ``s * slot_size``.

    The first ``mapped_bytes`` are backed (memory mapped, or file space allocated).
    """

    #: bytes the pool can grow to without moving
    reserved_bytes: int
    #: ``HOST_MEMORY``, ``DEVICE_MEMORY`` or ``FILE`` (fixed at construction)
    medium: int

    @property
    @abstractmethod
    def mapped_bytes(self) -> int: ...

    @abstractmethod
    def ensure_mapped(self, nbytes: int) -> None:
        """Back at least the first ``nbytes`` bytes (never shrinks). May raise; then nothing changed."""

    def shrink(self, nbytes: int) -> None:
        """Give back what lies beyond the first ``nbytes`` bytes where the medium allows (best effort)."""

    @abstractmethod
    def release(self) -> None:
        """Give everything back; the pool must not be used afterwards. Idempotent."""


class MemoryPool(Pool):
    """A pool in addressable memory (GPU memory, or host memory). ``base_address`` never changes,
    so growing a pool never moves the KV in it."""

    base_address: MemAddress
    #: the pool's bytes as a writable view when the CPU can access them directly, else None
    host_view: memoryview | None

    def ensure_mapped(self, nbytes: int) -> None:
        if nbytes <= self.mapped_bytes:
            return
        if nbytes > self.reserved_bytes:
            raise ValueError(f"pool needs {nbytes} bytes but only {self.reserved_bytes} are reserved")
        self._map(nbytes)

    @abstractmethod
    def _map(self, nbytes: int) -> None:
        """Back the first ``nbytes`` bytes (more than are mapped, at most ``reserved_bytes``); may
        raise, then nothing changed."""


class MemoryBackend(ABC):
    """Where the GPU tier lives (real CUDA memory, or host memory standing in for it), and how
    host-tier memory is allocated and copied to and from it.

    An ``asynchronous`` backend queues its copies on a stream of its own: nothing there is ordered
    with the engine's kernels except through events (``record_event`` / ``wait_event``, used by
    ``StreamOrder``), and the CPU may touch host memory a copy reads or writes only after
    ``wait_copies``. A synchronous backend's copies are complete on return; its event calls do nothing.
    """

    name: str
    #: whether ``copy_batch`` returns before its copies are done (they run on the backend's stream)
    asynchronous: bool = False

    @abstractmethod
    def reserve_pool(self, max_bytes: int) -> MemoryPool:
        """Reserve an address range for a GPU pool that may grow up to ``max_bytes``."""

    @abstractmethod
    def reserve_host_pool(self, max_bytes: int) -> MemoryPool:
        """Reserve host memory for a host-tier pool (page-locked where the backend copies by DMA)."""

    @abstractmethod
    def read(self, address: MemAddress, nbytes: int) -> bytes:
        """Copy ``nbytes`` of device memory at ``address`` to host (synchronous; for tests/debug)."""

    @abstractmethod
    def write(self, address: MemAddress, data: bytes) -> None:
        """Copy ``data`` into device memory at ``address`` (synchronous; for tests/debug)."""

    @abstractmethod
    def copy(self, dst: MemAddress, src: MemAddress, nbytes: int, stream: int) -> None:
        """Device-to-device copy ordered on ``stream`` (0: the backend's own stream)."""

    @abstractmethod
    def copy_batch(self, kind: int, dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
        """Copies of direction ``kind`` (``D2D``/``H2D``/``D2H``/``H2H``) on the backend's own stream,
        in one driver call where the driver offers it. Host addresses must be page-locked for DMA.
        An ``H2H`` copy is a CPU copy: it waits for the pending ones first (``wait_copies``)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work this backend issued (shutdown, pools shrinking, debug access)."""

    def wait_copies(self) -> None:
        """Before the CPU touches host memory (host tier, staging buffer) that an issued copy may
        read or write: wait for the copies issued since the last wait, if any (our stream only,
        never the device). Nothing to do on a synchronous backend."""

    def create_event(self) -> object:
        """A new event for ``record_event`` / ``wait_event`` (None on a synchronous backend)."""
        return None

    def destroy_event(self, event: object) -> None:
        """Give back an event of ``create_event`` (waits already queued on it stay valid)."""

    def record_event(self, event: object, stream: int) -> None:
        """Record ``event`` on ``stream`` (an engine stream, or ``COPY_STREAM``): it completes when the
        work queued there so far has; recording again replaces what later waits wait for."""

    def wait_event(self, stream: int, event: object) -> None:
        """Make the work queued on ``stream`` (an engine stream, or ``COPY_STREAM``) from now on wait
        until ``event`` (as last recorded) completes, without blocking the CPU."""

    def staging_buffer(self, min_bytes: int) -> MemoryPool | None:
        """A page-locked host buffer of at least ``min_bytes`` for disk <-> GPU copies; None when the
        GPU tier is CPU-addressable (no staging needed). Kept until ``shutdown``."""
        return None

    def shutdown(self) -> None:
        """Release backend-wide resources (streams, contexts, staging buffers); waits for our copies."""
