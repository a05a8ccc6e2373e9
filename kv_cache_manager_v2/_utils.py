"""Small integer helpers used across modules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

_T = TypeVar("_T")


def div_up(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``a >= 0, b > 0``."""
    return (a + b - 1) // b


def round_up(a: int, b: int) -> int:
    """Smallest multiple of ``b`` that is ``>= a``."""
    return div_up(a, b) * b


def is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int ``>= minimum`` (and ``<= maximum`` when given).

    Wrong types raise ``TypeError`` (bool is refused), wrong values ``ValueError``: the same
    exception types mypyc's own argument checks raise in production mode.
    """
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_number(name: str, value: object, positive: bool, what: str) -> float:
    """``value`` as a float if it is a finite real number (an int or a float; a bool will not do),
    > 0 when ``positive`` else >= 0; ``what`` says what it measures in the error."""
    if type(value) is bool or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number ({what}), got {type(value).__name__} {value!r}")
    v = float(value)
    if v != v or v == float("inf") or v < 0.0 or (positive and v == 0.0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} ({what}), got {value!r}")
    return v


def raw_field(obj: object, name: str) -> object:
    """Field ``name`` as stored: compiled code reading a typed field would convert it first (a bool
    becomes an int, a str a TypeError of mypyc's) before a check could refuse it clearly."""
    return getattr(obj, name)


def check_type(name: str, value: object, expected: type | tuple[type, ...]) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is an instance of ``expected``."""
    if not isinstance(value, expected):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise TypeError(f"{name} must be {names}, got {type(value).__name__} {value!r}")


def as_list(items: Sequence[_T]) -> list[_T]:
    """``items`` as a list (itself when it is one): compiled code indexes a list natively, any
    other sequence through the generic protocol."""
    return cast(list[_T], items) if type(items) is list else list(items)
