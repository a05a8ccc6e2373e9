"""What users wait for, summarised from a replay's per-request times: the queueing delay (arrival to
first admission), time to first token (TTFT), time per output token (TPOT) and end to end (E2E);
the throughput; the goodput under service-level objectives (``--slo-ttft``, ``--slo-tpot``).

Definitions (the report's ``latency`` section; every time in seconds, the replay keeps milliseconds):

- **Percentiles are nearest-rank**: pN of n values is the ceil(N x n / 100)-th smallest (numpy's
  ``inverted_cdf``). It is always one request's own value, and "p90 TTFT <= 2 s" means exactly "at
  least 90 % of the requests had their first token within 2 s". Means are arithmetic.
- **TPOT** is over the requests with more than one output token (a single token has no time between
  tokens; the replay notes 0 for it); the goodput counts such a request as meeting ``--slo-tpot``.
- **Throughput** is over the simulated span: from the first request's arrival (times
  ``--time-scale``; not time 0, so a trace whose timestamps start late is not diluted) to the end of
  the replay's last step (``replay.simulated_s``; over replicas, the fleet's): finished requests,
  prompt tokens (of first admissions, reused ones included) and output tokens, per second.
- **Goodput**: the finished requests whose TTFT is at most ``--slo-ttft`` and TPOT at most
  ``--slo-tpot`` (those given), per second of the span, and their share of every request of the
  workload (rejected requests count as misses).

No per-request times (a replay that notes none): every summary is None; the throughput stands.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._models import SimUserError
from ._replay_types import ReplayResult

PERCENTILES = (50, 90, 99)
#: points of ``ttft_cdf_s``: the TTFT at 1 %, 2 %, ... 100 % of the requests
CDF_POINTS = 100
#: ``kv-cache-sim`` options of the objectives: flag, help
SLO_OPTIONS = (
    ("--slo-ttft", "goodput: a request meets it when its time to first token is at most SECONDS"),
    ("--slo-tpot", "goodput: a request meets it when its mean time per output token is at most SECONDS"),
)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds (None: not given)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


def check_slo(ttft_s: float | None, tpot_s: float | None) -> Slo:
    """``--slo-ttft``/``--slo-tpot`` as given: each None or a finite number of seconds > 0."""
    for (flag, _), value in zip(SLO_OPTIONS, (ttft_s, tpot_s)):
        if value is not None and not 0.0 < value < math.inf:
            raise SimUserError(f"{flag} must be a finite number of seconds > 0, got {value}")
    return Slo(ttft_s, tpot_s)


def nearest_rank(sorted_values: Any, p: int) -> float:
    """pN (``p`` in 1..100) of non-empty ascending values: the ceil(p x n / 100)-th smallest."""
    n = len(sorted_values)
    return float(sorted_values[-(-p * n // 100) - 1])


def _sorted_s(values_ms: array[float]) -> Any:
    return np.sort(np.asarray(values_ms, dtype=np.float64)) / 1000.0


def summary(values_ms: array[float], positive_only: bool = False) -> dict[str, Any] | None:
    """Count, mean, p50/p90/p99 and max in seconds of per-request times in ms (None: no value)."""
    s = _sorted_s(values_ms)
    if positive_only:
        s = s[s > 0.0]
    n = len(s)
    if not n:
        return None
    out: dict[str, Any] = {"requests": n, "mean": float(s.mean())}  # (Any: mypyc would make n a float)
    for p in PERCENTILES:
        out[f"p{p}"] = nearest_rank(s, p)
    out["max"] = float(s[-1])
    return out


def latency_report(r: ReplayResult, slo: Slo | None = None, end_ms: float | None = None) -> dict[str, Any]:
    """The report's ``latency`` section of ``r`` (see the module doc); ``end_ms``: where the
    throughput's span ends (default: ``r``'s simulated time; it starts at ``r``'s first arrival)."""
    span_s = max(0.0, (r.sim_time_ms if end_ms is None else end_ms) - r.first_arrival_ms) / 1000.0
    ttft = _sorted_s(r.ttft_ms)
    return {
        "percentiles": "nearest rank",
        "queueing_s": summary(r.wait_ms),
        "ttft_s": summary(r.ttft_ms),
        "tpot_s": summary(r.tpot_ms, positive_only=True),
        "e2e_s": summary(r.e2e_ms),
        "ttft_cdf_s": [nearest_rank(ttft, p) for p in range(1, CDF_POINTS + 1)] if len(ttft) else [],
        "throughput": {
            "span_s": span_s,
            "requests_per_s": _per(r.finished, span_s),
            "prompt_tokens_per_s": _per(r.prompt_tokens, span_s),
            "output_tokens_per_s": _per(r.output_tokens, span_s),
        },
        "goodput": _goodput(r, slo, span_s),
    }


def _per(count: float, span_s: float) -> float:
    return count / span_s if span_s > 0 else 0.0


