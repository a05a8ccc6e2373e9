"""Memory backend interface: device pools that grow in place, host/device byte access, sync."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod

from .._common import MemAddress
from .._config import BACKEND_ENV_VAR, BACKEND_NAMES

logger = logging.getLogger("kv_cache_manager_v2")


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


def cuda_unusable_reason() -> str | None:
    """None when the CUDA driver loads and reports a device; else why CUDA cannot be used."""
    try:
        from ._cuda_backend import cuda_device_count

        if cuda_device_count() == 0:
            return "the CUDA driver reports no device"
        return None
    except Exception as e:  # bindings absent, driver missing, init failure: all mean "not usable"
        return f"{type(e).__name__}: {e}"


def select_backend(requested: str) -> MemoryBackend:
    """Create the backend for ``requested`` ("auto", "cuda" or "host"); env var overrides "auto"."""
    name = requested
    if name == "auto":
        env = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
        if env not in BACKEND_NAMES:
            raise ValueError(f"{BACKEND_ENV_VAR}={env!r} is not one of {BACKEND_NAMES}")
        name = env
    backend: MemoryBackend
    if name == "auto":
        name = "cuda" if cuda_unusable_reason() is None else "host"
    elif name == "cuda":
        reason = cuda_unusable_reason()
        if reason is not None:
            raise ValueError(f"backend 'cuda' was requested but CUDA is not usable here ({reason}); use 'host' or 'auto'")
    if name == "cuda":
        from ._cuda_backend import CudaBackend

        backend = CudaBackend()
    else:
        from ._host_backend import HostBackend

        backend = HostBackend()
    logger.info("kv_cache_manager_v2: using the %s memory backend (requested %r)", backend.name, requested)
    return backend
