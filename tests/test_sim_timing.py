"""The simulator's time model checked against what can be computed by hand: one request's time to
first token (its loads from a lower tier, then its prefill), a chunked-prefill timeline, the M/D/1
queue's mean wait and Little's law; tier I/O options and the per-request file."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim import SchedulerOptions, SimUserError, TierSpec, main
from kv_cache_manager_v2.sim._models import ModelShape, manager_config, proxy_page_bytes, real_bytes_per_proxy_byte
from kv_cache_manager_v2.sim._replay import Replay
from kv_cache_manager_v2.sim._replay_types import ReplayResult
from kv_cache_manager_v2.sim._step_cost import LinearCost
from kv_cache_manager_v2.sim._tier_io import (
    WRITE_BACKLOG_MS,
    Link,
    TierLinks,
    parse_bandwidth,
    parse_latency,
    tier_links,
)
from kv_cache_manager_v2.sim._workload import SimRequest

SMALL = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token
T = 16  # tokens per block


def _tier(kind: str, tokens: int, path: str | None = None) -> TierSpec:
    return TierSpec(kind, tokens * SMALL.bytes_per_token, f"{tokens}tok", path)


def _replay(
    tiers: list[TierSpec],
    reqs: list[SimRequest],
    opts: SchedulerOptions,
    cost: LinearCost | None = None,
    **config: Any,
) -> ReplayResult:
    page = proxy_page_bytes(T, False, SMALL)
    config = dataclasses.replace(manager_config(SMALL, T, tiers, False, page), **config)
    scale = real_bytes_per_proxy_byte(SMALL, T, page)
    return Replay(config, reqs, dataclasses.replace(opts, cost=cost), bytes_scale=scale).run()


def _by_index(r: ReplayResult) -> dict[int, Any]:
    return {x.index: x for x in r.outcomes}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_request_alone_waits_for_its_loads_then_its_prefill(kind: str, tmp_path: Any) -> None:
    """Request 0's prompt is pushed from the GPU to the lower tier by request 1; request 2, alone
    on an idle link, reuses it from there: TTFT = latency + bytes / bandwidth + step + its new
    tokens (LinearCost), bytes = 160 tokens of the real model (256 bytes a token)."""
    reqs = [
        SimRequest(0, 0.0, [(1, 160)], 160, 1, 1 << 30),
        SimRequest(1, 1000.0, [(10_000, 200)], 200, 1, (1 << 30) + 10),
        SimRequest(2, 2000.0, [(1, 160), (50_000, 16)], 176, 1, (1 << 30) + 20),
    ]
    bandwidth = 160 * SMALL.bytes_per_token / 1e-3  # the prefix in exactly 1 ms
    slow = Link(bandwidth, bandwidth, 0.5)
    links = TierLinks(host=slow) if kind == "host" else TierLinks(disk=slow)
    opts = SchedulerOptions(prompt_only=True, watermark=0.0, links=links)
    tiers = [_tier("gpu", 208), _tier(kind, 4096, str(tmp_path) if kind == "disk" else None)]
    r = _replay(tiers, reqs, opts, LinearCost(10.0, 1000.0))  # 1 ms a token
    assert r.finished == 3
    third = _by_index(r)[2]
    assert third.reused_per_level == [0, 160] and third.loaded_tokens == 160
    assert r.levels[1].onboarded_bytes * real_bytes_per_proxy_byte(SMALL, T, proxy_page_bytes(T, False, SMALL)) == (
        160 * SMALL.bytes_per_token
    )
    assert third.ttft_ms == pytest.approx(0.5 + 1.0 + 10.0 + 16.0)
    assert third.e2e_ms == third.ttft_ms and third.tpot_ms == 0.0 and third.wait_ms == 0.0
    assert _by_index(r)[0].ttft_ms == pytest.approx(10.0 + 160.0)  # nothing to load
    assert r.io_wait_ms == pytest.approx(1.5)
    # free links (no tier I/O): the same request costs its prefill alone
    free = _replay(tiers, reqs, SchedulerOptions(prompt_only=True, watermark=0.0), LinearCost(10.0, 1000.0))
    assert _by_index(free)[2].ttft_ms == pytest.approx(26.0) and free.io_wait_ms == 0.0


def _evict_then_reuse() -> tuple[list[SimRequest], float]:
    """Request 1 (at 1,000 ms) evicts request 0's 160-token prefix to the lower tier; request 2
    (also at 1,000) reuses it from there; and the bandwidth that moves the prefix in 1 ms."""
    reqs = [
        SimRequest(0, 0.0, [(1, 160)], 160, 1, 1 << 30),
        SimRequest(1, 1000.0, [(10_000, 200)], 200, 1, (1 << 30) + 10),
        SimRequest(2, 1000.0, [(1, 160), (50_000, 16)], 176, 1, (1 << 30) + 20),
    ]
    return reqs, 160 * SMALL.bytes_per_token / 1e-3


def test_loads_wait_behind_offloads_queued_on_the_same_link() -> None:
    """Request 1 evicts request 0's prefix to host (an offload that keeps the link busy for 2 ms
    plus latency); request 2 arrives while the link is still busy and reuses that prefix: its load
    starts when the offload is done."""
    reqs, bandwidth = _evict_then_reuse()
    links = TierLinks(host=Link(bandwidth, bandwidth / 100, 0.5))  # writes: 100 ms for the prefix
    opts = SchedulerOptions(prompt_only=True, watermark=0.0, max_batch=1, links=links)
    r = _replay([_tier("gpu", 208), _tier("host", 4096)], reqs, opts, LinearCost(10.0, 1000.0))
    one, two = _by_index(r)[1], _by_index(r)[2]
    assert one.ttft_ms == pytest.approx(10.0 + 200.0)  # its own step does not wait for its offload
    assert two.reused_per_level == [0, 160]
    # request 2 starts at 1210, behind the offload (issued at 1000: the link is busy until 1100.5)
    assert two.ttft_ms == pytest.approx(210.0 + 0.5 + 1.0 + 10.0 + 16.0)


def test_a_step_waits_while_its_link_has_more_than_the_write_backlog_queued() -> None:
    """As above with writes 30 times slower: request 1's offload of request 0's prefix holds the
    host link 3,000.5 ms (from 1,000), more than ``WRITE_BACKLOG_MS`` (1 s) beyond the step's start:
    the step waits until only 1 s of it is left, then computes; request 2 loads behind the rest.
    (The manager's write admission off: it would decline that write, next test.)"""
    reqs, bandwidth = _evict_then_reuse()
    links = TierLinks(host=Link(bandwidth, bandwidth / 3000, 0.5))  # writes: 3 s for the prefix
    opts = SchedulerOptions(prompt_only=True, watermark=0.0, max_batch=1, links=links)
    tiers = [_tier("gpu", 208), _tier("host", 4096)]
    r = _replay(tiers, reqs, opts, LinearCost(10.0, 1000.0), max_write_backlog_s=None)
    one, two = _by_index(r)[1], _by_index(r)[2]
    assert WRITE_BACKLOG_MS == 1000.0 and one.reused_per_level == [0, 0]
    assert one.ttft_ms == pytest.approx(4000.5 - 1000.0 - 1000.0 + 210.0)
    # request 2 starts at 3210.5; its load waits until the offload is done (4000.5), its own
    # offloads (request 1's blocks) make it wait again
    assert two.ttft_ms >= 4000.5 + 0.5 + 1.0 + 10.0 + 16.0 - 1000.0
    assert r.io_write_stall_ms >= 2000.5
    # never more than 1 s of writes left queued: the run lasts at least the link's writing time - 1 s
    written_ms = r.levels[1].offloaded_bytes * real_bytes_per_proxy_byte(SMALL, T, proxy_page_bytes(T, False, SMALL))
    written_ms /= bandwidth / 3000 / 1000
    assert r.sim_time_ms >= written_ms - WRITE_BACKLOG_MS


def test_writes_the_link_cannot_absorb_are_declined() -> None:
    """The same with the manager's write admission (its default bound, 1 s; priced from the link:
    300 ms a page): of request 0's 10 pages the link takes 3 (busy until 1,900.5 ms), the others
    are dropped. No step waits for writes (request 1: 210 ms, not 2,210.5); request 2 loads the
    3 blocks behind them (1,901.3 ms) and computes 128 tokens (+ 10 + 128 ms)."""
    reqs, bandwidth = _evict_then_reuse()
    links = TierLinks(host=Link(bandwidth, bandwidth / 3000, 0.5))
    opts = SchedulerOptions(prompt_only=True, watermark=0.0, max_batch=1, links=links)
    r = _replay([_tier("gpu", 208), _tier("host", 4096)], reqs, opts, LinearCost(10.0, 1000.0))
    one, two = _by_index(r)[1], _by_index(r)[2]
    assert r.io_write_stall_ms == 0.0 and r.levels[1].declined_pages > 0
    assert one.ttft_ms == pytest.approx(210.0)
    assert two.reused_per_level == [0, 48] and two.ttft_ms == pytest.approx(1901.3 + 138.0 - 1000.0)


def test_a_chunked_prefill_timeline_by_hand() -> None:
    """Step 10 ms + 1 ms a token, chunks of 64. A (32-token prompt, 4 outputs) arrives at 0; B
    (160-token prompt, 2 outputs) at 50, while A decodes:

    step 1 [0, 42): A's prompt (32); step 2 [42, 53): A decodes; step 3 [53, 128): A decodes, B's
    chunk of 64; step 4 [128, 203): A's last token, B's second chunk; step 5 [203, 245): B's last
    32 tokens, its first token; step 6 [245, 256): B's last token."""
    reqs = [
        SimRequest(0, 0.0, [(1, 32)], 32, 4, 1 << 30),
        SimRequest(1, 50.0, [(1000, 160)], 160, 2, (1 << 30) + 10),
    ]
    opts = SchedulerOptions(chunk=64, watermark=0.0)
    r = _replay([_tier("gpu", 4096)], reqs, opts, LinearCost(10.0, 1000.0))
    assert r.steps == 6 and r.sim_time_ms == pytest.approx(256.0)
    a, b = _by_index(r)[0], _by_index(r)[1]
    assert (a.wait_ms, a.ttft_ms, a.tpot_ms, a.e2e_ms) == pytest.approx((0.0, 42.0, (203.0 - 42.0) / 3, 203.0))
    assert (b.wait_ms, b.ttft_ms, b.tpot_ms, b.e2e_ms) == pytest.approx((3.0, 195.0, 11.0, 206.0))
    assert list(r.ttft_ms) == pytest.approx([42.0, 195.0])  # in finishing order
    assert list(r.tpot_ms) == pytest.approx([161.0 / 3, 11.0]) and list(r.e2e_ms) == pytest.approx([203.0, 206.0])
    assert a.output_tokens == 4 and b.output_tokens == 2 and a.recomputed_tokens == b.recomputed_tokens == 0


def test_every_computed_token_costs_recomputed_outputs_included() -> None:
    """Preempted by recompute, a request computes its generated tokens again: several tokens past
    its prompt in one step cost as a prefill chunk (not one decode token); the cost model sees every
    token the replay counts as computed."""
    reqs = [SimRequest(i, float(i * 5), [(i % 3 * 1000, 64)], 64, 120, (1 << 30) + i * 4096) for i in range(24)]
    # 1 ms a token, nothing a step: the steps' compute time counts the tokens the cost model saw
    r = _replay(
        [_tier("gpu", 1024)], reqs, SchedulerOptions(max_batch=16, chunk=64, watermark=0.0), LinearCost(0.0, 1000.0)
    )
    assert r.finished == 24 and r.preempted_recompute > 0
    assert r.compute_ms == pytest.approx(r.prefill_computed + r.decode_computed)


def _poisson(n: int, rate_per_ms: float, seed: int, outputs: Any = None) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate_per_ms, n))
    out = [1] * n if outputs is None else outputs(rng, n)
    return [SimRequest(i, float(times[i]), [(i * 64, 16)], 16, int(out[i]), (1 << 30) + i * 4096) for i in range(n)]


