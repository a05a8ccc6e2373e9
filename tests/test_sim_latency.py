"""What users wait for (``sim/_latency.py``): queueing, TTFT, TPOT and end-to-end summaries
(nearest-rank percentiles), throughput and goodput, checked against values computed by hand; the
report's ``latency`` section, the sweep table's TTFT columns, replicas merged by arrays, and the
``--slo-ttft``/``--slo-tpot`` refusals."""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import NO_REDIS_REASON, REDIS_SERVER

from kv_cache_manager_v2.sim import main
from kv_cache_manager_v2.sim._latency import Slo, compared_rows, latency_report, latency_rows, summary
from kv_cache_manager_v2.sim._plot import matplotlib_missing, write_plot
from kv_cache_manager_v2.sim._replay_types import ReplayResult
from kv_cache_manager_v2.sim._replicas import merge_results
from kv_cache_manager_v2.sim._report import format_sweep

SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"]
TINY = ["--conversations", "6", "--turns", "2", "--system-tokens", "300", "--user-tokens", "100"]
QUICK = [*SMALL, *TINY, "--output-tokens", "20", "--no-progress"]
STATS = {"requests", "mean", "p50", "p90", "p99", "max"}


def result(
    ttft: Sequence[float] = (),
    tpot: Sequence[float] = (),
    e2e: Sequence[float] = (),
    wait: Sequence[float] = (),
    sim_ms: float = 10_000.0,
    rejected: int = 0,
) -> ReplayResult:
    """A replay's result with its per-request arrays (ms) filled by hand."""
    r = ReplayResult(16, finished=len(ttft), rejected=rejected, sim_time_ms=sim_ms)
    r.ttft_ms.extend(ttft)
    r.tpot_ms.extend(tpot)
    r.e2e_ms.extend(e2e)
    r.wait_ms.extend(wait)
    return r


def test_percentiles_are_nearest_rank_and_means_arithmetic() -> None:
    # 10 values, 0.1 s .. 1.0 s, shuffled: pN is the ceil(N x 10 / 100)-th smallest
    s = summary(array("d", [700, 100, 1000, 300, 200, 900, 500, 400, 800, 600]))
    assert s == pytest.approx({"requests": 10, "mean": 0.55, "p50": 0.5, "p90": 0.9, "p99": 1.0, "max": 1.0})
    # 7 values: p50 the 4th (ceil 3.5), p90 the 7th (ceil 6.3), p99 the 7th
    s = summary(array("d", [7000, 1000, 2000, 3000, 4000, 5000, 6500]))
    assert s is not None
    assert (s["p50"], s["p90"], s["p99"], s["max"]) == (4.0, 7.0, 7.0, 7.0)
    assert s["mean"] == pytest.approx(28.5 / 7)
    # 200 values 1..200 ms: p99 the 198th, p90 the 180th, p50 the 100th (exact in integers)
    s = summary(array("d", range(200, 0, -1)))
    assert s is not None and (s["p50"], s["p90"], s["p99"]) == (0.1, 0.18, 0.198)
    one = summary(array("d", [250.0]))
    assert one == {"requests": 1, "mean": 0.25, "p50": 0.25, "p90": 0.25, "p99": 0.25, "max": 0.25}


