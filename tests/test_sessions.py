"""Sessions (``create_kv_cache(session_id=...)``, ``EngineRequest.session_id``) and directives by
session or by prefix (``KVCacheManager.directives``): each directive's outcome and its effect on
eviction order, ``end`` keeping the blocks other sessions share, KV data checked by the fake engine."""

from __future__ import annotations

import pytest
from conftest import REC, Clock, MakeManager, fixed, make_manager_per_policy, one_layer
from fake_engine import FakeEngine
from tier_helpers import loader, run, tree_pages

from kv_cache_manager_v2 import (
    CacheLevel,
    DirectiveOutcome,
    DirectiveStatus,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    LogicError,
    ReuseScope,
    SessionId,
    compiled,
)
from kv_cache_manager_v2._config import GpuCacheTierConfig
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

T = 16
make_manager = make_manager_per_policy  # (the fixture) every test here runs under each eviction policy
APPLIED, CLIPPED, DEFERRED, NOTHING = (
    DirectiveStatus.APPLIED,
    DirectiveStatus.CLIPPED,
    DirectiveStatus.DEFERRED,
    DirectiveStatus.NOTHING_CACHED,
)


def seq(base: int, blocks: int) -> list[int]:
    return list(range(base, base + blocks * T))


def reuse(m: KVCacheManager, engine: FakeEngine, tokens: list[int], expect: int) -> None:
    """A request of ``tokens`` reuses exactly ``expect`` tokens, byte for byte."""
    assert m.probe_reuse(input_tokens=tokens) == expect
    kv = m.create_kv_cache(input_tokens=tokens)
    assert kv.resume()
    assert kv.history_length == expect
    engine.check_all(kv, tokens, expect)
    kv.close()
    m.check_invariants()


def pressure(m: KVCacheManager, engine: FakeEngine, blocks: int, base: int, priority: int = 60) -> None:
    run(m, engine, seq(base, blocks), custom_priority_callback=fixed(priority))


def with_disk(make_manager: MakeManager, tmp_path: object, **kw: object) -> KVCacheManager:
    """A manager of 4 blocks in GPU memory, 4 on the host and 16 on the disk tier in ``tmp_path``."""
    return make_manager(
        one_layer(T),
        tokens_per_block=T,
        quota=4 * REC * T,
        host_quota=4 * REC * T,
        disk_quota=16 * REC * T,
        disk_path=str(tmp_path),
        **kw,
    )


def outcome(status: DirectiveStatus, blocks: int = 0, deferred: int = 0, kept: int = 0) -> DirectiveOutcome:
    return DirectiveOutcome(status, blocks, deferred, kept)


def test_retain_by_session_and_by_prefix_decides_what_is_evicted(make_manager: MakeManager) -> None:
    clock = Clock()
    m = make_manager(one_layer(T), tokens_per_block=T, quota=6 * REC * T, clock=clock)
    engine = FakeEngine(m)
    a, b, c = seq(1000, 2), seq(2000, 2), seq(3000, 2)
    run(m, engine, a, session_id="a")
    run(m, engine, b, session_id="b")
    run(m, engine, c)  # no session: named by its prefix
    d = m.directives
    assert d.retain(SessionId("a"), 80, 5.0) == outcome(APPLIED, 2)
    assert d.retain(c + seq(9000, 1), 70) == outcome(APPLIED, 2)  # the cached full blocks of the tokens
    pressure(m, engine, 2, 4000)  # b (35) goes first
    assert m.probe_reuse(input_tokens=b) == 0
    reuse(m, engine, a, 2 * T)
    reuse(m, engine, c, 2 * T)
    clock.now = 5.0  # a's duration ran out: back to 35, below the pressure (60) and c (70)
    pressure(m, engine, 2, 5000)
    assert m.probe_reuse(input_tokens=a) == 0
    reuse(m, engine, c, 2 * T)
    assert d.retain(SessionId("nobody"), 80) == outcome(NOTHING)
    assert d.retain(seq(8000, 2), 80) == outcome(NOTHING)


