"""``kv-cache-sim``'s time-model options (not compiled, like ``_cli``): what a step computes
(``_compute``: the roofline on ``--gpu-kind``, a calibration file, or ``--step-ms``/``--tokens-per-s``),
what tier I/O costs (``_tier_io``: the links, the manager's own time, the per-request file), and
the service-level objectives the report counts goodput against (``_latency``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from .._config import LOAD_POLICIES
from ._compute import DEFAULT_GPU_KIND, DEFAULT_MBU, DEFAULT_MFU, GPU_KINDS, build_step_cost
from ._latency import SLO_OPTIONS, Slo, check_slo
from ._models import ModelShape, SimUserError
from ._replay_types import SchedulerOptions
from ._tier_io import add_arguments, time_options


def add_time_arguments(p: argparse.ArgumentParser) -> None:
    """The time-model option groups of ``p``."""
    s = SchedulerOptions()
    g = p.add_argument_group("compute (a step's time)")
    g.add_argument("--gpu-kind", help=f"the model's roofline on {', '.join(GPU_KINDS)} (default: {DEFAULT_GPU_KIND})")
    g.add_argument("--mfu", type=float, help=f"share of the peak FLOP/s a step reaches (default: {DEFAULT_MFU})")
    g.add_argument("--mbu", type=float, help=f"share of the HBM bandwidth a step reaches (default: {DEFAULT_MBU})")
    g.add_argument("--calibration", metavar="FILE", help="instead: CSV of measured steps (see README)")
    g.add_argument(
        "--step-ms", type=float, help=f"instead: a fixed time a step ({s.step_ms:g} when only --tokens-per-s is given)"
    )
    g.add_argument(
        "--tokens-per-s",
        type=float,
        help=f"instead: + tokens at this rate ({s.tokens_per_s:g} when only --step-ms is given)",
    )
    g = p.add_argument_group("time (tier I/O, the manager's time, per request, objectives)")
    add_arguments(g)
    g.add_argument(
        "--load-policy",
        type=_load_policies,
        metavar="POLICY[,POLICY..]",
        help=f"the manager's load_policy ({', '.join(LOAD_POLICIES)}, or all), planned at each request's prefill "
        "rate with the tier links' costs, loads in the background (a request waits for its bytes while the "
        "others compute); several: one replay each, compared (default: none: every match loaded, a step waiting "
        "for its loads)",
    )
    for flag, what in SLO_OPTIONS:
        g.add_argument(flag, type=float, metavar="SECONDS", help=what)


def _load_policies(text: str) -> list[str]:
    """``--load-policy``: one policy, a comma-separated list, or ``all``."""
    return policy_list(text, LOAD_POLICIES, ("never", "always", "auto"))


def policy_list(text: str, choices: Sequence[str], every: Sequence[str]) -> list[str]:
    """A policy option's value: names of ``choices``, comma-separated, each once; ``all``: ``every``."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(every)
    for x in names:
        if x not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {x!r} (choose from {', '.join(choices)}, or all; comma-separated)"
            )
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: name each policy once, comma-separated")
    return names


def time_setup(
    a: argparse.Namespace,
    shape: ModelShape,
    options: SchedulerOptions,
    uses_disk: bool,
    sweep: tuple[str, list[str]] | None,
) -> tuple[SchedulerOptions, Slo]:
    """``options`` with the step cost, the tier links and ``--count-manager-time`` of ``a``, and the
    objectives; SimUserError (one line) for a bad or ignored option."""
    linear = (options.step_ms, options.tokens_per_s) if (a.step_ms, a.tokens_per_s) != (None, None) else None
    cost = build_step_cost(shape, a.gpu_kind, a.mfu, a.mbu, a.calibration, linear)
    gpu = GPU_KINDS.get(a.gpu_kind or DEFAULT_GPU_KIND, GPU_KINDS[DEFAULT_GPU_KIND])
    links = time_options(a, uses_disk, sweep, gpu.host_link_bytes_per_s)
    options = dataclasses.replace(options, cost=cost, links=links, count_manager_time=a.count_manager_time)
    if a.load_policy and (a.replicas != 1 or a.remote_url or a.restart_at is not None):
        raise SimUserError("--load-policy compares replays of one engine: drop --replicas/--remote-url/--restart-at")
    if a.load_policy and len(a.load_policy) > 1 and (a.metrics_port is not None or a.metrics_file):
        raise SimUserError("--metrics-port/--metrics-file report one replay: give one --load-policy")
    if options.prompt_only and a.slo_tpot is not None:
        raise SimUserError("--slo-tpot: --prompt-only generates no token after the first (no TPOT); drop one")
    return options, check_slo(a.slo_ttft, a.slo_tpot)
