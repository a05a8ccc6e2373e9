"""The kv-cache-sim command line: one-line errors with exit code 2, the JSON schema, tables, plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim import main
from kv_cache_manager_v2.sim._cli import build_parser
from kv_cache_manager_v2.sim._models import format_bytes
from kv_cache_manager_v2.sim._plot import matplotlib_missing

SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"]
TINY_LOAD = ["--conversations", "6", "--turns", "2", "--system-tokens", "300", "--user-tokens", "100"]
QUICK = SMALL + TINY_LOAD + ["--output-tokens", "20", "--gpu", "20000tok", "--no-progress"]
#: QUICK for a sweep of GPU quotas (which refuses a --gpu it would ignore)
QUICK_SWEEP = SMALL + TINY_LOAD + ["--output-tokens", "20", "--no-progress"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_json_and_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str
) -> tuple[int, dict[str, Any], str, str]:
    """One replay for both reports: ``--json FILE`` writes the JSON and prints the text (the slow
    replays are run once, not once per format); returns the code, the JSON, stdout and stderr."""
    path = tmp_path / "report.json"
    code, out, err = run(capsys, *args, "--json", str(path))
    doc: dict[str, Any] = json.loads(path.read_text()) if code == 0 else {}
    return code, doc, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        code, out, err = run(capsys, *args)
    except SystemExit as e:  # argparse errors
        code = int(e.code or 0)
        out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-cache-sim: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "llama-9b"], "unknown model preset 'llama-9b'; choose one of llama-3-8b"),
        (["--gpu", "1M"], "ambiguous; write 1MiB for bytes or 1Mtok for tokens"),
        (["--gpu", "lots"], "--gpu: cannot read 'lots'"),
        (["--model", "llama-3-70b", "--gpu", "4MiB"], "cannot hold one block of llama-3-70b"),
        (["--tokens-per-block", "48"], "power of two"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--watermark", "1.5"], "--watermark"),
        (["--sweep", "cpu=1,2"], "--sweep 'cpu=1,2': write TIER=V1,V2"),
        (["--sweep", "gpu=1,x"], "--sweep gpu: cannot read 'x'"),
        (["--trace", "/nonexistent/trace.jsonl"], "--trace /nonexistent/trace.jsonl: cannot read it"),
        (["--requests", "-1"], "--requests must be >= 0"),
        (["--eviction-policy", "fifo"], "argument --eviction-policy: invalid choice: 'fifo'"),
        (["--gpu"], "argument --gpu: expected one argument"),
        (["--gpu", "-1GiB"], "--gpu: '-1GiB' is negative"),
        (["--host", "-5"], "--host: '-5' is negative"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    line = one_line_error(capsys, *args, "--no-progress")
    assert says in line, line


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1,\n',
            "line 2: not valid JSON",
        ),
        ("[1, 2]\n", "line 1: expected a JSON object, got list"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}\n', "line 1: missing field 'input_length'"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n', "line 1: 'timestamp' must be"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}\n',
            "'input_length' must be an integer >= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1.5, "hash_ids": [1]}\n',
            "'output_length' must be an integer",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}\n',
            "'hash_ids' must be a list of integers",
        ),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n', "needs 2 hash_ids"),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 99999999, "hash_ids": [1]}\n',
            "output_length 99999999 is above",
        ),
        ("\n\n", "no requests in it"),
    ],
)
def test_malformed_traces_name_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, says: str
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    line = one_line_error(capsys, "--trace", str(path), "--no-progress")
    assert says in line, line
    assert str(path) in line


@pytest.mark.parametrize("tier", ["--host", "--disk"])
def test_lower_tiers_get_their_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path, tier: str) -> None:
    args = [*QUICK, "--gpu", "1500tok", tier, "40000tok"] + (["--disk-path", str(tmp_path)] if tier == "--disk" else [])
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    rep = json.loads(out)
    _check_schema(rep)
    low = rep["tiers"][1]
    assert [t["tier"] for t in rep["tiers"]] == ["gpu", tier[2:]]
    assert low["capacity_tokens"] > 0 and low["offloaded_pages"] > 0
    assert set(rep["hit_rate"]["by_tier"]) == {"gpu", tier[2:]}
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert f"{tier[2:]} 40000tok" in out and f"offloaded to {tier[2:]}" in out and "onboarded" in out, out
    assert f"gpu {rep['hit_rate']['by_tier']['gpu']:.3f} + {tier[2:]}" in out


def test_binary_trace_is_a_user_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n\xff\xfe\x00\n')
    assert "line 2: not UTF-8" in one_line_error(capsys, "--trace", str(path))


def test_errors_through_the_module_entry_point_have_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2.sim", "--model", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kv-cache-sim: error: unknown model preset 'nope'; choose one of llama-3-8b, llama-3-70b, qwen2.5-7b, "
        "qwen3-32b, gpt-oss-20b, gpt-oss-120b, qwen3-next-80b-a3b, nemotron-h-8b, jamba-v0.1, falcon-h1-7b, "
        "granite-4.0-h-small, or custom"
    ]


def test_table_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK)
    assert code == 0, err
    for label in (
        "hit rate (tokens)",
        "hit rate (blocks)",
        "prefill tokens",
        "GPU 20000tok",
        "preemptions",
        "per step",
        "requests/s",
    ):
        assert label in out, out
    assert "prompt blocks)  gpu " in out and "pages: " in out


def _check_schema(rep: dict[str, Any]) -> None:
    assert rep["schema"] == "kv-cache-sim/2"
    assert rep["mode"] in ("compiled", "interpreted")
    assert set(rep) >= {
        "model", "tokens_per_block", "workload", "scheduler", "requests", "hit_rate", "prefill", "decode",
        "tiers", "preemptions", "manager", "manager_cpu", "replay", "data_check", "series", "eviction_policy",
    }  # fmt: skip
    assert 0.0 <= rep["hit_rate"]["tokens"] <= 1.0 and 0.0 <= rep["hit_rate"]["blocks"] <= 1.0
    hit = rep["hit_rate"]
    assert list(hit["by_tier"]) == list(hit["tokens_by_tier"]) == [t["tier"] for t in rep["tiers"]]
    assert abs(sum(hit["by_tier"].values()) - hit["blocks"]) < 1e-9
    assert abs(sum(hit["tokens_by_tier"].values()) - hit["tokens"]) < 1e-9
    tier = rep["tiers"][0]
    assert tier["tier"] == "gpu" and tier["capacity_tokens"] > 0
    assert 0 < tier["peak_used_fraction"] <= tier["peak_occupied_fraction"] <= 1.0
    for t in rep["tiers"]:
        for key in ("offloaded", "onboarded", "dropped"):
            assert isinstance(t[f"{key}_pages"], int) and t[f"{key}_bytes"] >= t[f"{key}_pages"]
        assert t["max_step_onboarded_pages"] <= t["onboarded_pages"] and t["io_errors"] == 0
    assert rep["requests"]["finished"] == rep["workload"]["requests"]
    assert rep["prefill"]["reused_tokens"] + rep["prefill"]["computed_tokens"] >= rep["prefill"]["prompt_tokens"]
    assert rep["manager_cpu"]["per_step_us"]["p50"] <= rep["manager_cpu"]["per_step_us"]["max"]
    s = rep["series"]
    assert len(s["t_s"]) == len(s["gpu_used"]) == len(s["gpu_cached"]) == len(s["hit_rate_tokens"]) > 0
    assert s["t_s"] == sorted(s["t_s"])


def test_json_to_stdout_and_to_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, *QUICK, "--json")
    assert code == 0
    rep = json.loads(out)
    _check_schema(rep)
    assert rep["model"]["name"] == "custom" and rep["tokens_per_block"] == 16
    assert rep["data_check"] is None
    path = tmp_path / "r.json"
    code, out, _ = run(capsys, *QUICK, "--json", str(path), "--check-data")
    assert code == 0 and "hit rate (tokens)" in out and "data check" in out
    rep2 = json.loads(path.read_text())
    _check_schema(rep2)
    assert rep2["data_check"]["records_checked"] > 0
    assert rep2["hit_rate"] == rep["hit_rate"]  # checking data changes nothing the manager decides


def test_trace_replay_through_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 9]},
        {"timestamp": 9, "input_length": 700, "output_length": 4, "hash_ids": [4, 5]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = run(capsys, *SMALL, "--trace", str(path), "--json", "--no-progress", "--check-data")
    assert code == 0
    rep = json.loads(out)
    assert rep["workload"]["source"] == "trace" and rep["requests"]["finished"] == 3
    assert rep["prefill"]["reused_tokens"] == 1024  # the second request reuses blocks 1 and 2


def test_no_reuse_and_prompt_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *QUICK, "--no-reuse", "--prompt-only", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["hit_rate"]["tokens"] == 0.0
    assert rep["decode"]["computed_tokens"] == 0 and rep["decode"]["output_tokens"] == rep["requests"]["finished"]


def test_list_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--list-models")
    assert code == 0 and "gpt-oss-120b" in out and "sliding-window" in out


def test_sweep_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *QUICK_SWEEP, "--sweep", "gpu=4000tok,40000tok")
    assert code == 0
    assert "gpu quota" in out and "4000tok" in out and "40000tok" in out
    code, out, _ = run(capsys, *QUICK_SWEEP, "--sweep", "gpu=4000tok,40000tok", "--json")
    doc = json.loads(out)
    points = doc["sweep"]["points"]
    assert doc["sweep"]["key"] == "gpu" and len(points) == 2
    for rep in points:
        _check_schema(rep)
    assert points[0]["tiers"][0]["capacity_tokens"] < points[1]["tiers"][0]["capacity_tokens"]
    assert points[0]["hit_rate"]["tokens"] <= points[1]["hit_rate"]["tokens"]


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plot_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    one = tmp_path / "one.png"
    code, out, _ = run(capsys, *QUICK, "--plot", str(one))
    assert code == 0 and f"plot written to {one}" in out
    _png(one)
    sweep = tmp_path / "sweep.png"
    code, _, _ = run(capsys, *QUICK_SWEEP, "--sweep", "gpu=4000tok,40000tok", "--plot", str(sweep))
    assert code == 0
    _png(sweep)


def test_plot_without_matplotlib_is_a_user_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    line = one_line_error(capsys, *QUICK, "--plot", str(tmp_path / "x.png"))
    assert "--plot needs matplotlib" in line
    assert not os.path.exists(tmp_path / "x.png")


def test_runs_without_tqdm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    code, out, _ = run(capsys, *QUICK[:-1])  # progress enabled, but no tqdm (and no terminal): plain text
    assert code == 0 and "hit rate (tokens)" in out


def test_progress_bar_on_a_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, *QUICK[:-1])
    assert code == 0 and "hit rate (tokens)" in out
    assert "replay" in err and "req" in err  # tqdm's bar (left behind in the captured stream)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kv_cache_manager_v2.sim ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2.sim", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def cli_error(*args: str, env: dict[str, str] | None = None) -> str:
    """The one stderr line of a refused command line (exit code 2, nothing on stdout, no traceback)."""
    proc = cli(*args, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("kv-cache-sim: error: ") and proc.stdout == "", (proc.stdout, proc.stderr)
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--chunk", "-1"], "--chunk must be >= 0, got -1"),
        (["--disk", "1GiB", "--disk-path", "/nonexistent/dir"], "--disk-path /nonexistent/dir: no such directory"),
        (["--disk", "1GiB", "--disk-path", "{file}"], "--disk-path {file}: not a directory"),
        (["--disk-path", "{dir}"], "--disk-path needs a disk tier: give --disk"),
        (["--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: its directory /nonexistent: no such directory"),
        (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: its directory /nonexistent: no such"),
        (["--json", "{dir}"], "--json {dir}: is a directory"),
        (["--replicas", "2", "--remote-url", "notaurl"], "--remote-url 'notaurl': write redis://HOST:PORT"),
        (["--gpu", "99999999999999999999"], "is more than the 1 EiB a tier can have"),
        (["--gpu", "100000000Mtok"], "'100000000Mtok' of llama-3-8b (128 KiB a token) is more than the 1 EiB"),
        (["--gpu", "-1GiB"], "--gpu: '-1GiB' is negative"),
        (["--gpu", "1000000TiB"], "cannot reserve the pools of --gpu 1000000TiB (not enough memory or address"),
        (["--host", "1KiB"], "--host 1KiB cannot hold one block of llama-3-8b: one block of 32 tokens takes 4MiB"),
        (["--disk", "10tok"], "--disk 10tok cannot hold one block of llama-3-8b: one block of 32 tokens takes 32tok"),
        (["--trace", TRACE, "--seed", "3"], "--seed: for the built-in conversations, which --trace replaces; drop it"),
        (["--trace", TRACE, "--turns", "2", "--rate", "1"], "--turns, --rate: for the built-in conversations"),
        (["--swa-scratch"], "--swa-scratch: llama-3-8b has no sliding-window layers"),
    ],
)
def test_misuse_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    """Each misuse of issue #31, through a real process: one line on stderr, exit code 2, before any replay."""
    (tmp_path / "file").write_text("x")
    subst = {"{file}": str(tmp_path / "file"), "{dir}": str(tmp_path)}
    args = [subst.get(x, x) for x in args]
    for key, value in subst.items():
        says = says.replace(key, value)
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    line = cli_error(*args, "--no-progress")
    assert says in line, line


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_disk_path_where_no_file_can_be_made_names_the_path() -> None:
    line = cli_error("--disk", "1GiB", "--disk-path", "/proc", "--no-progress")
    assert "--disk-path /proc: no room for files there" in line and "lower" not in line, line


