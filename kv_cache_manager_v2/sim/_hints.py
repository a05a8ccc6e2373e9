"""Continuation hints from a workload's future (``--retention-hints ACCURACY``; issue 37).

An engine knows whether a conversation goes on (a tool call is running, a chat is open) and
roughly when; a trace replay can know it exactly by looking ahead: request ``i`` *continues* when
a later request's prompt starts with ``i``'s whole prompt, after the pause between their
arrivals. ``continuation_pauses`` (``sim/_sessions.py``) finds that pause; ``hint_retentions``
turns it into the close-time retention an engine would send, with a share ``1 - accuracy`` of
the labels flipped at random (seeded): continues, keep at ``KEEP_PRIORITY`` for the predicted
pause (with a margin); does not, ``DROP_PRIORITY`` for the blocks after its system prompt
(``shared``: the prefix other conversations start with, which an engine knows as its template;
dropping that too cost more than it freed, measured in ``benchmarks/retention_hints.py``).
``system_prompts`` finds the prefixes more than N conversations share, which
``--pin-system-prompts N`` pins. With sessions (``--sessions``: a trace's documents), the same
knowledge per session: ``session_hints`` keeps a session's shared prefix until it comes back and
drops the rest, ``SessionReturns`` raises it as the return nears.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._common import DEFAULT_PRIORITY, SessionId, TokenIdExt
from .._config import KVCacheManagerConfig
from .._retention import Retention
from ._latency import seconds, summary
from ._models import SimUserError, format_bytes
from ._replay import Replay
from ._replay_types import ReplayResult, SchedulerOptions
from ._sessions import (
    arrival_order,
    continuation_pauses,
    prefix_users,
    session_ids,
    session_pauses,
    session_prefixes,
    session_templates,
    sessions_of,
    system_prompts,
    trace_granularity,
)
from ._workload import TRACE_BLOCK_TOKENS, SimRequest

#: priority of a conversation that continues within a second (longer pauses: lower, down to
#: just above the default), and of one that ends
KEEP_PRIORITY = 99
PRIORITY_PER_DOUBLING = 5
DROP_PRIORITY = 0
#: the kept time: the predicted pause times PAUSE_FACTOR, plus PAUSE_SLACK_S
PAUSE_FACTOR = 1.25
PAUSE_SLACK_S = 1.0
#: ``--sweep hints=0.8,0.9,1.0``: one replay with hints per accuracy
HINTS_SWEEP_KEY = "hints"
HINTS_HELP = (
    "replay again with close-time continuation hints derived from the workload's future, a share "
    "1 - ACCURACY of them wrong, and report the hit rate with and without them"
)


def keep_priority(pause_s: float) -> int:
    """The priority of a conversation expected back in ``pause_s`` seconds: the sooner, the higher
    (where kept conversations compete for memory, the one needed last goes first), from
    ``KEEP_PRIORITY`` (a pause of a second or less) down to just above the default."""
    return max(DEFAULT_PRIORITY + 1, KEEP_PRIORITY - int(PRIORITY_PER_DOUBLING * math.log2(max(1.0, pause_s))))


def hint_retentions(
    pauses: Sequence[float | None],
    accuracy: float,
    seed: int = 0,
    horizon_s: float | None = None,
    drop: bool = False,
    shared: Sequence[int] | None = None,
) -> list[Retention | None]:
    """The close-time retention of each request from its continuation pause (None: it does not
    continue), a share ``1 - accuracy`` of the labels flipped (seeded). A request wrongly said
    to continue is kept for the median pause; one said not to gets no hint (``drop``:
    ``DROP_PRIORITY``; ``shared``, per request: the tokens of its prompt's prefix other
    conversations share, left out of the drop). ``horizon_s``: a conversation expected back later than this gets no hint
    (the cache could not hold it that long: about its size over the rate of incoming prompt tokens)."""
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy!r}")
    known = sorted(p for p in pauses if p is not None)
    typical = known[len(known) // 2] if known else 60.0
    rng = random.Random(seed)
    out: list[Retention | None] = []
    for i, pause in enumerate(pauses):
        continues = pause is not None
        if rng.random() >= accuracy:
            continues = not continues
        if continues:
            predicted = pause if pause is not None else typical
            if horizon_s is not None and predicted > horizon_s:
                out.append(None)
                continue
            out.append(Retention(keep_priority(predicted), predicted * PAUSE_FACTOR + PAUSE_SLACK_S))
        else:
            out.append(Retention(DROP_PRIORITY, None, shared[i] if shared is not None else 0) if drop else None)
    return out


def pin_threshold(
    requests: Sequence[SimRequest],
    budget_tokens: int,
    duration_s: float,
    granularity: int,
    conversation: Sequence[int] | None = None,
) -> int:
    """The smallest N of 2, 4, 8, ... for which pinning each prefix that at least N conversations
    (or requests) start with, for ``duration_s`` after each use, never holds more than
    ``budget_tokens`` pinned at once (a pin share of the cache): the most shared prompts first."""
    paths, users = prefix_users(requests, granularity, conversation)
    order = arrival_order(requests)
    n = 2
    while True:
        last_use: dict[int, float] = {}  # prefix -> when its pin ends
        ends: list[tuple[float, int]] = []  # (pin end, prefix), a heap
        peak = 0
        for k in order:
            now = requests[k].arrival_ms / 1000.0
            while ends and ends[0][0] <= now:
                end, prefix = heapq.heappop(ends)
                if last_use.get(prefix) == end:
                    del last_use[prefix]
            for prefix in paths[k]:
                if users[prefix] < n:
                    break
                last_use[prefix] = now + duration_s
                heapq.heappush(ends, (now + duration_s, prefix))
            peak = max(peak, len(last_use))
        if peak * granularity <= budget_tokens or peak == 0:
            return n
        n *= 2


def check_pin_share(more_than: int | None) -> None:
    """``--pin-system-prompts``: shared by more than N >= 1 conversations (or None: no pins)."""
    if more_than is not None and more_than < 1:
        raise SimUserError(
            f"--pin-system-prompts must be >= 1 (pin prefixes shared by more than N conversations), got {more_than}"
        )


def check_pin_duration(duration_s: float | None, more_than: int | None) -> None:
    """``--pin-duration``: finite seconds > 0, with ``--pin-system-prompts``."""
    if duration_s is None:
        return
    if not (duration_s > 0.0 and math.isfinite(duration_s)):
        raise SimUserError(f"--pin-duration must be a finite number of seconds > 0, got {duration_s:g}")
    if more_than is None:
        raise SimUserError("--pin-duration needs --pin-system-prompts N (the prefixes it pins)")


def check_accuracy(accuracy: float | None) -> None:
    """``--retention-hints``: an accuracy in [0, 1] (or None: no hints)."""
    if accuracy is not None and not 0.0 <= accuracy <= 1.0:
        raise SimUserError(f"--retention-hints must be an accuracy in [0, 1], got {accuracy:g}")


def session_hints(
    requests: Sequence[SimRequest], accuracy: float, tokens_per_block: int, seed: int = 0, time_scale: float = 1.0
) -> list[list[Retention]]:
    """Per request, the close-time hints of an engine that knows (a share ``1 - accuracy`` of the
    labels flipped, seeded, as ``hint_retentions``) whether the request's session comes back and
    after what pause: one that does keeps the prefix its prompt shares with the session's other
    requests (``session_prefixes``: its document) at ``keep_priority`` for the predicted pause,
    its private rest (question, output) at ``DROP_PRIORITY``, or, where the session's requests
    extend it whole (a conversation), all of it but its reasoning (``with_reasoning_hints``);
    one that does not drops all but the prefix other sessions share (``session_templates``).
    Pauses in the requests' time (``arrival_ms``, times ``time_scale``); prefixes in whole blocks
    (a trace's, else ``tokens_per_block``)."""
    sessions = sessions_of(requests)
    pauses = [p * time_scale if p is not None else None for p in session_pauses(requests, sessions)]
    granularity = TRACE_BLOCK_TOKENS if trace_granularity(requests) > 1 else tokens_per_block
    keeps = session_prefixes(requests, sessions, granularity)
    shared = session_templates(requests, sessions, granularity)
    hints = hint_retentions(pauses, accuracy, seed, drop=True, shared=shared)
    out: list[list[Retention]] = []
    for hint, keep in zip(with_reasoning_hints(requests, hints), keeps):
        h = hint[0] if isinstance(hint, list) else hint
        assert h is not None
        if h.priority == DROP_PRIORITY or keep is None:
            out.append(hint if isinstance(hint, list) else [h])
        else:  # its document kept, the rest (question, output, reasoning) dropped
            out.append([Retention(h.priority, h.duration_s, 0, keep), Retention(DROP_PRIORITY, None, keep)])
    return out


class SessionReturns:
    """What an engine that knows when a session comes back does while it waits: a priority set at
    close goes stale (a session kept long ago for a long pause ranks below one kept just now for
    a shorter one, though it is due sooner), so each time the time left until the session's
    predicted return halves, the engine raises its kept prefix (``directives.retain`` by prefix)
    to ``keep_priority`` of the time left, for as long as the close-time hint keeps it. The same
    knowledge as the hint (when the session comes back), used as time passes."""

    def __init__(self) -> None:
        #: (when, session, request, its predicted return, its priority now), a heap
        self._due: list[tuple[float, int, int, float, int]] = []
        self._latest: dict[int, int] = {}  # session -> its request closed last

    def closed(self, session: int, request: int, now_s: float, hints: Sequence[Retention]) -> None:
        """``request`` of ``session`` closed at ``now_s`` with ``hints`` (``session_hints``)."""
        self._latest[session] = request
        keep = hints[0]
        if keep.priority == DROP_PRIORITY or keep.duration_s is None:
            return
        pause = (keep.duration_s - PAUSE_SLACK_S) / PAUSE_FACTOR  # the predicted pause (``hint_retentions``)
        heapq.heappush(self._due, (now_s + pause / 2, session, request, now_s + pause, keep.priority))

    def due(self, now_s: float) -> list[tuple[int, int, float]]:
        """The raises due by ``now_s``, in order: (the request whose kept prefix, priority, duration_s)."""
        out: list[tuple[int, int, float]] = []
        while self._due and self._due[0][0] <= now_s:
            entry = heapq.heappop(self._due)
            session, request, back, priority = entry[1], entry[2], entry[3], entry[4]
            left = back - now_s
            if self._latest.get(session) != request or left <= 0.0:
                continue  # (its session came back since, or is late)
            raised = keep_priority(left)
            if raised > priority:
                out.append((request, raised, left * PAUSE_FACTOR + PAUSE_SLACK_S))
            if left > 1.0:
                heapq.heappush(self._due, (now_s + left / 2, session, request, back, max(raised, priority)))
        return out


def kept_prefix(request: SimRequest, hints: Sequence[Retention]) -> int:
    """The tokens of ``request``'s prompt its keep hint (``session_hints``, first) covers."""
    end = hints[0].end
    return request.prompt_length if end is None else min(end, request.prompt_length)


def with_reasoning_hints(
    requests: Sequence[SimRequest], hints: Sequence[Retention | None]
) -> list[Retention | list[Retention] | None]:
    """Each request's close-time hint with a token-range hint over its reasoning tokens
    (``SimRequest.reasoning``: no later request reuses them): ``DROP_PRIORITY`` there, the
    continuation hint (if any) up to the end of the prompt."""
    out: list[Retention | list[Retention] | None] = []
    for r, hint in zip(requests, hints):
        if r.reasoning <= 0:
            out.append(hint)
            continue
        begin = r.prompt_length
        span = Retention(DROP_PRIORITY, None, begin, begin + r.reasoning)
        if hint is None or hint.start >= begin:
            out.append([span])
        else:
            out.append([Retention(hint.priority, hint.duration_s, hint.start, begin), span])
    return out


def assign_sessions(requests: Sequence[SimRequest], end: bool, tokens_per_block: int) -> None:
    """``--sessions``: each request's ``session`` is its session's (``session_ids``: the built-in
    conversations, a trace's documents); with ``end`` (``--session-end``) a session's last request
    ends it, keeping the template its requests share with other sessions (``session_templates``:
    the engine knows its templates; the first session of one publishes it)."""
    ids, ends = session_ids(requests)
    granularity = TRACE_BLOCK_TOKENS if trace_granularity(requests) > 1 else tokens_per_block
    shared = session_templates(requests, sessions_of(requests), granularity) if end else []
    for i, r in enumerate(requests):
        r.session = SessionId(ids[i])
        r.ends_session = end and i in ends
        r.session_keep = shared[i] if shared else 0


def replay_with_hints(
    config: KVCacheManagerConfig,
    requests: list[SimRequest],
    options: SchedulerOptions,
    accuracy: float,
    without: float,
    seed: int = 0,
    pins: Sequence[tuple[int, int] | None] | None = None,
    scale: float = 1.0,
    pin_duration_s: float | None = None,
    on_result: Callable[[ReplayResult, float | None], None] | None = None,
) -> dict[str, Any]:
    """``--retention-hints ACCURACY``: the replay again, each finished request sending the hint of
    ``hint_retentions`` (pauses in simulated time: scaled by ``options.time_scale``; a request
    said not to continue drops its blocks after the system prompt it shares with other
    conversations); the report's ``retention_hints`` part (``without``: the token hit rate of the
    replay without hints; ``pins``, ``pin_duration_s``: the replay's ``Closing.pins``,
    ``pin_duration_s``; ``scale``: the model's bytes per proxy byte). Requests with reasoning
    tokens add a token-range hint over them (``with_reasoning_hints``). With ``--sessions``: the
    hints of ``session_hints``, the kept prefixes raised as their sessions' returns near
    (``SessionReturns``). ``on_result`` sees the replay's counters and ``accuracy`` first (``--per-request``)."""
    groups = sessions_of(requests) if any(r.session is not None for r in requests) else None
    if groups is not None:
        pauses = session_pauses(requests, groups)
    else:
        pauses = continuation_pauses(requests, trace_granularity(requests))
    scaled = [p * options.time_scale if p is not None else None for p in pauses]
    replay = Replay(config, requests, options, bytes_scale=scale)
    reasoning = any(r.reasoning for r in requests)
    raised: list[int] = []
    if groups is not None:
        per_session = session_hints(requests, accuracy, config.tokens_per_block, seed, options.time_scale)
        replay.retain = per_session
        raised = follow_returns(replay, requests, groups, per_session)
    else:
        shared = [p[1] if p is not None else 0 for p in system_prompts(requests, 1, config.tokens_per_block)]
        hints = hint_retentions(scaled, accuracy, seed, drop=True, shared=shared)
        replay.retain = with_reasoning_hints(requests, hints) if reasoning else hints
    replay.closing.pins = pins
    replay.closing.pin_duration_s = pin_duration_s
    result = replay.run()
    if on_result is not None:
        on_result(result, accuracy)
    continued = sorted(p for p in scaled if p is not None)
    extra: dict[str, Any] = {"reasoning_hints": True} if reasoning else {}
    if any(r.ends_session for r in requests):
        extra["sessions_ended_blocks"] = result_ended(result)
    if groups is not None:
        extra["sessions_raised"] = raised[0]
    return {
        **extra,
        "accuracy": accuracy,
        "seed": seed,
        "continued_share": round(len(continued) / len(requests), 4) if requests else 0.0,
        "median_pause_s": continued[len(continued) // 2] if continued else None,
        "token_hit_rate": round(result.reused_tokens / result.prompt_tokens, 4) if result.prompt_tokens else 0.0,
        "token_hit_rate_without": without,
        "peak_retained_bytes": int(result.levels[0].peak_retained * scale),
        "ttft_s": summary(result.ttft_ms),
    }


def follow_returns(
    replay: Replay, requests: Sequence[SimRequest], groups: Sequence[int], hints: Sequence[Sequence[Retention]]
) -> list[int]:
    """The engine of ``SessionReturns`` in ``replay``: each finished request's keep hint
    scheduled, each step's due raises sent (``directives.retain`` by prefix); returns a counter of
    the raises (one item, counted as the replay runs)."""
    returns = SessionReturns()
    raised = [0]
    manager = replay.rm.manager

    def step(_rm: object) -> None:
        for k, priority, duration_s in returns.due(replay.clock / 1000.0):
            tokens = requests[k].prompt_tokens()[: kept_prefix(requests[k], hints[k])]
            manager.directives.retain(cast("Sequence[TokenIdExt]", tokens), priority, duration_s)
            raised[0] += 1

    def close(index: int) -> None:
        returns.closed(groups[index], index, replay.clock / 1000.0, hints[index])

    replay.on_step = step
    replay.closing.on_close = close
    return raised


def result_ended(result: ReplayResult) -> dict[str, int]:
    """What ``--session-end``'s ``directives.end`` did in a replay, in blocks."""
    ended = result.sessions_ended
    return {"dropped": ended[0], "deferred": ended[1], "kept": ended[2]}


def sessions_report(requests: Sequence[SimRequest], result: ReplayResult) -> dict[str, Any]:
    """The report's ``sessions`` part (none without ``--sessions``): how many, whether their last
    turns ended them, what the ends did."""
    ids = {r.session for r in requests if r.session is not None}
    if not ids:
        return {}
    end = any(r.ends_session for r in requests)
    out: dict[str, Any] = {"sessions": len(ids), "end": end}
    if end:
        out["ended_blocks"] = result_ended(result)
    return {"sessions": out}


def add_session_options(g: Any) -> None:
    """``--sessions``, ``--session-end``, ``--reasoning-share`` in the parser's group ``g``."""
    g.add_argument(
        "--sessions",
        action="store_true",
        help="each request carries its session's id (create_kv_cache(session_id=); the built-in conversations, or "
        "a trace's documents: prompts sharing a block beyond their template); with --retention-hints, hints per session",
    )
    g.add_argument(
        "--session-end",
        action="store_true",
        help="with --sessions: when a session's last request closes, the session ends (directives.end: its "
        "private blocks leave the cache)",
    )
    g.add_argument(
        "--reasoning-share",
        type=float,
        metavar="SHARE",
        help="that share of each answer's tokens is reasoning, never reused (built-in: the next turn leaves it "
        "out); --retention-hints then also drops it first (a token-range hint)",
    )


def check_sessions(a: Any) -> None:
    """``--sessions`` and ``--session-end``: one replay of one engine; the end needs the sessions."""
    if a.session_end and not a.sessions:
        raise SimUserError("--session-end ends the sessions of --sessions: give --sessions too")
    if a.sessions and (a.restart_at is not None or a.replicas != 1 or a.remote_url):
        raise SimUserError("--sessions does not combine with --restart-at, --replicas or --remote-url")


def format_hints(rep: dict[str, Any]) -> str:
    """The report's lines for ``--retention-hints``, ``--sweep hints=`` and ``--pin-system-prompts``
    (empty without)."""
    out = ""
    p = rep.get("pins")
    if p is not None:
        out += (
            f"\npinned prefixes (shared by more than {p['shared_by_more_than']} conversations): {p['prefixes']:,} "
            f"({p['pinned_tokens']:,} tokens, {p['refused']:,} refused beyond max_pinned_share), "
            f"up to {format_bytes(p['peak_pinned_bytes'])} pinned on the GPU tier"
        )
    sweep = rep.get("retention_hints_sweep") or [h for h in [rep.get("retention_hints")] if h is not None]
    for h in sweep:
        out += (
            f"\nretention hints (accuracy {h['accuracy']:g}, {h['continued_share']:.1%} of requests continued): "
            f"token hit rate {h['token_hit_rate']:.3f} with, {h['token_hit_rate_without']:.3f} without; "
            f"up to {format_bytes(h['peak_retained_bytes'])} retained on the GPU tier"
        )
        ttft = h.get("ttft_s")
        if ttft is not None:  # (without: the report's own time to first token)
            out += f"; time to first token with them: mean {seconds(ttft['mean'])}, p90 {seconds(ttft['p90'])}"
    return out
