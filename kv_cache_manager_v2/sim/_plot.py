"""``--plot FILE``: a PNG of one replay (hit rate and GPU use over time) or of a sweep (hit rate over
every request vs capacity, and below it the load: simulated time over the trace's span, rejected requests).

Needs matplotlib (the ``sim`` extra); left interpreted in production mode (see setup_mypyc.py).
"""

from __future__ import annotations

from typing import Any


def matplotlib_missing() -> str | None:
    """Why --plot cannot work here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'kv_cache_manager_v2[sim]' (or matplotlib)"
    return None


def write_plot(
    path: str, report: dict[str, Any] | None = None, sweep: tuple[str, list[dict[str, Any]]] | None = None
) -> None:
    """Write the PNG: ``report`` (one replay) or ``sweep`` (key, reports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    if sweep is not None:
        key, all_reports = sweep
        level = {"gpu": 0, "host": 1, "disk": 2}[key]
        policies = list(dict.fromkeys(rep["eviction_policy"] for rep in all_reports))
        fig, (ax, ax_load) = plt.subplots(
            2, 1, figsize=(7.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
        )
        xs: list[int] = []
        top = 0.0
        for policy in policies:  # one pair of lines per eviction policy
            reports = [rep for rep in all_reports if rep["eviction_policy"] == policy]
            xs = [rep["tiers"][min(level, len(rep["tiers"]) - 1)]["capacity_tokens"] for rep in reports]
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
        for x, rep in zip(xs, reports):
            quota = rep["tiers"][min(level, len(rep["tiers"]) - 1)]["quota"]
            rejected = rep["requests"]["rejected"]
            preempted = rep["preemptions"]["suspend"] + rep["preemptions"]["recompute"]
            label = (
                quota
                + (f"\n{rejected:,} rejected" if rejected else "")
                + (f"\n{preempted:,} preempted" if preempted else "")
            )
            y = rep["hit_rate"]["tokens_all_requests"]
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_ylabel("prefix hit rate (all requests;\nrejected prompts count as misses)", fontsize=9)
        ax.set_ylim(0, min(1.0, max(top * 1.3, 0.02)))  # auto-scaled: small hit rates stay readable
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.set_title(f"{reports[0]['model']['name']}: hit rate vs {key} capacity")
        # the load: simulated time over the trace's span (1: kept up), requests rejected
        ratios = [rep["load"]["time_ratio"] for rep in reports]
        ax_load.plot(xs, ratios, "o-", color="tab:purple", label="simulated time / trace span")
        ax_load.axhline(1.0, color="gray", linewidth=0.8)
        ax_load.set_ylim(0, max([*ratios, 1.0]) * 1.2)
        ax_load.set_ylabel("time ratio", fontsize=9)
        ax_load.grid(True, alpha=0.3)
        rej = ax_load.twinx()
        rej.bar(xs, [rep["requests"]["rejected"] for rep in reports], width=[x * 0.15 for x in xs], alpha=0.3,
                color="tab:red", label="rejected requests")  # fmt: skip
        rej.set_ylabel("rejected", fontsize=9)
        rej.set_ylim(0, max([rep["requests"]["rejected"] for rep in reports] + [1]) * 1.2)
        handles = ax_load.get_legend_handles_labels()[0] + rej.get_legend_handles_labels()[0]
        ax_load.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper right")
        ax_load.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax_load.set_xticks(xs, [f"{x / 1000:,.0f}k" if x >= 1000 else str(x) for x in xs])
        ax_load.set_xlabel(f"{key} capacity (tokens)")
    else:
        assert report is not None
        s = report["series"]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        ax1.plot(s["t_s"], s["hit_rate_tokens"], color="tab:green")
        ax1.set_ylabel("hit rate (tokens, cumulative)")
        ax1.set_ylim(0, min(1.0, max([*s["hit_rate_tokens"], 0.0]) * 1.3 or 1.0))
        ax1.grid(True, alpha=0.3)
        ax2.stackplot(
            s["t_s"], s["gpu_used"], s["gpu_cached"], labels=["held by requests", "reusable cache"], alpha=0.8
        )
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
