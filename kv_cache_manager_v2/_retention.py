"""Retention the engine controls (values): a priority kept for a while (``Retention``), per token
range of a request (``RetentionRange``), and a request's retention (``RequestRetention``: ranges
of the prompt and its decode blocks). After its duration a page goes back to the priority it had
without retention (``DEFAULT_PRIORITY`` unless a ``custom_priority_callback`` chose another). A
duration counts from the page's release: it runs while no request uses the page (a request
reusing it stops it; its release starts the whole duration again).
The mechanism (expiry times, consulted when the evictor runs) is ``_storage/_expiry.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from ._common import MAX_PRIORITY
from ._utils import check_int, check_type, raw_field


def check_retention_priority(name: str, priority: object) -> int:
    """``priority`` if it is an eviction priority (an int in ``[0, MAX_PRIORITY]``)."""
    p = check_int(name, priority)
    if p > MAX_PRIORITY:
        raise ValueError(f"{name} must be in [0, {MAX_PRIORITY}], got {p}")
    return p


def check_duration(name: str, duration_s: object) -> float | None:
    """``duration_s`` if it is None (no expiry) or a finite number of seconds > 0."""
    if duration_s is None:
        return None
    if type(duration_s) is bool or not isinstance(duration_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(duration_s).__name__} {duration_s!r}")
    try:
        d = float(duration_s)
    except OverflowError:  # an int beyond any float
        d = math.inf
    if not (d > 0.0 and math.isfinite(d)):
        raise ValueError(f"{name} must be a finite number of seconds > 0 (or None: no expiry), got {duration_s!r}")
    return d


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class Retention:
    """Keep pages at ``priority`` (0..100; lower is evicted first) for ``duration_s`` seconds of
    the manager's clock from their release, paused while a request reuses them (None: until the
    pages are evicted, or reused after a close-time hint).
    ``start``: a close-time hint covers only the blocks holding a token at or after this position
    (the blocks before it, e.g. a system prompt other conversations share, keep their priority);
    ``end`` (None: the end of the history): only those holding a token before it (a token range:
    e.g. reasoning tokens no later request will reuse, ``Retention(0, start=s, end=e)``)."""

    priority: int
    duration_s: float | None = None
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        check_retention_priority("Retention.priority", raw_field(self, "priority"))
        check_duration("Retention.duration_s", raw_field(self, "duration_s"))
        start = check_int("Retention.start", raw_field(self, "start"))
        end = raw_field(self, "end")
        if end is not None and check_int("Retention.end", end) <= start:
            raise ValueError(f"Retention.end must be > start ({start}) or None, got {end}")


def check_hints(name: str, retain: object) -> Sequence[Retention]:
    """A close-time hint (``KVCache.close``'s ``retain``, not None): a ``Retention``, or a sequence
    of them over ascending token ranges that do not overlap (only the last may run to the end)."""
    if isinstance(retain, Retention):
        return (retain,)
    if not isinstance(retain, Sequence) or isinstance(retain, (str, bytes)):
        raise TypeError(f"{name} must be a Retention, a sequence of them or None, got {type(retain).__name__}")
    out: list[Retention] = []
    what = f"{name}: token ranges"
    for r in retain:
        check_type(f"{name}[{len(out)}]", r, Retention)
        assert isinstance(r, Retention)
        if out:
            _check_after(what, out[-1], r)
        out.append(r)
    return out


def _check_after(what: str, prev: Retention | RetentionRange, r: Retention | RetentionRange) -> None:
    """``r`` starts at or after the end of ``prev``, the range before it in ``what`` (ascending
    token ranges that do not overlap; only the last may run to the end)."""
    if prev.end is None or r.start < prev.end:
        raise ValueError(f"{what} must be ascending and not overlap: {r} starts before the end of {prev}")


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class RetentionRange:
    """Tokens ``[start, end)`` of a request (``end`` None: to the end of its prompt) keep
    ``priority`` for ``duration_s`` seconds. A block takes the range holding its first token."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        start = check_int("RetentionRange.start", raw_field(self, "start"))
        given_end = raw_field(self, "end")
        if given_end is not None:
            end = check_int("RetentionRange.end", given_end)
            if end <= start:
                raise ValueError(f"RetentionRange.end must be > start ({start}) or None, got {end}")
        check_retention_priority("RetentionRange.priority", raw_field(self, "priority"))
        check_duration("RetentionRange.duration_s", raw_field(self, "duration_s"))


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class RequestRetention:
    """A request's retention: ``ranges`` of its prompt (``RetentionRange`` or ``(start, end,
    priority, duration_s)`` tuples, ascending, not overlapping) and its decode blocks (blocks
    starting at or after the prompt's end: ``decode_priority`` for ``decode_duration_s``; None:
    no retention). Applied to the blocks the request publishes."""

    ranges: Sequence[RetentionRange | tuple[int, int | None, int, float | None]] = ()
    decode_priority: int | None = None
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        given: object = self.ranges
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise TypeError(f"RequestRetention.ranges must be a sequence of RetentionRange, got {given!r}")
        ranges: list[RetentionRange] = []
        for r in given:
            if isinstance(r, tuple):
                if len(r) != 4:
                    raise ValueError(f"a retention range tuple is (start, end, priority, duration_s), got {r!r}")
                r = RetentionRange(r[0], r[1], r[2], r[3])
            elif not isinstance(r, RetentionRange):
                raise TypeError(f"each of RequestRetention.ranges must be a RetentionRange or a 4-tuple, got {r!r}")
            if ranges:
                _check_after("RequestRetention.ranges", ranges[-1], r)
            ranges.append(r)
        object.__setattr__(self, "ranges", tuple(ranges))
        decode_priority, decode_duration = raw_field(self, "decode_priority"), raw_field(self, "decode_duration_s")
        if decode_priority is not None:
            check_retention_priority("RequestRetention.decode_priority", decode_priority)
        elif decode_duration is not None:
            raise ValueError("RequestRetention.decode_duration_s needs a decode_priority")
        check_duration("RequestRetention.decode_duration_s", decode_duration)

    @property
    def open_ended(self) -> bool:
        """Whether some range runs to the end of the prompt (``end`` None)."""
        return any(isinstance(r, RetentionRange) and r.end is None for r in self.ranges)

    def at(self, position: int, prompt_length: int) -> tuple[int, float | None] | None:
        """``(priority, duration_s)`` of the block starting at token ``position`` of a request whose
        prompt has ``prompt_length`` tokens, or None (no retention)."""
        if position >= prompt_length:
            p = self.decode_priority
            return (p, self.decode_duration_s) if p is not None else None
        for r in self.ranges:
            assert isinstance(r, RetentionRange)
            end = r.end if r.end is not None else prompt_length
            if r.start <= position < end:
                return (r.priority, r.duration_s)
        return None


def checked_prompt_end(retention: object, prompt_length: object, input_tokens: Sequence[object] | None) -> int:
    """``create_kv_cache``'s ``retention`` and ``prompt_length`` checked: where its prompt ends."""
    if retention is not None:
        check_type("retention", retention, RequestRetention)
    if prompt_length is not None:
        return check_int("prompt_length", prompt_length)
    if isinstance(retention, RequestRetention) and input_tokens is None and retention.open_ended:
        raise ValueError("retention: a range open to the end of the prompt needs input_tokens or prompt_length")
    return len(input_tokens) if input_tokens is not None else 0
