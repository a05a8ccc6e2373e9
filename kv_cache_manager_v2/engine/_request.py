"""The engine-neutral request the resource manager schedules KV memory for."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from typing import NewType

from mypy_extensions import mypyc_attr

from .._common import DEFAULT_PRIORITY, MAX_PRIORITY, Priority, ReuseScope, SessionId, TokenIdExt
from .._retention import RequestRetention
from .._sessions import check_session_id

RequestId = NewType("RequestId", int)


class RequestState(enum.Enum):
    """Phase of a request, as the engine sees it."""

    CONTEXT = 0  #: prompt tokens still to compute (possibly in several chunks)
    GENERATION = 1  #: one new token per step
    FINISHED = 2  #: done; call ``free_resources``


def check_field(name: str, value: object, minimum: int) -> int:
    """``value`` of the int field ``name`` if it is an int ``>= minimum`` (TypeError / ValueError)."""
    if type(value) is not int:
        raise TypeError(f"EngineRequest.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"EngineRequest.{name} must be >= {minimum}, got {value}")
    return value


@mypyc_attr(allow_interpreted_subclasses=True)
class EngineRequest:
    """One request as the resource manager sees it; engines use it directly or subclass it.

    Fixed at construction (read-only: the adapter keys its records by them): ``request_id``,
    ``prompt_tokens``, ``reuse_scope``. Set by the engine: ``generated_tokens`` (append-only;
    append the sampled token after a step that ends at the last token), ``max_new_tokens``,
    ``context_chunk_size`` (at most this many tokens per step while more than one token is
    uncomputed; 0 = no limit), ``state`` (set FINISHED when done), ``priority`` (eviction
    priority 0..100 of the pages this request creates, read at admission), ``retention``
    (``RequestRetention``: priorities with durations per token range, read at admission),
    ``session_id`` (the conversation or agent it belongs to, read at admission) and
    ``output_is_history`` (the output becomes the start of a later request, e.g. a conversation's
    next turn: hybrid models keep the recurrent state at its last full block; read at admission,
    ignored under ``ssm_snapshot_policy="interval"``). The adapter checks
    these where it uses them (``TypeError`` / ``ValueError``, the batch rolled back).

    Written by the resource manager, read by the engine: ``num_cached_tokens`` (tokens whose
    KV is in the cache; the step's input starts there), ``num_scheduled_tokens`` (positions
    ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)`` are this step's input;
    0 when not scheduled), ``num_reused_tokens`` (tokens taken from the reuse tree at the
    last admission), ``num_reused_tokens_per_level`` (those tokens by the cache level their block
    was found in: index 0 GPU, then host, disk), and ``state`` moving from CONTEXT to GENERATION
    once the prompt is cached.
    """

    def __init__(
        self,
        request_id: object,
        prompt_tokens: Sequence[TokenIdExt],
        max_new_tokens: object,
        context_chunk_size: object = 0,
        reuse_scope: ReuseScope | None = None,
        priority: object = DEFAULT_PRIORITY,
        retention: RequestRetention | None = None,
        session_id: SessionId | None = None,
    ) -> None:
        self._request_id = RequestId(check_field("request_id", request_id, 0))
        if isinstance(prompt_tokens, (str, bytes)) or not hasattr(prompt_tokens, "__len__"):
            raise TypeError(
                f"EngineRequest.prompt_tokens must be a sequence of tokens (list or array('I')), "
                f"got {type(prompt_tokens).__name__}"
            )
        if len(prompt_tokens) == 0:
            raise ValueError("EngineRequest.prompt_tokens must not be empty")
        self._prompt_tokens: Sequence[TokenIdExt] = prompt_tokens
        self.generated_tokens: list[TokenIdExt] = []
        self.max_new_tokens = check_field("max_new_tokens", max_new_tokens, 1)
        self.context_chunk_size = check_field("context_chunk_size", context_chunk_size, 0)
        if reuse_scope is not None and not isinstance(reuse_scope, ReuseScope):
            raise TypeError(f"EngineRequest.reuse_scope must be a ReuseScope or None, got {type(reuse_scope).__name__}")
        self._reuse_scope: ReuseScope | None = reuse_scope
        self.priority: Priority = check_priority(priority)
        if retention is not None and not isinstance(retention, RequestRetention):
            raise TypeError(
                f"EngineRequest.retention must be a RequestRetention or None, got {type(retention).__name__}"
            )
        #: priorities with durations of the blocks it publishes (ranges of its prompt, decode blocks)
        self.retention: RequestRetention | None = retention
        #: the conversation or agent it belongs to (``KVCacheManager.directives``; KV-cache events)
        self.session_id: SessionId | None = check_session_id("EngineRequest.session_id", session_id)
        self.output_is_history = False
        self.state = RequestState.CONTEXT
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_reused_tokens = 0
        self.num_reused_tokens_per_level: list[int] = []
        self._slot = -1  # where the last adapter that took it keeps its record (a hint it checks)

    @property
    def request_id(self) -> RequestId:
        """The request's id (unique among the adapter's requests)."""
        return self._request_id

    @property
    def prompt_tokens(self) -> Sequence[TokenIdExt]:
        """The prompt, as given at construction (fixed)."""
        return self._prompt_tokens

    @property
    def reuse_scope(self) -> ReuseScope | None:
        """Blocks are reused only between requests of equal scope (None: the default scope); fixed."""
        return self._reuse_scope

    def __repr__(self) -> str:
        return (
            f"EngineRequest(id={self.request_id}, state={self.state.name}, prompt={len(self.prompt_tokens)}, "
            f"generated={len(self.generated_tokens)}/{self.max_new_tokens}, cached={self.num_cached_tokens}, "
            f"scheduled={self.num_scheduled_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_tokens) + len(self.generated_tokens)

    @property
    def samples_this_step(self) -> bool:
        """Whether this step's input ends at the last token, so its logits give the next token."""
        n = self.num_scheduled_tokens
        return n > 0 and self.num_cached_tokens + n == len(self.prompt_tokens) + len(self.generated_tokens)

    def tokens(self, begin: object, end: object) -> list[TokenIdExt]:
        """Tokens at positions ``[begin, end)`` of prompt + generated (ints; objects: compiled code
        would turn a bool into an int first)."""
        if type(begin) is not int or type(end) is not int:
            raise TypeError(f"tokens(begin, end) takes ints, got {begin!r}, {end!r}")
        p = len(self.prompt_tokens)
        if begin >= p:
            return self.generated_tokens[begin - p : end - p]
        if end <= p:
            return list(self.prompt_tokens[begin:end])
        return list(self.prompt_tokens[begin:]) + self.generated_tokens[: end - p]

    def all_tokens(self) -> list[TokenIdExt]:
        """Prompt followed by generated tokens (a copy)."""
        return list(self.prompt_tokens) + self.generated_tokens


def slices_as_is(tokens: Sequence[TokenIdExt]) -> bool:
    """Whether ``KVCache.commit`` takes slices of ``tokens`` as they are: a list, or an ``array('I')``
    (whose chunks are committed without an int object per token)."""
    return type(tokens) is list or (isinstance(tokens, array) and tokens.typecode == "I")


def check_priority(priority: object) -> Priority:
    """``priority`` if it is an eviction priority (an int in ``[0, MAX_PRIORITY]``)."""
    p = check_field("priority", priority, 0)
    if p > MAX_PRIORITY:
        raise ValueError(f"EngineRequest.priority must be in [0, {MAX_PRIORITY}], got {p}")
    return Priority(p)