def test_a_session_lowers_only_its_private_blocks_and_raises_shared_ones(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    engine = FakeEngine(m)
    system = seq(1000, 1)
    a, b = system + seq(2000, 1), system + seq(3000, 1)
    run(m, engine, a, session_id="a")
    run(m, engine, b, session_id="b")  # reuses the system prompt: shared
    d = m.directives
    assert d.retain("a", 10) == outcome(APPLIED, 1, kept=1)  # the system prompt is not lowered
    pressure(m, engine, 2, 4000)  # one victim: a's own block (10)
    assert m.probe_reuse(input_tokens=a) == T
    reuse(m, engine, b, 2 * T)
    assert d.retain("b", 90) == outcome(APPLIED, 2)  # raising reaches the shared block too
    pressure(m, engine, 2, 5000)  # the earlier pressure (60) goes, not b (90)
    reuse(m, engine, b, 2 * T)


def test_pin_by_session_is_clipped_to_the_pin_share_and_unpin_ends_it(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T, max_pinned_share=0.25)
    engine = FakeEngine(m)
    a = seq(1000, 3)
    run(m, engine, a, session_id="a", custom_priority_callback=fixed(0))  # the first to go unless pinned
    d = m.directives
    assert d.pin("a") == outcome(CLIPPED, 2, kept=1)  # 2 of 8 slots may be pinned: the first two blocks
    stats = m.get_storage_statistics()[0]
    assert stats.pinned == 2
    pressure(m, engine, 6, 2000)  # one victim: a's unpinned last block
    assert m.probe_reuse(input_tokens=a) == 2 * T
    pressure(m, engine, 6, 3000)
    reuse(m, engine, a, 2 * T)
    assert d.unpin("a") == outcome(APPLIED, 2)
    assert d.unpin("a") == outcome(NOTHING)
    pressure(m, engine, 2, 4000)  # a goes first again (priority 0)
    assert m.probe_reuse(input_tokens=a) == 0
    # by prefix: the same pin as KVCacheManager.pin's (clipped instead of refused)
    b = seq(5000, 3)
    run(m, engine, b)
    assert d.pin(b) == outcome(CLIPPED, 2, kept=1)
    assert m.unpin(b)
    assert d.pin(b[: 2 * T]) == outcome(APPLIED, 2)
    assert d.unpin(b[: 2 * T]) == outcome(APPLIED, 2)
    assert d.pin(seq(7000, 2)) == outcome(NOTHING)


def test_demote_moves_a_sessions_private_blocks_down_now(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, host_quota=8 * REC * T)
    engine = FakeEngine(m)
    system = seq(1000, 1)
    a, b = system + seq(2000, 2), system + seq(3000, 1)
    run(m, engine, a, session_id="a")
    run(m, engine, b, session_id="b")
    d = m.directives
    assert d.demote("a", 1) == outcome(APPLIED, 2, kept=1)  # the user went idle; the system prompt is shared
    assert m.probe_reuse_levels(input_tokens=a) == [0, 1, 1]
    assert m.probe_reuse_levels(input_tokens=b) == [0, 0]
    m.check_invariants()
    reuse(m, engine, a, 3 * T)  # brought back up, byte for byte
    assert d.demote(b, 1) == outcome(APPLIED, 2)  # by prefix: every block of it
    assert m.probe_reuse_levels(input_tokens=b) == [1, 1]
    kv = m.create_kv_cache(input_tokens=a)  # a request using a's blocks (in GPU memory): they stay
    assert kv.resume()
    assert d.demote(a, 1) == outcome(APPLIED, 0, kept=3)
    kv.close()
    assert d.demote(seq(8000, 1), 1) == outcome(NOTHING)
    reuse(m, engine, b, 2 * T)


def test_prefetch_brings_a_sessions_and_a_prefixs_blocks_up_from_disk(
    make_manager: MakeManager, tmp_path: object
) -> None:
    m = with_disk(make_manager, tmp_path)
    loader(m).manual = True  # reads land when the test runs them
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 1)
    run(m, engine, a, session_id="a")
    run(m, engine, b, session_id="b")
    d = m.directives
    assert d.demote("a", 2) == outcome(APPLIED, 2)  # the user went idle: to disk
    assert d.demote(b, 2) == outcome(APPLIED, 1)
    assert [p.level for p in tree_pages(m, a)] == [2, 2]
    assert d.prefetch("a") == outcome(DEFERRED, 0, 2)  # the user is typing again: read in the background
    assert [p.level for p in tree_pages(m, a)] == [2, 2]  # nothing moved before the reads land
    q = loader(m)
    while q.queued:
        q.run_queued(len(q.queued) - 1)
    assert m.poll_loads() == 2
    assert [p.level for p in tree_pages(m, a)] == [1, 1]  # the host tier: no GPU memory before admission
    assert d.prefetch("a", 1) == outcome(APPLIED, 2)  # there already
    assert d.prefetch(b + seq(9000, 1), 1) == outcome(DEFERRED, 0, 1)  # by prefix
    assert d.prefetch("nobody") == outcome(NOTHING)
    with pytest.raises(ValueError, match="to_level"):
        d.prefetch("a", 3)
    with pytest.raises(TypeError, match="to_level"):
        d.prefetch("a", True)
    while q.queued:
        q.run_queued(0)
    m.poll_loads()
    m.check_invariants()
    reuse(m, engine, a, 2 * T)  # byte for byte
    reuse(m, engine, b, T)


