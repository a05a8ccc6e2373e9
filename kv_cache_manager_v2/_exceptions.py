"""Exceptions raised by the manager; every message says what was wrong and what to do."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

# mypyc cannot compile subclasses of RuntimeError as native classes; these stay Python classes.


@mypyc_attr(native_class=False)
class LogicError(RuntimeError):
    """The API was used in a way its contract does not allow (wrong state, bad order)."""


@mypyc_attr(native_class=False)
class OutOfMemoryError(RuntimeError):
    """Memory could not be provided."""


@mypyc_attr(native_class=False)
class OutOfPagesError(OutOfMemoryError):
    """No slot is free or evictable in a pool group."""


@mypyc_attr(native_class=False)
class CuError(RuntimeError):
    """A CUDA driver call failed; carries the driver status and its text."""

    def __init__(self, status: int, name: str, message: str, call: str) -> None:
        super().__init__(f"{call} failed: {name} ({status}): {message}")
        self.status = status
        self.name = name
        self.message = message
        self.call = call
