"""Continuation hints from a workload's future (``--retention-hints ACCURACY``; issue 37).

An engine knows whether a conversation goes on (a tool call is running, a chat is open) and
roughly when; a trace replay can know it exactly by looking ahead: request ``i`` *continues* when
a later request's prompt starts with ``i``'s whole prompt, after the pause between their
arrivals. ``continuation_pauses`` finds that pause; ``hint_retentions`` turns it into the
close-time retention an engine would send, with a share ``1 - accuracy`` of the labels flipped
at random (seeded): continues, keep at ``KEEP_PRIORITY`` for the predicted pause (with a margin);
does not, ``DROP_PRIORITY`` for the blocks after its system prompt (``shared``: the prefix other
conversations start with, which an engine knows as its template; dropping that too cost more
than it freed, measured in ``benchmarks/retention_hints.py``). Conversations are the chains of
``continuers``; ``system_prompts`` finds the prefixes more than N of them share, which
``--pin-system-prompts N`` pins.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from typing import Any

from .._common import DEFAULT_PRIORITY, SessionId
from .._config import KVCacheManagerConfig
from .._retention import Retention
from ._models import SimUserError, format_bytes
from ._replay import Replay
from ._replay_types import ReplayResult, SchedulerOptions
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


def continuation_pauses(requests: Sequence[SimRequest], granularity: int = 1) -> list[float | None]:
    """Per request, seconds until the first later request whose prompt starts with its prompt
    (its conversation continues), or None. ``granularity``: prompts are compared up to their last
    multiple of this many tokens (a trace's 512-token blocks: a trace names a prompt's partial
    last block apart from the full block a later turn holds there; shorter prompts never continue)."""
    return [
        (requests[j].arrival_ms - requests[i].arrival_ms) / 1000.0 if j is not None else None
        for i, j in enumerate(continuers(requests, granularity))
    ]


def continuers(requests: Sequence[SimRequest], granularity: int = 1) -> list[int | None]:
    """Per request, the index of the first later request whose prompt starts with its prompt
    (see ``continuation_pauses``), or None."""
    order = sorted(range(len(requests)), key=lambda k: (requests[k].arrival_ms, k))
    chain_ids: dict[tuple[int, int, int], int] = {}  # (parent chain, first, count) -> chain id
    # requests waiting for a continuation, by (chain of all but their last run, last run's first
    # token): (last run's length, request)
    waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
    out: list[int | None] = [None] * len(requests)
    for j in order:
        req = requests[j]
        segs = _truncated(req.prompt_segments, req.prompt_length // granularity * granularity)
        parent = -1
        for first, count in segs:  # every waiting prompt this one extends
            group = waiting.get((parent, first))
            if group is not None:
                kept = [(n, i) for n, i in group if n > count]
                for n, i in group:
                    if n <= count:
                        out[i] = j
                if kept:
                    waiting[(parent, first)] = kept
                else:
                    del waiting[(parent, first)]
            key = (parent, first, count)
            parent = chain_ids.setdefault(key, len(chain_ids))
        if segs:
            prefix = -1
            for first, count in segs[:-1]:
                prefix = chain_ids[(prefix, first, count)]
            waiting.setdefault((prefix, segs[-1][0]), []).append((segs[-1][1], j))
    return out


def conversations(next_turn: Sequence[int | None]) -> list[int]:
    """Per request, its conversation (the index of the conversation's last request), following
    ``continuers``' links."""
    out = [-1] * len(next_turn)
    for i in range(len(next_turn)):
        path = []
        k = i
        while out[k] < 0:
            path.append(k)
            nxt = next_turn[k]
            if nxt is None:
                out[k] = k
                break
            k = nxt
        for p in path:
            out[p] = out[k]
    return out


def keep_priority(pause_s: float) -> int:
    """The priority of a conversation expected back in ``pause_s`` seconds: the sooner, the higher
    (where kept conversations compete for memory, the one needed last goes first), from
    ``KEEP_PRIORITY`` (a pause of a second or less) down to just above the default."""
    return max(DEFAULT_PRIORITY + 1, KEEP_PRIORITY - int(PRIORITY_PER_DOUBLING * math.log2(max(1.0, pause_s))))


def _truncated(segments: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The token runs of the first ``length`` tokens of ``segments``."""
    out: list[tuple[int, int]] = []
    for first, count in segments:
        if length <= 0:
            break
        out.append((first, min(count, length)))
        length -= count
    return out


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


def shared_prefixes(
    requests: Sequence[SimRequest], more_than: int, granularity: int, conversation: Sequence[int] | None = None
) -> list[tuple[int, int] | None]:
    """Per request, the longest prefix of its prompt that more than ``more_than`` requests of the
    workload start with (``conversation``, per request: more than that many distinct
    conversations), as (prefix id, tokens), or None; prompts are compared in whole runs of
    ``granularity`` tokens (a block)."""
    paths, users = _prefix_users(requests, granularity, conversation)
    out: list[tuple[int, int] | None] = []
    for path in paths:
        depth = 0
        while depth < len(path) and users[path[depth]] > more_than:
            depth += 1
        out.append((path[depth - 1], depth * granularity) if depth else None)
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
    paths, users = _prefix_users(requests, granularity, conversation)
    order = sorted(range(len(requests)), key=lambda k: (requests[k].arrival_ms, k))
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


def _prefix_users(
    requests: Sequence[SimRequest], granularity: int, conversation: Sequence[int] | None
) -> tuple[list[list[int]], list[int]]:
    """Each request's prompt as a path of prefix ids (one per whole block), and per prefix id the
    number of requests (or distinct ``conversation`` ids) that start with it."""
    ids: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}  # (parent prefix, next chunk) -> prefix id
    users: list[set[int]] = []
    paths: list[list[int]] = []
    for i, r in enumerate(requests):
        who = conversation[i] if conversation is not None else i
        path: list[int] = []
        prefix = -1
        for chunk in _chunks(r.prompt_segments, r.prompt_length // granularity, granularity):
            prefix = ids.setdefault((prefix, chunk), len(ids))
            if prefix == len(users):
                users.append(set())
            users[prefix].add(who)
            path.append(prefix)
        paths.append(path)
    return paths, [len(u) for u in users]


def _chunks(segments: list[tuple[int, int]], num: int, size: int) -> list[tuple[tuple[int, int], ...]]:
    """The first ``num`` chunks of ``size`` tokens of ``segments``, each as its token runs (merged)."""
    out: list[tuple[tuple[int, int], ...]] = []
    cur: list[tuple[int, int]] = []
    room = size
    for first, count in segments:
        while count and len(out) < num:
            n = min(count, room)
            if cur and cur[-1][0] + cur[-1][1] == first:  # adjacent runs: one (the same tokens compare equal)
                cur[-1] = (cur[-1][0], cur[-1][1] + n)
            else:
                cur.append((first, n))
            first += n
            count -= n
            room -= n
            if not room:
                out.append(tuple(cur))
                cur = []
                room = size
    return out


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


def system_prompts(requests: Sequence[SimRequest], more_than: int, granularity: int) -> list[tuple[int, int] | None]:
    """``shared_prefixes`` of distinct conversations (chains of ``continuers``): what an engine
    knows as a system prompt or template, shared by more than ``more_than`` conversations."""
    talks = conversations(continuers(requests, _trace_granularity(requests)))
    return shared_prefixes(requests, more_than, granularity, talks)


def _trace_granularity(requests: Sequence[SimRequest]) -> int:
    """Prompts of a trace are compared in its 512-token blocks (see ``continuation_pauses``)."""
    return TRACE_BLOCK_TOKENS if requests and requests[0].source_line else 1


def session_ids(requests: Sequence[SimRequest]) -> tuple[list[str], set[int]]:
    """``--sessions``: per request, the session id of its conversation (the chains of
    ``continuers``: the built-in workload's conversations; a trace's prompts extending each other),
    and the requests that end a conversation (its last turn: ``--session-end``)."""
    talks = conversations(continuers(requests, _trace_granularity(requests)))
    return [f"conversation-{t}" for t in talks], {i for i, t in enumerate(talks) if t == i}


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
    """``--sessions``: each request's ``session`` is its conversation's (``session_ids``); with
    ``end`` (``--session-end``) a conversation's last turn ends it, keeping the system prompt its
    requests share with other conversations (the engine knows its templates; the first
    conversation of one publishes it)."""
    ids, ends = session_ids(requests)
    shared = system_prompts(requests, 1, tokens_per_block) if end else []
    for i, r in enumerate(requests):
        r.session = SessionId(ids[i])
        r.ends_session = end and i in ends
        prefix = shared[i] if shared else None
        r.session_keep = prefix[1] if prefix is not None else 0


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
) -> dict[str, Any]:
    """``--retention-hints ACCURACY``: the replay again, each finished request sending the hint of
    ``hint_retentions`` (pauses in simulated time: scaled by ``options.time_scale``; a request
    said not to continue drops its blocks after the system prompt it shares with other
    conversations); the report's ``retention_hints`` part (``without``: the token hit rate of the
    replay without hints; ``pins``, ``pin_duration_s``: the replay's ``Replay.pins``,
    ``pin_duration_s``; ``scale``: the model's bytes per proxy byte). Requests with reasoning
    tokens add a token-range hint over them (``with_reasoning_hints``)."""
    pauses = continuation_pauses(requests, _trace_granularity(requests))
    scaled = [p * options.time_scale if p is not None else None for p in pauses]
    shared = [p[1] if p is not None else 0 for p in system_prompts(requests, 1, config.tokens_per_block)]
    replay = Replay(config, requests, options, bytes_scale=scale)
    hints = hint_retentions(scaled, accuracy, seed, drop=True, shared=shared)
    reasoning = any(r.reasoning for r in requests)
    replay.retain = with_reasoning_hints(requests, hints) if reasoning else hints
    replay.pins = pins
    replay.pin_duration_s = pin_duration_s
    result = replay.run()
    continued = sorted(p for p in scaled if p is not None)
    extra: dict[str, Any] = {"reasoning_hints": True} if reasoning else {}
    if any(r.ends_session for r in requests):
        extra["sessions_ended_blocks"] = result_ended(result)
    return {
        **extra,
        "accuracy": accuracy,
        "seed": seed,
        "continued_share": round(len(continued) / len(requests), 4) if requests else 0.0,
        "median_pause_s": continued[len(continued) // 2] if continued else None,
        "token_hit_rate": round(result.reused_tokens / result.prompt_tokens, 4) if result.prompt_tokens else 0.0,
        "token_hit_rate_without": without,
        "peak_retained_bytes": int(result.levels[0].peak_retained * scale),
    }


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
        help="each request carries its conversation's session id (create_kv_cache(session_id=); the built-in "
        "conversations, or a trace's prompts extending each other)",
    )
    g.add_argument(
        "--session-end",
        action="store_true",
        help="with --sessions: when a conversation's last turn closes, its session ends (directives.end: its "
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
    return out
