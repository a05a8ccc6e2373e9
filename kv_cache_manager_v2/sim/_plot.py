"""``--plot FILE``: a PNG of one replay (hit rate and GPU use over time) or of a sweep (hit rate vs capacity).

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
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs: list[int] = []
        for policy in policies:  # one pair of lines per eviction policy
            reports = [rep for rep in all_reports if rep["eviction_policy"] == policy]
            xs = [rep["tiers"][min(level, len(rep["tiers"]) - 1)]["capacity_tokens"] for rep in reports]
            tag = f", {policy}" if len(policies) > 1 else ""
            ax.plot(xs, [rep["hit_rate"]["tokens"] for rep in reports], "o-", label=f"hit rate (prompt tokens{tag})")
            ax.plot(xs, [rep["hit_rate"]["blocks"] for rep in reports], "s--", label=f"hit rate (blocks{tag})")
        for x, rep in zip(xs, reports):
            quota = rep["tiers"][min(level, len(rep["tiers"]) - 1)]["quota"]
            ax.annotate(quota, (x, rep["hit_rate"]["tokens"]), textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(xs, [f"{x / 1000:,.0f}k" if x >= 1000 else str(x) for x in xs])
        ax.set_xlabel(f"{key} capacity (tokens)")
        ax.set_ylabel("prefix hit rate")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_title(f"{reports[0]['model']['name']}: hit rate vs {key} capacity")
    else:
        assert report is not None
        s = report["series"]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        ax1.plot(s["t_s"], s["hit_rate_tokens"], color="tab:green")
        ax1.set_ylabel("hit rate (tokens, cumulative)")
        ax1.set_ylim(0, 1)
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
        ax1.set_title(f"{report['model']['name']}, GPU {gpu['quota']}: {source}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
