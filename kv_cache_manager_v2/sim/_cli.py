"""``kv-cache-sim``: replay a request trace (or built-in conversations) through the real manager and report.

The command line: its parser, and the checks that turn it into a :class:`Setup` before any replay;
the running modes are in ``_run``. Left interpreted in production mode (argparse, optional
tqdm/matplotlib; see setup_mypyc.py): the replay it drives (``_replay``) is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, NoReturn

from .._config import EVICTION_POLICIES, REMOTE_URL_SCHEMES
from . import _hints
from ._check import DataCheckError
from ._fleet import add_routing_arguments, check_routing_arguments
from ._hints import HINTS_HELP, HINTS_SWEEP_KEY, check_accuracy, check_pin_duration, check_pin_share
from ._models import (
    PRESETS,
    SSM_KV_ONLY,
    SSM_PROMPT_ONLY,
    SSM_SWEEP_KEY,
    SWEEP_KEYS,
    ModelShape,
    SimUserError,
    TierSpec,
    format_count,
    is_zero_quota,
    model_shape,
    parse_quota,
)
from ._plot import matplotlib_missing
from ._replay_types import SchedulerOptions
from ._run import (
    Resources,
    Setup,
    SimMetrics,
    check_ssm_interval,
    run_fleet,
    run_replays,
    run_restart,
    tier_spec,
)
from ._signals import catch_sigterm, interrupted
from ._ssm_policy import SSM_POLICY_KEY, check_policy
from ._time_cli import add_time_arguments, policy_list, time_setup
from ._workload import MAX_ARRIVAL_MS, ConversationParams, SimRequest, generate_conversations, load_trace

PROG = "kv-cache-sim"
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
DEFAULT_GPU = "8GiB"
#: the most engine replicas of --replicas (each its own manager, all in this process)
MAX_REPLICAS = 64


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
        allow_abbrev=False,  # --hos 32GiB is a mistake, not --host
    )
    _add_model_arguments(p.add_argument_group("model"))
    g = p.add_argument_group("cache tiers (sizes: 16GiB, 512MiB, 2GB, a bare number is GiB; tokens: 3Mtok, 300ktok)")
    g.add_argument("--gpu", help=f"GPU tier quota (default: {DEFAULT_GPU})")
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
    g.add_argument("--retention-hints", type=float, metavar="ACCURACY", help=HINTS_HELP)
    g.add_argument(
        "--hints-seed",
        type=int,
        metavar="SEED",
        help="the seed of which hints are wrong (--retention-hints; default 0)",
    )
    _hints.add_session_options(g)
    g.add_argument(
        "--pin-system-prompts",
        type=int,
        metavar="N",
        help="pin (KVCacheManager.pin) each prefix that more than N conversations of the workload start with, once "
        "cached (the share a tier may pin: max_pinned_share)",
    )
    g.add_argument(
        "--pin-duration",
        type=float,
        metavar="SECONDS",
        help="with --pin-system-prompts: each pin lasts this many simulated seconds after each use of its prefix "
        "(default: to the end)",
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
    add_routing_arguments(g)
    g.add_argument(
        "--remote-url",
        help="the store of the shared tier (default: a private redis-server on a free loopback port): "
        "redis://host:port, redis+cluster://host:port[,host:port...] for a Redis Cluster or Valkey cluster, "
        "mooncake://master-host:port?metadata=URL for a Mooncake Store",
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
    g.add_argument("--time-scale", type=float, default=s.time_scale, help="multiply arrival times (0: all at once)")
    add_time_arguments(p)  # sim/_time_cli.py
    g = p.add_argument_group("output")
    g.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the report as JSON (default: stdout)")
    g.add_argument("--plot", metavar="FILE", help="write a PNG (needs matplotlib)")
    g.add_argument(
        "--sweep",
        action="append",  # given twice: refused in _setup, not the first silently replaced
        metavar="TIER=V1,V2,..",
        help="replay once per quota (and eviction policy), e.g. gpu=1,3,10 or gpu=1Mtok,3Mtok (host=0,8GiB,... "
        "or disk=0,...: 0 is a point without that tier); hybrid models: "
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


def _add_model_arguments(g: argparse._ArgumentGroup) -> None:
    """The ``model`` group of ``build_parser``: preset, overrides, hybrid snapshot options."""
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
        "--ssm-lower-tier-interval",
        type=int,
        metavar="N",
        help="hybrid models, policy auto with a host or disk tier: tokens between the snapshots written there "
        "(a positive multiple of --tokens-per-block) (default: the smallest power-of-two multiple of the interval "
        "whose span's KV weighs twice a state)",
    )
    g.add_argument(
        "--ssm-snapshot-policy",
        help="hybrid models: which recurrent-state snapshots requests keep: interval, branch or auto "
        "(the manager's ssm_snapshot_policy) (default: the manager's default)",
    )
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV block (a power of two)")


def _policies(text: str) -> list[str]:
    """``--eviction-policy``: one policy, a comma-separated list, or ``all``."""
    return policy_list(text, EVICTION_POLICIES, EVICTION_POLICIES)


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


def _shape(a: argparse.Namespace) -> ModelShape:
    return model_shape(
        a.model, a.layers, a.kv_heads, a.head_dim, a.dtype, a.window, a.swa_every, a.sinks, a.state_dtype
    )


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
    tiers = [tier_spec("gpu", "--gpu", a.gpu or DEFAULT_GPU, shape, None)]
    if a.host:
        tiers.append(tier_spec("host", "--host", a.host, shape, None))
    if a.disk:
        tiers.append(tier_spec("disk", "--disk", a.disk, shape, disk_path))
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
        reqs = load_trace(a.trace, a.requests, a.reasoning_share or 0.0)
        source = f"trace {os.path.basename(a.trace)}"
        desc: dict[str, Any] = {"source": "trace", "path": a.trace}
    else:
        given = {
            name: value
            for name in (flag[2:].replace("-", "_") for flag, _, _ in BUILT_IN_OPTIONS)
            if (value := getattr(a, name)) is not None
        }
        params = dataclasses.replace(ConversationParams(), **given)
        reqs = generate_conversations(params, a.requests, a.reasoning_share or 0.0)
        source = (
            f"built-in conversations ({params.conversations} x ~{params.turns:g} turns, "
            f"{params.system_prompts} system prompts of ~{params.system_tokens} tokens)"
        )
        desc = {"source": "conversations", "params": dataclasses.asdict(params)}
    if a.sessions:
        _hints.assign_sessions(reqs, a.session_end, a.tokens_per_block)
    if a.reasoning_share is not None:
        desc["reasoning_share"] = a.reasoning_share
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
        **{k: v for k in ("step_ms", "tokens_per_s") if (v := getattr(a, k)) is not None},
        time_scale=a.time_scale,
        reuse=not a.no_reuse,
        prompt_only=a.prompt_only,
    )


def _parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    key = key.strip().lower()
    if not sep or key not in (*SWEEP_KEYS, SSM_SWEEP_KEY, SSM_POLICY_KEY, HINTS_SWEEP_KEY) or not values.strip():
        raise SimUserError(
            f"--sweep {text!r}: write TIER=V1,V2,... with TIER one of {', '.join(SWEEP_KEYS)}, "
            f"{SSM_SWEEP_KEY}=N1,N2,..., {SSM_POLICY_KEY}=P1,P2,... or {HINTS_SWEEP_KEY}=ACCURACY1,ACCURACY2,..."
        )
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not vals:
        raise SimUserError(f"--sweep {text!r}: no value; write {key}=V1,V2,... (comma-separated)")
    if key == HINTS_SWEEP_KEY:
        for v in vals:
            try:
                accuracy = float(v)
            except ValueError:
                raise SimUserError(f"--sweep {key}: {v!r} is not an accuracy in [0, 1]") from None
            if not 0.0 <= accuracy <= 1.0:
                raise SimUserError(f"--sweep {key}: {v!r} is not an accuracy in [0, 1]")
        return key, vals
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
        if not (key != "gpu" and is_zero_quota(v)):
            parse_quota(f"--sweep {key}", v)
    return key, vals


def _setup(a: argparse.Namespace, res: Resources) -> Setup:
    """Check the command line (before any replay) into what the running modes need."""
    shape = _shape(a)
    if a.swa_scratch and not shape.num_swa_layers:
        raise SimUserError(
            f"--swa-scratch: {shape.name} has no sliding-window layers (choose a model with them, e.g. "
            "gpt-oss-20b, or give --window)"
        )
    _check_outputs(a)
    if a.sweep is not None and len(a.sweep) > 1:
        raise SimUserError(
            f"--sweep given {len(a.sweep)} times ({', '.join(map(repr, a.sweep))}): a run sweeps one key; "
            "keep one --sweep (the others would be ignored)"
        )
    sweep = _parse_sweep(a.sweep[0]) if a.sweep else None
    interval: int | None = a.ssm_reuse_interval
    if interval is not None:
        check_ssm_interval("--ssm-reuse-interval", interval, shape, a.tokens_per_block)
    if a.ssm_lower_tier_interval is not None:
        check_ssm_interval("--ssm-lower-tier-interval", a.ssm_lower_tier_interval, shape, a.tokens_per_block)
    _check_snapshot_policy(a, shape, sweep)
    _check_lower_tier_interval(a, sweep)
    if sweep is not None and sweep[0] == SSM_SWEEP_KEY:
        if interval is not None:
            raise SimUserError(f"--sweep {SSM_SWEEP_KEY} sets the interval of each replay: drop --ssm-reuse-interval")
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
        res.tmp = tempfile.mkdtemp(prefix="kv-cache-sim-disk-")
    disk_dir = a.disk_path or res.tmp
    tiers = _tiers(a, shape, disk_dir)
    options = _options(a)
    try:
        options.validate()
    except ValueError as e:  # a wrong type from check_int
        raise SimUserError(str(e)) from None
    if a.remote_url is not None and not a.remote_url.startswith(REMOTE_URL_SCHEMES):
        raise SimUserError(f"--remote-url {a.remote_url!r}: write redis://HOST:PORT (or one of {REMOTE_URL_SCHEMES})")
    if not 1 <= a.replicas <= MAX_REPLICAS:
        raise SimUserError(
            f"--replicas must be in [1, {MAX_REPLICAS}] (each replica is a manager here), got {a.replicas}"
        )
    check_routing_arguments(a)
    if a.remote_cluster and a.replicas == 1:
        raise SimUserError("--remote-cluster is the shared tier of --replicas N: give --replicas 2 or more")
    requests, workload = _workload(a)
    last_ms = max(r.arrival_ms for r in requests) * options.time_scale
    if last_ms > MAX_ARRIVAL_MS:
        raise SimUserError(
            f"the last request arrives {last_ms / 1000:,.0f} s into the replay, beyond a year of simulated time: "
            + ("lower --time-scale" if a.trace else "raise --rate, or lower --think-s or --time-scale")
        )
    if a.metrics_port is not None or a.metrics_file:
        if (
            sweep is not None
            or a.replicas != 1
            or a.remote_url
            or len(a.eviction_policy) > 1
            or a.restart_at is not None
            or a.retention_hints is not None
        ):
            raise SimUserError(
                "--metrics-port/--metrics-file report one replay: no --sweep, --replicas, --restart-at, "
                "--retention-hints (a second replay) or policies"
            )
        res.metrics = SimMetrics(a.metrics_port, a.metrics_file)
    hint_sweep = sweep is not None and sweep[0] == HINTS_SWEEP_KEY
    if hint_sweep and a.retention_hints is not None:
        raise SimUserError(f"--sweep {HINTS_SWEEP_KEY} sets the accuracy of each replay: drop --retention-hints")
    check_pin_share(a.pin_system_prompts)
    check_pin_duration(a.pin_duration, a.pin_system_prompts)
    for flag, given in (
        ("--retention-hints", a.retention_hints is not None),
        (f"--sweep {HINTS_SWEEP_KEY}", hint_sweep),
        ("--pin-system-prompts", a.pin_system_prompts is not None),
    ):
        if given and (a.restart_at is not None or a.replicas != 1 or a.remote_url):
            raise SimUserError(f"{flag} does not combine with --restart-at, --replicas or --remote-url")
    check_accuracy(a.retention_hints)
    if a.hints_seed is not None and a.retention_hints is None and not hint_sweep:
        raise SimUserError("--hints-seed seeds the wrong hints of --retention-hints or --sweep hints=: give one")
    _hints.check_sessions(a)
    options, slo = time_setup(a, shape, options, uses_disk, sweep)  # sim/_time_cli.py
    if a.per_request:
        _check_output("--per-request", a.per_request)
    return Setup(shape, tiers, options, requests, workload, sweep, interval, disk_dir, slo)


def _check_snapshot_policy(a: argparse.Namespace, shape: ModelShape, sweep: tuple[str, list[str]] | None) -> None:
    """``--ssm-snapshot-policy`` and ``--sweep ssm-policy=...``: known policies, on a hybrid model."""
    policy: str | None = a.ssm_snapshot_policy
    policy_sweep = sweep is not None and sweep[0] == SSM_POLICY_KEY
    if policy is not None:
        check_policy("--ssm-snapshot-policy", policy)
    if (policy is not None or policy_sweep) and not shape.is_hybrid:
        raise SimUserError(
            f"snapshot policies: {shape.name} has no recurrent layers (choose a hybrid preset, e.g. qwen3-next-80b-a3b)"
        )
    if policy_sweep and (policy is not None or a.plot):
        raise SimUserError(
            f"--sweep {SSM_POLICY_KEY} sets the policy of each replay: no --ssm-snapshot-policy or --plot"
        )


def _check_lower_tier_interval(a: argparse.Namespace, sweep: tuple[str, list[str]] | None) -> None:
    """``--ssm-lower-tier-interval`` spaces what policy ``auto`` writes to a host or disk tier, in a
    replay of this process: refused where no replay would use it (the snapshot options too, where
    --restart-at or --replicas replay with the manager's defaults)."""
    fleet = a.restart_at is not None or a.replicas != 1 or a.remote_url
    for flag in ("--ssm-snapshot-policy", "--ssm-lower-tier-interval"):
        if fleet and getattr(a, flag[2:].replace("-", "_")) is not None:
            raise SimUserError(
                f"{flag}: --restart-at and --replicas replay with the manager's snapshot defaults; drop {flag}"
            )
    if a.ssm_lower_tier_interval is None:
        return
    key, values = sweep if sweep is not None else ("", [])
    if not (a.host or a.disk or (key in ("host", "disk") and not all(map(is_zero_quota, values)))):
        raise SimUserError(
            "--ssm-lower-tier-interval spaces the snapshots policy auto writes to a host or disk tier, and this "
            "run has none: give --host or --disk, or drop --ssm-lower-tier-interval"
        )
    if key == SSM_POLICY_KEY:
        policies = values
    else:  # an interval sweep replays "interval" unless told; else the manager's default, "auto"
        policies = [a.ssm_snapshot_policy or ("interval" if key == SSM_SWEEP_KEY else "auto")]
    if "auto" not in policies:
        raise SimUserError(
            f"--ssm-lower-tier-interval applies to policy auto only, and this run replays {', '.join(policies)}: "
            "drop --ssm-lower-tier-interval"
        )


def _check_outputs(a: argparse.Namespace) -> None:
    """``--plot`` and ``--json FILE`` can be written (before minutes of replay)."""
    if a.plot:
        missing = matplotlib_missing()
        if missing:
            raise SimUserError(missing)
        _check_output("--plot", a.plot)
    if a.json and a.json != "-":
        _check_output("--json", a.json)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; returns the exit code (2: bad input, 1: data check failed)."""
    a = build_parser().parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    if a.list_models:
        width = max(map(len, PRESETS)) + 2
        for name, m in PRESETS.items():
            print(f"{name:<{width}}{m.describe()}")
        return 0
    res = Resources()
    previous = catch_sigterm()
    try:
        s = _setup(a, res)
        if a.restart_at is not None:
            return run_restart(a, s)
        if a.replicas != 1 or a.remote_url:
            return run_fleet(a, s, res)
        return run_replays(a, s, res.metrics)
    except SimUserError as e:
        return _fail(str(e))
    except DataCheckError as e:
        return _fail(f"data check failed: {e}", 1)
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except BaseException as e:
        code = interrupted(e)
        if code is None:
            raise
        return code
    finally:
        res.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
