"""Batched decode steps: ``resize_batch`` + ``commit_batch`` give exactly what the per-request
``resize`` + ``commit`` give (pages, indices, tokens, the reuse tree), the data a kernel reads
through the batch's pages is right, and misuse raises with nothing changed."""

from __future__ import annotations

import random

import pytest
from conftest import REC, attention_and_recurrent, kv_layers, make_config
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2 import (
    KVCache,
    KVCacheManager,
    KVCacheStatus,
    LogicError,
    Priority,
    SwaScratchReuseConfig,
)

T = 8


def _manager(hybrid: bool, slots: int) -> KVCacheManager:
    layers = kv_layers(4, T, window=20, swa_every=2, sink_tokens=4) if hybrid else kv_layers(2, T)
    slot = len(layers) * 2 * 32 * T
    return KVCacheManager(make_config(layers, tokens_per_block=T, quota=slot * slots))


def _state(m: KVCacheManager, caches: list[KVCache]) -> list[object]:
    out: list[object] = []
    for kv in caches:
        out.append((kv.status, kv.capacity, kv.history_length, kv.num_blocks, kv.committed_tokens))
        if kv.status is KVCacheStatus.ACTIVE:
            out.append([list(kv.get_base_page_indices(lg)) for lg in range(m.num_layer_groups)])
    out.append([(s.free, s.evictable) for s in m.get_storage_statistics()])
    out.append(m.reuse_statistics)
    return out


@pytest.mark.parametrize("hybrid", [False, True])
def test_batch_equals_per_request_calls(hybrid: bool) -> None:
    """Two identical managers, one driven request by request and one by batches, through
    prefill, decode across block boundaries and window moves, memory pressure (failed growth,
    eviction of reusable blocks) and custom priorities: the same state after every step. The
    fake engine writes and checks the KV of the batched one."""
    rng = random.Random(7)
    slots = 36
    single, batched = _manager(hybrid, slots), _manager(hybrid, slots)
    engine = FakeEngine(batched)
    system = [rng.randrange(1 << 20) for _ in range(3 * T + 2)]
    seqs: list[list[int]] = []
    pairs: list[tuple[KVCache, KVCache]] = []
    for r in range(10):
        prompt = system[: rng.randrange(len(system))] + [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 20))]
        pair = []
        for m in (single, batched):
            if r % 3 == 0:
                kv = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=lambda o, lc: Priority(o % 50))
            else:
                kv = m.create_kv_cache(input_tokens=prompt)
            assert kv.resume()
            pair.append(kv)
        a, b = pair
        h = b.history_length
        if not (a.resize(len(prompt)) and b.resize(len(prompt))):
            a.close()
            b.close()
            continue
        engine.step(b, prompt, h, len(prompt))
        a.commit(prompt[h:])
        b.commit(prompt[h:])
        seqs.append(prompt + [rng.randrange(1 << 20) for _ in range(100)])
        pairs.append((a, b))
    assert len(pairs) >= 5
    num_failed = 0
    for _step in range(60):
        live = [i for i, (a, _) in enumerate(pairs) if a.status is KVCacheStatus.ACTIVE]
        if not live:
            break
        failed_single = [j for j, i in enumerate(live) if not pairs[i][0].resize(pairs[i][0].num_committed_tokens + 1)]
        failed_batch = batched.resize_batch([pairs[i][1] for i in live])
        assert failed_batch == failed_single
        num_failed += len(failed_batch)
        assert _state(single, [p[0] for p in pairs]) == _state(batched, [p[1] for p in pairs])
        grown = [i for j, i in enumerate(live) if j not in failed_batch]
        for i in grown:
            b = pairs[i][1]
            n = b.num_committed_tokens
            engine.step(b, seqs[i], n, n + 1)
            pairs[i][0].commit([seqs[i][n]])
        batched.commit_batch([pairs[i][1] for i in grown], [seqs[i][pairs[i][1].num_committed_tokens] for i in grown])
        assert _state(single, [p[0] for p in pairs]) == _state(batched, [p[1] for p in pairs])
        for i in failed_batch[:1]:  # memory is short: one request goes away
            for kv in pairs[live[i]]:
                kv.close()
        assert _state(single, [p[0] for p in pairs]) == _state(batched, [p[1] for p in pairs])
    assert num_failed > 0  # memory ran short on the way
    for i, (a, b) in enumerate(pairs):
        if b.status is KVCacheStatus.ACTIVE:
            engine.check_all(b, seqs[i], b.num_committed_tokens)
        a.close()
        b.close()
    # the same blocks were published
    for seq in seqs:
        assert single.probe_reuse(None, seq) == batched.probe_reuse(None, seq)
    single.shutdown()
    batched.shutdown()


