"""Routing policies: pick a replica for a prompt from what each replica caches and how loaded it is.

A replica's *cached value* for a prompt is its cached prefix weighted by the tier each block is on
(``RouteWeights.tier_weights``: GPU 1.0, CPU 0.8, DISK 0.5, REMOTE 0.3 by default); its *load
cost* is ``queued_token * queued prefill tokens + running_request * running requests +
kv_utilization * KV utilisation`` (all in prompt tokens of work). Policies (``ROUTING_POLICIES``):

- ``round-robin``: the usable replicas in turn;
- ``least-load``: the least load cost (replicas without fresh load are left out; none fresh:
  round-robin);
- ``prefix``: the highest cached value;
- ``prefix+load`` (the default): the replica with the highest cached value while its load cost is
  within the affinity window of the least loaded (``<= least * (1 + affinity_ratio) +
  affinity_tokens``), or when its load is unknown; otherwise the highest ``cached value - load
  cost`` among replicas with fresh load.

Ties go to the first tied replica at or after a start that moves by one each route. A replica
marked unusable (its stream expired) is never picked while another is usable. The router side
(``kv_cache_manager_v2.events``) and the simulator (``kv-cache-sim --routing``) share this code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from mypy_extensions import mypyc_attr

from ._utils import check_int, check_type, raw_field

ROUTING_POLICIES: Final = ("round-robin", "least-load", "prefix", "prefix+load")
DEFAULT_POLICY: Final = "prefix+load"
#: tier weights by event medium (llm-d's GPU 1.0 / CPU 0.8; lower tiers cost a longer load)
DEFAULT_TIER_WEIGHTS: Final = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "REMOTE": 0.3}


class ReplicaLoad:
    """A replica's load as it publishes it: prefill tokens queued (waiting or not yet computed),
    requests running, and KV utilisation (0..1, the GPU tier's used share)."""

    __slots__ = ("kv_utilization", "queued_prefill_tokens", "running_requests")

    def __init__(
        self, queued_prefill_tokens: object = 0, running_requests: object = 0, kv_utilization: object = 0.0
    ) -> None:
        self.queued_prefill_tokens = check_int("queued_prefill_tokens", queued_prefill_tokens)
        self.running_requests = check_int("running_requests", running_requests)
        if type(kv_utilization) not in (int, float):
            raise TypeError(f"kv_utilization must be a float, got {type(kv_utilization).__name__}")
        u = float(kv_utilization)  # type: ignore[arg-type]
        if not 0.0 <= u <= 1.0:
            raise ValueError(f"kv_utilization must be in [0, 1], got {u}")
        self.kv_utilization = u

    def cost(self, weights: RouteWeights) -> float:
        """The load cost under ``weights`` (prompt tokens of work)."""
        return (
            weights.queued_token * self.queued_prefill_tokens
            + weights.running_request * self.running_requests
            + weights.kv_utilization * self.kv_utilization
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaLoad) and (
            self.queued_prefill_tokens,
            self.running_requests,
            self.kv_utilization,
        ) == (other.queued_prefill_tokens, other.running_requests, other.kv_utilization)

    def __hash__(self) -> int:
        return hash((self.queued_prefill_tokens, self.running_requests, self.kv_utilization))

    def __repr__(self) -> str:
        return (
            f"ReplicaLoad(queued_prefill_tokens={self.queued_prefill_tokens}, "
            f"running_requests={self.running_requests}, kv_utilization={self.kv_utilization})"
        )


def _default_tier_weights() -> dict[str, float]:
    return dict(DEFAULT_TIER_WEIGHTS)


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class RouteWeights:
    """How a router weighs cache against load (see the module doc; every weight finite, >= 0).

    ``tier_weights``: per event medium, what one cached token there is worth (a medium not named
    is worth 0); ``queued_token``, ``running_request``, ``kv_utilization``: the load cost of one
    queued prefill token, one running request, a full GPU tier; ``affinity_ratio`` and
    ``affinity_tokens``: the affinity window; ``load_stale_s``: a published load older than this
    is unknown (the replica is then weighed by its cache alone)."""

    tier_weights: Mapping[str, float] = field(default_factory=_default_tier_weights)
    queued_token: float = 1.0
    running_request: float = 1024.0
    kv_utilization: float = 1024.0
    affinity_ratio: float = 0.1
    affinity_tokens: float = 0.0
    load_stale_s: float = 2.0

    def __post_init__(self) -> None:
        tiers = raw_field(self, "tier_weights")
        check_type("tier_weights", tiers, Mapping)
        assert isinstance(tiers, Mapping)
        items: list[tuple[str, object]] = [(f"tier_weights[{k!r}]", v) for k, v in tiers.items()]
        for k in tiers:
            check_type("a tier_weights key", k, str)
        for name in ("queued_token", "running_request", "kv_utilization", "affinity_ratio", "affinity_tokens"):
            items.append((name, raw_field(self, name)))
        items.append(("load_stale_s", raw_field(self, "load_stale_s")))
        for name, v in items:
            if type(v) not in (int, float):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
            x = float(v)  # type: ignore[arg-type]
            if not 0.0 <= x < float("inf") or (name == "load_stale_s" and x == 0.0):
                raise ValueError(f"{name} must be a finite number >= 0 (load_stale_s > 0), got {v!r}")
        object.__setattr__(self, "tier_weights", dict(tiers))  # (its own: the caller's mapping may change)

    def value(self, tokens_per_medium: Mapping[str | None, int]) -> float:
        """The cached value of a prefix found as ``tokens_per_medium``."""
        w = self.tier_weights
        total = 0.0
        for medium, n in tokens_per_medium.items():
            if medium is not None:
                total += w.get(medium, 0.0) * n
        return total


class RoutePicker:
    """Applies one policy to what is known of each replica; keeps the rotation (see the module doc)."""

    def __init__(self, policy: object = DEFAULT_POLICY, weights: object = None) -> None:
        # (``object``: compiled, a typed argument is checked with mypyc's own message)
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a str, got {type(policy).__name__}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if weights is not None and not isinstance(weights, RouteWeights):
            raise TypeError(f"weights must be a RouteWeights or None, got {type(weights).__name__}")
        self.policy: str = policy
        self.weights: RouteWeights = weights if weights is not None else RouteWeights()
        self._next = 0

    def pick(self, values: Sequence[float], loads: Sequence[ReplicaLoad | None], usable: Sequence[bool]) -> int:
        """The replica for a prompt: ``values`` its cached value on each replica, ``loads`` each
        replica's fresh load (None: unknown), ``usable`` False for a replica not to route to."""
        n = len(values)
        if n == 0 or len(loads) != n or len(usable) != n:
            raise ValueError(f"one value, load and usable flag per replica, got {n}, {len(loads)}, {len(usable)}")
        start = self._next % n
        order = [(start + k) % n for k in range(n)]
        cands = [i for i in order if usable[i]] or order
        self._next = start + 1
        policy = self.policy
        if policy == "round-robin":
            return cands[0]
        w = self.weights
        costs: list[float] = [0.0] * n
        fresh: list[int] = []
        for i in cands:
            ld = loads[i]
            if ld is not None:
                costs[i] = ld.cost(w)
                fresh.append(i)
        if policy == "least-load":
            return _arg_best(fresh, [-c for c in costs]) if fresh else cands[0]
        best = _arg_best(cands, list(values))
        if policy == "prefix":
            return best
        if values[best] > 0.0:
            if loads[best] is None or not fresh:
                return best
            least = costs[_arg_best(fresh, [-c for c in costs])]
            if costs[best] <= least * (1.0 + w.affinity_ratio) + w.affinity_tokens:
                return best
        if not fresh:
            return best
        return _arg_best(fresh, [values[i] - costs[i] for i in range(n)])


def _arg_best(cands: list[int], score: list[float]) -> int:
    """The first of ``cands`` (in their order) with the highest score."""
    best = cands[0]
    top = score[best]
    for i in cands:
        if score[i] > top:
            best, top = i, score[i]
    return best