def test_a_redis_server_that_does_not_start_is_one_line() -> None:
    line = cli_error("--replicas", "2", "--no-progress", env={"KVCM_REDIS_SERVER": "/bin/false"})
    assert "--replicas: cannot start a private redis-server" in line and "give --remote-url" in line, line


def test_help_tells_each_default_once() -> None:
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        text = formatter._format_action(action)
        assert text.count("(default") <= 1, text
        assert "(default: None)" not in text and "(default: [" not in text, text
    help_text = " ".join(cli("--help").stdout.split())
    assert "--seed SEED built-in: random seed (default: 0)" in help_text
    assert "(default: a temporary one)" in help_text and "a bare number is GiB" in help_text


def test_sweep_counts_rejected_prompts_as_misses(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Small quotas reject the longer requests: every sweep point's hit rates are over the same requests
    (rejected prompts as misses), so they cannot rise because requests left the denominator."""
    quotas = "gpu=600tok,5000tok,40000tok"
    code, out, _ = run(capsys, *QUICK_SWEEP, "--sweep", quotas, "--json")
    assert code == 0
    points = json.loads(out)["sweep"]["points"]
    rejected = [p["requests"]["rejected"] for p in points]
    assert rejected[0] > rejected[-1] == 0 and rejected[0] < points[0]["requests"]["total"], rejected
    every = {p["prefill"]["prompt_tokens"] + p["requests"]["rejected_prompt_tokens"] for p in points}
    assert len(every) == 1  # one denominator
    for p in points:
        hit = p["hit_rate"]
        assert hit["tokens_all_requests"] == pytest.approx(p["prefill"]["reused_tokens"] / every.copy().pop())
        assert hit["tokens_all_requests"] <= hit["tokens"] and hit["blocks_all_requests"] <= hit["blocks"]
        assert (hit["tokens_all_requests"] == hit["tokens"]) == (p["requests"]["rejected"] == 0)
    all_requests = [p["hit_rate"]["tokens_all_requests"] for p in points]
    assert all_requests == sorted(all_requests), all_requests
    code, out, _ = run(capsys, *QUICK_SWEEP, "--sweep", quotas)
    assert code == 0
    head, *rows = out.splitlines()[1:6]
    assert "rejected" in head and "admitted" in head and "time" in head
    for row, p in zip(rows, points):
        assert f"{p['hit_rate']['tokens_all_requests']:.3f}" in row and f"{p['requests']['rejected']:,}" in row
    assert "warning: requests rejected (too long for the GPU tier) at gpu 600tok\n" in out
    code, out, _ = run(capsys, *QUICK, "--gpu", "600tok")
    assert code == 0 and "over all requests" in out and "rejected prompts count as misses" in out
    code, out, _ = run(capsys, *QUICK, "--gpu", "600tok", "--json")
    admit = json.loads(out)["load"]["gpu_quota_admitting_all"]
    assert admit == "1.1ktok"  # the longest request: 993 tokens + a block, rounded up
    code, out, _ = run(capsys, *QUICK, "--gpu", admit, "--json")
    assert code == 0 and json.loads(out)["requests"]["rejected"] == 0


OVERLOAD = [*SMALL, "--conversations", "40", "--turns", "2", "--system-tokens", "200", "--user-tokens", "200"]
OVERLOAD += ["--output-tokens", "100", "--rate", "20", "--tokens-per-s", "1e7", "--no-progress"]


def test_overload_warning_suggests_a_quota_that_keeps_up(capsys: pytest.CaptureFixture[str]) -> None:
    """Many arrivals on a small GPU tier: requests queue, the replay takes far longer than the workload's
    span, and the warning suggests a quota; with that quota the engine keeps up."""
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok", "--json")
    assert code == 0
    load = json.loads(out)["load"]
    assert load["overloaded"] and load["simulated_s"] > 1.2 * load["trace_span_s"] > 0
    assert load["wait_s"]["p99"] > 1.0 and load["suggested_gpu_quota"].endswith("tok")
    assert any("overloaded" in w and f"--gpu {load['suggested_gpu_quota']}" in w for w in load["warnings"])
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok")
    assert code == 0 and "warning: the simulated engine is overloaded" in out and ", overloaded)" in out
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", load["suggested_gpu_quota"], "--json")
    fit = json.loads(out)["load"]
    assert code == 0 and not fit["overloaded"] and fit["warnings"] == [] and fit["suggested_gpu_quota"] is None
    assert fit["wait_s"]["p99"] < load["wait_s"]["p99"]
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok", "--time-scale", "0", "--json")
    assert not json.loads(out)["load"]["overloaded"]  # everything at once: no span to keep up with


def test_sweep_plot_with_rejections_and_overload(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    code, out, _ = run(capsys, *OVERLOAD, "--sweep", "gpu=400tok,1000tok,20000tok", "--plot", str(path))
    assert code == 0 and "overloaded at gpu" in out
    _png(path)


# ---------------------------------------------------------------- hybrid models (recurrent layers)
HYBRID = ["--model", "qwen3-next-80b-a3b", "--trace", TRACE, "--requests", "120", "--no-progress"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "jamba-v0.1", "--ssm-reuse-interval", "100"], "--ssm-reuse-interval must be a positive multiple of --tokens-per-block (32), got 100"),
        (["--model", "jamba-v0.1", "--ssm-reuse-interval", "-64"], "--ssm-reuse-interval must be a positive multiple of --tokens-per-block (32), got -64"),
        (["--ssm-reuse-interval", "512"], "--ssm-reuse-interval: llama-3-8b has no recurrent layers"),
        (["--model", "jamba-v0.1", "--ssm-lower-tier-interval", "100"], "--ssm-lower-tier-interval must be a positive multiple of --tokens-per-block (32), got 100"),
        (["--ssm-lower-tier-interval", "2048"], "--ssm-lower-tier-interval: llama-3-8b has no recurrent layers"),
        (["--state-dtype", "fp32"], "--state-dtype: llama-3-8b has no recurrent layers"),
        (["--model", "nemotron-h-8b", "--state-dtype", "fp64"], "unknown --state-dtype 'fp64'"),
        (["--model", "nemotron-h-8b", "--layers", "8"], "a hybrid preset keeps its layer count"),
        (["--model", "nemotron-h-8b", "--check-data"], "--check-data checks KV records per token; nemotron-h-8b has recurrent layers"),
        (["--model", "falcon-h1-7b", "--sweep", "ssm-interval=512,often"], "--sweep ssm-interval: 'often' is not a number of tokens"),
        (["--model", "falcon-h1-7b", "--sweep", "ssm-interval=48"], "--sweep ssm-interval must be a positive multiple of --tokens-per-block (32), got 48"),
        (["--sweep", "ssm-interval=512"], "--sweep ssm-interval: llama-3-8b has no recurrent layers"),
        (["--model", "jamba-v0.1", "--sweep", "ssm-interval=512", "--ssm-reuse-interval", "64"], "drop --ssm-reuse-interval"),
        (["--model", "granite-4.0-h-small", "--gpu", "64MiB"], "cannot hold one block of granite-4.0-h-small"),
        (["--model", "jamba-v0.1", "--ssm-snapshot-policy", "often"], "--ssm-snapshot-policy: 'often' is not a snapshot policy; choose from interval, branch, auto"),
        (["--model", "jamba-v0.1", "--sweep", "ssm-policy=auto,kv,often"], "--sweep ssm-policy: 'often' is not a snapshot policy; choose from interval, branch, auto, kv"),
        (["--ssm-snapshot-policy", "branch"], "snapshot policies: llama-3-8b has no recurrent layers"),
        (["--model", "jamba-v0.1", "--sweep", "ssm-policy=auto", "--ssm-snapshot-policy", "branch"], "sets the policy of each replay"),
    ],
)  # fmt: skip
def test_hybrid_option_errors_are_one_line_through_the_entry_point(args: list[str], says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2.sim", *args, "--conversations", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kv-cache-sim: error: "), proc.stderr
    assert says in lines[0], lines[0]


def test_hybrid_replay_reports_state_memory_and_snapshots(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, rep, out, err = run_json_and_text(capsys, tmp_path, *HYBRID, "--ssm-reuse-interval", "256")
    assert code == 0, err
    m = rep["model"]
    # 36 gated delta-nets of conv 3 x 8192 and ssm 32 x 128 x 128, bf16
    assert (m["attention_layers"], m["recurrent_layers"]) == (12, 36)
    assert m["state_bytes_per_request"] == 36 * 2 * (3 * 8192 + 32 * 128 * 128)
    snap = rep["snapshots"]
    assert snap["interval"] == 256 and snap["taken"] > 0 and snap["reused"] > 0
    assert 0 < rep["hit_rate"]["tokens"] < 1
    # state bytes by tier at the end: the snapshots still kept (one state-sized page each)
    kept = sum(t["snapshot_bytes_at_end"] for t in rep["tiers"])
    assert kept == (snap["taken"] - snap["evicted"]) * m["state_bytes_per_request"] > 0
    assert "recurrent state" in out and "37.7 MiB per request" in out and "every 256 tokens" in out
    assert "in state snapshots)" in out
    code, out, _ = run(capsys, *QUICK, "--json")
    assert json.loads(out)["snapshots"] is None  # attention-only models have none


def test_ssm_lower_tier_interval_spaces_the_host_snapshots(capsys: pytest.CaptureFixture[str]) -> None:
    """``--ssm-lower-tier-interval`` reaches the manager: with a host tier, "auto" takes a quarter
    of the interval snapshots at 2048 tokens that it takes at 512 (the trace's prompts are long)."""
    taken = []
    for spacing in ("512", "2048"):
        code, out, err = run(
            capsys, *HYBRID[:-3], "--requests", "30", "--host", "64GiB", "--ssm-lower-tier-interval", spacing, "--json"
        )
        assert code == 0, err
        taken.append(json.loads(out)["snapshots"]["snapshots_interval"])
    assert taken[0] > 3 * taken[1] > 0


@pytest.mark.slow  # (a sweep: several full replays; scripts/test.sh quick skips it)
def test_hybrid_interval_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = [*HYBRID, "--gpu", "40GiB", "--sweep", "ssm-interval=64,1024,prompt,kv"]
    code, doc, out, err = run_json_and_text(capsys, tmp_path, *args)
    assert code == 0, err
    points = doc["sweep"]["points"]
    assert [p["sweep_point"] for p in points] == ["64", "1024", "prompt", "kv"]
    hits = [p["hit_rate"]["tokens"] for p in points]
    snaps = [p["snapshots"] for p in points]
    assert snaps[3] is None and points[3]["model"]["recurrent_layers"] == 0
    # denser snapshots: more of them; at prompt ends only, at most one per request
    assert snaps[0]["taken"] > snaps[1]["taken"] > snaps[2]["taken"] > 0
    assert snaps[2]["taken"] <= 120 and snaps[2]["interval"] >= 1 << 30
    # prompt ends (rounded down to a block) are almost never multiples of the 2048-token chunks: the
    # replay takes these snapshots because the adapter cuts each prefill chunk at the next one
    assert snaps[2]["taken"] >= 108
    # the attention layers alone bound every hybrid match
    assert hits[3] >= max(hits[:3]), hits
    # this trace shares prefixes at multiples of 512 tokens, never at a prompt end: prompt-end
    # snapshots alone reuse next to nothing
    assert hits[1] > 10 * hits[2], hits
    # a snapshot of 37.7 MiB every 64 tokens overflows the state pool (the default split counts one
    # snapshot per request): most are evicted, matches shorten
    assert snaps[0]["evicted"] > 10 * snaps[1]["evicted"] and hits[0] < hits[1], (snaps, hits)
    assert "ssm-interval" in out and "prompt" in out and "without any snapshot" in out


# ---------------------------------------------------------------- issue 38: inputs that hung, crashed or grew without bound
#: the address space a refused command line may use: far below what the runaway inputs took
MEMORY_LIMIT = 2 << 30


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def bounded_cli_error(*args: str, timeout: float = 120.0) -> str:
    """``cli_error`` under a 2 GiB address-space limit and a time limit (a hang fails as a timeout)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2.sim", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("kv-cache-sim: error: ") and proc.stdout == "", (proc.stdout, proc.stderr)
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # 14: NaN looped forever, inf divided by zero or reported "inf s simulated"
        (["--time-scale", "nan"], "--time-scale must be a finite number >= 0, got nan"),
        (["--step-ms", "nan"], "--step-ms must be in [0, 3600000] (an hour), got nan"),
        (["--step-ms", "inf"], "--step-ms must be in [0, 3600000] (an hour), got inf"),
        (["--tokens-per-s", "inf"], "--tokens-per-s must be a finite number > 0, got inf"),
        (["--think-s", "inf", "--turns", "2"], "--think-s must be a finite number >= 0, got inf"),
        (["--rate", "nan"], "--rate must be a finite number > 0"),
        # 15: memory without bound
        (["--layers", "1000000000"], "--layers must be at most 1,024, got 1,000,000,000"),
        (["--kv-heads", "100000000"], "--kv-heads must be at most 1,024"),
        (["--replicas", "1000000"], "--replicas must be in [1, 64]"),
        (["--trace", "/dev/zero"], "/dev/zero line 1: longer than 4 MiB; is this a JSON-lines trace?"),
        (["--turns", "1e9"], "--turns must be in [1, 1,000]"),
        (["--conversations", "100000", "--turns", "100"], "the built-in workload is too large to hold in memory"),
        # 17: ignored or meaningless options
        (["--sweep", "gpu=1,2", "--gpu", "4"], "--sweep gpu sets the gpu quota of each replay: drop --gpu"),
        (["--sweep", "host=1,2", "--host", "4"], "--sweep host sets the host quota of each replay: drop --host"),
        (["--window", "-1"], "--window must be >= 0 (0: no sliding-window layers), got -1"),
        (["--model", "gpt-oss-20b", "--swa-every", "0"], "--swa-every must be >= 1 (1: every layer slides), got 0"),
        (["--swa-every", "2"], "--swa-every: llama-3-8b has no sliding window; give --window too"),
        (["--model", "jamba-v0.1", "--ssm-reuse-interval", str(2**70)], "--ssm-reuse-interval must be at most"),
        (["--think-s", "nan"], "--think-s must be a finite number >= 0, got nan"),
        # 20: abbreviations, a bare number of GiB far beyond any tier
        (["--hos", "32GiB"], "unrecognized arguments: --hos 32GiB"),
        (["--gpu", "1000000"], "--gpu: '1000000' is 977 TiB (a bare number is GiB); write the unit"),
        # issue 37: hints sweep and pins
        (["--sweep", "hints=0.9,nan"], "--sweep hints: 'nan' is not an accuracy in [0, 1]"),
        (["--pin-system-prompts", "-3"], "--pin-system-prompts must be >= 1"),
    ],
)
def test_runaway_and_meaningless_inputs_are_one_line_in_bounded_time_and_memory(args: list[str], says: str) -> None:
    line = bounded_cli_error(*args)
    assert says in line, line


def test_trace_lines_whose_hash_ids_cover_more_than_the_input_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}\n')
    line = bounded_cli_error("--trace", str(path))
    assert f"{path} line 1: input_length 10 needs 1 hash_ids (512 tokens each), got 3" in line, line


def test_list_models_keeps_names_and_descriptions_apart(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--list-models")
    assert code == 0
    rows = out.splitlines()
    column = rows[0].index("llama-3-8b (")
    for row in rows:
        name = row.split()[0]
        assert row[:column].rstrip() == name and row[column - 2 : column] == "  ", row


def test_each_tier_reports_how_full_it_got_and_what_it_keeps(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 38.19: a host tier that pages were onboarded from reported "peak in use 0 B (0%)" (what
    requests held there), and the host sweep's "peak use" column was the GPU's. Each tier now says how
    full it got, how much of that requests held, and the reusable blocks it kept; the sweep shows the
    swept tier's fill beside the GPU's share held by requests."""
    more = ["--conversations", "30", "--turns", "3"]
    args = [*QUICK_SWEEP, *more, "--gpu", "1500tok", "--host", "3000tok"]
    code, doc, out, err = run_json_and_text(capsys, tmp_path, *args)
    assert code == 0, err
    host = doc["tiers"][1]
    assert host["onboarded_pages"] > 0 and host["dropped_pages"] > 0
    assert host["peak_occupied_fraction"] == 1.0  # it dropped pages: it was full
    assert 0 < host["reusable_bytes_at_end"] <= host["peak_occupied_bytes"] <= host["capacity_bytes"]
    row = next(line for line in out.splitlines() if line.startswith("  host 3000tok"))
    assert f"filled up to {format_bytes(host['peak_occupied_bytes'])} (100%)" in row, row
    assert f"held by suspended requests up to {format_bytes(host['peak_used_bytes'])}" in row, row
    assert f"{format_bytes(host['reusable_bytes_at_end'])} of reusable blocks at the end" in row, row
    sweep = [*QUICK_SWEEP, *more, "--gpu", "1500tok", "--sweep", "host=3000tok,40000tok"]
    code, doc, out, _ = run_json_and_text(capsys, tmp_path, *sweep)
    points = doc["sweep"]["points"]
    head, *rows = out.splitlines()[1:4]
    assert head.split()[10:12] == ["held", "filled"], head  # after ttft(p50), ttft(p90) (issue 48)
    for line, p in zip(rows, points):
        held, filled = line.split()[9:11]
        assert (
            held == f"{p['tiers'][0]['peak_used_fraction']:.0%}"
            and filled == f"{p['tiers'][1]['peak_occupied_fraction']:.0%}"
        )
    assert [line.split()[10] for line in rows] == ["100%", f"{points[1]['tiers'][1]['peak_occupied_fraction']:.0%}"]


def _figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The matplotlib figures --plot saves, kept for inspection (with the renderer that drew them)."""
    from matplotlib.figure import Figure

    figs: list[Any] = []
    real = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.saved_by = self.canvas.get_renderer()
        figs.append(self)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figs


def test_sweep_plot_ticks_labels_and_time_panel(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38.22: capacity ticks in M (not "1,000k"), the end points' labels inside the figure,
    and with --time-scale 0 (no span to compare with) the load panel draws the simulated time."""
    pytest.importorskip("matplotlib")
    figs = _figures(monkeypatch)
    path = tmp_path / "sweep.png"
    sweep = "gpu=400tok,1000tok,1000000tok,100000000tok"
    code, out, _ = run(capsys, *OVERLOAD, "--sweep", sweep, "--time-scale", "0", "--plot", str(path))
    assert code == 0, out
    _png(path)
    (fig,) = figs
    ax, ax_load = fig.axes[0], fig.axes[1]
    assert [t.get_text() for t in ax_load.get_xticklabels()] == ["400", "992", "1M", "100M"]
    renderer = fig.saved_by
    labels = [t for t in ax.texts if "tok" in t.get_text()]
    assert len(labels) == 4 and any("rejected" in t.get_text() for t in labels)
    for text in labels:
        box = text.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (text.get_text(), box, fig.bbox)
    (line,) = ax_load.get_lines()
    assert min(line.get_ydata()) > 0  # seconds simulated, not a ratio to a span of 0


@pytest.mark.slow  # (a sweep: several full replays; scripts/test.sh quick skips it)
def test_interval_sweep_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38.21: --sweep ssm-interval --plot draws hit rate and snapshots taken per interval, and
    the attention-only bound (kv) as a line."""
    pytest.importorskip("matplotlib")
    figs = _figures(monkeypatch)
    path = tmp_path / "ssm.png"
    args = ["--model", "qwen3-next-80b-a3b", "--trace", TRACE, "--requests", "40", "--no-progress", "--gpu", "40GiB"]
    args += ["--sweep", "ssm-interval=64,1024,prompt,kv"]
    code, doc, out, err = run_json_and_text(capsys, tmp_path, *args, "--plot", str(path))
    assert code == 0 and f"plot written to {path}" in out, err
    points = doc["sweep"]["points"]
    _png(path)
    (fig,) = figs
    ax, ttft, snaps = fig.axes  # (the second: each point's TTFT CDF)
    assert len(ttft.get_lines()) >= len(points)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "1024", "prompt"]
    hit, bound = ax.get_lines()
    assert list(hit.get_ydata()) == [p["hit_rate"]["tokens_all_requests"] for p in points[:3]]
    assert list(bound.get_ydata()) == [points[3]["hit_rate"]["tokens_all_requests"]] * 2
    assert list(snaps.get_lines()[0].get_ydata()) == [p["snapshots"]["taken"] for p in points[:3]]


@pytest.mark.slow  # (a sweep: several full replays; scripts/test.sh quick skips it)
def test_hybrid_snapshot_policy_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--sweep ssm-policy: one replay per policy beside the attention-only bound of the same run;
    snapshots by kind; "branch" takes no interval snapshot, "auto" takes both kinds."""
    args = [*HYBRID, "--gpu", "40GiB", "--sweep", "ssm-policy=interval,branch,auto,kv"]
    code, doc, out, err = run_json_and_text(capsys, tmp_path, *args)
    assert code == 0, err
    points = doc["sweep"]["points"]
    assert [p["sweep_point"] for p in points] == ["interval", "branch", "auto", "kv"]
    snaps = [p["snapshots"] for p in points]
    hits = [p["hit_rate"]["tokens"] for p in points]
    assert snaps[3] is None and hits[3] >= max(hits[:3]), hits
    assert snaps[0]["snapshots_interval"] > 0 and snaps[0]["snapshots_branch"] == snaps[0]["snapshots_demand"] == 0
    assert snaps[1]["snapshots_interval"] == 0 and snaps[1]["snapshots_last"] > 0
    assert snaps[2]["snapshots_interval"] > 0 and snaps[2]["snapshots_branch"] + snaps[2]["snapshots_demand"] > 0
    for snap in snaps[:3]:
        assert snap["taken"] == sum(snap[f"snapshots_{k}"] for k in ("interval", "branch", "last", "demand"))
        assert snap["evicted"] >= snap["snapshots_evicted_unused"]
        assert snap["attention_matched_tokens"] > 0
    # (auto's interval snapshots go first under pressure: on this sample, where prompt ends are never
    # shared, that costs a little; see README for the traces where it gains)
    assert hits[2] >= 0.9 * hits[0], hits
    assert "bound" in out and "ratio" in out and "1.00" in out
    code, out, _ = run(capsys, *HYBRID, "--ssm-snapshot-policy", "branch")
    assert code == 0 and "branch: at branch points" in out and "snapshot kinds" in out and "0 interval" in out


# ---------------------------------------------------------------- issue 47: empty sweeps, ignored options, bounds
HYBRID_TINY = ["--model", "jamba-v0.1", "--conversations", "2", "--turns", "1", "--no-progress"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # 16: an empty sweep was an IndexError traceback (hints: exit 0 with no sweep point)
        *[([*QUICK_SWEEP, "--sweep", f"{key}=,,,"], f"--sweep '{key}=,,,': no value") for key in ("gpu", "host", "disk", "hints")],
        *[([*HYBRID_TINY, "--sweep", f"{key}=, ,"], f"--sweep '{key}=, ,': no value") for key in ("ssm-interval", "ssm-policy")],
        # 17: options a run would ignore
        ([*HYBRID_TINY, "--ssm-lower-tier-interval", "2048"], "this run has none: give --host or --disk, or drop --ssm-lower-tier-interval"),
        ([*HYBRID_TINY, "--ssm-lower-tier-interval", "2048", "--sweep", "host=0"], "give --host or --disk"),
        ([*HYBRID_TINY, "--host", "8GiB", "--ssm-lower-tier-interval", "2048", "--ssm-snapshot-policy", "interval"], "applies to policy auto only, and this run replays interval: drop --ssm-lower-tier-interval"),
        ([*HYBRID_TINY, "--host", "8GiB", "--ssm-lower-tier-interval", "2048", "--ssm-snapshot-policy", "branch"], "this run replays branch: drop --ssm-lower-tier-interval"),
        ([*HYBRID_TINY, "--disk", "8GiB", "--ssm-lower-tier-interval", "2048", "--sweep", "ssm-policy=interval,branch,kv"], "this run replays interval, branch, kv: drop"),
        ([*HYBRID_TINY, "--host", "8GiB", "--ssm-lower-tier-interval", "2048", "--sweep", "ssm-interval=512,1024"], "this run replays interval: drop"),
        ([*HYBRID_TINY, "--disk", "8GiB", "--restart-at", "0.5", "--ssm-lower-tier-interval", "2048"], "--restart-at and --replicas replay with the manager's snapshot defaults; drop --ssm-lower-tier-interval"),
        ([*HYBRID_TINY, "--replicas", "2", "--ssm-snapshot-policy", "branch"], "snapshot defaults; drop --ssm-snapshot-policy"),
        ([*QUICK, "--metrics-file", "/nonexistent/metrics.prom", "--retention-hints", "0.9"], "--metrics-port/--metrics-file report one replay: no --sweep, --replicas, --restart-at, --retention-hints"),
        # 18: a custom model without its shape took llama-3-8b's silently
        (["--model", "custom", "--layers", "2"], "--model custom needs its shape: give --kv-heads, --head-dim (or choose a preset)"),
        (["--model", "custom"], "give --layers, --kv-heads, --head-dim"),
        # 18: arrivals beyond a year of simulated time
        ([*QUICK, "--rate", "1e-9"], "beyond a year of simulated time: raise --rate, or lower --think-s or --time-scale"),
        # 19: a second --sweep replaced the first
        ([*QUICK_SWEEP, "--sweep", "gpu=1,2", "--sweep", "host=1,2"], "--sweep given 2 times ('gpu=1,2', 'host=1,2'): a run sweeps one key"),
        ([*QUICK_SWEEP, "--sweep", "gpu=0,8GiB"], "--sweep gpu: '0' is less than one byte"),
    ],
)  # fmt: skip
def test_empty_sweeps_and_ignored_options_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    line = one_line_error(capsys, *args)
    assert says in line, line


@pytest.mark.parametrize(
    ("timestamp", "scale", "says"),
    [
        ("1e300", "1", "line 2: 'timestamp' must be a number in [0, 31,536,000,000] (milliseconds from the trace's start"),
        ("NaN", "1", "line 2: 'timestamp' must be a number in [0, 31,536,000,000]"),
        ("1000000000", "1000", "the last request arrives 1,000,000,000 s into the replay, beyond a year of simulated time: lower --time-scale"),
    ],
)  # fmt: skip
def test_trace_timestamps_beyond_a_year_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, timestamp: str, scale: str, says: str
) -> None:
    """Issue 47.18: a timestamp of 1e300 ms was replayed and reported as "1e297 s simulated"."""
    path = tmp_path / "trace.jsonl"
    first = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    path.write_text(first + first.replace('"timestamp": 0', f'"timestamp": {timestamp}'))
    line = one_line_error(capsys, *SMALL, "--trace", str(path), "--time-scale", scale, "--no-progress")
    assert says in line, line


