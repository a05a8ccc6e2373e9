from typing import Any, Generic, TypeVar, final

_T = TypeVar("_T")

@final
class ref(Generic[_T]):
    """The one non-owning reference of an object (created on first use).

    The object stores it in its ``_rawref`` attribute and must call
    ``invalidate()`` before it dies; afterwards calling the ref returns None.
    Hashable and compared by identity.
    """

    def __new__(cls, obj: _T) -> ref[_T]: ...
    def __call__(self) -> _T | None: ...
    @property
    def is_valid(self) -> bool: ...
    def invalidate(self) -> None: ...

NULL: ref[Any]

def untrack(obj: _T) -> _T:
    """Take ``obj`` out of the cyclic GC (its owner breaks its reference cycles); returns it."""

def fresh(obj: _T) -> ref[_T]:
    """A new ref of ``obj`` stored nowhere: for a class that keeps its one ref itself in
    ``_rawref`` (set by its own code); ``ref(obj)`` finds it there."""

def invalidate(r: ref[Any]) -> None:
    """``r.invalidate()`` as a plain function (no method lookup)."""
