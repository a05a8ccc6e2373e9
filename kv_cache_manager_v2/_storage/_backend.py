"""Memory backend interface: device pools that grow in place, host/device byte access, sync."""

from __future__ import annotations

from abc import ABC, abstractmethod

from .._common import MemAddress


class DevicePool(ABC):
    """A reserved address range whose first ``mapped_bytes`` are backed by memory.

    ``base_address`` never changes, so growing a pool never moves the KV in it.
    """

    base_address: MemAddress
    reserved_bytes: int

    @property
    @abstractmethod
    def mapped_bytes(self) -> int: ...

    @abstractmethod
    def ensure_mapped(self, nbytes: int) -> None:
        """Back at least the first ``nbytes`` bytes with memory (never shrinks)."""

    @abstractmethod
    def release(self) -> None:
        """Give all memory back; the pool must not be used afterwards."""


class MemoryBackend(ABC):
    """Where the GPU tier lives: real CUDA memory, or host memory standing in for it."""

    name: str

    @abstractmethod
    def reserve_pool(self, max_bytes: int) -> DevicePool:
        """Reserve an address range for a pool that may grow up to ``max_bytes``."""

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
    def synchronize(self) -> None:
        """Wait for all work this backend issued."""

    @abstractmethod
    def synchronize_device(self) -> None:
        """Wait for all work on the device, on every stream (before reading pages others wrote)."""

    def shutdown(self) -> None:
        """Release backend-wide resources (streams, contexts)."""
