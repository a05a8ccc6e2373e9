"""Continuation hints derived from a workload's future (``sim/_hints.py``) and the simulator's
``--retention-hints ACCURACY`` (issue 37)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kv_cache_manager_v2 import Retention
from kv_cache_manager_v2.sim import SimRequest, main
from kv_cache_manager_v2.sim._hints import (
    DROP_PRIORITY,
    KEEP_PRIORITY,
    PAUSE_FACTOR,
    PAUSE_SLACK_S,
    SessionReturns,
    assign_sessions,
    hint_retentions,
    keep_priority,
    kept_prefix,
    pin_threshold,
    session_hints,
    with_reasoning_hints,
)
from kv_cache_manager_v2.sim._models import ModelShape, TierSpec
from kv_cache_manager_v2.sim._replay_types import SchedulerOptions
from kv_cache_manager_v2.sim._run import simulate
from kv_cache_manager_v2.sim._sessions import (
    continuation_pauses,
    continuers,
    conversations,
    document_sessions,
    session_ids,
    session_prefixes,
    session_templates,
    shared_prefixes,
    system_prompts,
)
from kv_cache_manager_v2.sim._workload import (
    TRACE_BLOCK_TOKENS,
    ConversationParams,
    generate_conversations,
    mark_reasoning,
    segments_of_blocks,
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


def test_hints_keep_continued_conversations_for_their_pause_and_leave_the_others() -> None:
    pauses = [2.0, None, 300.0, None]
    assert hint_retentions(pauses, 1.0)[1::2] == [None, None]  # not continued: no hint
    hints = hint_retentions(pauses, 1.0, drop=True)
    assert hints[1] == hints[3] == Retention(DROP_PRIORITY)
    assert hints[0] == Retention(keep_priority(2.0), 2.0 * PAUSE_FACTOR + PAUSE_SLACK_S)
    assert hints[2].duration_s == 300.0 * PAUSE_FACTOR + PAUSE_SLACK_S
    assert KEEP_PRIORITY >= hints[0].priority > hints[2].priority > 35  # sooner back: kept longer
    flipped = hint_retentions(pauses, 0.0, drop=True)
    assert flipped[0] == flipped[2] == Retention(DROP_PRIORITY)
    assert flipped[1].priority > 35 and flipped[1].duration_s == 300.0 * PAUSE_FACTOR + PAUSE_SLACK_S  # the median
    many = [1.0 if i % 3 else None for i in range(3000)]
    wrong = sum((h is None) != (p is None) for h, p in zip(hint_retentions(many, 0.9, seed=7), many))
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
    # the hinted replay's time to first token, beside the report's own (without hints): more
    # reuse, less prefill, never a later first token on average here
    assert h["ttft_s"]["requests"] == plain["latency"]["ttft_s"]["requests"]
    assert 0.0 < h["ttft_s"]["mean"] <= plain["latency"]["ttft_s"]["mean"]
    assert main([*args, "--retention-hints", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "retention hints (accuracy 0.5" in text and "time to first token with them: mean " in text


def test_the_hints_seed_draws_which_hints_are_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    """``--hints-seed``: other wrong hints, another hinted replay; the replay without them the same."""
    args = [*SMALL, *LOAD, "--output-tokens", "20", "--gpu", "1500tok", "--no-progress", "--retention-hints", "0.5"]
    reports = []
    for seed in ([], ["--hints-seed", "0"], ["--hints-seed", "2"]):
        assert main([*args, *seed, "--json", "-"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    default, zero, other = reports
    assert [r["retention_hints"]["seed"] for r in reports] == [0, 0, 2]
    assert default["retention_hints"] == zero["retention_hints"]
    assert other["hit_rate"] == default["hit_rate"] and other["latency"] == default["latency"]
    assert other["retention_hints"]["token_hit_rate"] != default["retention_hints"]["token_hit_rate"]


def test_reasoning_is_left_out_of_the_next_turn_and_hinted_over_its_token_range() -> None:
    p = ConversationParams(conversations=3, turns=3.0, seed=1)
    plain = generate_conversations(p)
    reqs = generate_conversations(p, 0, 0.4)
    assert [r.arrival_ms for r in reqs] == [r.arrival_ms for r in plain]  # the same conversations
    for r in reqs:
        assert r.reasoning == int(0.4 * r.output_length)
        if r.after >= 0:  # the previous turn's answer without its reasoning
            prev = reqs[r.after]
            answer = (prev.output_base + prev.reasoning, prev.output_length - prev.reasoning)
            assert answer in r.prompt_segments and (prev.output_base, prev.output_length) not in r.prompt_segments
    assert continuers(reqs) == continuers(plain)  # each turn still starts with the previous prompt
    hints = with_reasoning_hints(reqs[:2], [Retention(90, 5.0), None])
    r0, r1 = reqs[0], reqs[1]
    assert hints[0] == [
        Retention(90, 5.0, 0, r0.prompt_length),
        Retention(DROP_PRIORITY, None, r0.prompt_length, r0.prompt_length + r0.reasoning),
    ]
    assert hints[1] == [Retention(DROP_PRIORITY, None, r1.prompt_length, r1.prompt_length + r1.reasoning)]
    mark_reasoning(plain, 0.25)
    assert all(r.reasoning == int(0.25 * r.output_length) for r in plain)


def test_sessions_are_the_conversations_and_their_last_turns_end_them() -> None:
    reqs = [
        req(0, 0.0, (0, 100)),
        req(1, 2.0, (0, 150)),  # continues 0
        req(2, 3.0, (0, 40), (500, 10)),  # another conversation, one turn, sharing 2 blocks of 16
    ]
    ids, ends = session_ids(reqs)
    assert ids[0] == ids[1] != ids[2] and ends == {1, 2}
    assign_sessions(reqs, True, 16)
    assert [r.session for r in reqs] == ids and [r.ends_session for r in reqs] == [False, True, True]
    assert [r.session_keep for r in reqs] == [32, 32, 32]  # what the two conversations share


def trace_req(index: int, at_s: float, *ids: int) -> SimRequest:
    """A trace's request: whole 512-token blocks ``ids``."""
    n = len(ids) * TRACE_BLOCK_TOKENS
    return SimRequest(index, at_s * 1000.0, segments_of_blocks(list(ids), n), n, 4, 1 << 31, source_line=index + 1)


