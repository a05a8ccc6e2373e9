"""Continuation hints from a workload's future (``--retention-hints ACCURACY``; issue 37).

An engine knows whether a conversation goes on (a tool call is running, a chat is open) and
roughly when; a trace replay can know it exactly by looking ahead: request ``i`` *continues* when
a later request's prompt starts with ``i``'s whole prompt, after the pause between their
arrivals. ``continuation_pauses`` finds that pause; ``hint_retentions`` turns it into the
close-time retention an engine would send, with a share ``1 - accuracy`` of the labels flipped
at random (seeded): continues, keep at ``KEEP_PRIORITY`` for the predicted pause (with a margin);
does not, ``DROP_PRIORITY`` (its own blocks go first) until reused.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from .._common import DEFAULT_PRIORITY
from .._config import KVCacheManagerConfig
from .._retention import Retention
from ._models import SimUserError
from ._replay import Replay
from ._replay_types import SchedulerOptions
from ._workload import TRACE_BLOCK_TOKENS, SimRequest

#: priority of a conversation that continues within a second (longer pauses: lower, down to
#: just above the default), and of one that ends
KEEP_PRIORITY = 99
PRIORITY_PER_DOUBLING = 5
DROP_PRIORITY = 0
#: the kept time: the predicted pause times PAUSE_FACTOR, plus PAUSE_SLACK_S
PAUSE_FACTOR = 1.25
PAUSE_SLACK_S = 1.0
HINTS_HELP = (
    "replay again with close-time continuation hints derived from the workload's future, a share "
    "1 - ACCURACY of them wrong, and report the hit rate with and without them"
)


def continuation_pauses(requests: Sequence[SimRequest], granularity: int = 1) -> list[float | None]:
    """Per request, seconds until the first later request whose prompt starts with its prompt
    (its conversation continues), or None. ``granularity``: prompts are compared up to their last
    multiple of this many tokens (a trace's 512-token blocks: a trace names a prompt's partial
    last block apart from the full block a later turn holds there; shorter prompts never continue)."""
    order = sorted(range(len(requests)), key=lambda k: (requests[k].arrival_ms, k))
    chain_ids: dict[tuple[int, int, int], int] = {}  # (parent chain, first, count) -> chain id
    # requests waiting for a continuation, by (chain of all but their last run, last run's first
    # token): (last run's length, request)
    waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
    out: list[float | None] = [None] * len(requests)
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
                        out[i] = (req.arrival_ms - requests[i].arrival_ms) / 1000.0
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
    pauses: Sequence[float | None], accuracy: float, seed: int = 0, horizon_s: float | None = None
) -> list[Retention | None]:
    """The close-time retention of each request from its continuation pause (None: it does not
    continue), a share ``1 - accuracy`` of the labels flipped (seeded). A request wrongly said
    to continue is kept for the median pause. ``horizon_s``: a conversation expected back later
    than this gets no hint (the cache could not hold it that long: about its size over the rate
    of incoming prompt tokens)."""
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy!r}")
    known = sorted(p for p in pauses if p is not None)
    typical = known[len(known) // 2] if known else 60.0
    rng = random.Random(seed)
    out: list[Retention | None] = []
    for pause in pauses:
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
            out.append(Retention(DROP_PRIORITY))
    return out


def check_accuracy(accuracy: float | None) -> None:
    """``--retention-hints``: an accuracy in [0, 1] (or None: no hints)."""
    if accuracy is not None and not 0.0 <= accuracy <= 1.0:
        raise SimUserError(f"--retention-hints must be an accuracy in [0, 1], got {accuracy:g}")


def replay_with_hints(
    config: KVCacheManagerConfig,
    requests: list[SimRequest],
    options: SchedulerOptions,
    accuracy: float,
    without: float,
    seed: int = 0,
) -> dict[str, Any]:
    """``--retention-hints ACCURACY``: the replay again, each finished request sending the hint of
    ``hint_retentions`` (pauses in simulated time: scaled by ``options.time_scale``); the report's
    ``retention_hints`` part (``without``: the token hit rate of the replay without hints)."""
    granularity = TRACE_BLOCK_TOKENS if requests and requests[0].source_line else 1
    pauses = continuation_pauses(requests, granularity)
    scaled = [p * options.time_scale if p is not None else None for p in pauses]
    replay = Replay(config, requests, options)
    replay.retain = hint_retentions(scaled, accuracy, seed)
    result = replay.run()
    continued = sorted(p for p in scaled if p is not None)
    return {
        "accuracy": accuracy,
        "seed": seed,
        "continued_share": round(len(continued) / len(requests), 4) if requests else 0.0,
        "median_pause_s": continued[len(continued) // 2] if continued else None,
        "token_hit_rate": round(result.reused_tokens / result.prompt_tokens, 4) if result.prompt_tokens else 0.0,
        "token_hit_rate_without": without,
    }


def format_hints(rep: dict[str, Any]) -> str:
    """The report's line for ``--retention-hints`` (empty without)."""
    h = rep.get("retention_hints")
    if h is None:
        return ""
    return (
        f"\nretention hints (accuracy {h['accuracy']:g}, {h['continued_share']:.1%} of requests continued): "
        f"token hit rate {h['token_hit_rate']:.3f} with, {h['token_hit_rate_without']:.3f} without"
    )
