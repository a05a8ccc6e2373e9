"""The simulator's figures, pinned to the digit: work on its speed (or the manager's) must leave
every figure of the report as it was, in both modes (issue 39: "speed only").

Each setup replays a prefix of the repository's trace under memory pressure (preemptions by
suspend and recompute, eviction; a hybrid model's snapshots; a host tier's offloads and onboards)
and compares a digest of the JSON report without its timing fields. A change that is meant to
change a figure updates the digest here and says why in its commit."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim._report import report_figures

#: the first 80 requests arriving 20x faster than in the trace: the GPU tier cannot hold them all
PRESSURE = ["--requests", "80", "--time-scale", "0.05"]
#: setup -> (kv-cache-sim options, digest of its figures)
SETUPS = {
    "full": ([*PRESSURE, "--gpu", "2GiB"], "402c946eefe5d00b"),
    "hybrid": ([*PRESSURE, "--model", "qwen3-next-80b-a3b", "--gpu", "2GiB"], "a340994d45b86bcf"),
    "host": ([*PRESSURE, "--gpu", "2GiB", "--host", "4GiB"], "adab3534999b41af"),
    #: the host setup with pages moving in no time (as before tier I/O): hit rates and steps as "host"
    "host-free-io": ([*PRESSURE, "--gpu", "2GiB", "--host", "4GiB", "--no-tier-io"], "b0f09a8c65931859"),
}


def digest(report: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(report_figures(report), sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_the_figures_are_as_pinned(setup: str) -> None:
    options, expected = SETUPS[setup]
    cmd = [sys.executable, "-m", "kv_cache_manager_v2.sim", "--trace", TRACE, "--no-progress", "--json", "-", *options]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(done.stdout)
    key = {"hit_rate": report["hit_rate"]["blocks"], "steps": report["replay"]["steps"], **report["preemptions"]}
    assert digest(report) == expected, f"{setup}: the figures changed ({key})"
