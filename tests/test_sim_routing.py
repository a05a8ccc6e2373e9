"""kv-cache-sim --replicas N --routing: routes on a tiny workload computed by hand, the per-policy
report, the single-cache bound, and the CLI's checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kv_cache_manager_v2._routing import RouteWeights
from kv_cache_manager_v2.sim import SchedulerOptions, main
from kv_cache_manager_v2.sim._fleet import parse_policies, run_routed, simulate_routing
from kv_cache_manager_v2.sim._models import ModelShape, TierSpec, manager_config, proxy_page_bytes
from kv_cache_manager_v2.sim._workload import SimRequest

SMALL = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token
T = 16
#: the shared prefix P (48 tokens), the unrelated prompt B, the suffixes
P, B = (1000, 48), (5000, 64)
#: load cost = queued prefill tokens only, no affinity window: routes follow cached - queued
BARE = RouteWeights(running_request=0.0, kv_utilization=0.0, affinity_ratio=0.0, affinity_tokens=0.0)


def config(tokens: int = 4096) -> Any:
    return manager_config(
        SMALL, T, [TierSpec("gpu", tokens * SMALL.bytes_per_token, "x")], False, proxy_page_bytes(T, False)
    )


def req(index: int, at_ms: float, *segments: tuple[int, int]) -> SimRequest:
    n = sum(c for _, c in segments)
    return SimRequest(index, at_ms, list(segments), n, 1, 90_000 + index * 10)


def workload() -> list[SimRequest]:
    """At 0: P + 32 own tokens, and B. At 1 s (both done): four prompts P + 32 own tokens at once,
    and B + 16 own tokens."""
    reqs = [req(0, 0.0, P, (2000, 32)), req(1, 0.0, B)]
    reqs += [req(2 + k, 1000.0, P, (3000 + 100 * k, 32)) for k in range(4)]
    reqs.append(req(6, 1000.0, B, (4000, 16)))
    return reqs


def routes(policy: str, weights: RouteWeights | None = None) -> list[int]:
    opts = SchedulerOptions(prompt_only=True, step_ms=10.0, tokens_per_s=10_000.0)
    results, by_index = run_routed([config(), config()], workload(), opts, policy, weights)
    assert sum(r.finished for r in results) == 7
    return [by_index[i] for i in range(7)]


def test_routes_by_hand() -> None:
    # round-robin: the rotation, in arrival order (ties in time: by request index)
    assert routes("round-robin") == [0, 1, 0, 1, 0, 1, 0]
    # prefix: nothing cached at 0 (rotation: 0, 1); at 1 s P is on replica 0 (48 tokens), B on 1 (64)
    assert routes("prefix") == [0, 1, 0, 0, 0, 0, 1]
    # least-load (queued prefill only; a request counts its prompt less what the replica caches of it):
    # 0 and 1 at 0 s; at 1 s, queued on (0, 1): (0, 0) -> 0 [rotation start 0] which queues 80 - 48,
    # (32, 0) -> 1, (32, 80) -> 0, (64, 80) -> 0; B + 16: (96, 80) -> 1
    assert routes("least-load", BARE) == [0, 1, 0, 1, 0, 0, 1]
    # prefix+load, no window: cached - queued on (0, 1); request 2: (48, 0) -> 0; 3: (48 - 32, 0) -> 0;
    # 4: (48 - 64, 0) -> 1; 5: queued (64, 80), replica 0 within the (empty) window of the least -> 0;
    # 6 (B + 16): queued (96, 80), replica 1 has the cache and the least load -> 1
    assert routes("prefix+load", BARE) == [0, 1, 0, 0, 1, 0, 1]
    # a window of 1024 tokens keeps every P prompt on its cache here
    wide = RouteWeights(running_request=0.0, kv_utilization=0.0, affinity_tokens=1024.0)
    assert routes("prefix+load", wide) == routes("prefix")


def test_report_and_bound() -> None:
    opts = SchedulerOptions(prompt_only=True, step_ms=10.0, tokens_per_s=10_000.0)
    doc = simulate_routing(config(), workload(), opts, 2, ["round-robin", "prefix"])
    rr, px = doc["policies"]["round-robin"], doc["policies"]["prefix"]
    # prefix reuses P four times (4 x 48) and B once (64); round-robin P twice (requests 2, 4) only
    assert px["prefill_computed_tokens"] == 80 + 64 + 4 * 32 + 16
    assert rr["prefill_computed_tokens"] == 80 + 64 + 2 * 80 + 2 * 32 + 80
    assert px["per_replica"]["requests"] == [5, 2] and rr["per_replica"]["requests"] == [4, 3]
    # one cache of both replicas' size reuses everything prefix routing does
    assert doc["single_cache_bound"]["prefill_computed_tokens"] == px["prefill_computed_tokens"]
    assert px["hit_rate_vs_bound"] == pytest.approx(1.0)
    assert rr["hit_rate"]["tokens"] == pytest.approx((2 * 48) / (80 + 64 + 4 * 80 + 80))
    assert px["ttft_s"]["p50"] is not None and len(px["ttft_cdf_s"]) == 100


def test_cli_routing(tmp_path: Any) -> None:
    out = tmp_path / "r.json"
    args = ["--conversations", "12", "--turns", "2", "--no-progress", "--replicas", "3"]
    assert main([*args, "--routing", "round-robin,prefix+load", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())["routing"]
    assert list(doc["policies"]) == ["round-robin", "prefix+load"] and doc["count"] == 3
    assert doc["weights"]["tier_weights"]["CPU"] == 0.8
    p = doc["policies"]["prefix+load"]
    assert sum(p["per_replica"]["requests"]) == p["finished"] + p["rejected"]
    assert main([*args, "--routing", "fastest"]) == 2
    assert main([*args, "--routing", "prefix,prefix"]) == 2
    assert main([*args[:-2], "--routing", "prefix"]) == 2  # needs replicas
    assert main([*args, "--routing", "prefix", "--remote-url", "redis://127.0.0.1:1"]) == 2
    weights = ["--routing-weights", "affinity_ratio=0.5,CPU=0.6"]
    assert main([*args, "--routing", "prefix+load", *weights, "--json", str(out)]) == 0
    w = json.loads(out.read_text())["routing"]["weights"]
    assert w["affinity_ratio"] == 0.5 and w["tier_weights"]["CPU"] == 0.6 and w["queued_token"] == 1.0
    assert main([*args, "--routing", "prefix", "--routing-weights", "speed=2"]) == 2
    assert main([*args, "--routing", "prefix", "--routing-weights", "queued_token=-1"]) == 2
    assert main([*args, "--routing", "prefix", "--routing-weights", "queued_token=x"]) == 2
    assert main([*args, *weights]) == 2  # without --routing: it would be ignored
    assert parse_policies("all") == ["round-robin", "least-load", "prefix", "prefix+load"]


def test_cli_routing_plot(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "cdf.png"
    args = ["--conversations", "6", "--turns", "2", "--no-progress", "--replicas", "2", "--routing", "all"]
    assert main([*args, "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
