"""Zero-copy views of a buffer's pool: numpy on the host backend, ``__cuda_array_interface__`` on CUDA."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class CudaBufferView:
    """Device memory of one buffer's pool, described for torch/cupy/numba without a copy.

    ``torch.as_tensor(view, device="cuda")`` or ``cupy.asarray(view)`` wrap it in place (CUDA
    Array Interface v3). Valid until the manager shuts down; only pages the manager has handed
    out are backed by memory.
    """

    def __init__(self, address: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.address = address
        self.shape = shape
        self.dtype = np.dtype(dtype)
        n = 1
        for d in shape:
            n *= d
        self.nbytes: int = n * int(self.dtype.itemsize)

    def __repr__(self) -> str:
        return f"CudaBufferView(address=0x{self.address:x}, shape={self.shape}, dtype={self.dtype})"

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.address, False),
            "strides": None,
            "version": 3,
        }


def host_view(address: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A writable numpy array over host memory at ``address`` (no copy; the caller keeps the memory alive)."""
    dt = np.dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    raw = (ctypes.c_ubyte * (n * int(dt.itemsize))).from_address(address)
    return np.frombuffer(memoryview(raw), dtype=dt).reshape(shape)


def page_layout(stride: int, dtype: Any, page_shape: tuple[int, ...] | None) -> tuple[Any, tuple[int, ...]]:
    """Check that ``page_shape`` elements of ``dtype`` fill one page of ``stride`` bytes."""
    if dtype is None:
        if page_shape is not None:
            raise ValueError("get_buffers: page_shape needs a dtype")
        return np.dtype(np.uint8), (stride,)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"get_buffers: dtype must be a numpy dtype or dtype-like, got {dtype!r}") from e
    if page_shape is None:
        if stride % dt.itemsize != 0:
            raise ValueError(f"get_buffers: a page of {stride} bytes is not a whole number of {dt} elements")
        return dt, (stride // int(dt.itemsize),)
    shape = tuple(page_shape)
    n = 1
    for d in shape:
        if type(d) is not int or d <= 0:
            raise ValueError(f"get_buffers: page_shape must be positive ints, got {page_shape!r}")
        n *= d
    if n * int(dt.itemsize) != stride:
        raise ValueError(
            f"get_buffers: page_shape {shape} of {dt} is {n * int(dt.itemsize)} bytes but a page of this buffer "
            f"is {stride} bytes"
        )
    return dt, shape