def test_the_latency_section_from_a_replay_result() -> None:
    r = result(
        ttft=[500, 1500, 2500, 3000],
        tpot=[10, 60, 20, 0],  # the last request had one output token: no TPOT
        e2e=[2500, 9000, 4500, 3000],
        wait=[0, 100, 200, 300],
        rejected=1,
    )
    r.prompt_tokens, r.output_tokens = 4000, 400
    lat = latency_report(r, Slo(2.0, 0.05))
    assert lat["percentiles"] == "nearest rank"
    assert lat["ttft_s"] == pytest.approx(
        {"requests": 4, "mean": 1.875, "p50": 1.5, "p90": 3.0, "p99": 3.0, "max": 3.0}
    )
    assert lat["tpot_s"] == pytest.approx(
        {"requests": 3, "mean": 0.03, "p50": 0.02, "p90": 0.06, "p99": 0.06, "max": 0.06}
    )
    assert lat["e2e_s"]["p50"] == 3.0 and lat["e2e_s"]["mean"] == pytest.approx(4.75)
    assert lat["queueing_s"]["p50"] == 0.1 and lat["queueing_s"]["p90"] == 0.3
    # throughput over the simulated span (10 s): 4 requests, 4,000 prompt and 400 output tokens
    assert lat["throughput"] == {
        "span_s": 10.0,
        "requests_per_s": 0.4,
        "prompt_tokens_per_s": 400.0,
        "output_tokens_per_s": 40.0,
    }
    # goodput: only the first request meets both (the second misses TPOT, the others TTFT); of 5
    # requests (the rejected one a miss)
    assert lat["goodput"] == {"slo_ttft_s": 2.0, "slo_tpot_s": 0.05, "requests": 1, "requests_per_s": 0.1, "share": 0.2}
    ttft_only = latency_report(r, Slo(ttft_s=2.0))["goodput"]
    assert (ttft_only["requests"], ttft_only["share"], ttft_only["slo_tpot_s"]) == (2, 0.4, None)
    # the one-token request (TPOT 0) meets any TPOT objective; the boundary is included
    tpot_only = latency_report(r, Slo(tpot_s=0.02))["goodput"]
    assert tpot_only["requests"] == 3
    assert latency_report(r)["goodput"] is None and latency_report(r, Slo())["goodput"] is None
    # the CDF: the TTFT at 1 % .. 100 % of the requests (nearest rank): 25 points per request here
    cdf = lat["ttft_cdf_s"]
    assert cdf == [0.5] * 25 + [1.5] * 25 + [2.5] * 25 + [3.0] * 25
    assert cdf[49] == lat["ttft_s"]["p50"] and cdf[89] == lat["ttft_s"]["p90"]
    # another span (the fleet's, for a replica)
    assert latency_report(r, None, 20_000.0)["throughput"]["requests_per_s"] == 0.2


