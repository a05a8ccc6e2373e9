"""``kv-cache-sim --replicas N --routing POLICY[,POLICY..]``: the same requests replayed once per
routing policy over N replicas, each with its own manager (queue, batch, tiers) under the time model.

A router in front of the fleet routes each request when it arrives (a conversation's next turn when
the previous answer is out) by one of the policies of ``kv_cache_manager_v2._routing`` (the code a
real router runs). What it knows of a replica is what the replica would publish: its cached prefix
of the prompt by tier (``probe_reuse_levels``: what its event stream's index answers) and its load
(prefill tokens queued or not yet computed, requests running, GPU utilisation) as of the
replica's last step. The replicas advance on one simulated time line (``_replicas``).

Per policy: hit rate, prefill tokens computed, TTFT percentiles and CDF, throughput, and each
replica's load (tokens computed, requests); and the hit rate of one cache of the fleet's total size
(one replica with N times the tiers, batch and token budget: the bound routing can approach).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from typing import Any, cast

from .._common import ReuseScope, TokenIdExt
from .._config import KVCacheManagerConfig
from .._routing import ROUTING_POLICIES, ReplicaLoad, RoutePicker, RouteWeights
from ._latency import latency_report
from ._models import SimUserError
from ._replay import Replay
from ._replay_types import ReplayResult, SchedulerOptions
from ._replicas import ReplicaReplay, earliest, finish, merge_results, shut_down
from ._tier_io import tier_kind
from ._workload import SimRequest

#: the event medium of each tier kind (``_tier_io.tier_kind``)
_MEDIUM = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


class RoutedReplica(ReplicaReplay):
    """One replica behind the router: a finished request's next turn goes back to the router.

    Deeper because: each level changes where a finished request's next turn goes
    (``_release_successors``): ``Replay`` replays it itself, ``ReplicaReplay`` on the replica its
    index names, this one through the router."""

    def __init__(
        self,
        router: FleetRouter,
        config: KVCacheManagerConfig,
        requests: list[SimRequest],
        options: SchedulerOptions,
        bytes_scale: float,
    ) -> None:
        super().__init__([], config, requests, options, bytes_scale=bytes_scale)
        self.router = router
        self.media = [_MEDIUM[tier_kind(x)] for x in self.config.cache_tiers]
        #: request index -> prompt tokens the router expected it to reuse here
        self.expected: dict[int, int] = {}

    def _release_successors(self, index: int) -> None:
        for nxt in self.router.successors.pop(index, []):
            sim = self.requests[nxt]
            self.router.arrive(nxt, max(sim.arrival_ms * self.opts.time_scale, self.clock))

    def cached(self, tokens: Sequence[TokenIdExt], scope: ReuseScope | None) -> tuple[int, dict[str | None, int]]:
        """The reusable prefix of ``tokens`` here: its length and its tokens by medium."""
        m = self.rm.manager
        n = m.probe_reuse(scope, tokens)
        levels = m.probe_reuse_levels(scope, tokens)
        t = self.t
        out: dict[str | None, int] = {}
        for k, lvl in enumerate(levels):
            medium = self.media[int(lvl)]
            out[medium] = out.get(medium, 0) + min(t, n - k * t)
        return n, out

    def load(self) -> ReplicaLoad:
        """What the replica would publish now (see the module doc)."""
        queued = 0
        expected = self.expected
        requests = self.requests
        for _, index in self.arrivals:
            queued += requests[index].prompt_length - expected.get(index, 0)
        for live in self.waiting:
            queued += live.prompt_length - expected.get(live.sim.index, 0)
        for live in self.running:
            queued += max(0, live.prompt_length - live.req.num_cached_tokens)
        for live in self.suspended:
            queued += max(0, live.prompt_length - live.req.num_cached_tokens)
        util = min(1.0, max(0.0, self.rm.manager.gpu_utilization))
        return ReplicaLoad(max(0, queued), len(self.running) + len(self.suspended), util)


class FleetRouter:
    """The router of one policy's replay: arrivals in time order, each routed as it comes."""

    def __init__(self, policy: str, weights: RouteWeights | None, requests: list[SimRequest], reuse: bool) -> None:
        self.picker = RoutePicker(policy, weights)
        self.requests = requests
        self.reuse = reuse
        self.fleet: list[RoutedReplica] = []
        self.arrivals: list[tuple[float, int]] = []
        self.successors: dict[int, list[int]] = {}
        #: request index -> replica (in routing order)
        self.routes: dict[int, int] = {}

    def arrive(self, index: int, at_ms: float) -> None:
        heapq.heappush(self.arrivals, (at_ms, index))

    def route(self) -> None:
        """Route the next arrival to a replica."""
        at_ms, index = heapq.heappop(self.arrivals)
        sim = self.requests[index]
        tokens = cast("Sequence[TokenIdExt]", sim.prompt_tokens())
        scope = None if self.reuse else ReuseScope(salt=index)
        w = self.picker.weights
        policy = self.picker.policy
        found = [rep.cached(tokens, scope) for rep in self.fleet] if policy != "round-robin" else []
        values = [w.value(m) for _, m in found] if found else [0.0] * len(self.fleet)
        loads: list[ReplicaLoad | None] = [rep.load() for rep in self.fleet]
        k = self.picker.pick(values, loads, [True] * len(self.fleet))
        rep = self.fleet[k]
        rep.expected[index] = found[k][0] if found else 0
        self.routes[index] = k
        rep._arrive(index, at_ms)


