"""The repository's own trace (traces/multi_turn.jsonl): written by scripts/make_trace.py, byte for
byte; a valid Mooncake-format trace with multi-turn prefix sharing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim._workload import TRACE_BLOCK_TOKENS, load_trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.mode_independent  # (a stdlib-only script)
def test_the_script_writes_the_shipped_file(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_trace.py"), "--out", str(out)], check=True, timeout=120
    )
    assert out.read_bytes() == Path(TRACE).read_bytes()


def test_it_is_a_multi_turn_mooncake_trace() -> None:
    records = [json.loads(line) for line in Path(TRACE).read_text().splitlines()]
    reqs = load_trace(TRACE)  # the simulator's loader accepts every line
    assert len(reqs) == len(records) > 1000
    times = [r["timestamp"] for r in records]
    assert times == sorted(times)
    for r in records:
        assert len(r["hash_ids"]) == -(-r["input_length"] // TRACE_BLOCK_TOKENS)
    # a later turn starts with every full block of an earlier turn's prompt (and goes on)
    earlier: set[tuple[int, ...]] = set()  # full-block prefixes of the prompts so far
    continued = 0
    for r in records:
        ids = r["hash_ids"]
        continued += any(tuple(ids[:k]) in earlier for k in range(4, len(ids)))
        earlier.add(tuple(ids[: r["input_length"] // TRACE_BLOCK_TOKENS]))
    assert continued > len(records) // 3
    # a shared first block (system prompts, popular documents) across many requests
    firsts = [r["hash_ids"][0] for r in records]
    assert max(firsts.count(h) for h in set(firsts)) > 50


def test_the_long_trace_has_twelve_thousand_long_prompts(tmp_path: Path) -> None:
    """``--long``: the size of a real serving trace (the main job's benchmark): 12,024 requests,
    mean prompt about 12k tokens, still a valid multi-turn trace for the simulator."""
    out = tmp_path / "long.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_trace.py"), "--long", "--out", str(out)], check=True, timeout=300
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 12_024
    mean = sum(r["input_length"] for r in records) / len(records)
    assert 11_500 < mean < 13_000, mean
    assert len(load_trace(str(out))) == len(records)
