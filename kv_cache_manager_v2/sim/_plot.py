"""``--plot FILE``: a PNG of one replay (hit rate and GPU use over time), of a quota sweep (hit rate
over every request vs capacity, and below it the load: simulated time over the trace's span, rejected
requests), or of a snapshot-interval sweep (hit rate and snapshots taken vs the interval, the
attention-only bound as a line). A sweep whose replays noted per-request times adds a panel of the
time-to-first-token CDF, one line per sweep point (``latency.ttft_cdf_s``; ``--slo-ttft`` a line).

Needs matplotlib (the ``sim`` extra); left interpreted in production mode (see setup_mypyc.py).
"""

from __future__ import annotations

from typing import Any

from ._models import SSM_KV_ONLY, SSM_SWEEP_KEY, swept_tier


def matplotlib_missing() -> str | None:
    """Why --plot cannot work here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'kv_cache_manager_v2[sim]' (or matplotlib)"
    return None


def capacity_label(tokens: float) -> str:
    """A capacity tick: 992, 20k, 1.5M, 100M, 2G (three significant digits at most)."""
    for size, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if tokens >= size:
            return f"{tokens / size:.3g}{suffix}"
    return f"{tokens:.0f}"


def write_plot(
    path: str, report: dict[str, Any] | None = None, sweep: tuple[str, list[dict[str, Any]]] | None = None
) -> None:
    """Write the PNG: ``report`` (one replay) or ``sweep`` (key, reports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep is not None and sweep[0] == SSM_SWEEP_KEY:
        fig = _interval_sweep_figure(plt, sweep[1])
    elif sweep is not None:
        fig = _quota_sweep_figure(plt, *sweep)
    else:
        assert report is not None
        fig = _replay_figure(plt, report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_routing_plot(path: str, doc: dict[str, Any]) -> None:
    """``--routing``: the TTFT CDF of every policy, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(doc["policies"])
    reports = [{"latency": {"ttft_cdf_s": p["ttft_cdf_s"], "goodput": None}} for p in doc["policies"].values()]
    _ttft_cdf_panel(ax, names, reports, f"{doc['count']} replicas, routing")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _quota_sweep_figure(plt: Any, key: str, all_reports: list[dict[str, Any]]) -> Any:
    import matplotlib.ticker

    policies = list(dict.fromkeys(rep["eviction_policy"] for rep in all_reports))
    cdf = _has_cdf(all_reports)
    fig, axes = plt.subplots(
        3 if cdf else 2,
        1,
        figsize=(7.5, 10 if cdf else 6.5),
        gridspec_kw={"height_ratios": [3, 1.4, 2.6][: 3 if cdf else 2]},
    )
    ax, ax_load = axes[0], axes[1]
    ax_load.sharex(ax)
    ax.tick_params(labelbottom=False)
    xs: list[int] = []
    top = 0.0
    for policy in policies:  # one pair of lines per eviction policy
        reports = [rep for rep in all_reports if rep["eviction_policy"] == policy]
        xs = [swept_tier(rep, key)["capacity_tokens"] for rep in reports]
        tag = f", {policy}" if len(policies) > 1 else ""
        tok = [rep["hit_rate"]["tokens_all_requests"] for rep in reports]
        blk = [rep["hit_rate"]["blocks_all_requests"] for rep in reports]
        line = ax.plot(xs, tok, "o-", label=f"hit rate (prompt tokens{tag})")[0]
        ax.plot(xs, blk, "s--", color=line.get_color(), alpha=0.7, label=f"hit rate (blocks{tag})")
        if any(rep["requests"]["rejected"] for rep in reports):
            adm = [rep["hit_rate"]["tokens"] for rep in reports]
            ax.plot(xs, adm, ":", color=line.get_color(), alpha=0.5, label=f"admitted requests only{tag}")
            top = max(top, *adm)
        top = max(top, *tok, *blk)
        over = [(x, y) for x, y, rep in zip(xs, tok, reports) if rep["load"]["overloaded"]]
        if over:
            ax.plot(
                [x for x, _ in over], [y for _, y in over], "x", color="tab:red", markersize=10,
                label="overloaded" if policy == policies[0] else None,
            )  # fmt: skip
    for i, (x, rep) in enumerate(zip(xs, reports)):
        quota = swept_tier(rep, key)["quota"]
        rejected = rep["requests"]["rejected"]
        preempted = rep["preemptions"]["suspend"] + rep["preemptions"]["recompute"]
        label = (
            quota
            + (f"\n{rejected:,} rejected" if rejected else "")
            + (f"\n{preempted:,} preempted" if preempted else "")
        )
        y = rep["hit_rate"]["tokens_all_requests"]
        # the end points' labels grow inwards: centred, they would be cut at the figure's edges
        ha = "center" if 0 < i < len(xs) - 1 or len(xs) == 1 else ("left" if i == 0 else "right")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 7), ha=ha, fontsize=8)
    if min(xs) > 0:
        ax.set_xscale("log")
    else:  # a point without the swept tier (--sweep host=0,...): linear near 0
        ax.set_xscale("symlog", linthresh=min([x for x in xs if x > 0], default=1))
    ax.set_ylabel("prefix hit rate (all requests;\nrejected prompts count as misses)", fontsize=9)
    ax.set_ylim(0, min(1.0, max(top * 1.3, 0.02)))  # auto-scaled: small hit rates stay readable
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"{reports[0]['model']['name']}: hit rate vs {key} capacity")
    _load_panel(ax_load, xs, reports)
    ax_load.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_load.set_xticks(xs, [capacity_label(x) for x in xs])
    ax_load.set_xlabel(f"{key} capacity (tokens)")
    if cdf:
        many = len(policies) > 1
        labels = [f"{swept_tier(r, key)['quota']}" + (f", {r['eviction_policy']}" if many else "") for r in all_reports]
        _ttft_cdf_panel(axes[2], labels, all_reports, f"{key} quota")
    return fig


def _has_cdf(reports: list[dict[str, Any]]) -> bool:
    return any(rep.get("latency", {}).get("ttft_cdf_s") for rep in reports)


def _ttft_cdf_panel(ax: Any, labels: list[str], reports: list[dict[str, Any]], title: str) -> None:
    """The share of requests whose time to first token is at most x, one line per sweep point
    (``ttft_cdf_s``: the TTFT at 1 % ... 100 % of the requests); ``--slo-ttft`` as a vertical line."""
    for label, rep in zip(labels, reports):
        xs = rep["latency"]["ttft_cdf_s"]
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post", label=label)
    slo = next((g["slo_ttft_s"] for r in reports if (g := r["latency"]["goodput"]) and g["slo_ttft_s"]), None)
    if slo is not None:
        ax.axvline(slo, color="tab:red", linestyle="--", linewidth=1, label=f"--slo-ttft {slo:g} s")
    lows = [x for rep in reports for x in rep["latency"]["ttft_cdf_s"][:1]]
    if lows and min(lows) > 0:
        import matplotlib.ticker as ticker

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.1, 0.2, 0.5, 1, 2, 5 s...
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("time to first token (s, simulated)")
    ax.set_ylabel("share of requests", fontsize=9)
    ax.axhline(0.9, color="gray", linestyle=":", linewidth=1)  # where p90 reads off
    ax.set_yticks([0.0, 0.25, 0.5, 0.75, 0.9, 1.0])
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", title=title, title_fontsize=8)


def _load_panel(ax_load: Any, xs: list[int], reports: list[dict[str, Any]]) -> None:
    """Below a quota sweep: simulated time over the trace's span (1: kept up), or, when every request
    arrived at once (``--time-scale 0``: no span), the simulated time itself; requests rejected."""
    if any(rep["load"]["trace_span_s"] for rep in reports):
        ratios = [rep["load"]["time_ratio"] for rep in reports]
        ax_load.plot(xs, ratios, "o-", color="tab:purple", label="simulated time / trace span")
        ax_load.axhline(1.0, color="gray", linewidth=0.8)
        ax_load.set_ylim(0, max([*ratios, 1.0]) * 1.2)
        ax_load.set_ylabel("time ratio", fontsize=9)
    else:
        sim_s = [rep["load"]["simulated_s"] for rep in reports]
        ax_load.plot(xs, sim_s, "o-", color="tab:purple", label="simulated time (all requests at once)")
        ax_load.set_ylim(0, max([*sim_s, 1e-3]) * 1.2)
        ax_load.set_ylabel("simulated s", fontsize=9)
    ax_load.grid(True, alpha=0.3)
    rej = ax_load.twinx()
    least = min([x for x in xs if x > 0], default=1)  # a bar's width at a point without the tier
    rej.bar(xs, [rep["requests"]["rejected"] for rep in reports], width=[max(x, least) * 0.15 for x in xs], alpha=0.3,
            color="tab:red", label="rejected requests")  # fmt: skip
    rej.set_ylabel("rejected", fontsize=9)
    rej.set_ylim(0, max([rep["requests"]["rejected"] for rep in reports] + [1]) * 1.2)
    handles = ax_load.get_legend_handles_labels()[0] + rej.get_legend_handles_labels()[0]
    ax_load.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper right")


def _interval_sweep_figure(plt: Any, all_reports: list[dict[str, Any]]) -> Any:
    """Hit rate (all requests) and snapshots taken per snapshot interval, one point per interval in
    the sweep's order (``prompt``: prompt ends only); ``kv`` (the attention layers alone, the bound a
    snapshot at every block would reach) is a horizontal line."""
    policies = list(dict.fromkeys(rep["eviction_policy"] for rep in all_reports))
    if _has_cdf(all_reports):
        fig, (ax, ax_cdf) = plt.subplots(2, 1, figsize=(7.5, 8.5), gridspec_kw={"height_ratios": [5, 3.5]})
        many = len(policies) > 1
        labels = [str(r["sweep_point"]) + (f", {r['eviction_policy']}" if many else "") for r in all_reports]
        _ttft_cdf_panel(ax_cdf, labels, all_reports, "snapshot interval")
    else:
        fig, ax = plt.subplots(figsize=(7.5, 5))
    snaps = ax.twinx()
    labels = list(dict.fromkeys(str(r["sweep_point"]) for r in all_reports if r["sweep_point"] != SSM_KV_ONLY))
    xs = list(range(len(labels)))
    for policy in policies:
        tag = f", {policy}" if len(policies) > 1 else ""
        mine = [rep for rep in all_reports if rep["eviction_policy"] == policy]
        points = [rep for rep in mine if rep["sweep_point"] != SSM_KV_ONLY]
        if points:
            line = ax.plot(xs, [p["hit_rate"]["tokens_all_requests"] for p in points], "o-", label=f"hit rate (prompt tokens{tag})")[0]  # fmt: skip
            snaps.plot(xs, [p["snapshots"]["taken"] for p in points], "s:", color=line.get_color(), alpha=0.6,
                       label=f"snapshots taken{tag}")  # fmt: skip
        for rep in mine:
            if rep["sweep_point"] == SSM_KV_ONLY:
                ax.axhline(rep["hit_rate"]["tokens_all_requests"], color="gray", linestyle="--", linewidth=1,
                           label=f"kv: attention layers alone (a snapshot at every block){tag}")  # fmt: skip
    ax.set_xticks(xs, labels)
    ax.set_xlabel("snapshot interval (tokens; prompt: at prompt ends only)")
    ax.set_ylabel("prefix hit rate (all requests)", fontsize=9)
    ax.set_ylim(0, 1.0)
    ax.grid(True, alpha=0.3)
    snaps.set_ylabel("snapshots taken", fontsize=9)
    snaps.set_ylim(0, None)
    handles = ax.get_legend_handles_labels()[0] + snaps.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="best")
    ax.set_title(f"{all_reports[0]['model']['name']}: hit rate and snapshots vs snapshot interval", fontsize=10)
    return fig


def _replay_figure(plt: Any, report: dict[str, Any]) -> Any:
    s = report["series"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(s["t_s"], s["hit_rate_tokens"], color="tab:green")
    ax1.set_ylabel("hit rate (tokens, cumulative)")
    ax1.set_ylim(0, min(1.0, max([*s["hit_rate_tokens"], 0.0]) * 1.3 or 1.0))
    ax1.grid(True, alpha=0.3)
    ax2.stackplot(s["t_s"], s["gpu_used"], s["gpu_cached"], labels=["held by requests", "reusable cache"], alpha=0.8)
    ax2.set_ylabel("GPU tier use")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("simulated time (s)")
    ax2.legend(loc="upper left", framealpha=0.9)
    ax2.grid(True, alpha=0.3)
    gpu = report["tiers"][0]
    source = str(report["workload"]["description"]).split(":")[0]
    notes = []
    if report["requests"]["rejected"]:
        notes.append(f"{report['requests']['rejected']:,} rejected")
    if report["load"]["overloaded"]:
        notes.append(f"overloaded: x{report['load']['time_ratio']:.1f} the arrivals' span")
    title = f"{report['model']['name']}, GPU {gpu['quota']}: {source}"
    ax1.set_title(title + (f"\n({'; '.join(notes)})" if notes else ""), fontsize=9)
    return fig