def test_prefetch_without_load_workers_starts_nothing(make_manager: MakeManager, tmp_path: object) -> None:
    m = with_disk(make_manager, tmp_path, load_workers=0)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a, session_id="a")
    assert m.directives.demote("a", 2) == outcome(APPLIED, 2)
    assert m.directives.prefetch("a") == outcome(APPLIED, 0, kept=2)  # the create reads what it takes
    assert [p.level for p in tree_pages(m, a)] == [2, 2]
    reuse(m, engine, a, 2 * T)


def test_end_drops_the_private_blocks_and_keeps_what_others_share(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=12 * REC * T)
    engine = FakeEngine(m)
    system = seq(1000, 1)
    turn1 = system + seq(2000, 1)
    turn2 = turn1 + seq(3000, 1)
    b = system + seq(4000, 1)
    ext = turn1 + seq(5000, 1)  # a request without a session extends a's first turn
    run(m, engine, turn1, session_id="a")
    run(m, engine, turn2, session_id="a")
    run(m, engine, b, session_id="b")
    run(m, engine, ext)
    free = m.get_storage_statistics()[0].free
    # a's own blocks: turn1's and turn2's; turn1's stays (ext needs it), the system prompt is b's too
    assert m.directives.end("a") == outcome(APPLIED, 1, kept=2)
    assert m.get_storage_statistics()[0].free == free + 1  # dropped now, not when evicted
    assert m.probe_reuse(input_tokens=turn2) == 2 * T
    reuse(m, engine, b, 2 * T)  # the other session reuses all of its blocks, byte for byte
    reuse(m, engine, ext, 3 * T)
    assert m.directives.end("a") == outcome(NOTHING)  # forgotten
    assert m.directives.end("b") == outcome(APPLIED, 1, kept=1)  # the system prompt was shared with a
    reuse(m, engine, system, T)


