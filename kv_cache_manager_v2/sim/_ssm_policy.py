"""Hybrid models' snapshot policies in the simulator (``--ssm-snapshot-policy``, ``--sweep
ssm-policy=interval,branch,auto,kv``): the replay of each policy, the manager's snapshot counters
by kind, and the table comparing each policy's hit rate with the attention-only bound (``kv``:
the attention layers alone, as if every block had a snapshot) of the same sweep."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._common import ReuseStatistics
from .._config import SNAPSHOT_POLICIES
from ._models import ModelShape, SimUserError, format_count

#: the --sweep key over snapshot policies, and its value for the attention-only bound
SSM_POLICY_KEY = "ssm-policy"
KV_ONLY = "kv"
#: the manager's snapshot counters the replay adds up (``ReuseStatistics`` field names)
COUNTERS = (
    "attention_matched_tokens",
    "snapshots_interval",
    "snapshots_branch",
    "snapshots_last",
    "snapshots_demand",
    "snapshots_evicted_unused",
)


def check_policy(option: str, value: str) -> None:
    """A snapshot policy the manager knows (``kv``: the attention-only bound, in a sweep only)."""
    allowed = (*SNAPSHOT_POLICIES, KV_ONLY) if option.startswith("--sweep") else SNAPSHOT_POLICIES
    if value not in allowed:
        raise SimUserError(f"{option}: {value!r} is not a snapshot policy; choose from {', '.join(allowed)}")


def policy_point(value: str, shape: ModelShape) -> tuple[ModelShape, str | None]:
    """One point of an ssm-policy sweep: the shape to replay and its policy."""
    check_policy(f"--sweep {SSM_POLICY_KEY}", value)
    if value == KV_ONLY:
        return dataclasses.replace(shape, name=f"{shape.name} (attention only)", recurrent_layers=()), None
    return shape, value


def add_counters(totals: dict[str, int], stats: ReuseStatistics) -> None:
    """Add a manager's snapshot counters to ``totals`` (they restart with a new manager)."""
    for name in COUNTERS:
        totals[name] = totals.get(name, 0) + getattr(stats, name)


def format_policy_sweep(reports: list[dict[str, Any]]) -> str:
    """One line per snapshot policy (eviction policy): token hit rate, the attention-only bound of
    the same sweep and the ratio, snapshots taken by kind, reused, evicted (of which unused)."""
    bounds = {rep["eviction_policy"]: rep["hit_rate"]["tokens_all_requests"] for rep in reports if not rep["snapshots"]}
    head = (
        f"{'ssm-policy':<12}{'evict':<10}{'hit(tok)':>10}{'bound':>8}{'ratio':>7}{'interval':>10}{'branch':>8}"
        f"{'last':>8}{'demand':>8}{'reused':>8}{'evicted':>9}{'unused':>9}{'peak use':>10}"
    )
    lines = [head]
    for rep in reports:
        snap = rep["snapshots"] or {}
        hit = rep["hit_rate"]["tokens_all_requests"]
        bound = bounds.get(rep["eviction_policy"])
        ratio = f"{hit / bound:.2f}" if bound else "-"
        kinds = [
            format_count(snap.get(f"snapshots_{k}", 0)) if snap else "-"
            for k in ("interval", "branch", "last", "demand")
        ]
        counts = [format_count(snap[k]) if snap else "-" for k in ("reused", "evicted")]
        unused = format_count(snap.get("snapshots_evicted_unused", 0)) if snap else "-"
        lines.append(
            f"{rep.get('sweep_point', ''):<12}{rep['eviction_policy']:<10}{hit:>10.3f}"
            f"{(f'{bound:.3f}' if bound is not None else '-'):>8}{ratio:>7}{kinds[0]:>10}{kinds[1]:>8}{kinds[2]:>8}"
            f"{kinds[3]:>8}{counts[0]:>8}{counts[1]:>9}{unused:>9}{rep['tiers'][0]['peak_used_fraction']:>10.0%}"
        )
    lines.append(
        "hit(tok): over all requests; bound: kv, the attention layers alone (a snapshot at every block); "
        "snapshots taken by kind (interval: multiples of the interval), reused, evicted (unused: never reused)"
    )
    return "\n".join(lines)


def snapshot_rows(snap: dict[str, Any]) -> list[tuple[str, str]]:
    """The one-replay report's rows on snapshots (label, text): where they are taken, then by kind."""
    policy = snap.get("policy", "interval")
    where = {
        "interval": f"every {snap['interval']} tokens and at prompt ends",
        "branch": "at branch points, prompt and output ends, on demand",
        "auto": f"every {snap['interval']} tokens, at branch points, prompt and output ends, on demand",
    }.get(policy, "")
    rows = [
        (
            "state snapshots",
            f"{policy}: {where}: {format_count(snap['taken'])} taken, {format_count(snap['reused'])} reused, "
            f"{format_count(snap['evicted'])} evicted, {format_count(snap['skipped'])} skipped (no free slot); "
            "a match ends at a snapshot",
        )
    ]
    if "snapshots_interval" in snap:
        kinds = ", ".join(
            f"{format_count(snap[f'snapshots_{k}'])} {k}" for k in ("interval", "branch", "last", "demand")
        )
        rows.append(
            (
                "snapshot kinds",
                f"{kinds}; {format_count(snap['snapshots_evicted_unused'])} evicted never reused; the attention "
                f"layers alone matched {format_count(snap['attention_matched_tokens'])} tokens",
            )
        )
    return rows