def test_throughput_spans_from_the_first_arrival_not_time_zero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    r = result(ttft=[100, 200], sim_ms=3_602_000.0)
    r.first_arrival_ms = 3_600_000.0  # a trace whose timestamps start an hour in
    lat = latency_report(r)
    assert lat["throughput"]["span_s"] == 2.0 and lat["throughput"]["requests_per_s"] == 1.0
    # through the CLI: the same trace an hour later has the same throughput
    spans = []
    for start in (0, 3_600_000):
        path = tmp_path / f"trace{start}.jsonl"
        lines = [
            {"timestamp": start + t, "input_length": 700, "output_length": 4, "hash_ids": [i, i + 1]}
            for i, t in enumerate((0, 500, 900))
        ]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        assert main([*SMALL, "--trace", str(path), "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
        doc = json.loads((tmp_path / "r.json").read_text())
        spans.append((doc["latency"]["throughput"], doc["replay"]["simulated_s"]))
    assert spans[0][0] == pytest.approx(spans[1][0]) and spans[0][0]["span_s"] > 0
    assert spans[1][0]["span_s"] == pytest.approx(spans[1][1] - 3600.0)


def test_no_per_request_times_report_nothing_and_never_crash() -> None:
    lat = latency_report(result(sim_ms=0.0), Slo(2.0, 0.1))
    assert [lat[k] for k in ("queueing_s", "ttft_s", "tpot_s", "e2e_s", "goodput")] == [None] * 5
    assert lat["ttft_cdf_s"] == []
    assert lat["throughput"] == {
        "span_s": 0.0,
        "requests_per_s": 0.0,
        "prompt_tokens_per_s": 0.0,
        "output_tokens_per_s": 0.0,
    }
    # only one-token requests: no TPOT at all
    assert latency_report(result(ttft=[5.0], tpot=[0.0]))["tpot_s"] is None


def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    path = tmp_path / "report.json"
    code = main([*QUICK, *args, "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(path.read_text()), out


def test_the_json_latency_keys_and_the_text_section(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc, out = run(capsys, tmp_path, "--gpu", "20000tok", "--slo-ttft", "2", "--slo-tpot", "0.1")
    lat = doc["latency"]
    assert set(lat) == {"percentiles", "queueing_s", "ttft_s", "tpot_s", "e2e_s", "ttft_cdf_s", "throughput", "goodput"}
    assert set(lat["throughput"]) == {"span_s", "requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s"}
    # the span: the first arrival (the first conversation's start, after 0) to the last step's end
    assert 0 < lat["throughput"]["span_s"] < doc["replay"]["simulated_s"]
    assert lat["throughput"]["output_tokens_per_s"] == pytest.approx(
        doc["decode"]["output_tokens"] / lat["throughput"]["span_s"]
    )
    assert set(lat["queueing_s"]) == STATS and lat["queueing_s"]["requests"] == doc["requests"]["finished"]
    assert type(lat["queueing_s"]["requests"]) is int  # a count, in both modes
    for key in ("ttft_s", "tpot_s", "e2e_s"):  # present once the replay notes per-request times
        assert lat[key] is None or set(lat[key]) == STATS
    if lat["goodput"] is not None:
        assert set(lat["goodput"]) == {"slo_ttft_s", "slo_tpot_s", "requests", "requests_per_s", "share"}
        assert (lat["goodput"]["slo_ttft_s"], lat["goodput"]["slo_tpot_s"]) == (2.0, 0.1)
    assert "what users wait for (simulated)" in out
    assert "  queueing                  mean " in out and "  throughput " in out


def test_the_text_report_shows_every_figure() -> None:
    rep = {"latency": latency_report(result([500, 1500], [10, 20], [900, 3000], [0, 40]), Slo(1.0))}
    rows = dict(latency_rows(rep["latency"]))
    assert rows["time to first token"] == "mean 1.00 s, p50 500 ms, p90 1.50 s, p99 1.50 s (2 requests)"
    assert rows["time per output token"].startswith("mean 15 ms, p50 10 ms")
    assert rows["queueing"].startswith("mean 20 ms, p50 0.0 ms, p90 40 ms")
    assert (
        rows["goodput"] == "0.10 requests/s meet TTFT <= 1.00 s: 50.0% of the requests (rejected ones count as misses)"
    )
    assert rows["throughput"].startswith("0.20 requests/s")


def test_the_sweep_table_has_ttft_p50_p90_beside_the_hit_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc, out = run(capsys, tmp_path, "--gpu", "1500tok", "--sweep", "host=0,40000tok")
    head = out.splitlines()[1].split()
    assert head[6:10] == ["admitted", "ttft(p50)", "ttft(p90)", "rejected"], head
    points = doc["sweep"]["points"]
    # the columns from each point's TTFT (filled by hand here: the figures of the format)
    points[0]["latency"] = latency_report(result([1000, 2000, 3000, 9000]), Slo(2.5))
    points[1]["latency"] = latency_report(result([400, 500, 600, 700]), Slo(2.5))
    lines = format_sweep("host", points).splitlines()
    assert lines[0].split()[6:11] == ["admitted", "ttft(p50)", "ttft(p90)", "slo(met)", "rejected"], lines[0]
    assert [line.split()[6:9] for line in lines[1:3]] == [["2.00", "9.00", "50%"], ["0.50", "0.70", "100%"]]
    assert "slo(met): share of the requests meeting" in lines[3]
    points[0]["latency"] = latency_report(result())  # no per-request times: "-"
    points[1]["latency"] = latency_report(result())
    lines = format_sweep("host", points).splitlines()
    assert "slo(met)" not in lines[0] and [line.split()[6:8] for line in lines[1:3]] == [["-", "-"]] * 2


def test_a_sweep_plot_draws_the_ttft_cdf_per_point(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if matplotlib_missing() is not None:
        pytest.skip("matplotlib is not installed")
    from matplotlib.figure import Figure

    figs: list[Any] = []
    real = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        figs.append(self)

    monkeypatch.setattr(Figure, "savefig", keep)
    doc, _ = run(capsys, tmp_path, "--gpu", "1500tok", "--sweep", "host=0,40000tok")
    points = doc["sweep"]["points"]
    points[0]["latency"] = latency_report(result([1000, 2000, 3000, 9000]), Slo(2.5))
    points[1]["latency"] = latency_report(result([400, 500, 600, 700]), Slo(2.5))
    write_plot(str(tmp_path / "sweep.png"), None, ("host", points))
    (fig,) = figs
    cdf = fig.axes[2]
    assert cdf.get_xlabel() == "time to first token (s, simulated)"
    lines = {line.get_label(): line for line in cdf.get_lines() if not str(line.get_label()).startswith("_")}
    assert set(lines) == {"0", "40000tok", "--slo-ttft 2.5 s"}
    assert list(lines["40000tok"].get_xdata())[::25] == [0.4, 0.5, 0.6, 0.7]
    assert list(lines["40000tok"].get_ydata())[-1] == 1.0


def test_replicas_merge_the_arrays_not_the_percentiles() -> None:
    a = result(ttft=[100, 200, 300], tpot=[5, 5, 5], e2e=[1, 2, 3], wait=[0, 0, 0], sim_ms=8000.0)
    b = result(ttft=[5000], tpot=[50], e2e=[9], wait=[70], sim_ms=10_000.0)
    fleet = merge_results([a, b])
    assert list(fleet.ttft_ms) == [100, 200, 300, 5000] and list(fleet.tpot_ms) == [5, 5, 5, 50]
    assert list(fleet.e2e_ms) == [1, 2, 3, 9] and list(fleet.wait_ms) == [0, 0, 0, 70]
    lat = latency_report(fleet, Slo(1.0))
    # p50 of the merged 4 values is the 2nd (0.2 s); the mean of the replicas' p50s would be 2.6 s
    assert lat["ttft_s"]["p50"] == 0.2 and lat["ttft_s"]["p90"] == 5.0
    assert lat["goodput"]["requests"] == 3 and lat["goodput"]["requests_per_s"] == 0.3  # the fleet's 10 s
    per = [latency_report(r, Slo(1.0), fleet.sim_time_ms) for r in (a, b)]
    assert sum(p["goodput"]["requests_per_s"] for p in per) == pytest.approx(lat["goodput"]["requests_per_s"])
    private = {"latency": latency_report(result([100, 300]), Slo(1.0))}
    shared = {"latency": lat, "per_replica_latency": per}
    rows = compared_rows(private, shared)
    assert rows[0].split() == ["TTFT", "p50", "(s)", "0.10", "0.20", "+0.10"], rows
    assert rows[-1] == "  TTFT p90 per replica (shared, s): 0.30, 5.00"
    assert any(r.startswith("  goodput (shared): 0.30 requests/s meet TTFT <= 1.00 s") for r in rows)


@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)
def test_replicas_report_latency_in_all_and_per_replica(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc, out = run(capsys, tmp_path, "--gpu", "20000tok", "--replicas", "2", "--slo-ttft", "2")
    for label in ("private", "shared"):
        rep = doc["replicas"][label]
        fleet, per = rep["latency"], rep["per_replica_latency"]
        assert len(per) == 2 and all(set(p) == set(fleet) for p in per)
        # every throughput over the fleet's span: the replicas' add up to the fleet's
        assert all(p["throughput"]["span_s"] == fleet["throughput"]["span_s"] for p in per)
        for key in ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s"):
            assert sum(p["throughput"][key] for p in per) == pytest.approx(fleet["throughput"][key])
        assert fleet["queueing_s"]["requests"] == sum(p["queueing_s"]["requests"] for p in per)
    assert "  output tokens/s " in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--slo-ttft", "0"], "--slo-ttft must be a finite number of seconds > 0, got 0.0"),
        (["--slo-ttft", "-1"], "--slo-ttft must be a finite number of seconds > 0, got -1.0"),
        (["--slo-tpot", "nan"], "--slo-tpot must be a finite number of seconds > 0, got nan"),
        (["--slo-tpot", "inf"], "--slo-tpot must be a finite number of seconds > 0, got inf"),
        (["--slo-ttft", "2s"], "argument --slo-ttft: invalid float value: '2s'"),
        (["--prompt-only", "--slo-tpot", "0.1"], "--slo-tpot: --prompt-only generates no token after the first"),
    ],
)
def test_bad_objectives_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    try:
        code = main([*QUICK, *args])
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-cache-sim: error: ") and says in lines[0], err