def test_end_keeps_a_template_the_session_published_first(make_manager: MakeManager) -> None:
    """The first session of a system prompt published it alone (private so far): ``keep`` names
    it, so its end leaves it for the sessions to come."""
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    system = seq(1000, 2)
    run(m, engine, system + seq(2000, 1), session_id="a")
    with pytest.raises(ValueError, match="reuse_scope applies to keep"):
        m.directives.end("a", None, ReuseScope(salt=1))
    assert m.directives.end("a", keep=system + [5]) == outcome(APPLIED, 1, kept=2)
    reuse(m, engine, system + seq(3000, 1), 2 * T)  # the next conversation finds it, byte for byte


def test_end_keeps_the_blocks_another_pin_holds(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    a = seq(1000, 3)
    run(m, engine, a, session_id="a")
    assert m.pin(a[: 2 * T]) == 2 * T  # the engine pinned the first two blocks by prefix
    assert m.directives.end("a") == outcome(APPLIED, 1, kept=2)  # only the unpinned last block goes
    assert m.get_storage_statistics()[0].pinned == 2
    reuse(m, engine, a, 2 * T)  # the pin still holds them, byte for byte
    assert m.unpin(a[: 2 * T])
    m.check_invariants()


def test_a_session_has_the_partial_tail_its_last_request_published(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T, host_quota=8 * REC * T)
    engine = FakeEngine(m)
    tokens = seq(1000, 2) + seq(2000, 1)[: T // 2]  # two full blocks and a partial tail, published at close
    run(m, engine, tokens, session_id="a")
    assert m.probe_reuse(input_tokens=tokens + [7]) == len(tokens)
    assert m.directives.demote("a", 1) == outcome(APPLIED, 3)
    assert m.probe_reuse_levels(input_tokens=tokens + [7]) == [1, 1, 1]
    assert m.directives.end("a") == outcome(APPLIED, 3)  # nothing of the session is left behind
    assert m.probe_reuse(input_tokens=tokens + [7]) == 0
    assert m.get_storage_statistics(CacheLevel(1))[0].free == 8
    m.check_invariants()


def test_end_defers_the_blocks_a_request_still_uses(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    engine = FakeEngine(m)
    a, b = seq(1000, 2), seq(2000, 2)
    run(m, engine, a, session_id="a", custom_priority_callback=fixed(80))
    run(m, engine, b, session_id="b")
    kv = m.create_kv_cache(input_tokens=a, session_id="a")  # the session's last request is still open
    assert m.directives.end("a") == outcome(DEFERRED, 0, 2)
    assert kv.resume()
    engine.check_all(kv, a, 2 * T)
    kv.close()
    m.check_invariants()
    pressure(m, engine, 2, 3000)  # a's blocks now go first (priority 0), before b (35)
    assert m.probe_reuse(input_tokens=a) == 0
    reuse(m, engine, b, 2 * T)


def test_an_open_requests_published_blocks_belong_to_its_session(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=8 * REC * T)
    engine = FakeEngine(m)
    tokens = seq(1000, 3)
    kv = m.create_kv_cache(input_tokens=tokens, session_id="a")
    assert kv.resume() and kv.resize(len(tokens))
    engine.step(kv, tokens, 0, len(tokens))
    kv.commit(tokens)
    assert m.directives.pin("a") == outcome(APPLIED, 3)
    kv.close()
    assert m.get_storage_statistics()[0].pinned == 3
    assert m.directives.end("a") == outcome(APPLIED, 3)  # its pin ends with it
    assert m.get_storage_statistics()[0].pinned == 0
    m.check_invariants()


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (5, TypeError, "session_id must be a str|str or None object expected"),  # (compiled: mypyc's words)
        (b"a", TypeError, "session_id must be a str|str or None object expected"),
        ("", ValueError, "non-empty str of at most 256"),
        ("x" * 257, ValueError, "non-empty str of at most 256"),
    ],
)
def test_bad_session_ids_are_refused_clearly(make_manager: MakeManager, bad: object, error: type, words: str) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T)
    with pytest.raises(error, match=words):
        m.create_kv_cache(input_tokens=seq(1, 1), session_id=bad)  # type: ignore[arg-type]
    assert m.num_open_caches == 0
    with pytest.raises(error, match=words):
        EngineRequest(1, seq(1, 1), 1, session_id=bad)  # type: ignore[arg-type]
    assert EngineRequest(1, seq(1, 1), 1, session_id=SessionId("x" * 256)).session_id == "x" * 256


