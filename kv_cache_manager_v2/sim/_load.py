"""Whether the simulated engine kept up with its arrivals (the report's ``load`` section): the
simulated time against the trace's span, the waits before admission, the steps' compute time (any
cost model: ``ReplayResult.compute_ms``), and the warnings that say what would keep up (a GPU quota,
a faster compute, a sweep); the sweep table's advice."""

from __future__ import annotations

import math
from typing import Any

from ._compute import RooflineCost
from ._models import ModelShape, TierSpec, format_count, format_quota, is_token_quota, swept_tier
from ._replay_types import ReplayResult, SchedulerOptions
from ._step_cost import LinearCost

#: overloaded: the replay took more than this many times the trace's span (plus OVERLOAD_SLACK_S)
OVERLOAD_RATIO = 1.2
OVERLOAD_SLACK_S = 10.0


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def _compute_advice(options: SchedulerOptions) -> tuple[str, str]:
    """(how the steps computed, what makes them faster) for the overload warning."""
    cost = options.cost
    if cost is None or isinstance(cost, LinearCost):
        return f"at --tokens-per-s {options.tokens_per_s:g}", "raise --tokens-per-s"
    if isinstance(cost, RooflineCost):
        return f"on one {cost.gpu.name} (the roofline)", "a faster --gpu-kind or more --replicas"
    return "at the calibrated step times", "a faster engine or more --replicas"


def load_report(r: ReplayResult, shape: ModelShape, tiers: list[TierSpec], options: SchedulerOptions) -> dict[str, Any]:
    """Whether the simulated engine kept up with the arrivals, and a GPU quota that would fit."""
    span_s = r.trace_span_ms / 1000.0
    sim_s = r.sim_time_ms / 1000.0
    waits = sorted(x / 1000.0 for x in r.wait_ms)
    computed = r.prefill_computed + r.decode_computed
    compute_s = r.compute_ms / 1000.0  # what its steps computed (any cost model), not loads or the manager
    overloaded = span_s > 0 and sim_s > OVERLOAD_RATIO * span_s + OVERLOAD_SLACK_S
    gpu = tiers[0]
    in_tokens = is_token_quota(gpu.text)
    bpt = shape.bytes_per_token
    t = r.tokens_per_block
    # its blocks (one more for alignment) and its live recurrent state
    longest_bytes = (r.longest_request_tokens + t) * bpt + shape.state_bytes_per_request
    fit_bytes = max(r.ideal_peak_tokens * bpt / (1.0 - options.watermark), longest_bytes)
    suggested = format_quota(fit_bytes, shape, in_tokens) if overloaded and fit_bytes > gpu.quota_bytes else None
    # with a tier below the GPU, reuse from it saves compute that the bound (no reuse) ignores: a GPU
    # quota between this one and the bound may keep up; a sweep finds the smallest
    lower = " ".join(f"--{t.kind} {t.text}" for t in tiers[1:])
    sweep = None
    if suggested is not None and lower:
        mid = format_quota(math.sqrt(gpu.quota_bytes * fit_bytes), shape, in_tokens)
        sweep = f"gpu={','.join(dict.fromkeys((gpu.text, mid, suggested)))}"
    admits_all = format_quota(longest_bytes, shape, in_tokens)
    warnings: list[str] = []
    if r.rejected:
        warnings.append(
            f"rejected {r.rejected:,} of {r.num_requests:,} requests as longer than the GPU tier holds (the longest needs "
            f"{format_count(r.longest_request_tokens)} tokens; --gpu {admits_all} admits every one"
            + (
                ", plus the share the manager gives snapshots, which grows as --ssm-reuse-interval shrinks"
                if shape.is_hybrid
                else ""
            )
            + "); their prompts count as misses in the hit rates over all requests"
        )
    if overloaded:
        msg = (
            f"the simulated engine is overloaded: {sim_s:,.0f} s simulated for {span_s:,.0f} s of arrivals "
            f"(x{sim_s / span_s:.1f}; requests waited {percentile(waits, 0.5):,.0f} s at p50, "
            f"{percentile(waits, 0.99):,.0f} s at p99 before admission)"
        )
        if compute_s > 0.9 * span_s:
            how, fix = _compute_advice(options)
            msg += (
                f"; its steps computed {format_count(computed)} tokens {how} for {compute_s:,.0f} s: {fix} "
                "(or spread arrivals with --time-scale)"
            )
        if suggested is not None:
            msg += (
                f"; the requests in flight at their arrival times hold up to {format_count(r.ideal_peak_tokens)} "
                f"tokens: --gpu {suggested} holds them all even without reuse"
            )
        if sweep is not None:
            msg += f"; with {lower} reusing blocks less may keep up: --sweep {sweep} {lower} finds how much"
        warnings.append(msg)
    return {
        "trace_span_s": span_s,
        "simulated_s": sim_s,
        "time_ratio": ratio(sim_s, span_s),
        "overloaded": overloaded,
        "wait_s": {
            "mean": ratio(sum(waits), len(waits)),
            "p50": percentile(waits, 0.5),
            "p99": percentile(waits, 0.99),
            "max": waits[-1] if waits else 0.0,
        },
        "compute_s": compute_s,
        "ideal_peak_tokens": r.ideal_peak_tokens,
        "longest_request_tokens": r.longest_request_tokens,
        "gpu_quota_admitting_all": admits_all,  #: a GPU quota that rejects no request
        "suggested_gpu_quota": suggested,  #: overloaded only: holds every request in flight, without reuse
        "suggested_gpu_sweep": sweep,  #: overloaded with a lower tier: from this quota to suggested_gpu_quota
        "warnings": warnings,
    }


def load_text(load: dict[str, Any]) -> str:
    w = load["wait_s"]
    head = f"waited before admission: p50 {w['p50']:,.1f} s, p99 {w['p99']:,.1f} s"
    if not load["trace_span_s"]:
        return head
    return (
        f"{load['simulated_s']:,.0f} s simulated for {load['trace_span_s']:,.0f} s of arrivals "
        f"(x{load['time_ratio']:.2f}{', overloaded' if load['overloaded'] else ''}); " + head
    )


def sweep_advice(key: str, reports: list[dict[str, Any]]) -> list[str]:
    """Warnings for rejected requests and overloaded points, and the smallest quota that does neither."""
    quota = [swept_tier(rep, key)["quota"] for rep in reports]
    out: list[str] = []
    rejecting = [q for q, rep in zip(quota, reports) if rep["requests"]["rejected"]]
    if rejecting:
        out.append(
            f"warning: requests rejected (too long for the GPU tier) at {key} {', '.join(dict.fromkeys(rejecting))}"
        )
    overloaded = [q for q, rep in zip(quota, reports) if rep["load"]["overloaded"]]
    if not overloaded:
        return out
    out.append(f"warning: the simulated engine is overloaded at {key} {', '.join(dict.fromkeys(overloaded))}")
    fine = [q for q, rep in zip(quota, reports) if not rep["load"]["overloaded"] and not rep["requests"]["rejected"]]
    if fine:
        out.append(f"  the smallest {key} quota of this sweep that keeps up and rejects nothing: {fine[0]}")
    else:
        last = reports[-1]["load"]
        note = [w for w in last["warnings"] if w.startswith("the simulated engine")]
        if note:
            out.append(f"  at {key} {quota[-1]}: {note[0]}")
    return out