def documents() -> list[SimRequest]:
    """Template block 1 shared by 11 conversations; documents A (blocks 10, 11) and B (20, 21)
    queried again, each request with a question block of its own."""
    return [
        trace_req(0, 0.0, 1, 10, 11, 100),  # A
        trace_req(1, 1.0, 1, 20, 21, 101),  # B
        trace_req(2, 2.0, 1, 10, 11, 102),  # A again, another question
        trace_req(3, 3.0, 1, 30, 103),  # alone: the template only
        trace_req(4, 4.0, 1, 20, 21, 101, 104),  # continues 1 (starts with its whole prompt)
        trace_req(5, 5.0, 1, 10, 105),  # A's first block only
        trace_req(6, 6.0, 2, 10, 11),  # A's blocks after another template: another chain
        *[trace_req(7 + k, 7.0 + k, 1, 40 + k) for k in range(6)],
    ]


def test_a_traces_sessions_are_the_documents_its_prompts_share_beyond_their_template() -> None:
    reqs = documents()
    alone = list(range(6, 13))
    assert document_sessions(reqs, TRACE_BLOCK_TOKENS) == [0, 1, 0, 3, 1, 0, *alone]
    assert document_sessions(reqs, TRACE_BLOCK_TOKENS, min_blocks=2) == [0, 1, 0, 3, 1, 5, *alone]
    # a template is a prefix more than N conversations start with: below that, block 1 is a document
    assert document_sessions(reqs, TRACE_BLOCK_TOKENS, template_conversations=11) == [0] * 6 + [6] + [0] * 6
    ids, ends = session_ids(reqs)
    assert ids[0] == ids[2] == ids[5] != ids[1] == ids[4] and len(set(ids)) == 10
    assert ends == {3, 4, 5, *alone}  # each session's last request
    sessions = document_sessions(reqs, TRACE_BLOCK_TOKENS)
    # the prefix each shares with its session's other requests (None: all of it, or nobody)
    b = TRACE_BLOCK_TOKENS
    assert session_prefixes(reqs, sessions, b)[:7] == [3 * b, None, 3 * b, None, 4 * b, 2 * b, None]
    assert session_templates(reqs, sessions, b) == [b] * 6 + [0] + [b] * 6  # block 1: other sessions'
    assign_sessions(reqs, True, 16)
    assert [r.session for r in reqs] == ids and [r.session_keep for r in reqs] == [b] * 6 + [0] + [b] * 6