def test_a_host_or_disk_sweep_has_a_point_without_the_tier(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47.19: ``--sweep host=0,...`` was refused, so a host sweep had no "no host" row; now 0
    is a point without that tier (in the table, the JSON and the plot)."""
    args = [*QUICK_SWEEP, "--gpu", "1500tok", "--sweep", "host=0,40000tok"]
    plot = []
    if matplotlib_missing() is None:
        figs = _figures(monkeypatch)
        plot = ["--plot", str(tmp_path / "host.png")]
    code, doc, out, err = run_json_and_text(capsys, tmp_path, *args, *plot)
    assert code == 0, err
    points = doc["sweep"]["points"]
    assert [[t["tier"] for t in p["tiers"]] for p in points] == [["gpu"], ["gpu", "host"]]
    assert points[0]["hit_rate"]["tokens"] < points[1]["hit_rate"]["tokens"]
    rows = out.splitlines()[2:4]
    assert rows[0].split()[:3] == ["0", "0", "lru"] and rows[0].split()[10] == "-", rows
    assert rows[1].split()[0] == "40000tok", rows
    if plot:
        (fig,) = figs
        assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["0", "40k"]
    # a disk sweep beside a host tier: its 0 point keeps the host tier
    code, doc, out, err = run_json_and_text(
        capsys, tmp_path, *QUICK_SWEEP, "--gpu", "1500tok", "--host", "3000tok", "--sweep", "disk=0,40000tok"
    )
    assert code == 0, err
    points = doc["sweep"]["points"]
    assert [[t["tier"] for t in p["tiers"]] for p in points] == [["gpu", "host"], ["gpu", "host", "disk"]]
    assert out.splitlines()[2].split()[:2] == ["0", "0"]


def test_overload_advice_accounts_for_a_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 47.20: the advice was the same with or without a host tier, and the JSON suggested a GPU
    quota where the run kept up. The suggestion (every request in flight, no reuse: an upper bound)
    comes only with an overload; with a host tier, whose reuse may keep up with less, a sweep from
    this quota to the bound too."""
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok", "--host", "4000tok", "--json")
    assert code == 0
    load = json.loads(out)["load"]
    assert load["overloaded"] and load["suggested_gpu_quota"] == "19ktok"
    assert load["suggested_gpu_sweep"] == "gpu=1000tok,4.3ktok,19ktok"
    assert any(
        "--gpu 19ktok holds them all even without reuse; with --host 4000tok reusing blocks less may keep up: "
        "--sweep gpu=1000tok,4.3ktok,19ktok --host 4000tok finds how much" in w
        for w in load["warnings"]
    ), load["warnings"]
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok", "--json")
    load = json.loads(out)["load"]
    assert load["overloaded"] and load["suggested_gpu_quota"] == "19ktok" and load["suggested_gpu_sweep"] is None
    assert not any("reusing blocks" in w for w in load["warnings"])
    # keeping up (everything at once: no span), nothing is suggested though 19ktok would hold more
    code, out, _ = run(capsys, *OVERLOAD, "--gpu", "1000tok", "--host", "4000tok", "--time-scale", "0", "--json")
    load = json.loads(out)["load"]
    assert not load["overloaded"] and load["suggested_gpu_quota"] is None and load["suggested_gpu_sweep"] is None


@pytest.mark.parametrize(("signal_exc", "code"), [("sigterm", 143), ("ctrl-c", 130)])
def test_a_run_cut_short_exits_as_interrupted_even_where_its_clean_up_raised(
    monkeypatch: pytest.MonkeyPatch, signal_exc: str, code: int
) -> None:
    """The signal lands inside a manager call; the adapter's clean-up then meets the manager still
    in that call (LogicError). The exit code is still the interruption's, not an error's."""
    from kv_cache_manager_v2 import LogicError
    from kv_cache_manager_v2.sim import _cli
    from kv_cache_manager_v2.sim._signals import Terminated

    def close() -> None:  # (``kv.close()`` while the interrupted call still holds the manager)
        raise LogicError("close() was called while another call into this manager is in progress")

    def cut_short(*args: Any, **kwargs: Any) -> int:
        try:
            raise Terminated if signal_exc == "sigterm" else KeyboardInterrupt
        except BaseException:
            close()  # the adapter's clean-up, as in ``prepare_resources``
            raise

    def failing(*args: Any, **kwargs: Any) -> int:
        close()
        return 0

    monkeypatch.setattr(_cli, "run_replays", cut_short)
    assert main(["--conversations", "2", "--no-progress"]) == code
    monkeypatch.setattr(_cli, "run_replays", failing)
    with pytest.raises(LogicError):  # an error of its own still surfaces
        main(["--conversations", "2", "--no-progress"])