def test_poisson_arrivals_with_a_fixed_service_time_wait_as_in_m_d_1() -> None:
    """One server (a batch of one), every request one step of D ms: the mean wait in the queue is
    M/D/1's rho D / (2 (1 - rho)) (Pollaczek-Khinchine with no service variance), within 5 %."""
    d, rho, n = 10.0, 0.5, 20_000
    reqs = _poisson(n, rho / d, seed=3)
    opts = SchedulerOptions(max_batch=1, chunk=0, prompt_only=True, watermark=0.0)
    r = _replay([_tier("gpu", 100_000)], reqs, opts, LinearCost(d, 1e15))
    assert r.finished == n
    expected = rho * d / (2 * (1 - rho))
    mean_wait = float(np.mean(r.wait_ms))
    assert abs(mean_wait - expected) <= 0.05 * expected, (mean_wait, expected)
    assert all(x.e2e_ms == pytest.approx(x.wait_ms + d) for x in r.outcomes)


def test_littles_law_holds_over_a_long_run() -> None:
    """Continuous batching with decode: the mean number of requests in the system (arrived, not
    finished; integrated over time from the replay's arrival and finish times) equals the arrival
    rate times the mean time in the system, within 2 %, over the steady part of a long run."""
    reqs = _poisson(3000, 0.05, seed=7, outputs=lambda rng, n: rng.integers(1, 40, n))
    opts = SchedulerOptions(max_batch=8, chunk=64, watermark=0.0)
    r = _replay([_tier("gpu", 100_000)], reqs, opts, LinearCost(5.0, 20_000.0))
    assert r.finished == len(reqs)
    events = sorted(
        [(x.arrival_ms, 1) for x in r.outcomes] + [(x.arrival_ms + x.e2e_ms, -1) for x in r.outcomes],
        key=lambda e: (e[0], e[1]),
    )
    span = reqs[-1].arrival_ms
    lo, hi = 0.1 * span, 0.9 * span
    area = 0.0
    n = 0
    prev = lo
    for t, k in events:
        if t > hi:
            break
        if t > lo:
            area += n * (t - prev)
            prev = t
        n += k
    area += n * (hi - prev)
    inside = [x for x in r.outcomes if lo <= x.arrival_ms < hi]
    little = len(inside) / (hi - lo) * float(np.mean([x.e2e_ms for x in inside]))
    mean_in_system = area / (hi - lo)
    assert mean_in_system > 1.0  # requests do share the GPU
    assert abs(mean_in_system - little) <= 0.02 * little, (mean_in_system, little)