def test_session_hints_keep_a_sessions_document_until_it_comes_back() -> None:
    reqs = documents()
    b = TRACE_BLOCK_TOKENS
    hints = session_hints(reqs, 1.0, 16)
    # 0: A comes back at 2 s (request 2): its document kept for that pause, its question dropped
    assert hints[0] == [
        Retention(keep_priority(2.0), 2.0 * PAUSE_FACTOR + PAUSE_SLACK_S, 0, 3 * b),
        Retention(0, None, 3 * b),
    ]
    assert hints[2] == [
        Retention(keep_priority(3.0), 3.0 * PAUSE_FACTOR + PAUSE_SLACK_S, 0, 3 * b),
        Retention(0, None, 3 * b),
    ]
    assert hints[1] == [Retention(keep_priority(3.0), 3.0 * PAUSE_FACTOR + PAUSE_SLACK_S)]  # 4 extends it whole
    assert hints[5] == hints[3] == [Retention(DROP_PRIORITY, None, b)]  # last of its session: all but the template
    assert hints[6] == [Retention(DROP_PRIORITY)]
    flipped = session_hints(reqs, 0.0, 16)
    assert flipped[0] == [Retention(DROP_PRIORITY, None, b)]
    median = sorted([2.0, 3.0, 3.0])[1]
    keep = Retention(keep_priority(median), median * PAUSE_FACTOR + PAUSE_SLACK_S, 0, 2 * b)
    assert flipped[5] == [keep, Retention(DROP_PRIORITY, None, 2 * b)]  # wrongly kept: its document
    mark_reasoning(reqs, 0.5)  # (4 output tokens: 2 of reasoning)
    last = reqs[3].prompt_length
    assert session_hints(reqs, 1.0, 16)[3] == [Retention(0, None, b, last), Retention(0, None, last, last + 2)]
    # a share 1 - accuracy of the labels flipped: 100 documents queried 4 times, 300 come back
    many = [trace_req(i, i * 0.1, 1000 + i % 100, 5000 + i) for i in range(400)]
    got = session_hints(many, 0.9, 16, seed=3)
    wrong = sum((h[0].priority == DROP_PRIORITY) == (i < 300) for i, h in enumerate(got))
    assert 20 <= wrong <= 60 and got == session_hints(many, 0.9, 16, seed=3)


