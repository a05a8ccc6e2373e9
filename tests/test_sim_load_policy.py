"""``kv-cache-sim --load-policy``: the manager's load plan in the simulator's time model, checked by
hand on a tiny workload (one request reusing a prefix from the host tier over a fast or a slow
link), loads in the background while others compute, and the option's checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim import SchedulerOptions, main
from kv_cache_manager_v2.sim._loading import step_rate
from kv_cache_manager_v2.sim._models import (
    ModelShape,
    TierSpec,
    manager_config,
    proxy_page_bytes,
    real_bytes_per_proxy_byte,
)
from kv_cache_manager_v2.sim._replay import Replay
from kv_cache_manager_v2.sim._replay_types import ReplayResult
from kv_cache_manager_v2.sim._step_cost import LinearCost
from kv_cache_manager_v2.sim._tier_io import Link, TierLinks
from kv_cache_manager_v2.sim._workload import SimRequest

SMALL = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token
T = 16
#: bytes per second that move request 0's 160-token prefix in 1 ms
PREFIX_IN_1MS = 160 * SMALL.bytes_per_token / 1e-3


def _tier(kind: str, tokens: int, path: str | None = None) -> TierSpec:
    return TierSpec(kind, tokens * SMALL.bytes_per_token, f"{tokens}tok", path)


def _replay(
    reqs: list[SimRequest],
    policy: str | None,
    bandwidth: float,
    write: float = PREFIX_IN_1MS,
    weight: float = 1.0,
    disk: str | None = None,
    **options: Any,
) -> ReplayResult:
    """The GPU (208 tokens) and a host tier, or with ``disk`` (a directory) a disk tier in its place
    (read apart from the steps: a request loading from it waits for the first step after its
    bytes; host copies run within the step, which waits for them)."""
    page = proxy_page_bytes(T, False, SMALL)
    lower = _tier("disk", 4096, disk) if disk is not None else _tier("host", 4096)
    config = manager_config(SMALL, T, [_tier("gpu", 208), lower], False, page)
    backlog = options.pop("max_write_backlog_s", 1.0)
    config = dataclasses.replace(config, recompute_queue_weight=weight, max_write_backlog_s=backlog)
    scale = real_bytes_per_proxy_byte(SMALL, T, page)
    link = Link(bandwidth, write, 0.5)  # (writes: by default the prefix in 1 ms)
    links = TierLinks(disk=link) if disk is not None else TierLinks(host=link)
    opts = SchedulerOptions(prompt_only=True, watermark=0.0, links=links, load_policy=policy, **options)
    return Replay(config, reqs, dataclasses.replace(opts, cost=LinearCost(10.0, 1000.0)), bytes_scale=scale).run()


def _requests(*extra: SimRequest) -> list[SimRequest]:
    """Request 0 computes a 160-token prefix; request 1 pushes it to the host tier; request 2 (at
    2,000 ms) reuses it and computes 16 tokens of its own."""
    return [
        SimRequest(0, 0.0, [(1, 160)], 160, 1, 1 << 30),
        SimRequest(1, 1000.0, [(10_000, 200)], 200, 1, (1 << 30) + 10),
        SimRequest(2, 2000.0, [(1, 160), (50_000, 16)], 176, 1, (1 << 30) + 20),
        *extra,
    ]


@pytest.mark.parametrize(
    ("link_ms", "expected"),
    [
        # the prefix in 1 ms: loading (0.5 + 1 ms, then 10 + 16) beats recomputing (10 + 176)
        (1.0, {"never": 186.0, "always": 27.5, "auto": 27.5}),
        # in 1,000 ms: recomputing wins (a block 100 ms to load, ~17 ms to recompute)
        (1000.0, {"never": 186.0, "always": 1026.5, "auto": 186.0}),
    ],
)
def test_one_request_by_hand(link_ms: float, expected: dict[str, float]) -> None:
    """Step 10 ms + 1 ms a token; the prefill rate auto plans with is that step's for 176 tokens
    (176 / 186 ms); a host block (16 tokens) loads in link_ms / 10 plus 0.5 ms once."""
    for policy, ttft in expected.items():
        r = _replay(_requests(), policy, PREFIX_IN_1MS / link_ms)
        third = next(x for x in r.outcomes if x.index == 2)
        assert third.ttft_ms == pytest.approx(ttft), policy
        loaded = policy == "always" or (policy == "auto" and link_ms == 1.0)
        assert third.reused_per_level == ([0, 160] if loaded else [0, 0]), policy
        plan = r.load_plan
        assert plan is not None and plan["policy"] == policy
        assert sum(plan["loaded_tokens"][1:]) == (160 if loaded else 0)  # type: ignore[index, arg-type]
        assert sum(plan["recomputed_tokens"]) == (0 if loaded else 160)  # type: ignore[arg-type]
    assert step_rate(LinearCost(10.0, 1000.0), 176, 2048, 176)[0] == pytest.approx(176 / 0.186)


@pytest.mark.parametrize("apart", [True, False])
def test_others_compute_while_a_request_loads(tmp_path: Any, apart: bool) -> None:
    """Request 3 (16 new tokens) arrives with request 2, whose prefix loads for 1,000.5 ms under
    "always". From disk (read apart, as in the adapter's loading state) request 3's step does not
    wait (TTFT 10 + 16 ms) and request 2 joins the first step after its bytes; host copies are
    ordered within the step: request 2 joins at once and the step waits for them (1,000.5 + 10 +
    32 ms for both), as it does without a load policy (every load in the step)."""
    late = SimRequest(3, 2000.0, [(90_000, 16)], 16, 1, (1 << 30) + 30)
    slow = PREFIX_IN_1MS / 1000.0
    disk = str(tmp_path) if apart else None
    ttft = {x.index: x.ttft_ms for x in _replay(_requests(late), "always", slow, disk=disk).outcomes}
    if apart:
        assert ttft[3] == pytest.approx(26.0) and ttft[2] == pytest.approx(1000.5 + 26.0)
    else:
        assert ttft[3] == pytest.approx(1000.5 + 10.0 + 32.0) and ttft[2] == ttft[3]
    waiting = {x.index: x.ttft_ms for x in _replay(_requests(late), None, slow, disk=disk).outcomes}
    assert waiting[3] == pytest.approx(1000.5 + 10.0 + 32.0) and waiting[2] == waiting[3]


def test_a_loading_request_takes_no_share_of_the_step(tmp_path: Any) -> None:
    """A step of 180 tokens: request 2 (176 tokens) loads its prefix from disk for 1,000.5 ms, so it
    takes none of the step's tokens: request 3 (16) is admitted behind it into the same step
    (10 + 16 ms), not after request 2's prefill; request 2 joins the first step after its load."""
    late = SimRequest(3, 2000.0, [(90_000, 16)], 16, 1, (1 << 30) + 30)
    r = _replay(_requests(late), "always", PREFIX_IN_1MS / 1000.0, disk=str(tmp_path), max_num_tokens=180)
    ttft = {x.index: x.ttft_ms for x in r.outcomes}
    assert ttft[3] == pytest.approx(26.0) and ttft[2] == pytest.approx(1000.5 + 26.0)


def test_auto_sees_the_links_backlog() -> None:
    """Request 1's admission (1,000 ms) writes request 0's prefix to the host over 2,000 ms: the
    link is busy until 3,000.5 ms. Request 2 (2,000 ms) would load the prefix in 1 ms, but only
    after that: "always" waits (1,000.5 + 0.5 + 1 + 26 ms); "auto" sees the 1,000.5 ms backlog
    (``set_tier_wait``) and recomputes, as "never" does (10 + 176 ms). (The manager's write
    admission off: it would decline that write, next test.)"""
    ttft = {}
    for policy in ("never", "always", "auto"):
        r = _replay(_requests(), policy, PREFIX_IN_1MS, PREFIX_IN_1MS / 2000, max_write_backlog_s=None)
        ttft[policy] = next(x.ttft_ms for x in r.outcomes if x.index == 2)
    assert ttft == pytest.approx({"never": 186.0, "always": 1028.0, "auto": 186.0})


@pytest.mark.parametrize("backlog", [1.0, 3.0])
def test_a_write_the_link_cannot_absorb_is_declined(backlog: float) -> None:
    """The same with write admission (200 ms a page on the link): at a 1 s bound the link takes 5
    of the prefix's 10 pages (busy until 2,000.5 ms) and the rest are dropped: "always" and "auto"
    load 80 tokens behind them (0.5 + 0.5 + 0.5 ms, then 10 + 96), "never" recomputes (186). At
    3 s every page is written: "auto" sees the manager's own queued write and recomputes."""
    ttft = {}
    for policy in ("never", "always", "auto"):
        r = _replay(_requests(), policy, PREFIX_IN_1MS, PREFIX_IN_1MS / 2000, max_write_backlog_s=backlog)
        ttft[policy] = next(x.ttft_ms for x in r.outcomes if x.index == 2)
        assert (r.levels[1].declined_pages > 2) is (backlog == 1.0)
    if backlog == 1.0:
        assert ttft == pytest.approx({"never": 186.0, "always": 107.5, "auto": 107.5})
    else:
        assert ttft == pytest.approx({"never": 186.0, "always": 1028.0, "auto": 186.0})


@pytest.mark.parametrize(("weight", "loads"), [(1.0, True), (0.0, False)])
def test_auto_prices_recompute_by_the_engines_queue(tmp_path: Any, weight: float, loads: bool) -> None:
    """Requests 3 to 5 (16 tokens each) arrive with request 2; a step holds 200 tokens. Request
    2's prefix is on disk, 168.5 ms to load; its 176 tokens add 176 ms to request 3's 26 ms step,
    so the prefix recomputes in 160 ms: alone it recomputes (weight 0; loading would also wait for
    the boundary of the others' 26 ms steps, 13 ms on average; requests 4 and 5 then wait for its
    step: 202 + 42 ms). With 3 requests waiting at weight 1 a recomputed token costs 4 times its
    time and it loads: its own wait (168.5 + 13 ms) stays within one of the others' steps of its
    recompute time. It joins the first step after its bytes (168.5 + 26 ms), while requests 3 and
    4 start at once (42 ms: it takes no share of their step) and 5 follows (68 ms)."""
    extra = [SimRequest(3 + i, 2000.0, [(90_000 + 1000 * i, 16)], 16, 1, (1 << 30) + 30 + 10 * i) for i in range(3)]
    r = _replay(_requests(*extra), "auto", PREFIX_IN_1MS / 168, weight=weight, max_num_tokens=200, disk=str(tmp_path))
    ttft = {x.index: x.ttft_ms for x in r.outcomes if x.index >= 2}
    if loads:
        assert ttft == pytest.approx({2: 194.5, 3: 42.0, 4: 42.0, 5: 68.0})
    else:
        assert ttft == pytest.approx({2: 202.0, 3: 202.0, 4: 244.0, 5: 244.0})


def test_a_short_prompt_recomputes_what_it_would_wait_a_step_for(tmp_path: Any) -> None:
    """Request 2 (20 tokens, its first 16 on disk) arrives with request 3 (150 tokens, 100-token
    chunks). Its prompt finishes in this step whatever it recomputes: its tokens cost what they
    add to request 3's 110 ms step (20 ms), so the 16 matched ones recompute in 16 ms, while a
    load (0.6 ms) would wait for that step to end: "auto" recomputes, as "never" (TTFT 130 ms);
    "always" loads and samples a step later (110 + 64 ms)."""
    reqs = [
        *_requests()[:2],
        SimRequest(2, 2000.0, [(1, 16), (50_000, 4)], 20, 1, (1 << 30) + 20),
        SimRequest(3, 2000.0, [(90_000, 150)], 150, 1, (1 << 30) + 30),
    ]
    ttft = {}
    for policy in ("never", "always", "auto"):
        (tmp_path / policy).mkdir()
        r = _replay(reqs, policy, PREFIX_IN_1MS, disk=str(tmp_path / policy), chunk=100)
        ttft[policy] = next(x.ttft_ms for x in r.outcomes if x.index == 2)
    assert ttft == pytest.approx({"never": 130.0, "always": 174.0, "auto": 130.0})


def test_the_cli_compares_the_policies(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    out = tmp_path / "r.json"
    args = ["--trace", TRACE, "--requests", "40", "--gpu", "2GiB", "--host", "4GiB", "--no-progress"]
    assert main([*args, "--load-policy", "all", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "load policy" in text and "never" in text and "auto" in text
    points = json.loads(out.read_text())["sweep"]["points"]
    assert [p["load_plan"]["policy"] for p in points] == ["never", "always", "auto"]
    assert sum(points[0]["load_plan"]["loaded_tokens"][1:]) == 0  # never loads from the host


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--load-policy", "sometimes"], "invalid choice: 'sometimes'"),
        (["--load-policy", "auto,auto"], "name each policy once"),
        (["--load-policy", "auto", "--replicas", "2"], "--load-policy compares replays of one engine"),
    ],
)
def test_bad_load_policy_options(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    try:
        code = main(["--requests", "5", "--no-progress", *args])
    except SystemExit as e:  # (argparse: a bad value)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err.splitlines()[-1], err
