"""Re-entrancy and threads: a call made while another is in progress (from a priority callback or
another thread) is refused with a ``LogicError`` and changes nothing, and the call in progress ends
as if alone; a cache garbage-collected during a call is closed when the call ends."""

from __future__ import annotations

import threading

import pytest
from conftest import REC, MakeManager, cache_state, free_slots, kv_layers
from tier_helpers import SLOT, T, seq

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LogicError,
    Priority,
)


# ---------------------------------------------------------------- a call back into the manager
def test_a_priority_callback_cannot_call_back_into_the_manager(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 16)
    holder: list[KVCache] = []

    def closes_its_own_cache(o: int, lc: int) -> Priority:
        holder[0].close()
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=closes_its_own_cache)  # type: ignore[arg-type]
    holder.append(kv)
    kv.resume()
    before = free_slots(m)[0]
    with pytest.raises(LogicError, match="another call"):
        kv.resize(4 * T)
    assert kv.status is KVCacheStatus.ACTIVE and kv.capacity == 0 and free_slots(m)[0] == before
    m.check_invariants()
    kv.close()
    assert free_slots(m)[0] == 16


def test_a_one_token_commit_from_a_callback_changes_nothing(make_manager: MakeManager) -> None:
    """The decode commit's fast path is refused like any call while another is in progress,
    before the token goes in (it used to stay in the tail, unpublished)."""
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 16)
    other = m.create_kv_cache()
    other.resume()
    assert other.resize(2 * T)
    other.commit(list(range(T + 3)))
    before = other.committed_tokens

    def commits_the_other(o: int, lc: int) -> Priority:
        other.commit([7])
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=commits_the_other)  # type: ignore[arg-type]
    kv.resume()
    with pytest.raises(LogicError, match="another call"):
        kv.resize(4 * T)
    assert other.committed_tokens == before and other.history_length == T + 3
    m.check_invariants()
    kv.close()
    other.close()


def test_a_cache_collected_during_a_call_is_closed_when_it_ends(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    victim = [m.create_kv_cache()]
    victim[0].resume()
    assert victim[0].resize(3 * T)

    def drops_the_other(o: int, lc: int) -> Priority:
        victim.clear()  # its last reference: __del__ runs inside resize()
        return Priority(35)

    kv = m.create_kv_cache(custom_priority_callback=drops_the_other)  # type: ignore[arg-type]
    kv.resume()
    assert kv.resize(T)
    assert m.num_open_caches == 1
    m.check_invariants()
    kv.close()


# ---------------------------------------------------------------- calls from another thread
def test_overlapping_calls_from_two_threads_are_refused_not_corrupting() -> None:
    m = KVCacheManager(KVCacheManagerConfig(T, [GpuCacheTierConfig(2 * REC * T * 64)], kv_layers(1, T), backend="host"))
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def slow(o: int, lc: int) -> Priority:
        inside.set()
        release.wait(5)
        return Priority(35)

    a = m.create_kv_cache(custom_priority_callback=slow)  # type: ignore[arg-type]
    a.resume()
    t = threading.Thread(target=lambda: a.resize(2 * T))
    t.start()
    assert inside.wait(5)
    try:
        m.create_kv_cache()
    except LogicError as e:
        errors.append(e)
    release.set()
    t.join()
    assert len(errors) == 1 and "another call" in str(errors[0])
    assert a.capacity == 2 * T
    m.check_invariants()
    a.close()
    m.shutdown()


def test_calls_refused_while_another_thread_is_inside_change_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), T, 64 * SLOT)
    inside = threading.Event()
    release = threading.Event()

    def slow(o: int, lc: int) -> Priority:
        inside.set()
        release.wait(5)
        return Priority(35)

    a = m.create_kv_cache()
    assert a.resume() and a.resize(2 * T)
    a.commit(seq(1, T - 1))  # the next token completes a block
    b = m.create_kv_cache(custom_priority_callback=slow)  # type: ignore[arg-type]
    assert b.resume()
    t = threading.Thread(target=lambda: b.resize(2 * T))
    t.start()
    assert inside.wait(5)
    try:
        before = cache_state(a)
        for call in (
            lambda: a.commit([5]),  # completes a block
            lambda: a.commit([5, 6]),
            lambda: a.resize(4 * T),
            lambda: a.suspend(),
            lambda: a.stop_committing(),
            lambda: m.create_kv_cache(),
        ):
            with pytest.raises(LogicError, match="another call"):
                call()
            assert cache_state(a) == before
    finally:
        release.set()
        t.join()
    assert b.capacity == 2 * T
    m.check_invariants()
    a.commit([5])
    assert a.num_committed_tokens == T
    a.close()
    b.close()


@pytest.mark.skipif(kvm.compiled, reason="patches a method of a compiled class")
def test_commit_refused_after_its_idle_check_takes_its_token_back(
    make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interpreted mode can switch threads between the decode commit's idle check and its entry;
    simulated here: another call starts right after the token went into the tail."""
    from kv_cache_manager_v2._core._kv_cache import KVCache

    m = make_manager(kv_layers(2, T), T, 64 * SLOT)
    a = m.create_kv_cache()
    assert a.resume() and a.resize(2 * T)
    a.commit(seq(1, T - 1))
    commit_token = KVCache._commit_token

    def then_another_thread_enters(self: KVCache, token: int) -> bool:
        done = commit_token(self, token)
        self._ctx.busy = True
        return done

    monkeypatch.setattr(KVCache, "_commit_token", then_another_thread_enters)
    before = cache_state(a)
    with pytest.raises(LogicError, match="another call"):
        a.commit([5])
    assert cache_state(a) == before
    monkeypatch.undo()
    m._ctx.busy = False  # the other call ends
    a.commit([5])
    assert a.get_committed_tokens() == seq(1, T - 1) + [5]
    m.check_invariants()
    a.close()