def test_the_simulator_runs_sessions_their_end_and_reasoning_hints(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SMALL, *LOAD, "--output-tokens", "20", "--gpu", "6000tok", "--no-progress", "--reasoning-share", "0.4"]
    assert main([*args, "--retention-hints", "1.0", "--json", "-"]) == 0
    hints_only = json.loads(capsys.readouterr().out)
    flags = ["--sessions", "--session-end", "--retention-hints", "1.0", "--json", "-"]
    assert main([*args, *flags]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["workload"]["reasoning_share"] == 0.4
    assert rep["sessions"]["sessions"] == 12 and rep["sessions"]["end"]
    ended = rep["sessions"]["ended_blocks"]
    assert ended["dropped"] > 0  # each conversation's own blocks left at its end
    h = rep["retention_hints"]
    assert h["reasoning_hints"] and h["sessions_ended_blocks"]["dropped"] > 0
    # (no pressure from ended conversations here: the end costs at most a partial block's reuse)
    assert abs(h["token_hit_rate"] - hints_only["retention_hints"]["token_hit_rate"]) < 0.01
    assert "sessions" not in hints_only


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--retention-hints", "1.5"], "--retention-hints must be an accuracy in [0, 1], got 1.5"),
        (["--retention-hints", "x"], "argument --retention-hints: invalid float value: 'x'"),
        (["--retention-hints", "1", "--replicas", "2"], "--retention-hints does not combine with"),
        (["--sweep", "hints=0.9,1.5"], "--sweep hints: '1.5' is not an accuracy in [0, 1]"),
        (["--sweep", "hints=x"], "--sweep hints: 'x' is not an accuracy in [0, 1]"),
        (["--sweep", "hints=0.9", "--retention-hints", "0.9"], "--sweep hints sets the accuracy of each replay"),
        (["--sweep", "hints=0.9", "--replicas", "2"], "--sweep hints does not combine with"),
        (["--hints-seed", "1"], "--hints-seed seeds the wrong hints of --retention-hints or --sweep hints=: give one"),
        (["--retention-hints", "0.9", "--hints-seed", "x"], "argument --hints-seed: invalid int value: 'x'"),
        (["--pin-system-prompts", "0"], "--pin-system-prompts must be >= 1"),
        (["--pin-duration", "5"], "--pin-duration needs --pin-system-prompts"),
        (["--pin-system-prompts", "2", "--pin-duration", "0"], "--pin-duration must be a finite number"),
        (["--pin-system-prompts", "2", "--pin-duration", "inf"], "--pin-duration must be a finite number"),
        (["--pin-system-prompts", "2", "--replicas", "2"], "--pin-system-prompts does not combine with"),
        (["--session-end"], "--session-end ends the sessions of --sessions: give --sessions too"),
        (["--sessions", "--replicas", "2"], "--sessions does not combine with"),
        (["--reasoning-share", "1"], "--reasoning-share must be in [0, 1)"),
        (["--reasoning-share", "-0.1"], "--reasoning-share must be in [0, 1)"),
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


def test_shared_prefixes_are_the_longest_ones_more_than_n_requests_start_with() -> None:
    reqs = [
        req(0, 0.0, (0, 40), (100, 8)),
        req(1, 1.0, (0, 40), (200, 8)),
        req(2, 2.0, (0, 20), (20, 20), (100, 16)),  # the same tokens in other runs: 0 starts with them too
        req(3, 3.0, (0, 15)),  # not one whole block of 16
        req(4, 4.0, (500, 48)),
    ]
    got = shared_prefixes(reqs, 2, 16)
    assert [g[1] if g else None for g in got] == [32, 32, 32, None, None]  # 3 requests share 2 blocks
    assert got[0] == got[1] == got[2]  # one prefix (one pin)
    pairs = shared_prefixes(reqs, 1, 16)
    assert [g[1] if g else None for g in pairs] == [48, 32, 48, None, None]  # 0 and 2 share 3 blocks
    assert pairs[0] == pairs[2] != pairs[1]
    assert shared_prefixes(reqs, 3, 16) == [None] * 5


def test_system_prompts_are_prefixes_distinct_conversations_share() -> None:
    reqs = [
        req(0, 0.0, (0, 32), (100, 16)),  # conversation A, turn 1
        req(1, 1.0, (0, 32), (100, 32)),  # A, turn 2 (starts with turn 1's prompt)
        req(2, 2.0, (0, 32), (100, 48)),  # A, turn 3
        req(3, 3.0, (0, 32), (300, 16)),  # B: the same system prompt (2 blocks of 16)
    ]
    nxt = continuers(reqs)
    assert nxt == [1, 2, None, None]
    assert conversations(nxt) == [2, 2, 2, 3]  # named by their last request
    # by requests, three share A's first turn too; by conversations, only the system prompt
    assert [g[1] if g else None for g in shared_prefixes(reqs, 2, 16)] == [48, 48, 48, 32]
    assert [g[1] if g else None for g in system_prompts(reqs, 1, 16)] == [32, 32, 32, 32]
    assert system_prompts(reqs, 2, 16) == [None] * 4
    # a request said not to continue drops only what follows the system prompt
    hints = hint_retentions([1.0, 1.0, None, None], 1.0, drop=True, shared=[32, 32, 32, 0])
    assert hints[2] == Retention(DROP_PRIORITY, None, 32) and hints[3] == Retention(DROP_PRIORITY)
    assert hints[0] is not None and hints[0].start == 0  # a continuation keeps the whole history


def test_the_pin_threshold_is_the_smallest_whose_pins_fit_the_budget() -> None:
    reqs = [req(i, float(i), (0, 32), (1000 + 100 * i, 16)) for i in range(4)]  # 4 chats, one prompt
    reqs += [req(4 + i, 4.0 + i, (500, 16), (3000 + 100 * i, 16)) for i in range(2)]  # 2 chats, another
    talks = list(range(6))
    assert pin_threshold(reqs, 48, 10.0, 16, talks) == 2  # both prompts (3 blocks) fit
    assert pin_threshold(reqs, 32, 10.0, 16, talks) == 4  # only the one 4 chats share
    assert pin_threshold(reqs, 32, 0.5, 16, talks) == 2  # short pins: never both at once
    assert pin_threshold(reqs, 16, 10.0, 16, talks) == 8  # nothing fits: no prefix that shared


SHAPE = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token
ONE_AT_A_TIME = SchedulerOptions(max_batch=1, time_scale=0.0, prompt_only=True)


def gpu_tokens(tokens: int) -> list[TierSpec]:
    return [TierSpec("gpu", tokens * SHAPE.bytes_per_token, f"{tokens}tok")]


def system_prompt_workload(system_tokens: int) -> list[SimRequest]:
    """Three requests with one system prompt, apart by unrelated prompts that fill the cache."""
    reqs: list[SimRequest] = []
    for i in range(12):
        if i % 4 == 0:
            reqs.append(req(i, float(i), (0, system_tokens), (10_000 + 100 * i, 40)))
        else:
            reqs.append(req(i, float(i), (50_000 + 1000 * i, 600)))
    return reqs


def test_pinned_system_prompts_stay_cached_through_the_public_pin() -> None:
    reqs = system_prompt_workload(256)
    plain = simulate(SHAPE, gpu_tokens(1024), 16, reqs, {}, ONE_AT_A_TIME)
    pinned = simulate(SHAPE, gpu_tokens(1024), 16, reqs, {}, ONE_AT_A_TIME, pin_shared=2)
    assert "pins" not in plain and plain["prefill"]["reused_tokens"] == 0  # LRU lost it each time
    p = pinned["pins"]
    assert p["prefixes"] == 1 and p["pinned_tokens"] == 256 and p["refused"] == 0
    assert p["peak_pinned_bytes"] == 256 * SHAPE.bytes_per_token
    assert pinned["prefill"]["reused_tokens"] == 2 * 256  # the 2nd and 3rd use hit the pinned prompt
    assert plain["tiers"][0]["peak_pinned_bytes"] == 0


def test_pins_with_a_duration_end_unless_their_prefix_is_used_again_in_time() -> None:
    reqs = system_prompt_workload(256)
    short = simulate(SHAPE, gpu_tokens(1024), 16, reqs, {}, ONE_AT_A_TIME, pin_shared=2, pin_duration=1e-6)
    long = simulate(SHAPE, gpu_tokens(1024), 16, reqs, {}, ONE_AT_A_TIME, pin_shared=2, pin_duration=3600.0)
    assert short["pins"]["prefixes"] == 1 and short["prefill"]["reused_tokens"] == 0  # ended before the next use
    assert long["pins"]["duration_s"] == 3600.0 and long["prefill"]["reused_tokens"] == 2 * 256


def test_a_pin_beyond_max_pinned_share_is_refused_and_counted() -> None:
    rep = simulate(SHAPE, gpu_tokens(1024), 16, system_prompt_workload(576), {}, ONE_AT_A_TIME, pin_shared=2)
    p = rep["pins"]  # 576 of 1024 tokens: beyond the default share of one half
    assert p["prefixes"] == 0 and p["pinned_tokens"] == 0 and p["refused"] == 1
    assert rep["tiers"][0]["peak_pinned_bytes"] == 0


def test_the_hints_sweep_reports_each_accuracy_against_one_replay_without(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*SMALL, *LOAD, "--output-tokens", "20", "--gpu", "6000tok", "--no-progress"]
    assert main([*args, "--sweep", "hints=0.5,1.0", "--pin-system-prompts", "3", "--json", "-"]) == 0
    rep = json.loads(capsys.readouterr().out)
    sweep = rep["retention_hints_sweep"]
    assert [h["accuracy"] for h in sweep] == [0.5, 1.0]
    assert all(h["token_hit_rate_without"] == rep["hit_rate"]["tokens"] for h in sweep)
    assert all(h["peak_retained_bytes"] > 0 for h in sweep) and rep["pins"]["prefixes"] > 0
    assert main([*args, "--sweep", "hints=0.5,1.0", "--pin-system-prompts", "3"]) == 0
    out = capsys.readouterr().out
    assert "retention hints (accuracy 0.5" in out and "retention hints (accuracy 1," in out
    assert "pinned prefixes (shared by more than 3 conversations)" in out


def test_session_returns_raise_a_kept_prefix_as_its_session_nears() -> None:
    returns = SessionReturns()
    keep = [Retention(keep_priority(64.0), 64.0 * PAUSE_FACTOR + PAUSE_SLACK_S, 0, 1024), Retention(0, None, 1024)]
    returns.closed(7, 0, 10.0, keep)  # session 7 expected back at 74 s
    assert returns.due(41.9) == []  # (the first raise when half the pause is left)
    assert returns.due(42.0) == [(0, keep_priority(32.0), 32.0 * PAUSE_FACTOR + PAUSE_SLACK_S)]
    assert keep_priority(32.0) > keep[0].priority
    assert returns.due(58.0) == [(0, keep_priority(16.0), 16.0 * PAUSE_FACTOR + PAUSE_SLACK_S)]
    returns.closed(7, 3, 60.0, [Retention(DROP_PRIORITY, None, 512)])  # it came back: nothing more for 0
    returns.closed(8, 4, 60.0, [Retention(DROP_PRIORITY)])  # a drop: nothing to raise
    assert returns.due(1000.0) == []
    r = trace_req(0, 0.0, 1, 2, 3)
    assert kept_prefix(r, keep) == 1024 and kept_prefix(r, [Retention(90, 5.0)]) == 3 * TRACE_BLOCK_TOKENS


def test_the_simulator_derives_a_traces_sessions_from_its_documents(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # 8 documents after one template, each queried 4 times with a question of its own, in turn
    lines = [
        json.dumps(
            {"timestamp": 200 * i, "input_length": 1536, "output_length": 4, "hash_ids": [0, 100 + i % 8, 1000 + i]}
        )
        for i in range(32)
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    args = [*SMALL, "--trace", str(path), "--gpu", "8000tok", "--no-progress", "--json", "-"]
    assert main([*args, "--sessions", "--session-end", "--retention-hints", "0.9"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["sessions"]["sessions"] == 8 and rep["sessions"]["ended_blocks"]["dropped"] > 0
    h = rep["retention_hints"]
    assert h["continued_share"] == 0.75  # each document but its last query comes back
    # every document's later queries reuse it whole (the template and document blocks: 55 of 96 blocks)
    assert h["token_hit_rate"] == pytest.approx(55 / 96, abs=1e-3)
    assert h["token_hit_rate"] > h["token_hit_rate_without"] + 0.1
    assert h["sessions_raised"] > 0  # kept documents raised as their next query neared
