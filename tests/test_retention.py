"""Retention the engine controls (issue 37): token ranges and decode blocks with priorities and
durations, the close-time hint, a simulated clock; through the fake engine (the conftest turns
the invariant checker on), under both eviction policies."""

from __future__ import annotations

import datetime
import fractions
import math
from array import array
from collections.abc import Callable

import numpy as np
import pytest
from conftest import REC, Clock, MakeManager, fixed, make_manager_per_policy, one_layer
from fake_engine import FakeEngine
from tier_helpers import run

from kv_cache_manager_v2 import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BufferConfig,
    CacheLevel,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LayerId,
    RequestRetention,
    Retention,
    RetentionRange,
    SsmLayerConfig,
    compiled,
)
from kv_cache_manager_v2._config import GpuCacheTierConfig
from kv_cache_manager_v2._storage._expiry import _SWEEP_SLACK
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

T = 16
make_manager = make_manager_per_policy  # (the fixture) every test here runs under each eviction policy


def seq(base: int, blocks: int) -> list[int]:
    return list(range(base, base + blocks * T))


def pressure(m: KVCacheManager, engine: FakeEngine, blocks: int, base: int, priority: int = 60) -> None:
    """A request of ``blocks`` new blocks (evicting that many when memory is full), closed."""
    run(m, engine, seq(base, blocks), custom_priority_callback=fixed(priority))


def test_a_range_keeps_its_priority_until_its_duration_ends_exactly(make_manager: MakeManager) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, retention=RequestRetention([(0, None, 80, 10.0)]))
    run(m, engine, b, custom_priority_callback=fixed(50))
    clock.now = 9.999
    pressure(m, engine, 1, 3000, 20)  # B (50) goes before A (80)
    assert m.probe_reuse(input_tokens=a) == 2 * T
    assert m.probe_reuse(input_tokens=b) == T
    stats = m.get_storage_statistics()[0]
    assert stats.retained == 2 and stats.retained_bytes == 2 * sum(stats.slot_sizes)
    clock.now = 10.0  # A is back at the default priority (35), below B
    assert m.get_storage_statistics()[0].retained == 0
    pressure(m, engine, 2, 4000, 20)
    assert m.probe_reuse(input_tokens=a) == T
    assert m.probe_reuse(input_tokens=b) == T
    kv = m.create_kv_cache(input_tokens=b)
    assert kv.resume()
    engine.check_all(kv, b, T)
    kv.close()


def test_durations_survive_demotion_and_promotion_and_expire_on_the_host_tier(make_manager: MakeManager) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, host_quota=8 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, retention=RequestRetention([RetentionRange(0, None, 80, 10.0)]))
    run(m, engine, b, custom_priority_callback=fixed(50))
    pressure(m, engine, 4, 3000)  # A and B move down to the host tier
    assert m.probe_reuse_levels(input_tokens=a) == [1, 1]
    c = m.create_kv_cache(input_tokens=a)  # A comes back up to GPU memory ...
    assert c.resume()
    engine.check_all(c, a, 2 * T)
    c.close()
    assert m.probe_reuse_levels(input_tokens=a) == [0, 0]
    clock.now = 5.0
    pressure(m, engine, 4, 4000)  # ... and down again: the host holds B (50), 60s, A (80)
    assert m.probe_reuse_levels(input_tokens=a) == [1, 1]
    clock.now = 9.5
    pressure(m, engine, 2, 5000)  # the host evicts B, not A
    assert m.probe_reuse(input_tokens=b) == 0
    assert m.probe_reuse(input_tokens=a) == 2 * T
    clock.now = 10.0
    pressure(m, engine, 2, 6000)  # A expired on the host tier: it goes first
    assert m.probe_reuse(input_tokens=a) == 0


def test_decode_blocks_take_the_decode_retention(make_manager: MakeManager) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=5 * REC * T, clock=clock)
    engine = FakeEngine(m)
    prompt, out = seq(1000, 2), seq(9000, 1)
    retention = RequestRetention([(0, None, 80, None)], decode_priority=20, decode_duration_s=30.0)
    kv = m.create_kv_cache(input_tokens=prompt, retention=retention)
    assert kv.resume() and kv.resize(3 * T)
    full = prompt + out
    engine.step(kv, full, 0, 3 * T)
    kv.commit(full)
    kv.close()
    b = seq(2000, 2)
    run(m, engine, b, custom_priority_callback=fixed(50))
    pressure(m, engine, 1, 3000, 90)  # the decode block (20) goes first
    assert m.probe_reuse(input_tokens=full) == 2 * T
    assert m.probe_reuse(input_tokens=b) == 2 * T
    pressure(m, engine, 1, 4000, 90)  # then B (50), not the prompt (80, no expiry)
    assert m.probe_reuse(input_tokens=b) == T
    clock.now = 1e6
    pressure(m, engine, 1, 5000, 90)
    assert m.probe_reuse(input_tokens=full) == 2 * T


@pytest.mark.parametrize("hint", [False, True])
def test_the_close_time_hint_keeps_a_conversation_until_it_is_reused(make_manager: MakeManager, hint: bool) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, Retention(80, 60.0) if hint else None)
    run(m, engine, b, custom_priority_callback=fixed(50))
    pressure(m, engine, 2, 3000, 60)
    assert m.probe_reuse(input_tokens=a) == (2 * T if hint else 0)
    assert m.probe_reuse(input_tokens=b) == (0 if hint else 2 * T)
    if not hint:
        return
    run(m, engine, seq(2000, 2), custom_priority_callback=fixed(50))  # B again, in place of the 60s
    kv = m.create_kv_cache(input_tokens=a)  # the conversation continues: the hint ends
    assert kv.resume()
    engine.check_all(kv, a, 2 * T)
    kv.close()
    pressure(m, engine, 2, 4000, 90)  # A (35 again) goes before B (50)
    assert m.probe_reuse(input_tokens=a) == 0
    assert m.probe_reuse(input_tokens=b) == 2 * T