def test_the_manager_time_can_be_counted() -> None:
    """``count_manager_time``: every step also takes the manager's measured CPU time."""
    reqs = _poisson(50, 0.01, seed=1)
    opts = SchedulerOptions(max_batch=1, chunk=0, prompt_only=True)
    plain = _replay([_tier("gpu", 10_000)], reqs, opts, LinearCost(10.0, 1e15))
    counted = _replay(
        [_tier("gpu", 10_000)], reqs, SchedulerOptions(max_batch=1, chunk=0, prompt_only=True, count_manager_time=True),
        LinearCost(10.0, 1e15),
    )  # fmt: skip
    assert all(x.e2e_ms - x.wait_ms == pytest.approx(10.0) for x in plain.outcomes)
    assert all(x.e2e_ms - x.wait_ms > 10.0 for x in counted.outcomes)


def test_the_report_records_whether_the_manager_time_counts(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """``--count-manager-time`` changes every time: the JSON (``scheduler``) and the text's first line say so."""
    args = ["--trace", TRACE, "--requests", "5", "--no-progress", "--json", str(tmp_path / "r.json")]
    for extra, counted in (([], False), (["--count-manager-time"], True)):
        assert main([*args, *extra]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert json.loads((tmp_path / "r.json").read_text())["scheduler"]["count_manager_time"] is counted
        assert ("+ the manager's CPU time" in first) is counted, first


def test_bandwidth_and_latency_parsing() -> None:
    assert parse_bandwidth("o", "50GB/s") == 50e9
    assert parse_bandwidth("o", "200MB/s") == 200e6
    assert parse_bandwidth("o", "1.5GiB/s") == 1.5 * 2**30
    assert parse_bandwidth("o", "25Gb/s") == 25e9 / 8
    assert parse_bandwidth("o", "inf") == float("inf")
    assert parse_latency("o", "0.5ms") == 0.5 and parse_latency("o", "100us") == pytest.approx(0.1)
    assert parse_latency("o", "1s") == 1000.0 and parse_latency("o", "0") == 0.0
    for bad in ("50", "50GB", "-1GB/s", "0GB/s", "fast", ""):
        with pytest.raises(SimUserError, match="bandwidth"):
            parse_bandwidth("--tier-bandwidth host", bad)
    for bad in ("0.5", "5 min", "-1ms", "1h"):
        with pytest.raises(SimUserError, match="latency"):
            parse_latency("--tier-latency host", bad)
    links = tier_links("disk=200MB/s,host=40GB/s,disk-write=100MB/s", "disk=0.2ms", ("host", "disk"))
    assert links.disk == Link(200e6, 100e6, 0.2) and links.host == Link(40e9, 40e9, TierLinks().host.latency_ms)
    assert links.remote == TierLinks().remote
    with pytest.raises(SimUserError, match="no remote tier"):
        tier_links(None, "remote=0.5ms", ("host",))
    with pytest.raises(SimUserError, match="TIER=VALUE"):
        tier_links("gpu=1GB/s", None, ("host",))
    with pytest.raises(SimUserError, match="twice"):
        tier_links("host=1GB/s,host=2GB/s", None, ("host",))
    with pytest.raises(SimUserError, match="TIER=VALUE"):
        tier_links(None, "host-read=1ms", ("host",))


def _lines(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_per_request_file(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """``--per-request``: a line per request, by index, rejected ones marked; with tier I/O on (the
    default) a request that loads pages from the host waits longer than with ``--no-tier-io``, and
    one that loads nothing waits as long (the same requests: the run differs by load times only)."""
    args = ["--trace", TRACE, "--requests", "120", "--gpu", "2GiB", "--host", "8GiB", "--no-progress"]
    runs = []
    for extra in ([], ["--no-tier-io"]):
        path = tmp_path / f"requests{len(runs)}.jsonl"
        assert main([*args, *extra, "--per-request", str(path)]) == 0
        runs.append(_lines(path))
    capsys.readouterr()
    timed, free = runs
    assert [x["index"] for x in timed] == list(range(120))
    rejected = [x for x in timed if x["rejected"]]
    assert rejected and all(x["ttft_ms"] is None and x["line"] == x["index"] + 1 for x in rejected)
    done = [x for x in timed if not x["rejected"]]
    assert all(x["e2e_ms"] >= x["ttft_ms"] >= x["wait_ms"] >= 0 and x["output_tokens"] >= 1 for x in done)
    assert all(set(x["reused_tokens"]) == {"gpu", "host"} for x in done)
    assert all(x["loaded_tokens"] >= x["reused_tokens"]["host"] for x in done)
    loaded = [(a, b) for a, b in zip(timed, free) if not a["rejected"] and a["loaded_tokens"]]
    assert loaded and any(a["ttft_ms"] > b["ttft_ms"] for a, b in loaded)
    assert sum(a["ttft_ms"] for a, _ in loaded) > sum(b["ttft_ms"] for _, b in loaded)
    first = timed[0]  # alone at first: nothing to load, the same time either way
    assert first["loaded_tokens"] == 0 and first["ttft_ms"] == free[0]["ttft_ms"]


def test_a_sweep_labels_its_runs_in_the_per_request_file(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    path = tmp_path / "requests.jsonl"
    args = ["--trace", TRACE, "--requests", "30", "--sweep", "host=0,4GiB", "--no-progress", "--per-request", str(path)]
    assert main([*args, "--tier-bandwidth", "host=1GB/s"]) == 0
    capsys.readouterr()
    lines = _lines(path)
    assert len(lines) == 60 and {x["run"] for x in lines} == {"replay (host 0)", "replay (host 4GiB)"}


def test_the_per_request_file_holds_the_hinted_replay_too(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """``--per-request`` with ``--retention-hints``: the hinted replay's requests follow the
    replay's, each labelled, and they are the ones its report's hit rate and TTFT count."""
    path, out = tmp_path / "requests.jsonl", tmp_path / "report.json"
    args = ["--trace", TRACE, "--requests", "80", "--gpu", "1GiB", "--sessions", "--session-end", "--no-progress"]
    assert main([*args, "--retention-hints", "0.9", "--per-request", str(path), "--json", str(out)]) == 0
    capsys.readouterr()
    lines, rep = _lines(path), json.loads(out.read_text())
    assert [x["run"] for x in lines] == ["replay"] * 80 + ["replay hints 0.9"] * 80
    for run, hit, ttft in [
        (lines[:80], rep["hit_rate"]["tokens"], rep["latency"]["ttft_s"]),
        (lines[80:], rep["retention_hints"]["token_hit_rate"], rep["retention_hints"]["ttft_s"]),
    ]:
        assert [x["index"] for x in run] == list(range(80))
        served = [x for x in run if not x["rejected"]]
        reused = sum(x["reused_tokens"]["gpu"] for x in served) / sum(x["prompt_tokens"] for x in served)
        assert reused == pytest.approx(hit, abs=1e-4)
        assert np.mean([x["ttft_ms"] for x in served]) / 1000.0 == pytest.approx(ttft["mean"])
    assert lines[:80] != [{**x, "run": "replay"} for x in lines[80:]]  # the hints changed something


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tier-bandwidth", "disk=200MB/s"], "--tier-bandwidth disk: this run has no disk tier"),
        (["--host", "4GiB", "--tier-bandwidth", "host=fast"], "--tier-bandwidth host: 'fast' is not a bandwidth"),
        (["--host", "4GiB", "--tier-latency", "host=5"], "--tier-latency host: '5' is not a latency"),
        (["--host", "4GiB", "--tier-latency", "remote=1ms"], "this run has no remote tier"),
        (["--host", "4GiB", "--no-tier-io", "--tier-latency", "host=1ms"], "--no-tier-io"),
        (["--per-request", "/nonexistent/dir/x.jsonl"], "--per-request /nonexistent/dir/x.jsonl"),
    ],
)
def test_bad_time_options_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert main([*args, "--requests", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