def test_batch_misuse_changes_nothing() -> None:
    m = _manager(False, 40)
    other = _manager(False, 40)
    caches = []
    for r in range(3):
        kv = m.create_kv_cache(input_tokens=[])
        assert kv.resume() and kv.resize(5)
        kv.commit(list(range(r, r + 4)))
        caches.append(kv)
    stranger = other.create_kv_cache(input_tokens=[])
    suspended = m.create_kv_cache(input_tokens=[])
    before = _state(m, caches)
    cases: list[tuple[object, type[Exception], str]] = [
        (lambda: m.commit_batch(caches, [1, 2]), ValueError, "3 caches but 2 tokens"),
        (
            lambda: m.commit_batch([caches[0], caches[1], caches[0]], [1, 2, 3]),
            ValueError,
            r"caches\[2\] is listed twice",
        ),
        (lambda: m.commit_batch([caches[0], stranger], [1, 2]), ValueError, "another KVCacheManager"),
        (lambda: m.commit_batch([caches[0], suspended], [1, 2]), LogicError, r"caches\[1\].*ACTIVE"),
        (lambda: m.commit_batch(caches, [1, -2, 3]), ValueError, r"caches\[1\].*outside"),
        (lambda: m.commit_batch(caches, [1, 2, 3.0]), TypeError, r"caches\[2\].*int or bytes"),
        (lambda: m.commit_batch([*caches, "x"], [1, 2, 3, 4]), TypeError, r"caches\[3\] must be a KVCache"),
        (lambda: m.resize_batch([caches[0], suspended]), LogicError, r"caches\[1\] is SUSPENDED"),
        (lambda: m.resize_batch(caches, -1), ValueError, "num_new_tokens"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()  # type: ignore[operator]
        assert _state(m, caches) == before
    # capacity: every cache has room for one more token, the second commit finds none
    m.commit_batch(caches, [7, 8, 9])
    after = _state(m, caches)
    with pytest.raises(LogicError, match=r"caches\[0\].*beyond capacity"):
        m.commit_batch(caches, [7, 8, 9])
    assert _state(m, caches) == after
    for kv in [*caches, suspended]:
        kv.close()
    stranger.close()
    m.shutdown()
    with pytest.raises(LogicError, match="shut down"):
        m.commit_batch([], [])
    other.shutdown()


def test_resize_batch_reports_who_did_not_grow() -> None:
    """Memory for one more block only: the first cache that needs one gets it, the next one is
    reported and unchanged; caches with room in their last block grow without memory."""
    m = _manager(False, 8)
    caches = []
    for n in (T, T, T - 3):  # two full blocks, one with room
        kv = m.create_kv_cache(input_tokens=[])
        assert kv.resume() and kv.resize(n)
        kv.commit([1000 * n + i for i in range(n)])
        caches.append(kv)
    filler = m.create_kv_cache(input_tokens=[])
    assert filler.resume() and filler.resize(T * (m.get_storage_statistics()[0].free - 1))
    assert m.get_storage_statistics()[0].free == 1
    before = _state(m, [caches[1]])
    assert m.resize_batch(caches) == [1]
    assert [kv.capacity for kv in caches] == [T + 1, T, T - 2]
    assert _state(m, [caches[1]])[:2] == before[:2]
    assert m.resize_batch(caches, 0) == []  # never shrinks
    assert [kv.capacity for kv in caches] == [T + 1, T, T - 2]
    for kv in [*caches, filler]:
        kv.close()
    m.shutdown()


def test_resize_batch_checks_index_buffers_before_anything_changes() -> None:
    m = _manager(False, 64)
    caches = []
    for r in range(3):
        kv = m.create_kv_cache()
        kv.resume()
        assert kv.resize(T)
        kv.commit(list(range(r * 100, r * 100 + T)))
        caches.append(kv)
    from array import array

    from kv_cache_manager_v2 import BeamIndex, LayerGroupId

    small = array("i", [0])  # one block: the next step needs two
    caches[2].set_base_page_index_buf(BeamIndex(0), LayerGroupId(0), memoryview(small))
    before = _state(m, caches)
    with pytest.raises(LogicError, match=r"caches\[2\].*index buffer"):
        m.resize_batch(caches)
    assert _state(m, caches) == before
    m.check_invariants()
    for kv in caches:
        kv.close()


def _random_manager(kind: str, slots: int) -> KVCacheManager:
    """A manager of ``kind``: full attention, sliding windows with sinks, windows with scratch
    blocks, or a hybrid (attention + recurrent) that keeps a snapshot every two blocks."""
    if kind == "hybrid":  # half the memory for live states and snapshots
        cfg = make_config(
            attention_and_recurrent(T),  # type: ignore[arg-type]
            tokens_per_block=T,
            quota=2 * 2 * REC * T * slots,
            initial_pool_ratio=[0.5, 0.5],
            ssm_snapshot_policy="interval",
            ssm_reuse_interval=2 * T,
        )
        return KVCacheManager(cfg)
    layers = list(kv_layers(4, T, window=12, swa_every=2, sink_tokens=3)) if kind != "full" else kv_layers(2, T)
    slot = len(layers) * 2 * REC * T
    extra: dict[str, object] = {"swa_scratch_reuse": SwaScratchReuseConfig()} if kind == "scratch" else {}
    return KVCacheManager(make_config(layers, tokens_per_block=T, quota=slot * slots, **extra))  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(["full", "swa", "scratch", "hybrid"]))
def test_batch_step_matches_per_request_step_on_random_batches(data: st.DataObject, kind: str) -> None:
    """Random batches (lengths, beams, members suspended for a while, memory running short, window
    crossings, snapshot positions): ``resize_batch`` + ``commit_batch`` leave exactly the state the
    per-request ``resize`` + ``commit`` leave, and a batch with a suspended member raises with
    nothing changed; the fake engine checks the KV of the batched side's single-beam caches."""
    slots = data.draw(st.integers(12, 60), label="slots")
    single, batched = _random_manager(kind, slots), _random_manager(kind, slots)
    engine = FakeEngine(batched)
    n = data.draw(st.integers(1, 6), label="requests")
    seqs: list[list[int]] = []
    pairs: list[tuple[KVCache, KVCache]] = []
    for r in range(n):
        length = data.draw(st.integers(1, 4 * T), label="prompt")
        width = data.draw(st.sampled_from([1, 1, 2]), label="beams") if kind in ("full", "swa") else 1
        prompt = [(r * 7919 + i) % 1000 for i in range(length)]
        pair = []
        for m in (single, batched):
            kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=width)
            pair.append(kv)
        a, b = pair
        h = b.history_length
        resumed = a.resume()
        assert b.resume() == resumed
        grown = resumed and a.resize(length)
        assert (grown and b.resize(length)) == grown
        if not grown:
            a.close()
            b.close()
            continue
        if width == 1:
            engine.step(b, prompt, h, length)
        a.commit(prompt[h:])
        b.commit(prompt[h:])
        seqs.append(prompt + [(r * 104729 + i) % 1000 for i in range(64)])
        pairs.append((a, b))
    steps = data.draw(st.integers(1, 40), label="steps")
    for step in range(steps):
        for a, b in pairs:  # every third step, members may leave the batch (suspended) or come back
            if step % 3 or a.status is KVCacheStatus.CLOSED or not data.draw(st.booleans(), label="toggle"):
                continue
            if a.status is KVCacheStatus.ACTIVE:
                for kv in (a, b):
                    kv.resize(kv.history_length)
                    kv.suspend()
            elif a.resume():
                assert b.resume()
        live = [i for i, (a, _b) in enumerate(pairs) if a.status is KVCacheStatus.ACTIVE]
        asleep = [i for i, (a, _b) in enumerate(pairs) if a.status is KVCacheStatus.SUSPENDED]
        if asleep:  # misuse: nothing changes
            before = _state(batched, [p[1] for p in pairs])
            with pytest.raises(LogicError, match="SUSPENDED"):
                batched.resize_batch([pairs[i][1] for i in live + asleep[:1]])
            with pytest.raises(LogicError, match="ACTIVE"):
                batched.commit_batch([pairs[i][1] for i in asleep[:1] + live], [1] * (len(live) + 1))
            assert _state(batched, [p[1] for p in pairs]) == before
        failed_single = [j for j, i in enumerate(live) if not pairs[i][0].resize(pairs[i][0].num_committed_tokens + 1)]
        assert batched.resize_batch([pairs[i][1] for i in live]) == failed_single
        assert _state(single, [p[0] for p in pairs]) == _state(batched, [p[1] for p in pairs])
        grown = [i for j, i in enumerate(live) if j not in failed_single]
        tokens = [seqs[i][pairs[i][0].num_committed_tokens] for i in grown]
        for i, token in zip(grown, tokens):
            b = pairs[i][1]
            if b.beam_width == 1:
                engine.step(b, seqs[i], b.num_committed_tokens, b.num_committed_tokens + 1)
            pairs[i][0].commit([token])
        batched.commit_batch([pairs[i][1] for i in grown], tokens)
        assert _state(single, [p[0] for p in pairs]) == _state(batched, [p[1] for p in pairs])
        for i in failed_single[:1]:  # memory is short: one request goes away
            for kv in pairs[live[i]]:
                kv.close()
    for i, (a, b) in enumerate(pairs):
        if b.status is KVCacheStatus.ACTIVE and b.beam_width == 1:
            engine.check_all(b, seqs[i], b.num_committed_tokens)
        a.close()
        b.close()
    batched.check_invariants()
    for seq in seqs:
        assert single.probe_reuse(None, seq) == batched.probe_reuse(None, seq)
    single.shutdown()
    batched.shutdown()