def test_a_request_sharing_only_a_prefix_leaves_the_hint(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    prefix = seq(1000, 2)
    a = prefix + seq(2000, 2)
    run(m, engine, a, Retention(80, 60.0))
    b = seq(3000, 2)
    run(m, engine, b, custom_priority_callback=fixed(50))
    run(m, engine, prefix + seq(4000, 1))  # another conversation on the same prefix: not A's continuation
    pressure(m, engine, 3, 5000)  # evicts its own block (35) and B's tail (50), not A's prefix
    assert m.probe_reuse(input_tokens=a) == 4 * T
    assert m.probe_reuse(input_tokens=b) == T


def test_a_low_hint_lowers_only_the_blocks_the_request_published(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=6 * REC * T)
    engine = FakeEngine(m)
    e, prefix = seq(5000, 2), seq(1000, 2)
    run(m, engine, e)
    run(m, engine, prefix)
    d = prefix + seq(2000, 2)
    run(m, engine, d, Retention(0))  # "this conversation ends": D's own blocks go first
    pressure(m, engine, 2, 3000, 90)
    assert m.probe_reuse(input_tokens=d) == 2 * T
    assert m.probe_reuse(input_tokens=e) == 2 * T
    pressure(m, engine, 2, 4000, 90)  # then the oldest default-priority blocks: E, not the prefix
    assert m.probe_reuse(input_tokens=e) == 0
    assert m.probe_reuse(input_tokens=prefix) == 2 * T


@pytest.mark.parametrize("start", [0, 2 * T, 2 * T + 1])
def test_a_hint_from_a_start_leaves_the_blocks_before_it(make_manager: MakeManager, start: int) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    system = seq(1000, 2)  # a system prompt others will share, first published by this request
    chat = system + seq(2000, 2)
    run(m, engine, chat, Retention(0, None, start))  # "this chat ends" after the system prompt
    other = seq(3000, 2)
    run(m, engine, other, custom_priority_callback=fixed(20))
    pressure(m, engine, 6, 4000, 90)  # 2 free slots, then the 4 lowest-priority blocks go
    kept = m.probe_reuse(input_tokens=system) == 2 * T
    assert kept == (start > 0)  # from a start: the chat's own blocks (0), then other's (20)
    assert m.probe_reuse(input_tokens=other) == (0 if start else 2 * T)
    assert m.probe_reuse(input_tokens=chat) == (2 * T if start else 0)
    if kept:
        kv = m.create_kv_cache(input_tokens=system + seq(6000, 1))
        assert kv.resume()
        engine.check_all(kv, system, 2 * T)
        kv.close()


def test_a_token_range_hint_drops_a_reasoning_span_first_and_keeps_the_conversation(make_manager: MakeManager) -> None:
    """Hints over token ranges at close: the conversation (before the reasoning) kept, the
    reasoning span (no later request reuses it) evicted first; blocks after a range's end keep
    their priority."""
    m = make_manager(one_layer(T), tokens_per_block=T, quota=9 * REC * T)
    engine = FakeEngine(m)
    turn = seq(1000, 2)
    reasoning = seq(2000, 2)  # tokens [2T, 4T): the model's reasoning, stripped from the next turn
    answer = seq(3000, 1)
    chat = turn + reasoning + answer
    run(m, engine, chat, [Retention(90, None, end=2 * T + 1), Retention(0, None, 2 * T + 1, 4 * T)])
    other = seq(4000, 2)
    run(m, engine, other, custom_priority_callback=fixed(20))
    # the blocks: turn (90, 90), the block holding tokens 2T..3T (both ranges: the later one's, 0), 3T..4T (0), answer (35)
    pressure(m, engine, 7, 5000, 95)  # 2 free slots, then the 5 lowest: reasoning's 2 blocks (0), other's, ...
    assert m.probe_reuse(input_tokens=turn) == 2 * T
    assert m.probe_reuse(input_tokens=other) == 0
    kv = m.create_kv_cache(input_tokens=turn + seq(6000, 1))  # the next turn: without the reasoning
    assert kv.resume()
    engine.check_all(kv, turn, 2 * T)
    kv.close()
    m.check_invariants()


def test_close_time_hints_over_ranges_are_checked() -> None:
    from kv_cache_manager_v2._retention import check_hints

    assert check_hints("retain", [Retention(1, end=5), Retention(2, start=5)]) == [
        Retention(1, end=5),
        Retention(2, start=5),
    ]
    with pytest.raises(ValueError, match="ascending and not overlap"):
        check_hints("retain", [Retention(1, end=6), Retention(2, start=5)])
    with pytest.raises(ValueError, match="ascending and not overlap"):
        check_hints("retain", [Retention(1), Retention(2, start=5)])
    with pytest.raises(TypeError, match=r"retain\[1\]"):
        check_hints("retain", [Retention(1, end=5), 7])
    with pytest.raises(TypeError, match="a Retention, a sequence of them or None"):
        check_hints("retain", 7)


def test_a_low_hint_ends_when_any_request_reuses_the_blocks(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=6 * REC * T)
    engine = FakeEngine(m)
    doc = seq(1000, 2)
    run(m, engine, doc, Retention(0))  # "nobody comes back to this" ...
    e = seq(5000, 2)
    run(m, engine, e)
    run(m, engine, doc[:T] + seq(2000, 1))  # ... but another request reads its first block
    pressure(m, engine, 3, 3000, 90)  # the second block (still 0), then the oldest at 35: E's tail
    assert m.probe_reuse(input_tokens=doc) == T
    assert m.probe_reuse(input_tokens=e) == T


def test_the_default_clock_is_monotonic() -> None:
    import time

    cfg = KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 16)], one_layer(T), backend="host")
    assert cfg.clock is time.monotonic


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: Retention(101), ValueError, "Retention.priority must be in [0, 100]"),
        (lambda: Retention(-1), ValueError, "Retention.priority"),
        (lambda: Retention(True), TypeError, "Retention.priority"),  # type: ignore[arg-type]
        (lambda: Retention(50, 0.0), ValueError, "finite number of seconds > 0"),
        (lambda: Retention(50, math.inf), ValueError, "finite number of seconds > 0"),
        (lambda: Retention(50, math.nan), ValueError, "finite number of seconds > 0"),
        (lambda: Retention(50, "5"), TypeError, "Retention.duration_s must be a number"),  # type: ignore[arg-type]
        (lambda: Retention(0, None, -1), ValueError, "Retention.start must be >= 0"),
        (lambda: Retention(0, None, 1.5), TypeError, "Retention.start must be an int"),  # type: ignore[arg-type]
        (lambda: Retention(0, None, 4, 2), ValueError, "Retention.end must be > start (4)"),
        (lambda: Retention(0, None, 0, 2.5), TypeError, "Retention.end must be an int"),  # type: ignore[arg-type]
        (lambda: RetentionRange(8, 8, 50), ValueError, "RetentionRange.end must be > start (8)"),
        (lambda: RetentionRange(-1, None, 50), ValueError, "RetentionRange.start"),
        (lambda: RetentionRange(0, None, 500), ValueError, "RetentionRange.priority"),
        (lambda: RequestRetention([(0, 10, 50, None), (5, 20, 60, None)]), ValueError, "ascending and not overlap"),
        (lambda: RequestRetention([(0, None, 50, None), (5, 20, 60, None)]), ValueError, "ascending and not overlap"),
        (lambda: RequestRetention([(0, 10, 50)]), ValueError, "(start, end, priority, duration_s)"),  # type: ignore[list-item]
        (lambda: RequestRetention(["x"]), TypeError, "RetentionRange or a 4-tuple"),  # type: ignore[list-item]
        (lambda: RequestRetention("ab"), TypeError, "sequence of RetentionRange"),  # type: ignore[arg-type]
        (lambda: RequestRetention(decode_duration_s=5.0), ValueError, "needs a decode_priority"),
        (lambda: RequestRetention(decode_priority=101), ValueError, "decode_priority"),
        (lambda: RequestRetention(decode_priority=5, decode_duration_s=-1.0), ValueError, "decode_duration_s"),
        # an int beyond any float is a bad duration like the others (not an OverflowError)
        (lambda: Retention(50, 10**400), ValueError, "Retention.duration_s must be a finite number"),
        (lambda: RetentionRange(0, None, 50, 10**400), ValueError, "RetentionRange.duration_s must be a finite"),
        (lambda: RequestRetention([(0, None, 50, 10**400)]), ValueError, "RetentionRange.duration_s must be a"),
        (
            lambda: RequestRetention(decode_priority=5, decode_duration_s=10**400),
            ValueError,
            "RequestRetention.decode_duration_s must be a finite number",
        ),
        (
            lambda: KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 16)], one_layer(T), clock=5),  # type: ignore[arg-type]
            TypeError,
            "clock must be a callable",
        ),
    ],
)
def test_bad_retention_values_are_refused_clearly(
    make: Callable[[], object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        make()
    assert words in str(info.value)


def test_bad_retention_arguments_are_refused_and_change_nothing(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    with pytest.raises(TypeError, match=None if compiled else "retention"):  # compiled: mypyc's own message
        m.create_kv_cache(retention=Retention(5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs input_tokens or prompt_length"):
        m.create_kv_cache(retention=RequestRetention([(0, None, 50, None)]))
    with pytest.raises(ValueError, match="prompt_length"):
        m.create_kv_cache(input_tokens=seq(0, 1), retention=RequestRetention(), prompt_length=-1)
    assert m.num_open_caches == 0
    kv = m.create_kv_cache(retention=RequestRetention([(0, None, 50, None)]), prompt_length=T)
    with pytest.raises(TypeError, match=None if compiled else "retain"):
        kv.close(retain=50)  # type: ignore[arg-type]
    assert m.num_open_caches == 1
    kv.close(retain=Retention(50, 1.0))
    assert m.num_open_caches == 0


# ---------------------------------------------------------------- a duration counts from the release
def test_a_duration_counts_from_the_release_not_the_commit(make_manager: MakeManager) -> None:
    """The reference system's rule: blocks at 80 for 10 s, committed at 0, released at 15, a
    competitor at 50, pressure at 16: the blocks at 80 stay (their 10 s began at 15)."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    kv = m.create_kv_cache(input_tokens=a, retention=RequestRetention([(0, None, 80, 10.0)]))
    assert kv.resume() and kv.resize(len(a))
    engine.step(kv, a, 0, len(a))
    kv.commit(a)  # t = 0
    clock.now = 15.0
    kv.close()  # released: A's 10 s start now
    run(m, engine, b, custom_priority_callback=fixed(50))
    clock.now = 16.0
    pressure(m, engine, 2, 3000, 20)  # B (50) goes before A (80)
    assert m.probe_reuse(input_tokens=a) == 2 * T
    assert m.probe_reuse(input_tokens=b) == 0
    clock.now = 25.0  # A's 10 s since its release are over: back at 35, below C (50)
    run(m, engine, b, custom_priority_callback=fixed(50))
    pressure(m, engine, 2, 4000, 60)
    assert m.probe_reuse(input_tokens=a) == 0
    assert m.probe_reuse(input_tokens=b) == 2 * T


@pytest.mark.parametrize("how", ["suspended", "shared", "reused"])
def test_a_duration_runs_only_while_no_request_owns_the_block(make_manager: MakeManager, how: str) -> None:
    """A suspended request keeps its blocks' duration from running; a block shared by two
    requests starts its duration when the last one lets go; a request that takes a released
    block stops its duration, and its release starts it afresh."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b, c = seq(1000, 2), seq(2000, 2), seq(3000, 2)
    keep = RequestRetention([(0, None, 80, 10.0)])
    if how == "reused":
        run(m, engine, a, retention=keep)  # released at 0: runs until 10
        clock.now = 5.0
    kv = m.create_kv_cache(input_tokens=a, retention=keep)
    assert kv.resume() and kv.resize(len(a))
    h = kv.history_length
    engine.step(kv, a, h, len(a))
    kv.commit(a[h:])
    other = None
    if how == "suspended":
        kv.suspend()
    elif how == "shared":
        other = m.create_kv_cache(input_tokens=a)
        assert other.resume()
        clock.now = 3.0
        other.close()  # A still owns the blocks: nothing runs yet
    clock.now = 15.0
    if how == "suspended":
        assert kv.resume()
        engine.check_all(kv, a, len(a))
    kv.close()  # the last owner lets go at 15: 10 s from now
    m.check_invariants()
    run(m, engine, b, custom_priority_callback=fixed(50))
    clock.now = 24.9
    pressure(m, engine, 2, 4000, 60)  # B (50) goes before A (80)
    assert m.probe_reuse(input_tokens=a) == 2 * T
    assert m.probe_reuse(input_tokens=b) == 0
    clock.now = 25.0  # A is back at 35: it goes before the blocks at 60
    run(m, engine, c, custom_priority_callback=fixed(50))
    assert m.probe_reuse(input_tokens=a) == 0
    assert m.probe_reuse(input_tokens=seq(4000, 2)) == 2 * T


@pytest.mark.parametrize("statistics", [False, True], ids=["quiet", "statistics"])
def test_a_retention_whose_time_is_up_ends_when_its_block_is_reused(
    make_manager: MakeManager, statistics: bool
) -> None:
    """Blocks at 80 for 10 s released at 0, reused (no retention of their own) and released at 15,
    pressure at 16: their retention ended at 10, before the reuse, whether a statistics call (which
    applies expiry) came between or not: the reuse neither stops its clock nor gives it 10 s again."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, retention=RequestRetention([(0, None, 80, 10.0)]))  # released at 0: until 10
    clock.now = 15.0
    if statistics:
        assert m.get_storage_statistics()[0].retained == 0
    run(m, engine, a)
    assert m.get_storage_statistics()[0].retained == 0
    run(m, engine, b, custom_priority_callback=fixed(50))
    clock.now = 16.0
    pressure(m, engine, 2, 3000, 60)  # A is back at 35: it goes before B (50)
    m.check_invariants()
    assert m.probe_reuse(input_tokens=a) == 0
    assert m.probe_reuse(input_tokens=b) == 2 * T


# ---------------------------------------------------------------- hostile clocks
class HostileClock:
    """A clock that, from call ``after`` on, returns ``bad`` (or raises it, an exception), ``times``
    times; seconds ``now`` otherwise."""

    def __init__(self, bad: object, after: int, times: int = 1) -> None:
        self.now = 0.0
        self.bad, self.after, self.times, self.calls = bad, after, times, 0

    def __call__(self) -> object:
        self.calls += 1
        if self.calls > self.after and self.times > 0:
            self.times -= 1
            if isinstance(self.bad, BaseException):
                raise self.bad
            return self.bad
        return self.now


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (datetime.datetime(2026, 1, 1), TypeError, "config.clock must return seconds as a float"),
        (True, TypeError, "config.clock must return seconds as a float"),
        ("5", TypeError, "config.clock must return seconds as a float"),
        (math.nan, ValueError, "config.clock must return a finite number of seconds"),
        (math.inf, ValueError, "config.clock must return a finite number of seconds"),
        (10**400, ValueError, "config.clock must return a finite number of seconds"),
        (RuntimeError("clock down"), RuntimeError, "clock down"),
    ],
    ids=["datetime", "bool", "str", "nan", "inf", "huge-int", "raises"],
)
def test_a_clock_that_returns_no_time_is_refused_at_construction(
    make_manager: MakeManager, bad: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=HostileClock(bad, 0))
    with pytest.raises(TypeError, match=r"config\.clock must return seconds"):
        make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=datetime.datetime.now)
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=lambda: 7)  # an int will do
    assert m.pin(seq(0, 1), duration_s=1.0) == 0


@pytest.mark.parametrize(
    "kind",
    [np.int64, np.float32, np.float64, np.uint32, fractions.Fraction],
    ids=["int64", "float32", "float64", "uint32", "fraction"],
)
def test_a_clock_may_return_any_real_number(make_manager: MakeManager, kind: Callable[[int], object]) -> None:
    """numpy scalars (and other real numbers) are seconds like a float; a numpy bool, NaN or
    infinity of that kind is refused like Python's."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=lambda: kind(int(clock.now)))
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a, retention=RequestRetention([(0, None, 80, 10.0)]))
    assert m.pin(a, duration_s=5.0) == 2 * T
    clock.now = 9.0
    assert m.get_storage_statistics()[0].retained == 2
    clock.now = 10.0
    assert m.get_storage_statistics()[0].retained == 0
    m.check_invariants()
    for bad, error in ((np.bool_(True), TypeError), (np.float32("nan"), ValueError), (np.float64("inf"), ValueError)):
        with pytest.raises(error, match=r"config\.clock must return"):
            make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=lambda bad=bad: bad)


@pytest.mark.parametrize(
    "bad",
    [RuntimeError("clock down"), math.nan, -math.inf, "x", datetime.datetime(2026, 1, 1)],
    ids=["raises", "nan", "-inf", "str", "datetime"],
)
def test_a_clock_failing_later_never_leaves_an_operation_half_done(make_manager: MakeManager, bad: object) -> None:
    """Commits, closes (with a hint), eviction and statistics go on with the last good reading
    while the clock fails; a NaN never enters an expiry time (retention ends once the clock is
    good again); ``pin`` with a duration refuses, changing nothing."""
    clock = HostileClock(bad, 1, times=10**6)  # good at construction only
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, Retention(80, 10.0), retention=RequestRetention([(0, None, 80, 10.0)]))
    m.check_invariants()
    with pytest.raises(type(bad) if isinstance(bad, BaseException) else (TypeError, ValueError)):
        m.pin(a, duration_s=5.0)
    assert m.unpin(a) is False  # nothing was pinned
    run(m, engine, b, custom_priority_callback=fixed(50))
    stats = m.get_storage_statistics()[0]
    assert stats.retained == 2
    pressure(m, engine, 2, 3000, 20)  # the clock stands still: A (80) stays, B (50) goes
    assert m.probe_reuse(input_tokens=a) == 2 * T
    clock.times = 0  # the clock is good again
    clock.now = 10.0  # A's 10 s since its release at 0 are over
    assert m.get_storage_statistics()[0].retained == 0
    pressure(m, engine, 4, 4000, 40)
    assert m.probe_reuse(input_tokens=a) == 0
    clock.times = (
        10**6
    )  # failing again: a request with retention commits, suspends and closes, and the manager shuts down
    kv = m.create_kv_cache(input_tokens=b, retention=RequestRetention([(0, None, 80, 10.0)]))
    assert kv.resume() and kv.resize(len(b))
    engine.step(kv, b, kv.history_length, len(b))
    kv.commit(b[kv.history_length :])
    kv.suspend()
    m.check_invariants()
    kv.close(retain=Retention(90, 5.0))
    m.check_invariants()
    m.shutdown()


def test_a_clock_may_go_back_only_a_little(make_manager: MakeManager) -> None:
    clock = Clock()
    clock.now = 100.0
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a)
    clock.now = 99.5  # within the tolerance: reads as 100 (no time passes)
    assert m.pin(a, duration_s=1.0) == 2 * T
    clock.now = 50.0  # far back: refused, nothing changes
    with pytest.raises(ValueError, match=r"config\.clock went back 50 s"):
        m.pin(seq(1000, 1), duration_s=1.0)
    assert not m.unpin(seq(1000, 1))
    clock.now = 100.9
    pressure(m, engine, 2, 2000)
    assert m.probe_reuse(input_tokens=a) == 2 * T  # pinned until 101
    clock.now = 101.0
    pressure(m, engine, 4, 3000)
    assert m.probe_reuse(input_tokens=a) == 0


def test_a_pin_duration_beyond_any_float_is_a_bad_duration(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    with pytest.raises(ValueError, match="duration_s must be a finite number of seconds > 0"):
        m.pin(seq(0, 1), duration_s=10**400)


# ---------------------------------------------------------------- through the engine adapter
def serve(
    a: KVCacheResourceManager, engine: FakeEngine, r: EngineRequest, retain: Retention | list[Retention] | None = None
) -> None:
    """Run ``r`` to its end (one token per decode step) and free it with ``retain``."""
    while len(r.generated_tokens) < r.max_new_tokens:
        assert a.prepare_resources([r]) == []
        b = r.num_cached_tokens
        engine.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
        if r.samples_this_step:
            r.generated_tokens.append(9000 + 100 * r.request_id + len(r.generated_tokens))
        a.update_resources([r])
    r.state = RequestState.FINISHED
    a.free_resources(r, retain)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_the_adapter_passes_request_retention_and_the_finish_hint(backend: str, policy: str) -> None:
    clock = Clock()
    layers = one_layer(T)
    cfg = KVCacheManagerConfig(
        T,
        [GpuCacheTierConfig(6 * REC * T)],
        layers,
        backend=backend,
        eviction_policy=policy,
        clock=clock,  # type: ignore[arg-type]
    )
    a = KVCacheResourceManager(cfg)
    engine = FakeEngine(a.manager)
    m = a.manager
    system = EngineRequest(1, seq(1000, 2), 1, retention=RequestRetention([(0, None, 90, 100.0)]))
    serve(a, engine, system)
    chat = EngineRequest(2, seq(2000, 2), 1)
    serve(a, engine, chat, [Retention(80, 10.0, end=T), Retention(80, 10.0, start=T)])  # it continues within 10 s
    other = EngineRequest(3, seq(3000, 2), 1, priority=50)
    serve(a, engine, other)
    filler = EngineRequest(4, seq(4000, 2), 1, priority=95)
    serve(a, engine, filler)  # evicts the lowest: other (50)
    assert m.probe_reuse(input_tokens=seq(3000, 2)) == 0
    assert m.probe_reuse(input_tokens=seq(2000, 2)) == 2 * T
    assert m.probe_reuse(input_tokens=seq(1000, 2)) == 2 * T
    clock.now = 10.0  # the chat's hint expired: it goes before the system prompt (90 for 100 s)
    serve(a, engine, EngineRequest(5, seq(5000, 2), 1, priority=95))
    assert m.probe_reuse(input_tokens=seq(2000, 2)) == 0
    assert m.probe_reuse(input_tokens=seq(1000, 2)) == 2 * T
    # (compiled, the annotated argument is refused by mypyc's own check first)
    with pytest.raises(TypeError, match=r"EngineRequest\.retention|RequestRetention or None object expected"):
        EngineRequest(6, seq(1, 1), 1, retention=Retention(5))  # type: ignore[arg-type]
    r = EngineRequest(7, seq(6000, 1), 1)
    assert a.prepare_resources([r]) == []
    with pytest.raises(TypeError, match=None if compiled else "retain"):
        a.free_resources(r, 5)  # type: ignore[arg-type]
    assert a.has_resources(r)
    a.free_resources(r)
    a.shutdown()


# ---------------------------------------------------------------- pins
def test_a_pinned_prefix_is_never_evicted_until_unpinned(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T, max_pinned_share=0.5)
    engine = FakeEngine(m)
    system, other = seq(1000, 2), seq(2000, 2)
    run(m, engine, system, custom_priority_callback=fixed(0))  # the lowest priority: first to go
    run(m, engine, other)
    assert m.pin(system + seq(7000, 1)) == 2 * T  # the cached full blocks of the tokens
    stats = m.get_storage_statistics()[0]
    assert stats.pinned == 2 and stats.pinned_bytes == 2 * sum(stats.slot_sizes)
    pressure(m, engine, 6, 3000)  # everything else goes
    assert m.probe_reuse(input_tokens=system) == 2 * T
    assert m.probe_reuse(input_tokens=other) == 0
    kv = m.create_kv_cache(input_tokens=system)  # a pinned prefix is reused as usual
    assert kv.resume()
    engine.check_all(kv, system, 2 * T)
    kv.close()
    assert not m.unpin(system)  # not the tokens pinned
    assert m.unpin(system + seq(7000, 1))
    pressure(m, engine, 2, 4000)  # now it goes first again (priority 0)
    assert m.probe_reuse(input_tokens=system) == 0


def test_a_pin_beyond_its_share_is_refused_and_changes_nothing(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T, max_pinned_share=0.25)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 1)
    run(m, engine, a)
    run(m, engine, b)
    assert m.pin(a) == 2 * T  # 2 of 8 slots
    with pytest.raises(ValueError, match=r"3 of the 8 slots .* beyond max_pinned_share 0\.25 \(2 slots\)"):
        m.pin(b)
    assert m.pin(a[:T]) == T  # pages already pinned count once
    pressure(m, engine, 6, 3000)  # b was not pinned: it goes
    assert m.probe_reuse(input_tokens=b) == 0
    assert m.probe_reuse(input_tokens=a) == 2 * T
    assert m.unpin(a)
    pressure(m, engine, 1, 4000)  # the second block stays pinned by the other pin
    assert m.probe_reuse(input_tokens=a) == T


def test_a_pin_with_a_duration_ends_by_itself(make_manager: MakeManager) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a)
    assert m.pin(a, duration_s=5.0) == 2 * T
    clock.now = 4.9
    pressure(m, engine, 2, 3000)
    assert m.probe_reuse(input_tokens=a) == 2 * T
    clock.now = 5.0
    pressure(m, engine, 4, 4000)
    assert m.probe_reuse(input_tokens=a) == 0
    assert not m.unpin(a)


