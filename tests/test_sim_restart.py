"""kv-cache-sim --restart-at: a restart mid-replay with a persistent disk tier, compared with a replay
without restart (records checked across the restart with --check-data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_cache_manager_v2.sim import main

SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"]
LOAD = ["--conversations", "16", "--turns", "3", "--system-tokens", "300", "--user-tokens", "100"]
QUICK = SMALL + LOAD + ["--output-tokens", "20", "--gpu", "4000tok", "--no-progress"]


def test_a_restart_with_a_persistent_disk_tier_keeps_the_hit_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    code = main(
        [*QUICK, "--host", "4000tok", "--disk", "100000tok", "--disk-path", str(disk), "--restart-at", "0.5"]
        + ["--check-data", "--json", str(out)]
    )
    text, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out.read_text())
    s = doc["restart"]
    assert s["adopted_pages"] > 0 and s["requests_before"] > 0
    assert s["restarted_hit_rate_before"] == s["warm_hit_rate_before"]  # the same replay up to the restart
    assert s["warm_hit_rate_after"] > 0.3
    assert s["after_vs_warm"] >= 0.9
    assert doc["restarted"]["data_check"]["records_checked"] > 0  # every record, across the restart
    assert doc["warm"]["requests"]["finished"] == doc["restarted"]["requests"]["finished"]
    assert "restart at 0.50 of the arrivals" in text and "of warm" in text
    assert list(disk.iterdir()) == []  # both replays' files were made there and removed


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--restart-at", "0.5"], "needs a disk tier"),
        (["--disk", "10000tok", "--restart-at", "1.5"], "fraction in (0, 1)"),
        (["--disk", "10000tok", "--restart-at", "0.5", "--sweep", "gpu=4000tok,8000tok"], "does not combine"),
        (["--disk", "10000tok", "--restart-at", "0.5", "--remote-cluster"], "--replicas 2 or more"),
    ],
)
def test_restart_errors(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    code = main([*QUICK, *args])
    _, err = capsys.readouterr()
    assert code == 2 and says in err and err.count("\n") == 1


def test_restart_recompute_is_named_apart_from_preemption(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 38.18: the requests the restart freed compute their prompts again; that is not a
    preemption, and the report names the two apart."""
    out = tmp_path / "report.json"
    load = ["--conversations", "6", "--turns", "2", "--system-tokens", "300", "--user-tokens", "100"]
    args = [*SMALL, *load, "--output-tokens", "20", "--gpu", "1500tok", "--no-progress"]
    args += ["--disk", "40000tok", "--disk-path", str(tmp_path), "--restart-at", "0.5"]
    args += ["--step-ms", "15"]  # steps long enough that requests are in flight at the restart
    assert main([*args, "--json", str(out)]) == 0
    text, _ = capsys.readouterr()
    rep = json.loads(out.read_text())["restarted"]
    pre, pm = rep["prefill"], rep["preemptions"]
    assert pm["recompute"] == 0 and pre["recomputed_tokens"] == 0
    assert pre["recomputed_after_restart_tokens"] > 0
    prefill = next(line for line in text.splitlines() if "prefill tokens" in line)
    assert f"({pre['recomputed_after_restart_tokens']:,} recomputed after the restart)" in prefill, prefill
    assert "after preemption" not in text