def run_routed(
    configs: Sequence[KVCacheManagerConfig],
    requests: list[SimRequest],
    options: SchedulerOptions,
    policy: str,
    weights: RouteWeights | None = None,
    bytes_scale: float = 1.0,
) -> tuple[list[ReplayResult], dict[int, int]]:
    """Replay ``requests`` over one replica per config, routed by ``policy``; per replica its
    counters, and the route of every request (index -> replica)."""
    router = FleetRouter(policy, weights, requests, options.reuse)
    fleet = router.fleet
    wall0 = time.perf_counter()
    try:
        for cfg in configs:
            fleet.append(RoutedReplica(router, cfg, requests, options, bytes_scale))
        for sim in requests:
            if sim.after >= 0:
                router.successors.setdefault(sim.after, []).append(sim.index)
            else:
                router.arrive(sim.index, sim.arrival_ms * options.time_scale)
        while True:
            best, best_t = earliest(fleet)
            if router.arrivals and (best is None or router.arrivals[0][0] <= best_t):
                router.route()
            elif best is not None:
                best.advance()
            else:
                break
    except BaseException:
        shut_down(fleet)
        raise
    return finish(fleet, wall0), router.routes


def _computed(r: ReplayResult) -> int:
    return r.prefill_computed + r.decode_computed


def _summary(results: list[ReplayResult], routes: dict[int, int], n: int) -> dict[str, Any]:
    fleet = merge_results(results)
    lat = latency_report(fleet, None, fleet.sim_time_ms)
    per_tokens = [_computed(r) for r in results]
    per_requests = [0] * n
    for k in routes.values():
        per_requests[k] += 1
    low = min(per_tokens)
    ttft = lat["ttft_s"] or {}
    return {
        "hit_rate": {
            "tokens": fleet.reused_tokens / fleet.prompt_tokens if fleet.prompt_tokens else 0.0,
            "blocks": fleet.hit_blocks / fleet.prompt_blocks if fleet.prompt_blocks else 0.0,
        },
        "prefill_computed_tokens": fleet.prefill_computed,
        "ttft_s": {f"p{p}": ttft.get(f"p{p}") for p in (50, 90, 99)},
        "throughput": lat["throughput"],
        "finished": fleet.finished,
        "rejected": fleet.rejected,
        "preemptions": fleet.readmissions,
        "per_replica": {"computed_tokens": per_tokens, "requests": per_requests},
        "load_max_over_min": max(per_tokens) / low if low > 0 else None,
        "ttft_cdf_s": lat["ttft_cdf_s"],
        "simulated_s": fleet.sim_time_ms / 1000.0,
        "wall_s": results[0].wall_s,
    }


def scaled_config(config: KVCacheManagerConfig, n: int) -> KVCacheManagerConfig:
    """``config`` with every tier ``n`` times larger (one cache of a fleet's total size)."""
    tiers = [t if t.quota is None else dataclasses.replace(t, quota=t.quota * n) for t in config.cache_tiers]
    return dataclasses.replace(config, cache_tiers=tiers)


def simulate_routing(
    config: KVCacheManagerConfig,
    requests: list[SimRequest],
    options: SchedulerOptions,
    replicas: int,
    policies: Sequence[str],
    weights: RouteWeights | None = None,
    bytes_scale: float = 1.0,
) -> dict[str, Any]:
    """Every policy's replay over ``replicas`` replicas of ``config`` and the single-cache bound."""
    out: dict[str, Any] = {"count": replicas, "policies": {}}
    w = weights if weights is not None else RouteWeights()
    out["weights"] = {**dataclasses.asdict(w), "tier_weights": dict(w.tier_weights)}
    for policy in policies:
        results, routes = run_routed([config] * replicas, requests, options, policy, weights, bytes_scale)
        out["policies"][policy] = _summary(results, routes, replicas)
    big = dataclasses.replace(
        options, max_batch=options.max_batch * replicas, max_num_tokens=options.max_num_tokens * replicas
    )
    bound = Replay(scaled_config(config, replicas), requests, big, bytes_scale=bytes_scale).run()
    out["single_cache_bound"] = {
        "hit_rate": {
            "tokens": bound.reused_tokens / bound.prompt_tokens if bound.prompt_tokens else 0.0,
            "blocks": bound.hit_blocks / bound.prompt_blocks if bound.prompt_blocks else 0.0,
        },
        "prefill_computed_tokens": bound.prefill_computed,
    }
    for rep in out["policies"].values():
        b = out["single_cache_bound"]["hit_rate"]["tokens"]
        rep["hit_rate_vs_bound"] = rep["hit_rate"]["tokens"] / b if b > 0 else None
    return out