def test_pins_stay_where_they_are_on_a_host_tier_and_clear_with_the_reusable_blocks(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, host_quota=4 * REC * T)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a)
    pressure(m, engine, 4, 2000)  # a moves to the host tier
    assert m.probe_reuse_levels(input_tokens=a) == [1, 1]
    m.pin(a)
    for base in (3000, 4000, 5000):  # the host tier fills and evicts again and again
        pressure(m, engine, 4, base)
    assert m.probe_reuse_levels(input_tokens=a) == [1, 1]
    m.clear_reusable_blocks()
    assert m.probe_reuse(input_tokens=a) == 0
    assert not m.unpin(a)


def test_a_resume_after_its_own_pin_ran_out_plans_as_it_evicts(make_manager: MakeManager) -> None:
    """A suspended request's first 2 blocks pinned for 5 s on a 4-slot GPU, its third moved down to
    the host by an active request: resumed at 10, the expired pin makes its own pages evictable
    again, yet they are not room for its third block (resuming locks them). No room: False,
    nothing changed; once the other request closes, the resume brings the block up."""
    clock = Clock()
    m = make_manager(
        one_layer(T), tokens_per_block=T, quota=4 * REC * T, host_quota=8 * REC * T, max_pinned_share=0.5, clock=clock
    )
    engine = FakeEngine(m)
    r, b = seq(1000, 3), seq(2000, 2)
    kv = m.create_kv_cache(input_tokens=r)
    assert kv.resume() and kv.resize(len(r))
    engine.step(kv, r, 0, len(r))
    kv.commit(r)
    assert m.pin(r[: 2 * T], duration_s=5.0) == 2 * T
    kv.suspend()
    other = m.create_kv_cache(input_tokens=b)
    assert other.resume() and other.resize(len(b))  # r's third block (HELD) goes down to the host
    engine.step(other, b, 0, len(b))
    assert m.probe_reuse_levels(input_tokens=r) == [0, 0, 1]
    clock.now = 10.0  # the pin ran out
    assert not kv.resume()  # GPU: r's 2 pages and the other's 2, all taken
    m.check_invariants()
    assert kv.status is KVCacheStatus.SUSPENDED
    assert m.probe_reuse_levels(input_tokens=r) == [0, 0, 1]
    other.close()
    assert kv.resume()
    engine.check_all(kv, r, len(r))
    kv.close()
    m.check_invariants()


