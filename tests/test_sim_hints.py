"""Continuation hints derived from a workload's future (``sim/_hints.py``) and the simulator's
``--retention-hints ACCURACY`` (issue 37)."""

from __future__ import annotations

import json

import pytest

from kv_cache_manager_v2 import Retention
from kv_cache_manager_v2.sim import SimRequest, main
from kv_cache_manager_v2.sim._hints import (
    DROP_PRIORITY,
    KEEP_PRIORITY,
    PAUSE_FACTOR,
    PAUSE_SLACK_S,
    continuation_pauses,
    hint_retentions,
    keep_priority,
)

SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"]
LOAD = ["--conversations", "12", "--turns", "3", "--system-tokens", "300", "--user-tokens", "100"]


def req(index: int, at_s: float, *segments: tuple[int, int]) -> SimRequest:
    return SimRequest(index, at_s * 1000.0, list(segments), sum(c for _, c in segments), 4, 1 << 31)


def test_a_request_continues_when_a_later_prompt_starts_with_its_prompt() -> None:
    reqs = [
        req(0, 0.0, (0, 100)),
        req(1, 2.0, (0, 150)),  # starts with 0's prompt (a longer run of the same tokens)
        req(2, 3.0, (0, 150), (900, 10)),  # starts with 1's
        req(3, 3.5, (0, 50), (500, 60)),  # shares 50 tokens with the others only
        req(4, 9.0, (0, 50), (500, 60), (700, 5)),  # continues 3
        req(5, 9.5, (0, 100)),  # a re-sent prompt: nothing later
        req(6, 10.0, (7, 3)),
    ]
    assert continuation_pauses(reqs) == [2.0, 1.0, None, 5.5, None, None, None]
    # compared up to their last multiple of 64 (128) tokens: shorter prompts never continue
    assert continuation_pauses(reqs, 64) == [2.0, 1.0, None, 5.5, None, None, None]
    assert continuation_pauses(reqs, 128) == [None, 1.0, None, None, None, None, None]


def test_hints_keep_continued_conversations_for_their_pause_and_drop_the_others() -> None:
    pauses = [2.0, None, 300.0, None]
    hints = hint_retentions(pauses, 1.0)
    assert hints[1] == hints[3] == Retention(DROP_PRIORITY)
    assert hints[0] == Retention(keep_priority(2.0), 2.0 * PAUSE_FACTOR + PAUSE_SLACK_S)
    assert hints[2].duration_s == 300.0 * PAUSE_FACTOR + PAUSE_SLACK_S
    assert KEEP_PRIORITY >= hints[0].priority > hints[2].priority > 35  # sooner back: kept longer
    flipped = hint_retentions(pauses, 0.0)
    assert flipped[0] == flipped[2] == Retention(DROP_PRIORITY)
    assert flipped[1].priority > 35 and flipped[1].duration_s == 300.0 * PAUSE_FACTOR + PAUSE_SLACK_S  # the median
    many = [1.0 if i % 3 else None for i in range(3000)]
    wrong = sum((h.priority == DROP_PRIORITY) != (p is None) for h, p in zip(hint_retentions(many, 0.9, seed=7), many))
    assert 240 <= wrong <= 360  # about 10 %, the same for the same seed
    assert hint_retentions(many, 0.9, seed=7) == hint_retentions(many, 0.9, seed=7)
    with pytest.raises(ValueError, match=r"accuracy must be in \[0, 1\]"):
        hint_retentions(pauses, 1.5)


def test_the_simulator_reports_the_hit_rate_with_and_without_hints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*SMALL, *LOAD, "--output-tokens", "20", "--gpu", "6000tok", "--no-progress"]
    assert main([*args, "--json", "-"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "retention_hints" not in plain
    assert main([*args, "--retention-hints", "1.0", "--json", "-"]) == 0
    rep = json.loads(capsys.readouterr().out)
    h = rep["retention_hints"]
    assert h["accuracy"] == 1.0 and h["token_hit_rate_without"] == plain["hit_rate"]["tokens"]
    assert h["continued_share"] >= 0.4  # conversations of ~3 turns: all but their last continue
    assert h["token_hit_rate"] > h["token_hit_rate_without"]
    assert main([*args, "--retention-hints", "0.5"]) == 0
    assert "retention hints (accuracy 0.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--retention-hints", "1.5"], "--retention-hints must be an accuracy in [0, 1], got 1.5"),
        (["--retention-hints", "x"], "argument --retention-hints: invalid float value: 'x'"),
        (["--retention-hints", "1", "--replicas", "2"], "--retention-hints does not combine with"),
    ],
)
def test_bad_retention_hints_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    try:
        code = main([*SMALL, *LOAD, "--no-progress", *extra])
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
