"""Backend selection: CUDA when the driver loads and reports a device, else the host emulation."""

from __future__ import annotations

import logging
import os

from .._config import BACKEND_ENV_VAR, BACKEND_NAMES
from ._backend import MemoryBackend

logger = logging.getLogger("kv_cache_manager_v2")


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
        reason = cuda_unusable_reason()
        name = "cuda" if reason is None else "host"
        if reason is not None:  # a warning: shown without any logging set up (a GPU machine may be misconfigured)
            logger.warning(
                "kv_cache_manager_v2: backend 'auto' falls back to the host-emulated device: CUDA is not usable "
                "here (%s); pages live in host memory. backend='host' chooses it without this warning",
                reason,
            )
    elif name == "cuda":
        reason = cuda_unusable_reason()
        if reason is not None:
            raise ValueError(
                f"backend 'cuda' was requested but CUDA is not usable here ({reason}); use 'host' or 'auto'"
            )
    if name == "cuda":
        from ._cuda_backend import CudaBackend

        backend = CudaBackend()
    else:
        from ._host_backend import HostBackend

        backend = HostBackend()
    logger.info("kv_cache_manager_v2: using the %s memory backend (requested %r)", backend.name, requested)
    return backend