def add_routing_arguments(g: Any) -> None:
    """``--routing`` and ``--routing-weights`` in the parser's replicas group."""
    g.add_argument(
        "--routing",
        metavar="POLICY[,POLICY..]",
        help="with --replicas N: private caches, no shared tier; the requests replayed once per routing policy "
        "(round-robin, least-load, prefix, prefix+load, or all) and compared with one cache of the fleet's size",
    )
    g.add_argument(
        "--routing-weights",
        metavar="NAME=VALUE,..",
        help="with --routing: the router's weights (queued_token, running_request, kv_utilization, affinity_ratio, "
        "affinity_tokens; GPU, CPU, DISK, REMOTE: tier weights)",
    )


def check_routing_arguments(a: Any) -> None:
    """``--routing``/``--routing-weights`` against the other options (``SimUserError``)."""
    if a.routing_weights is not None and a.routing is None:
        raise SimUserError("--routing-weights weighs the routers of --routing: give --routing too")
    if a.routing is not None and (a.replicas < 2 or a.remote_url or a.remote_cluster):
        raise SimUserError("--routing compares routers over --replicas N >= 2 private caches: no --remote-url/-cluster")


def routing_choice(a: Any) -> tuple[list[str], RouteWeights | None]:
    """``--routing``'s policies and ``--routing-weights``' weights (None: the defaults), checked (``SimUserError``)."""
    try:
        return parse_policies(a.routing), parse_weights(a.routing_weights) if a.routing_weights else None
    except (TypeError, ValueError) as e:
        raise SimUserError(str(e)) from None


def parse_policies(text: str) -> list[str]:
    """``--routing``'s comma-separated policies ("all": every one), checked; ValueError names the allowed."""
    names = list(ROUTING_POLICIES) if text == "all" else [x.strip() for x in text.split(",")]
    bad = [x for x in names if x not in ROUTING_POLICIES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(
            f"--routing takes policies from {', '.join(ROUTING_POLICIES)} (or all), comma-separated, "
            f"each once; got {text!r}"
        )
    return names


def parse_weights(text: str) -> RouteWeights:
    """``--routing-weights``: NAME=VALUE pairs over the defaults (a medium name sets its tier weight)."""
    fields: dict[str, float] = {}
    tiers = dict(RouteWeights().tier_weights)
    allowed = ("queued_token", "running_request", "kv_utilization", "affinity_ratio", "affinity_tokens")
    for item in text.split(","):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or (name not in allowed and name not in tiers):
            raise ValueError(
                f"--routing-weights: {item!r} is not NAME=VALUE with NAME one of {', '.join(allowed)}, "
                f"{', '.join(tiers)}"
            )
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"--routing-weights: {name}={value!r} is not a number") from None
        if name in tiers:
            tiers[name] = x
        else:
            fields[name] = x
    return dataclasses.replace(RouteWeights(), tier_weights=tiers, **fields)


def format_routing(doc: dict[str, Any]) -> str:
    """The text report: one row per policy."""
    bound = doc["single_cache_bound"]["hit_rate"]["tokens"]
    lines = [
        f"kv-cache-sim: {doc['count']} replicas, routing compared (single-cache bound: hit rate {bound:.3f})",
        f"  {'policy':<13}{'hit rate':>9}{'/bound':>8}{'prefill':>14}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
        f"{'out tok/s':>11}{'max/min':>9}",
    ]
    for name, p in doc["policies"].items():
        t = p["ttft_s"]
        vs = p["hit_rate_vs_bound"]
        lm = p["load_max_over_min"]
        lines.append(
            f"  {name:<13}{p['hit_rate']['tokens']:>9.3f}{'-' if vs is None else f'{vs:.3f}':>8}"
            f"{p['prefill_computed_tokens']:>14,}{_s(t['p50']):>10}{_s(t['p90']):>9}{_s(t['p99']):>9}"
            f"{p['throughput']['output_tokens_per_s']:>11,.0f}{'-' if lm is None else f'{lm:.2f}':>9}"
        )
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"
