"""``kv-cache-sim --restart-at FRACTION``: the engine restarts mid-replay with a persistent disk tier.

The replay runs twice on the same workload: warm (no restart; the counters are only split at the
restart time) and restarted (at that time every live request is freed and queued again, the manager
shuts down, writing the GPU and host tiers' reusable blocks back to the disk tier, and a new manager
adopts the directory). Each disk tier lives in a fresh directory of its own. The summary compares
the block hit rate of the requests first admitted after the restart time.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from .._exceptions import OutOfMemoryError
from ._latency import Slo
from ._models import ModelShape, SimUserError, TierSpec, manager_config, proxy_page_bytes, real_bytes_per_proxy_byte
from ._replay import Replay
from ._replay_types import ReplayResult, SchedulerOptions
from ._report import build_report
from ._workload import SimRequest


def _after(r: ReplayResult) -> float:
    """Block hit rate of the prompts first admitted after the split."""
    n = r.prompt_blocks - r.split_prompt_blocks
    return (r.hit_blocks - r.split_hit_blocks) / n if n else 0.0


def _before(r: ReplayResult) -> float:
    return r.split_hit_blocks / r.split_prompt_blocks if r.split_prompt_blocks else 0.0


def simulate_restart(
    shape: ModelShape,
    tiers: list[TierSpec],
    tokens_per_block: int,
    requests: list[SimRequest],
    workload: dict[str, Any],
    options: SchedulerOptions,
    fraction: float,
    swa_scratch: bool = False,
    check_data: bool = False,
    eviction_policy: str = "lru",
    compiled: bool = False,
    progress: Callable[[str], tuple[Callable[[int], None] | None, Callable[[], None]]] | None = None,
    ssm_reuse_interval: int | None = None,
    slo: Slo | None = None,
) -> dict[str, Any]:
    """Both replays (see the module doc); returns ``{"restart": summary, "warm": report,
    "restarted": report}`` (``compiled``: the package's mode, for the reports). Raises :class:`SimUserError` for refused settings."""
    if type(fraction) is not float or not 0.0 < fraction < 1.0:
        raise SimUserError(f"--restart-at must be a fraction in (0, 1) of the replay's arrivals, got {fraction!r}")
    kinds = [t.kind for t in tiers]
    if "disk" not in kinds:
        raise SimUserError("--restart-at needs a disk tier (--disk): it is what survives the restart")
    arrivals = [r.arrival_ms for r in requests if r.after < 0]
    if not arrivals:
        raise SimUserError("--restart-at: the workload has no requests")
    split_ms = fraction * max(arrivals) * options.time_scale
    t = tokens_per_block
    page_bytes = proxy_page_bytes(t, check_data, shape)
    scale = real_bytes_per_proxy_byte(shape, t, page_bytes)
    out: dict[str, Any] = {}
    results: dict[str, ReplayResult] = {}
    disk_dir = next(x.path for x in tiers if x.kind == "disk")  # --disk-path or the CLI's temporary one
    for name, restart in (("warm", False), ("restarted", True)):
        path = tempfile.mkdtemp(prefix="kv-cache-sim-restart-", dir=disk_dir)
        try:
            row = [dataclasses.replace(x, path=path, persistent=True) if x.kind == "disk" else x for x in tiers]
            config = manager_config(shape, t, row, swa_scratch, page_bytes, eviction_policy, ssm_reuse_interval)
            update, close = progress(f"replay ({name})") if progress is not None else (None, None)
            try:
                try:
                    replay = Replay(
                        config, requests, options, check_data, update, split_ms=split_ms, restart=restart,
                        bytes_scale=scale,
                    )  # fmt: skip
                    result = replay.run()  # the restart opens a second manager on the same files
                except ValueError as e:
                    raise SimUserError(f"the manager refused this configuration: {e}") from None
                except (OSError, OutOfMemoryError) as e:
                    why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
                    raise SimUserError(f"--restart-at: the persistent disk tier in {disk_dir}: {why}") from None
            finally:
                if close is not None:
                    close()
            results[name] = result
            rep = build_report(result, shape, tiers, options, workload, compiled, swa_scratch, scale, slo)
            rep["eviction_policy"] = eviction_policy
            out[name] = rep
        finally:
            shutil.rmtree(path, ignore_errors=True)
    warm, restarted = results["warm"], results["restarted"]
    warm_after = _after(warm)
    out["restart"] = {
        "at_fraction": fraction,
        "at_s": split_ms / 1000.0,
        "requests_before": sum(1 for a in arrivals if a * options.time_scale < split_ms),
        "adopted_pages": restarted.adopted_pages,
        "warm_hit_rate_before": _before(warm),
        "warm_hit_rate_after": warm_after,
        "restarted_hit_rate_before": _before(restarted),
        "restarted_hit_rate_after": _after(restarted),
        "after_vs_warm": _after(restarted) / warm_after if warm_after else None,
    }
    return out


def format_restart(summary: dict[str, Any]) -> str:
    """The summary's text lines."""
    s = summary
    ratio = s["after_vs_warm"]
    return "\n".join(
        [
            f"restart at {s['at_fraction']:.2f} of the arrivals ({s['at_s']:.1f} s simulated): "
            f"{s['adopted_pages']:,} pages adopted from the persistent disk tier",
            f"  block hit rate before: warm {s['warm_hit_rate_before']:.3f}, restarted {s['restarted_hit_rate_before']:.3f}",
            f"  block hit rate after:  warm {s['warm_hit_rate_after']:.3f}, restarted {s['restarted_hit_rate_after']:.3f}"
            + (f" ({ratio:.3f} of warm)" if ratio is not None else ""),
        ]
    )
