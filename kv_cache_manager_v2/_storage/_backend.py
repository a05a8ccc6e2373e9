"""Memory backend interface: pools that grow in place (GPU, host memory, disk), byte access, copies, sync."""

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
    host-tier memory is allocated and copied to and from it."""

    name: str

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
        in one driver call where the driver offers it. Host addresses must be page-locked for DMA."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work this backend issued."""

    @abstractmethod
    def synchronize_device(self) -> None:
        """Wait for all work on the device, on every stream (before reading pages others wrote)."""

    def staging_buffer(self, min_bytes: int) -> MemoryPool | None:
        """A page-locked host buffer of at least ``min_bytes`` for disk <-> GPU copies; None when the
        GPU tier is CPU-addressable (no staging needed). Kept until ``shutdown``."""
        return None

    def shutdown(self) -> None:
        """Release backend-wide resources (streams, contexts, staging buffers)."""