def _goodput(r: ReplayResult, slo: Slo | None, span_s: float) -> dict[str, Any] | None:
    """The requests meeting every objective given (None: none given, or no per-request times)."""
    if slo is None or (slo.ttft_s is None and slo.tpot_s is None):
        return None
    n = len(r.ttft_ms)
    if not n or (slo.tpot_s is not None and len(r.tpot_ms) != n):
        return None
    ok = np.ones(n, dtype=bool)
    if slo.ttft_s is not None:
        ok &= np.asarray(r.ttft_ms, dtype=np.float64) <= slo.ttft_s * 1000.0
    if slo.tpot_s is not None:
        ok &= np.asarray(r.tpot_ms, dtype=np.float64) <= slo.tpot_s * 1000.0
    met = int(ok.sum())
    return {
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
        "requests": met,
        "requests_per_s": _per(met, span_s),
        "share": met / (n + r.rejected),
    }


def seconds(x: float) -> str:
    """A time for the text report: 850 ms, 12.5 ms, 1.25 s, 1,234.5 s."""
    if x < 1.0:
        return f"{x * 1000:.1f} ms" if x < 0.01 else f"{x * 1000:.0f} ms"
    return f"{x:,.2f} s" if x < 100 else f"{x:,.1f} s"


def _stats(s: dict[str, Any]) -> str:
    return (
        f"mean {seconds(s['mean'])}, "
        + ", ".join(f"p{p} {seconds(s[f'p{p}'])}" for p in PERCENTILES)
        + f" ({int(s['requests']):,} requests)"
    )


def _objectives(g: dict[str, Any]) -> str:
    given = [(name, g[key]) for name, key in (("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s")) if g[key] is not None]
    return " and ".join(f"{name} <= {seconds(v)}" for name, v in given)


def latency_rows(lat: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of the text report's ``latency`` section."""
    rows = [
        (label, _stats(lat[key]))
        for label, key in (
            ("queueing", "queueing_s"),
            ("time to first token", "ttft_s"),
            ("time per output token", "tpot_s"),
            ("end to end", "e2e_s"),
        )
        if lat[key] is not None
    ]
    tp = lat["throughput"]
    rows.append(
        (
            "throughput",
            f"{tp['requests_per_s']:,.2f} requests/s, {tp['prompt_tokens_per_s']:,.0f} prompt tokens/s, "
            f"{tp['output_tokens_per_s']:,.0f} output tokens/s (over {tp['span_s']:,.1f} s simulated)",
        )
    )
    g = lat["goodput"]
    if g is not None:
        rows.append(
            (
                "goodput",
                f"{g['requests_per_s']:,.2f} requests/s meet {_objectives(g)}: {g['share']:.1%} of the requests "
                "(rejected ones count as misses)",
            )
        )
    return rows


def ttft_cell(rep: dict[str, Any], p: int) -> str:
    """A sweep table's TTFT pN cell in seconds ("-": no per-request times)."""
    ttft = rep["latency"]["ttft_s"]
    return "-" if ttft is None else f"{ttft[f'p{p}']:,.2f}"


def slo_cell(rep: dict[str, Any]) -> str:
    """A sweep table's goodput share cell ("-": no objective or no per-request times)."""
    g = rep["latency"]["goodput"]
    return "-" if g is None else f"{g['share']:.0%}"


def compared_rows(private: dict[str, Any], shared: dict[str, Any]) -> list[str]:
    """``--replicas``: TTFT p50/p90 and output throughput, private vs shared (over the whole fleet:
    the replicas' arrays merged), goodput, then the shared run's TTFT p90 per replica."""
    lp, ls = private["latency"], shared["latency"]
    lines: list[str] = []
    for p in (50, 90):
        if lp["ttft_s"] is not None and ls["ttft_s"] is not None:
            a, b = lp["ttft_s"][f"p{p}"], ls["ttft_s"][f"p{p}"]
            lines.append(f"  {f'TTFT p{p} (s)':<26}{a:>12,.2f}{b:>12,.2f}{b - a:>+10,.2f}")
    a, b = lp["throughput"]["output_tokens_per_s"], ls["throughput"]["output_tokens_per_s"]
    lines.append(f"  {'output tokens/s':<26}{a:>12,.0f}{b:>12,.0f}{b - a:>+10,.0f}")
    for label, lat in (("private", lp), ("shared", ls)):
        if lat["goodput"] is not None:
            g = lat["goodput"]
            lines.append(
                f"  goodput ({label}): {g['requests_per_s']:,.2f} requests/s meet {_objectives(g)} ({g['share']:.1%})"
            )
    cells = [ttft_cell({"latency": lat}, 90) for lat in shared["per_replica_latency"]]
    if any(c != "-" for c in cells):
        lines.append(f"  TTFT p90 per replica (shared, s): {', '.join(cells)}")
    return lines
