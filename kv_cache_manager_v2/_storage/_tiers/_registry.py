"""Every medium and tier in one place: the access object of each ``Pool.medium``, the copy route
of each (source medium, destination medium), and the ``Tier`` that builds a local level's pools.
A new medium adds its tier module and its lines here."""

from __future__ import annotations

from ..._common import CacheTier
from ..._config import DiskCacheTierConfig, LocalCacheTierConfig
from .._backend import D2D, D2H, DEVICE_MEMORY, FILE, H2D, HOST_MEMORY, NUM_MEDIA, MemoryBackend
from .._layout import StorageLayout
from ._base import MediumAccess, Route, Tier
from ._disk_tier import DeviceToFile, DiskTier, FileAccess, FileCopy, FileToDevice, FileToHost, HostToFile
from ._gpu_tier import DeviceAccess, DeviceCopy, GpuTier
from ._host_tier import HostAccess, HostCopy, HostTier


def media(backend: MemoryBackend, staging_bytes: int) -> list[MediumAccess]:
    """The access object of each medium, indexed by ``Pool.medium`` (``staging_bytes``: the least
    staging buffer between device memory and the CPU)."""
    out: list[MediumAccess] = [HostAccess(backend)] * NUM_MEDIA
    out[DEVICE_MEMORY] = DeviceAccess(backend, staging_bytes)
    out[FILE] = FileAccess(backend)
    return out


def routes(backend: MemoryBackend, staging_bytes: int) -> list[Route]:
    """The copy route of each pair of media, indexed by ``source * NUM_MEDIA + destination``."""
    table: dict[tuple[int, int], Route] = {
        (HOST_MEMORY, HOST_MEMORY): HostCopy(),
        (HOST_MEMORY, DEVICE_MEMORY): DeviceCopy(H2D),
        (DEVICE_MEMORY, HOST_MEMORY): DeviceCopy(D2H),
        (DEVICE_MEMORY, DEVICE_MEMORY): DeviceCopy(D2D),
        (FILE, FILE): FileCopy(),
        (HOST_MEMORY, FILE): HostToFile(),
        (FILE, HOST_MEMORY): FileToHost(),
        (DEVICE_MEMORY, FILE): DeviceToFile(backend, staging_bytes),
        (FILE, DEVICE_MEMORY): FileToDevice(backend, staging_bytes),
    }
    return [table[(src, dst)] for src in range(NUM_MEDIA) for dst in range(NUM_MEDIA)]


def local_tier(
    cfg: LocalCacheTierConfig,
    backend: MemoryBackend,
    layout: StorageLayout,
    slots: list[int],
    disk_fingerprint: bytes,
    tokens_per_block: int,
) -> Tier:
    """The tier object of a local cache level with ``slots[g]`` slots per pool group of ``layout``
    (``disk_fingerprint``, ``tokens_per_block``: a persistent disk tier's records)."""
    if isinstance(cfg, DiskCacheTierConfig):
        return DiskTier(backend, cfg, layout, slots, disk_fingerprint, tokens_per_block)
    if cfg.tier is CacheTier.HOST_MEM:
        return HostTier(backend)
    return GpuTier(backend)