def test_a_pinned_page_pulled_up_beyond_the_share_is_held_by_its_pin_only_within_the_share(
    make_manager: MakeManager,
) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T, host_quota=8 * REC * T, max_pinned_share=0.25)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a)
    assert m.pin(a) == 2 * T  # the GPU tier's share: 2 of 8 slots
    run(m, engine, b)
    pressure(m, engine, 6, 3000)  # b moves down to the host tier
    assert m.probe_reuse_levels(input_tokens=b) == [1, 1]
    assert m.pin(b) == 2 * T  # pinned on the host tier (its share: 2 of 8 slots)
    kv = m.create_kv_cache(input_tokens=b)  # b comes up to the GPU tier, whose share is taken
    assert kv.resume()
    engine.check_all(kv, b, 2 * T)
    assert pinned(m) == [2, 0]  # b's pin is not held on the GPU tier: beyond its share
    kv.close()
    pressure(m, engine, 6, 4000)  # so b leaves the GPU tier like any page: down, pinned there again
    assert m.probe_reuse_levels(input_tokens=b) == [1, 1]
    assert m.probe_reuse_levels(input_tokens=a) == [0, 0]
    assert pinned(m) == [2, 2]
    for base in (5000, 6000, 7000):  # the host tier fills and evicts again and again: b stays
        pressure(m, engine, 6, base)
    assert m.probe_reuse_levels(input_tokens=b) == [1, 1]
    kv = m.create_kv_cache(input_tokens=b)
    assert kv.resume()
    engine.check_all(kv, b, 2 * T)
    kv.close()
    assert m.unpin(a) and m.unpin(b)
    assert pinned(m) == [0, 0]


