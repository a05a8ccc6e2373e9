"""The report: a JSON-ready dict built from a replay's counters, and its text rendering."""

from __future__ import annotations

from typing import Any

from ._compute import describe_cost
from ._latency import Slo, latency_report, latency_rows, slo_cell, ttft_cell
from ._load import load_report, load_text, percentile, ratio, sweep_advice
from ._models import (
    SSM_SWEEP_KEY,
    ModelShape,
    TierSpec,
    format_bytes,
    format_count,
    swept_tier,
)
from ._replay_types import LevelUsage, ReplayResult, SchedulerOptions
from ._ssm_policy import SSM_POLICY_KEY, format_policy_sweep, snapshot_rows
from ._step_cost import LinearCost
from ._tier_io import link_report, link_rows

SCHEMA = "kv-cache-sim/2"
MAX_SERIES_POINTS = 400


def _downsample(values: list[float], n: int) -> list[float]:
    if len(values) <= n:
        return values
    step = len(values) / n
    return [values[min(len(values) - 1, int(i * step))] for i in range(n)] + [values[-1]]


def build_report(
    result: ReplayResult,
    shape: ModelShape,
    tiers: list[TierSpec],
    options: SchedulerOptions,
    workload: dict[str, Any],
    compiled: bool,
    swa_scratch: bool,
    scale: float,
    slo: Slo | None = None,
) -> dict[str, Any]:
    """Everything the simulator reports, JSON-ready (schema ``kv-cache-sim/2``); ``scale``: the
    model's bytes per byte of the proxy manager; ``slo``: the goodput's objectives (``_latency``)."""
    r = result
    return {
        "schema": SCHEMA,
        "mode": "compiled" if compiled else "interpreted",
        "model": _model(shape, swa_scratch),
        "snapshots": _snapshots(r) if shape.is_hybrid else None,
        "tokens_per_block": r.tokens_per_block,
        "workload": workload,
        "scheduler": _scheduler(options, tiers[0].quota_bytes),
        "requests": {
            "total": r.num_requests,
            "finished": r.finished,
            "rejected": r.rejected,
            # trace lines (built-in workload: request indices) of the first rejected requests
            "rejected_examples": list(r.rejected_lines),
            "rejected_prompt_tokens": r.rejected_prompt_tokens,
        },
        "hit_rate": _hit_rate(r, tiers),
        "prefill": {
            "prompt_tokens": r.prompt_tokens,
            "reused_tokens": r.reused_tokens,
            "prompt_blocks": r.prompt_blocks,
            "hit_blocks": r.hit_blocks,
            "computed_tokens": r.prefill_computed,
            # computed again: by requests preempted by recompute, and by those the restart freed
            "recomputed_tokens": r.readmitted_tokens - r.readmitted_reused_tokens,
            "recomputed_after_restart_tokens": r.restart_readmitted_tokens - r.restart_readmitted_reused_tokens,
        },
        "decode": {"output_tokens": r.output_tokens, "computed_tokens": r.decode_computed},
        "tiers": [_tier_row(tier, usage, shape, scale) for tier, usage in zip(tiers, r.levels)],
        "preemptions": {"suspend": r.preempted_suspend, "recompute": r.preempted_recompute, "resumed": r.resumed},
        "load": load_report(r, shape, tiers, options),
        "latency": latency_report(r, slo),  # what users wait for, in seconds (see _latency)
        "tier_io": link_report(options.links, [t.kind for t in tiers[1:]], r.io_wait_ms, r.io_write_stall_ms),
        "manager": {
            "reused_blocks": r.reused_blocks,
            "missed_blocks": r.missed_blocks,
            "reused_pages": r.reused_pages,
            "allocated_pages": r.allocated_pages,
        },
        "manager_cpu": _manager_cpu(r),
        "replay": {
            "wall_s": r.wall_s,
            "steps": r.steps,
            "max_batch": r.max_batch,
            "simulated_s": r.sim_time_ms / 1000.0,
            "requests_per_s": ratio(r.finished, r.wall_s),
            "blocks_per_s": ratio(r.blocks_replayed, r.wall_s),
        },
        "data_check": {"records_checked": r.records_checked} if r.records_checked else None,
        "series": _series(r),
    }