def test_bad_directives_are_refused_and_change_nothing(make_manager: MakeManager) -> None:
    m = make_manager(one_layer(T), tokens_per_block=T, quota=4 * REC * T, host_quota=4 * REC * T)
    engine = FakeEngine(m)
    a = seq(1000, 2)
    run(m, engine, a, session_id="a")
    d = m.directives
    for call, error, words in [
        (lambda: d.retain(5, 50), TypeError, "session id .* or a prefix|object expected"),  # type: ignore[arg-type]
        (lambda: d.retain(b"ab", 50), TypeError, "session id .* or a prefix|object expected"),
        (lambda: d.retain("", 50), ValueError, "non-empty str"),
        (lambda: d.retain("a", 101), ValueError, r"priority must be in \[0, 100\]"),
        (lambda: d.retain("a", True), TypeError, "priority must be an int"),
        (lambda: d.retain("a", 50, 0.0), ValueError, "duration_s must be a finite number"),
        (lambda: d.retain("a", 50, reuse_scope=ReuseScope()), ValueError, "reuse_scope applies to a prefix"),
        (lambda: d.retain([1.5], 50), TypeError, "token"),  # type: ignore[list-item]
        (lambda: d.pin("a", -1.0), ValueError, "duration_s"),
        (lambda: d.demote("a", 0), ValueError, "to_level must be >= 1"),
        (lambda: d.demote("a", 2), ValueError, r"to_level must be a local cache level .* \[1, 2\)"),
        (lambda: d.demote("a", CacheLevel(True)), TypeError, "to_level must be an int"),
        (lambda: d.end(["a"]), TypeError, "session must be a session id"),
    ]:
        with pytest.raises(error, match=words):
            call()
    stats = m.get_storage_statistics()[0]
    assert (stats.retained, stats.pinned) == (0, 0)
    assert m.probe_reuse_levels(input_tokens=a) == [0, 0]
    reuse(m, engine, a, 2 * T)
    m.shutdown()
    with pytest.raises(LogicError):
        d.end("a")


def test_the_adapter_gives_requests_their_session(backend: str) -> None:
    cfg = KVCacheManagerConfig(T, [GpuCacheTierConfig(8 * REC * T)], one_layer(T), backend=backend)
    adapter = KVCacheResourceManager(cfg)
    engine = FakeEngine(adapter.manager)
    r = EngineRequest(1, seq(1000, 2), T, session_id=SessionId("chat"))
    while len(r.generated_tokens) < r.max_new_tokens:
        assert adapter.prepare_resources([r]) == []
        start = r.num_cached_tokens
        kv: KVCache = adapter.get_kv_cache(r)
        engine.step(kv, r.all_tokens(), start, start + r.num_scheduled_tokens)
        if r.samples_this_step:
            r.generated_tokens.append(9000 + len(r.generated_tokens))
        adapter.update_resources([r])
    r.state = RequestState.FINISHED
    adapter.free_resources(r)
    # the prompt's two blocks and the output's 15 tokens committed (the last is never): a partial tail
    assert adapter.manager.directives.pin("chat") == outcome(APPLIED, 3)
    bad = EngineRequest(2, seq(2000, 1), 1)
    if compiled:  # the attribute's type is checked when it is set
        with pytest.raises(TypeError):
            bad.session_id = 7  # type: ignore[assignment]
    else:  # checked at admission, nothing admitted
        bad.session_id = 7  # type: ignore[assignment]
        with pytest.raises(TypeError, match="session_id must be a str"):
            adapter.prepare_resources([bad])
        assert not adapter.has_resources(bad)
    adapter.shutdown()