def pinned(m: KVCacheManager, levels: int = 2) -> list[int]:
    """Pinned pages per cache level."""
    return [m.get_storage_statistics(CacheLevel(level))[0].pinned for level in range(levels)]


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"duration_s": 0}, ValueError, "duration_s must be a finite number of seconds > 0"),
        ({"duration_s": "1"}, TypeError, "duration_s must be a number of seconds or None"),
        ({"reuse_scope": 5}, TypeError, "reuse_scope"),
    ],
)
def test_bad_pins_are_refused_clearly(
    make_manager: MakeManager, kw: dict[str, object], error: type[Exception], words: str
) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    with pytest.raises(error, match=words if not compiled or error is ValueError else None):
        m.pin(seq(0, 1), **kw)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="max_pinned_share"):
        KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 16)], one_layer(T), max_pinned_share=1.5)
    with pytest.raises(TypeError, match="max_pinned_share"):
        KVCacheManagerConfig(8, [GpuCacheTierConfig(1 << 16)], one_layer(T), max_pinned_share=True)


def test_a_pin_of_tokens_not_cached_records_nothing_and_unpin_takes_what_pin_takes(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    assert m.pin(a) == 0  # nothing cached: no pin
    assert not m.unpin(a)
    assert m.pin(a, duration_s=5.0) == 0
    assert not m.unpin(a)
    run(m, engine, a)
    for pinned_as, unpinned_as in ((list, tuple), (tuple, array_of), (array_of, list)):
        assert m.pin(pinned_as(a)) == 2 * T
        assert m.get_storage_statistics()[0].pinned == 2
        assert m.unpin(unpinned_as(a))
        assert not m.unpin(a)
        assert m.get_storage_statistics()[0].pinned == 0
    assert m.pin(a) == 2 * T
    m.clear_reusable_blocks()
    assert m.pin(a) == 0  # the pin of those tokens ends: they pin nothing now
    assert not m.unpin(a)
    for bad, kw in (("abc", {}), (b"abc", {}), ([1.5], {}), (None, {}), (a, {"reuse_scope": 5})):
        with pytest.raises(TypeError):
            m.unpin(bad, **kw)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            m.pin(bad, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        m.unpin([1 << 40])


def array_of(tokens: list[int]) -> array[int]:
    return array("I", tokens)


def test_a_tier_shrink_lets_go_of_the_oldest_pins_holds_beyond_the_share(make_manager: MakeManager) -> None:
    """8 of 16 GPU slots pinned at share 0.5, the tier shrunk to 10 slots (the share allows 5):
    the oldest pins' pages beyond it (their last blocks first) are ordinary pages again, still
    pinned: evicted down a tier, where their pins hold again."""
    m = make_manager(
        one_layer(T), tokens_per_block=T, quota=16 * REC * T, host_quota=16 * REC * T, max_pinned_share=0.5
    )
    engine = FakeEngine(m)
    prefixes = [seq(1000 * (i + 1), 2) for i in range(4)]
    for tokens in prefixes:
        run(m, engine, tokens)
        assert m.pin(tokens) == 2 * T
    assert pinned(m) == [8, 0]
    assert m.resize(CacheLevel(0), 10 * REC * T)
    m.check_invariants()
    assert pinned(m) == [5, 0]
    pressure(m, engine, 5, 9000)  # a 5-block request fits: the released pages move down
    m.check_invariants()
    assert pinned(m) == [5, 3]
    assert [m.probe_reuse_levels(input_tokens=t) for t in prefixes] == [[1, 1], [0, 1], [0, 0], [0, 0]]
    for tokens in prefixes:
        kv = m.create_kv_cache(input_tokens=tokens)
        assert kv.resume()
        engine.check_all(kv, tokens, 2 * T)
        kv.close()
        assert m.unpin(tokens)
    m.check_invariants()


def test_a_refused_tier_shrink_keeps_the_pins_held(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=16 * REC * T, max_pinned_share=0.5)
    engine = FakeEngine(m)
    a = seq(1000, 8)
    kv = m.create_kv_cache(input_tokens=a)
    assert kv.resume()
    assert kv.resize(len(a))
    engine.step(kv, a, 0, len(a))
    kv.commit(a)
    kv.suspend()  # 8 HELD pages with nowhere to go
    b = seq(2000, 8)
    run(m, engine, b)
    assert m.pin(b) == 8 * T
    assert not m.resize(CacheLevel(0), 10 * REC * T)  # the suspended request's pages do not fit
    m.check_invariants()
    stats = m.get_storage_statistics()[0]
    assert stats.pinned == 8 and stats.total == 16
    assert m.unpin(b)
    assert kv.resume()
    engine.check_all(kv, a, len(a))
    kv.close()


def _two_pins_shrunk(make_manager: MakeManager) -> tuple[KVCacheManager, FakeEngine, list[int], list[int]]:
    """A (4 blocks) then B (4) cached and pinned on 16 GPU slots at share 0.5, the tier shrunk to 10
    slots: 5 pins held."""
    m = make_manager(one_layer(T), tokens_per_block=T, quota=16 * REC * T, max_pinned_share=0.5)
    engine = FakeEngine(m)
    a, b = seq(1000, 4), seq(2000, 4)
    for tokens in (a, b):
        run(m, engine, tokens)
        assert m.pin(tokens) == 4 * T
    assert m.resize(CacheLevel(0), 10 * REC * T)
    assert pinned(m, 1) == [5]
    return m, engine, a, b


def test_pins_a_shrink_let_go_of_hold_again_when_the_tier_grows_back(make_manager: MakeManager) -> None:
    """8 of 16 slots pinned, the tier shrunk to 10 (5 held), grown back to 16: all 8 hold again
    (the oldest pins first), and pressure keeps every pinned block."""
    m, engine, a, b = _two_pins_shrunk(make_manager)
    assert m.resize(CacheLevel(0), 12 * REC * T)  # room for one more: the oldest pin's first block
    m.check_invariants()
    assert pinned(m, 1) == [6]
    assert m.resize(CacheLevel(0), 16 * REC * T)
    m.check_invariants()
    assert pinned(m, 1) == [8]
    for base in (5000, 6000):
        pressure(m, engine, 8, base)
    m.check_invariants()
    for tokens in (a, b):
        kv = m.create_kv_cache(input_tokens=tokens)
        assert kv.resume()
        engine.check_all(kv, tokens, 4 * T)
        kv.close()


def test_pinning_again_holds_the_pins_a_shrink_let_go_of_within_the_share(make_manager: MakeManager) -> None:
    """A (4 blocks) and B (4) pinned on 16 slots, the tier shrunk to 10: A's last 3 blocks are let
    go of; B unpinned, pinning A again holds them again (the share has room), so pressure keeps A."""
    m, engine, a, b = _two_pins_shrunk(make_manager)
    assert m.pin(a) == 4 * T  # no room: the pin stands, its let-go pages stay ordinary pages
    assert pinned(m, 1) == [5]
    assert m.unpin(b)
    assert pinned(m, 1) == [1]
    assert m.pin(a) == 4 * T
    m.check_invariants()
    assert pinned(m, 1) == [4]
    pressure(m, engine, 6, 5000)  # B's 4 blocks go, A's stay
    m.check_invariants()
    assert m.probe_reuse(input_tokens=a) == 4 * T
    assert m.probe_reuse(input_tokens=b) == 0


def test_the_expiry_heap_shrinks_with_the_live_retention_after_a_burst(make_manager: MakeManager) -> None:
    """Entries of freed pages are swept relative to the pages under retention now, not to the
    heap's peak: after a 4000-page burst, at most 100 retained pages at a time keep a small heap."""
    m = make_manager(one_layer(T), tokens_per_block=4, quota=4096 * REC * T)  # (a slot: REC * T bytes)
    retention = RequestRetention([(0, None, 80, 3600.0)])
    heap = m._storage.expiries
    for i in range(31):
        tokens = list(range(100_000 * i, 100_000 * i + (4000 if i == 0 else 100) * 4))
        kv = m.create_kv_cache(input_tokens=tokens, retention=retention)
        assert kv.resume() and kv.resize(len(tokens))
        kv.commit(tokens)
        kv.close()
        m.clear_reusable_blocks()  # their heap entries are dead now
    m.check_invariants()
    assert len(heap) <= 2 * 100 + 2 * _SWEEP_SLACK  # not the 7000 entries of the burst and after


def test_releases_at_a_standing_clock_leave_one_heap_entry_a_page(make_manager: MakeManager) -> None:
    """2 retained blocks reused and released 5000 times while the clock stands still: each release
    pushes an entry identical to the last but for its sequence; the sweep keeps one a page."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a, retention=RequestRetention([(0, None, 80, 3600.0)]))
    heap = m._storage.expiries
    for _ in range(5000):
        kv = m.create_kv_cache(input_tokens=a)
        assert kv.resume()
        kv.close()
    m.check_invariants()
    assert m.get_storage_statistics()[0].retained == 2
    assert len(heap) <= 2 * 2 + 2 * _SWEEP_SLACK  # not 5000 entries
    clock.now = 3600.0  # the one entry left a page ends its retention on time
    assert m.get_storage_statistics()[0].retained == 0
    assert len(heap) == 0


def test_snapshots_of_a_hybrid_model_and_window_pages_take_the_retention(make_manager: MakeManager) -> None:
    """Recurrent layers (snapshots) beside a sliding window with sinks: every page the request
    publishes, snapshot included, is retained, and all of it expires on time."""
    clock = Clock()
    ssm = SsmLayerConfig(LayerId(100), [BufferConfig("ssm_state", 64)])
    swa = AttentionLayerConfig(LayerId(0), [BufferConfig("key", REC * T)], 2 * T, 2)
    m = make_manager([ssm, swa], tokens_per_block=T, quota=64 * REC * T, clock=clock, ssm_reuse_interval=2 * T)
    engine = FakeEngine(m)
    a = seq(1000, 4)
    kv = m.create_kv_cache(input_tokens=a[:-1], retention=RequestRetention([(0, None, 80, 10.0)]))
    assert kv.resume()
    for end in (2 * T, len(a) - 1):  # the first commit ends at a snapshot position
        h = kv.history_length
        assert kv.resize(end)
        engine.step(kv, a, h, end)
        kv.commit(a[h:end])
    kv.close()
    by_group = {s.slot_sizes: s.retained for s in m.get_storage_statistics()}
    assert by_group[(64,)] == 1  # the snapshot at 2 blocks
    assert by_group[(REC * T,)] >= 2  # the window's published pages (the sink block and the last ones)
    kv = m.create_kv_cache(input_tokens=a)  # a hybrid match ends at a snapshot
    assert kv.resume()
    assert kv.history_length == 2 * T
    engine.check_all(kv, a, kv.history_length)
    kv.close()
    clock.now = 10.0
    assert sum(s.retained for s in m.get_storage_statistics()) == 0


def test_a_later_hint_replaces_an_earlier_one_on_a_shared_history(make_manager: MakeManager) -> None:
    """A continuation that matches only part of the hinted history (its last message differs)
    leaves the first hint; its own hint, lower but longer, then replaces it on the shared blocks."""
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=6 * REC * T, clock=clock)
    engine = FakeEngine(m)
    p = seq(1000, 2)
    run(m, engine, p + seq(2000, 1), Retention(80, 10.0))
    later = p + seq(3000, 1)
    run(m, engine, later, Retention(60, 100.0))
    b = seq(4000, 2)
    run(m, engine, b, custom_priority_callback=fixed(50))
    clock.now = 20.0  # the first hint ran out; the second holds the shared blocks at 60
    pressure(m, engine, 2, 5000, 90)  # the first request's own block (35), then B's tail (50)
    assert m.probe_reuse(input_tokens=later) == 3 * T
    assert m.probe_reuse(input_tokens=b) == T