#: ``replay`` fields that measure the machine, not the replay
TIMING_FIELDS = ("wall_s", "requests_per_s", "blocks_per_s")


def report_figures(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (``build_report``) without what measures the machine (the replay's wall time and
    rates, the manager's CPU time), the build mode and the trace file's path: what two replays of
    one workload and setup must agree on, to the digit."""
    out = {k: v for k, v in report.items() if k not in ("mode", "manager_cpu")}
    out["replay"] = {k: v for k, v in report["replay"].items() if k not in TIMING_FIELDS}
    out["workload"] = {k: v for k, v in report["workload"].items() if k != "path"}
    return out


def _model(shape: ModelShape, swa_scratch: bool) -> dict[str, Any]:
    return {
        "name": shape.name,
        "layers": shape.num_layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype": shape.dtype,
        "window": shape.window if shape.num_swa_layers else None,
        "sliding_window_layers": shape.num_swa_layers,
        "sinks": shape.sinks,
        "bytes_per_token": shape.bytes_per_token,
        "swa_scratch_reuse": swa_scratch,
        "attention_layers": len(shape.kv_layers),
        "recurrent_layers": len(shape.recurrent_layers),
        "state_dtype": shape.state_dtype if shape.is_hybrid else None,
        #: one request's (one beam's) recurrent state: conv_state + ssm_state of every recurrent layer
        "state_bytes_per_request": shape.state_bytes_per_request,
    }


def _snapshots(r: ReplayResult) -> dict[str, Any]:
    return {
        "interval": r.snapshot_interval,
        "taken": r.snapshots_taken,
        "skipped": r.snapshots_skipped,
        "reused": r.snapshots_reused,
        "evicted": r.snapshots_evicted,
        **r.snapshot_counters,
    }


def _linear(options: SchedulerOptions) -> bool:
    """Whether steps take ``step_ms`` plus their tokens at ``tokens_per_s`` (else ``options.cost``)."""
    return options.cost is None or isinstance(options.cost, LinearCost)


def _scheduler(options: SchedulerOptions, gpu_quota_bytes: float) -> dict[str, Any]:
    linear = _linear(options)
    return {
        "max_batch": options.max_batch,
        "max_num_tokens": options.max_num_tokens,
        "chunk": options.chunk,
        "watermark": options.watermark,
        "step_ms": options.step_ms if linear else None,  # (None: see compute)
        "tokens_per_s": options.tokens_per_s if linear else None,
        "time_scale": options.time_scale,
        "reuse": options.reuse,
        "prompt_only": options.prompt_only,
        "count_manager_time": options.count_manager_time,  #: steps also take the manager's CPU time
        "compute": describe_cost(options.cost or LinearCost(options.step_ms, options.tokens_per_s), gpu_quota_bytes),
    }


def _hit_rate(r: ReplayResult, tiers: list[TierSpec]) -> dict[str, Any]:
    all_tokens = r.prompt_tokens + r.rejected_prompt_tokens
    all_blocks = r.prompt_blocks + r.rejected_prompt_blocks
    return {
        # over the admitted requests' prompts
        "tokens": ratio(r.reused_tokens, r.prompt_tokens),
        "blocks": ratio(r.hit_blocks, r.prompt_blocks),
        # over every request of the workload, rejected prompts counting as misses: the same
        # denominator at every quota (compare these across a sweep)
        "tokens_all_requests": ratio(r.reused_tokens, all_tokens),
        "blocks_all_requests": ratio(r.hit_blocks, all_blocks),
        # split by the tier each reused block was found in at admission (they add up to the totals)
        "by_tier": {t.kind: ratio(u.hit_blocks, r.prompt_blocks) for t, u in zip(tiers, r.levels)},
        "tokens_by_tier": {t.kind: ratio(u.reused_tokens, r.prompt_tokens) for t, u in zip(tiers, r.levels)},
    }


def _tier_row(tier: TierSpec, usage: LevelUsage, shape: ModelShape, scale: float) -> dict[str, Any]:
    cap = usage.capacity * scale
    return {
        "tier": tier.kind,
        "quota": tier.text,
        "capacity_bytes": int(cap),
        "capacity_tokens": int(cap // shape.bytes_per_token),
        "peak_used_bytes": int(usage.peak_used * scale),
        "peak_used_fraction": ratio(usage.peak_used, usage.capacity),
        "peak_occupied_bytes": int(usage.peak_occupied * scale),
        "peak_occupied_fraction": ratio(usage.peak_occupied, usage.capacity),
        "reusable_bytes_at_end": int(usage.reusable_at_end * scale),
        "snapshot_bytes_at_end": int(usage.snapshots_at_end * scale),
        "peak_pinned_bytes": int(usage.peak_pinned * scale),
        "peak_retained_bytes": int(usage.peak_retained * scale),
        # traffic in pages (one block of one layer group) and the model's bytes
        "offloaded_pages": usage.offloaded_pages,
        "offloaded_bytes": int(usage.offloaded_bytes * scale),
        "onboarded_pages": usage.onboarded_pages,
        "onboarded_bytes": int(usage.onboarded_bytes * scale),
        "dropped_pages": usage.dropped_pages,
        "dropped_bytes": int(usage.dropped_bytes * scale),
        "io_errors": usage.io_errors,
        "declined_writes_pages": usage.declined_pages,
        "declined_writes_bytes": int(usage.declined_bytes * scale),
        "max_step_offloaded_pages": usage.max_step_offloaded_pages,
        "max_step_onboarded_pages": usage.max_step_onboarded_pages,
    }


def _manager_cpu(r: ReplayResult) -> dict[str, Any]:
    steps = sorted(r.step_us)
    return {
        "total_s": r.manager_s,
        "per_step_us": {
            "mean": ratio(sum(steps), len(steps)),
            "p50": percentile(steps, 0.5),
            "p99": percentile(steps, 0.99),
            "max": steps[-1] if steps else 0.0,
        },
        "per_request_step_us": ratio(r.manager_s * 1e6, r.request_steps),
    }


def _series(r: ReplayResult) -> dict[str, list[float]]:
    return {
        "t_s": _downsample(list(r.series_t_s), MAX_SERIES_POINTS),
        "gpu_used": _downsample(list(r.series_used), MAX_SERIES_POINTS),
        "gpu_cached": _downsample(list(r.series_cached), MAX_SERIES_POINTS),
        "hit_rate_tokens": _downsample(list(r.series_hit), MAX_SERIES_POINTS),
        "running": _downsample(list(r.series_running), MAX_SERIES_POINTS),
    }


def _row(label: str, value: str) -> str:
    return f"  {label:<26}{value}"


def _by_tier(split: dict[str, float]) -> str:
    return "  " + " + ".join(f"{k} {v:.3f}" for k, v in split.items())


def _recomputed(pre: dict[str, Any]) -> str:
    """Prefill computed again: after a preemption by recompute, after the engine's restart."""
    parts = []
    if pre["recomputed_tokens"]:
        parts.append(f"{format_count(pre['recomputed_tokens'])} recomputed after preemption")
    if pre.get("recomputed_after_restart_tokens"):
        parts.append(f"{format_count(pre['recomputed_after_restart_tokens'])} recomputed after the restart")
    return f" ({', '.join(parts)})" if parts else ""


def _tier_use(tier: dict[str, Any], i: int) -> str:
    """How full a tier got (its blocks: requests' and reusable ones), how much of it requests held
    (below the GPU: suspended requests that spilled), and the reusable blocks left at the end."""
    held = "requests" if i == 0 else "suspended requests"
    return (
        f"{format_count(tier['capacity_tokens'])} tokens; filled up to {format_bytes(tier['peak_occupied_bytes'])} "
        f"({tier['peak_occupied_fraction']:.0%}), held by {held} up to {format_bytes(tier['peak_used_bytes'])} "
        f"({tier['peak_used_fraction']:.0%}); {format_bytes(tier['reusable_bytes_at_end'])} of reusable blocks at the end"
        + (
            f" ({format_bytes(tier['snapshot_bytes_at_end'])} in state snapshots)"
            if tier["snapshot_bytes_at_end"]
            else ""
        )
    )


def _traffic(tiers: list[dict[str, Any]], i: int) -> str:
    """Where one tier's pages went: down (evicted to the next tier), up (onboarded), dropped."""
    tier = tiers[i]
    parts: list[str] = []
    if i + 1 < len(tiers):
        below = tiers[i + 1]
        parts.append(
            f"{format_count(below['offloaded_pages'])} offloaded to {below['tier']} "
            f"({format_bytes(below['offloaded_bytes'])}; at most {format_count(below['max_step_offloaded_pages'])} a step)"
            + (
                f", {format_count(below['declined_writes_pages'])} declined (its link's write backlog full)"
                if below["declined_writes_pages"]
                else ""
            )
        )
    if i > 0:
        parts.append(
            f"{format_count(tier['onboarded_pages'])} onboarded ({format_bytes(tier['onboarded_bytes'])}; "
            f"at most {format_count(tier['max_step_onboarded_pages'])} a step)"
        )
    parts.append(f"{format_count(tier['dropped_pages'])} dropped")
    if tier["io_errors"]:
        parts.append(f"{format_count(tier['io_errors'])} disk errors")
    return "pages: " + ", ".join(parts)


def format_report(rep: dict[str, Any]) -> str:
    """The summary table of one replay."""
    m = rep["model"]
    w = rep["workload"]
    hit = rep["hit_rate"]
    pre = rep["prefill"]
    req = rep["requests"]
    cpu = rep["manager_cpu"]
    rp = rep["replay"]
    pm = rep["preemptions"]
    lines = [
        f"kv-cache-sim: {m['name']}, {format_bytes(m['bytes_per_token'])}/token, "
        f"{rep['tokens_per_block']} tokens/block, {rep['scheduler']['compute']['text']}"
        + (" + the manager's CPU time" if rep["scheduler"]["count_manager_time"] else "")
        + f" ({rep['mode']})",
        _row("workload", str(w["description"])),
        _row(
            "requests",
            f"{req['finished']:,} finished"
            + (
                f", {req['rejected']:,} rejected (too long for the GPU tier; "
                + ("trace lines " if w.get("source") == "trace" else "requests ")
                + ", ".join(str(x) for x in req["rejected_examples"])
                + ("..." if req["rejected"] > len(req["rejected_examples"]) else "")
                + ")"
                if req["rejected"]
                else ""
            )
            + f"; {rp['simulated_s']:.1f} s simulated",
        ),
        "prefix reuse",
        _row(
            "hit rate (tokens)",
            f"{hit['tokens']:.3f}  ({format_count(pre['reused_tokens'])} of {format_count(pre['prompt_tokens'])} prompt tokens reused)"
            + (_by_tier(hit["tokens_by_tier"]) if len(hit["tokens_by_tier"]) > 1 else ""),
        ),
        _row(
            "hit rate (blocks)",
            f"{hit['blocks']:.3f}  ({format_count(pre['hit_blocks'])} of {format_count(pre['prompt_blocks'])} prompt blocks)"
            + _by_tier(hit["by_tier"]),
        ),
        *(
            [
                _row(
                    "over all requests",
                    f"{hit['tokens_all_requests']:.3f} tokens, {hit['blocks_all_requests']:.3f} blocks "
                    f"(the {req['rejected']:,} rejected prompts count as misses)",
                )
            ]
            if req["rejected"]
            else []
        ),
        _row(
            "prefill tokens",
            f"{format_count(pre['reused_tokens'])} saved, {format_count(pre['computed_tokens'])} computed"
            + _recomputed(pre),
        ),
        *_snapshot_lines(rep),
        "memory",
    ]
    if m.get("recurrent_layers"):
        lines.append(
            _row(
                "recurrent state",
                f"{format_bytes(m['state_bytes_per_request'])} per request ({m['recurrent_layers']} recurrent layers, "
                f"{m['state_dtype']}), besides {format_bytes(m['bytes_per_token'])}/token of KV in "
                f"{m['attention_layers']} attention layers",
            )
        )
    tiers = rep["tiers"]
    for i, tier in enumerate(tiers):
        name = tier["tier"].upper() if tier["tier"] == "gpu" else tier["tier"]
        lines.append(_row(f"{name} {tier['quota']}", _tier_use(tier, i)))
        lines.append(_row("", _traffic(tiers, i)))
    lines += [
        "scheduling",
        _row(
            "steps",
            f"{rp['steps']:,} (largest batch {rp['max_batch']}); preemptions: {pm['suspend']:,} suspended "
            f"({pm['resumed']:,} resumed), {pm['recompute']:,} recomputed",
        ),
        _row("load", load_text(rep["load"])),
        "what users wait for (simulated)",
        *(_row(label, text) for label, text in latency_rows(rep["latency"])),
        *(_row(label, text) for label, text in link_rows(rep["tier_io"])),
        "manager CPU time",
        _row(
            "per step",
            f"mean {cpu['per_step_us']['mean']:.0f} us, p50 {cpu['per_step_us']['p50']:.0f} us, "
            f"p99 {cpu['per_step_us']['p99']:.0f} us; {cpu['per_request_step_us']:.1f} us per request per step",
        ),
        _row(
            "replay",
            f"{rp['wall_s']:.2f} s wall: {rp['requests_per_s']:,.0f} requests/s, {rp['blocks_per_s']:,.0f} blocks/s "
            f"(manager {cpu['total_s']:.2f} s)",
        ),
    ]
    if rep["data_check"] is not None:
        lines.append(_row("data check", f"passed: {rep['data_check']['records_checked']:,} records checked"))
    lines += [f"warning: {w}" for w in [rep["scheduler"]["compute"].get("warning"), *rep["load"]["warnings"]] if w]
    return "\n".join(lines)


def _snapshot_lines(rep: dict[str, Any]) -> list[str]:
    """Hybrid models: the recurrent-state snapshots that bound every match."""
    snap = rep.get("snapshots")
    if not snap:
        return []
    return [_row(label, text) for label, text in snapshot_rows(snap)]


def format_sweep(key: str, reports: list[dict[str, Any]]) -> str:
    """One line per sweep point: capacity, eviction policy, hit rates over every request (rejected
    prompts are misses, so every point has the same denominator) and over the admitted ones,
    rejected requests, the peak GPU share requests held and the peak share of the swept tier that
    held blocks, preemptions, pages dropped (all tiers), simulated time / trace span; then what to
    make of overloaded points."""
    if key == SSM_POLICY_KEY:
        return format_policy_sweep(reports)
    if key == SSM_SWEEP_KEY:
        return format_ssm_sweep(reports)
    goodput = any(rep["latency"]["goodput"] is not None for rep in reports)
    slo_head = f"{'slo(met)':>10}" if goodput else ""
    head = (
        f"{key + ' quota':<14}{'tokens':>12}  {'policy':<10}{'hit(tok)':>10}{'hit(blk)':>10}{'admitted':>10}"
        f"{'ttft(p50)':>11}{'ttft(p90)':>11}{slo_head}"
        f"{'rejected':>10}{'held':>7}{'filled':>8}{'preempt':>9}{'dropped':>10}{'time':>8}"
    )
    lines = [head]
    for rep in reports:
        slo = f"{slo_cell(rep):>10}" if goodput else ""
        tier = swept_tier(rep, key)
        gpu = rep["tiers"][0]
        dropped = sum(t["dropped_pages"] for t in rep["tiers"])
        pm = rep["preemptions"]
        hit = rep["hit_rate"]
        load = rep["load"]
        ratio = f"x{load['time_ratio']:.1f}" + ("!" if load["overloaded"] else " ") if load["trace_span_s"] else "-"
        filled = f"{tier['peak_occupied_fraction']:.0%}" if tier["capacity_tokens"] else "-"
        lines.append(
            f"{tier['quota']:<14}{format_count(tier['capacity_tokens']):>12}  {rep['eviction_policy']:<10}"
            f"{hit['tokens_all_requests']:>10.3f}{hit['blocks_all_requests']:>10.3f}{hit['tokens']:>10.3f}"
            f"{ttft_cell(rep, 50):>11}{ttft_cell(rep, 90):>11}{slo}"
            f"{rep['requests']['rejected']:>10,}{gpu['peak_used_fraction']:>7.0%}{filled:>8}"
            f"{pm['suspend'] + pm['recompute']:>9,}"
            f"{format_count(dropped):>10}{ratio:>8}"
        )
    lines.append(
        "hit(tok), hit(blk): over all requests (rejected prompts count as misses); admitted: token hit rate of "
        "the admitted requests only; ttft(p50), ttft(p90): time to first token, s (nearest rank; -: no "
        "per-request times)"
        + (", slo(met): share of the requests meeting --slo-ttft/--slo-tpot" if goodput else "")
        + "; held: peak GPU share held by requests; filled: peak share of the "
        f"{key} tier holding blocks (requests' or reusable); time: simulated time / trace span (!: overloaded)"
    )
    lines += sweep_advice(key, reports)
    return "\n".join(lines)


def format_ssm_sweep(reports: list[dict[str, Any]]) -> str:
    """One line per snapshot interval of a hybrid model (``prompt``: prompt-end snapshots only;
    ``kv``: the attention layers alone, the bound a snapshot at every block would reach): hit rates,
    snapshots taken / reused / evicted / skipped, peak GPU use, preemptions."""
    head = (
        f"{'ssm-interval':<14}{'policy':<10}{'hit(tok)':>10}{'hit(blk)':>10}{'taken':>10}{'reused':>10}"
        f"{'evicted':>10}{'skipped':>10}{'peak use':>10}{'preempt':>9}"
    )
    lines = [head]
    for rep in reports:
        snap = rep.get("snapshots") or {}
        hit = rep["hit_rate"]
        pm = rep["preemptions"]
        count = {k: format_count(snap[k]) if snap else "-" for k in ("taken", "reused", "evicted", "skipped")}
        lines.append(
            f"{rep.get('sweep_point', ''):<14}{rep['eviction_policy']:<10}{hit['tokens_all_requests']:>10.3f}"
            f"{hit['blocks_all_requests']:>10.3f}{count['taken']:>10}{count['reused']:>10}{count['evicted']:>10}"
            f"{count['skipped']:>10}{rep['tiers'][0]['peak_used_fraction']:>10.0%}{pm['suspend'] + pm['recompute']:>9,}"
        )
    lines.append(
        "hit(tok), hit(blk): over all requests; prompt: snapshots at prompt ends only; kv: the attention layers "
        "alone (a snapshot at every block); without any snapshot a hybrid model reuses nothing"
    )
    rejecting = [str(rep.get("sweep_point")) for rep in reports if rep["requests"]["rejected"]]
    if rejecting:
        lines.append(f"warning: requests rejected (too long for the GPU tier) at ssm-interval {', '.join(rejecting)}")
    return "\n".join(lines)


def format_load_plans(reports: list[dict[str, Any]]) -> str:
    """The replays of ``--load-policy`` side by side (nothing without it): TTFT, tokens loaded from
    below the GPU and recomputed by the plan, the time requests waited for their own loads."""
    rows = [rep for rep in reports if "load_plan" in rep]
    if len(rows) < 2:
        return ""
    lines = [f"\n  {'load policy':<12}{'TTFT mean':>11}{'p90':>10}{'loaded':>10}{'recomputed':>12}{'load wait':>11}"]
    for rep in rows:
        lp = rep["load_plan"]
        ttft = rep["latency"]["ttft_s"] or {"mean": 0.0, "p90": 0.0}
        loaded = sum(lp["loaded_tokens"][1:])
        lines.append(
            f"  {lp['policy']:<12}{ttft['mean']:>10.3f}s {ttft['p90']:>8.3f}s{format_count(loaded):>10}"
            f"{format_count(sum(lp['recomputed_tokens'])):>12}{lp['request_load_wait_s']:>10.1f}s"
        )
    return "\n".join(lines) + "\n"
