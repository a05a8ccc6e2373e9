"""The resource-manager adapter (kv_cache_manager_v2.engine): the per-step contract, all-or-nothing
preparation, capacity queries against what the manager really allocates, block tables and pool views."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import REC, attention_and_recurrent, kv_layers, make_config
from fake_engine import FakeEngine, adapter_step, next_token
from tier_helpers import seq

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BlockStoredEvent,
    CacheLevel,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheStatus,
    LayerGroupId,
    LayerId,
    LogicError,
    PageIndexMode,
    ReuseScope,
    SwaScratchReuseConfig,
    TokenId,
    TokenIdExt,
    compiled,
)
from kv_cache_manager_v2.engine import CudaBufferView, EngineRequest, KVCacheResourceManager, RequestState

T = 4


def arg_type_error(name: str) -> str | None:
    """The message to expect for a wrong argument type: compiled, mypyc checks annotations itself."""
    return None if compiled else name


@pytest.fixture
def make_adapter(backend: str) -> Iterator[Callable[..., KVCacheResourceManager]]:
    made: list[KVCacheResourceManager] = []

    def factory(
        layers: list[AttentionLayerConfig], tokens_per_block: int = T, quota: int = 1 << 16, **kw: object
    ) -> KVCacheResourceManager:
        kw["backend"] = backend
        a = KVCacheResourceManager(make_config(layers, tokens_per_block, quota, **kw))
        made.append(a)
        return a

    yield factory
    for a in made:
        a.shutdown()


def slot_bytes(num_layers: int, tokens_per_block: int = T) -> int:
    return num_layers * 2 * REC * tokens_per_block


def toks(*ranges: range) -> list[TokenIdExt]:
    return [TokenId(t) for r in ranges for t in r]


def run_to_end(adapter: KVCacheResourceManager, engine: FakeEngine, r: EngineRequest, free: bool = True) -> None:
    while len(r.generated_tokens) < r.max_new_tokens:
        assert adapter_step(adapter, engine, [r]) == []
    r.state = RequestState.FINISHED
    if free:
        adapter.free_resources(r)


# ---------------------------------------------------------------- the request protocol
def test_engine_request_validates_its_fields() -> None:
    with pytest.raises(TypeError, match=arg_type_error("request_id")):
        EngineRequest("1", [1], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_id"):
        EngineRequest(-1, [1], 1)
    with pytest.raises(ValueError, match="prompt_tokens must not be empty"):
        EngineRequest(1, [], 1)
    with pytest.raises(TypeError, match="prompt_tokens"):
        EngineRequest(1, "abc", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineRequest(1, [1], 0)
    with pytest.raises(TypeError, match=arg_type_error("context_chunk_size")):
        EngineRequest(1, [1], 1, context_chunk_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        EngineRequest(1, [1], 1, priority=101)
    with pytest.raises(TypeError, match=arg_type_error("reuse_scope")):
        EngineRequest(1, [1], 1, reuse_scope=3)  # type: ignore[arg-type]
    r = EngineRequest(7, toks(range(5)), 3)
    r.generated_tokens += toks(range(100, 102))
    assert r.num_tokens == 7
    assert r.tokens(3, 6) == [3, 4, 100] and r.tokens(5, 7) == [100, 101] and r.tokens(0, 2) == [0, 1]
    assert r.state is RequestState.CONTEXT and not r.samples_this_step


def test_adapter_request_identity_is_fixed_and_step_fields_are_checked_where_used(backend: str) -> None:
    t = 4
    a = KVCacheResourceManager(make_config(kv_layers(1, t), t, 64 * 2 * REC * t, backend=backend))
    engine = FakeEngine(a.manager)
    prompt = seq(1, 12)
    req = EngineRequest(7, prompt, 4, context_chunk_size=8)
    assert a.prepare_resources([req]) == []
    engine.step(a.get_kv_cache(req), req.all_tokens(), 0, 8)
    a.update_resources([req])
    assert req.num_cached_tokens == 8
    kv = a.get_kv_cache(req)
    before = (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity)
    for name, value in (("request_id", 8), ("prompt_tokens", seq(2, 12)), ("reuse_scope", ReuseScope(salt=1))):
        with pytest.raises(AttributeError):
            setattr(req, name, value)
    assert req.request_id == 7 and list(req.prompt_tokens) == prompt and req.reuse_scope is None
    req.context_chunk_size = -3
    with pytest.raises(ValueError, match="context_chunk_size"):
        a.prepare_resources([req])
    with pytest.raises(ValueError, match="context_chunk_size"):
        a.get_needed_resource_to_completion(req)
    assert (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity) == before
    with pytest.raises(TypeError):  # refused at assignment (compiled) or where it is used
        req.context_chunk_size = "4"  # type: ignore[assignment]
        a.prepare_resources([req])
    req.context_chunk_size = 4
    req.max_new_tokens = 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        a.get_needed_resource_to_completion(req)
    req.max_new_tokens = 4
    other = EngineRequest(9, seq(3, 8), 2)
    other.priority = 500  # type: ignore[assignment]
    with pytest.raises(ValueError, match="priority"):
        a.prepare_resources([req, other])  # the batch is rolled back: req is as it was
    assert (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity) == before
    assert a.manager.num_open_caches == 1
    assert a.prepare_resources([req]) == []
    assert req.num_scheduled_tokens == 4
    engine.step(a.get_kv_cache(req), req.all_tokens(), 8, 12)
    a.update_resources([req])
    assert a.get_kv_cache(req).history_length == 12
    a.free_resources(req)
    a.shutdown()


# ---------------------------------------------------------------- the step
def test_chunked_prefill_then_decode_and_reuse_of_prompt_minus_last_token(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(100, 112)), max_new_tokens=3, context_chunk_size=5)
    seen = []
    while r.state is RequestState.CONTEXT:
        assert a.prepare_resources([r]) == []
        seen.append((r.num_cached_tokens, r.num_scheduled_tokens, r.samples_this_step))
        b = r.num_cached_tokens
        eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
        if r.samples_this_step:
            r.generated_tokens.append(next_token(r))
        a.update_resources([r])
    assert seen == [(0, 5, False), (5, 5, False), (10, 2, True)]
    assert r.state is RequestState.GENERATION and r.num_cached_tokens == 12 and r.num_reused_tokens == 0
    run_to_end(a, eng, r)
    # the same prompt again: everything but the last token is reused (8 full + 3 of a partial block)
    r2 = EngineRequest(2, toks(range(100, 112)), max_new_tokens=1)
    assert a.prepare_resources([r2]) == []
    assert (r2.num_reused_tokens, r2.num_cached_tokens, r2.num_scheduled_tokens) == (11, 11, 1)
    assert r2.samples_this_step
    eng.check_all(a.get_kv_cache(r2), r2.all_tokens(), 11)  # the reused KV is r's
    a.update_resources([r2])
    assert r2.state is RequestState.GENERATION


def test_free_publishes_generated_blocks_and_partial_tail(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(10)), max_new_tokens=5)
    run_to_end(a, eng, r)
    # committed: the prompt and the first 4 generated tokens (the last sampled token is never computed)
    assert a.manager.probe_reuse(None, r.all_tokens()) == 14
    r2 = EngineRequest(2, r.all_tokens() + [TokenId(1)], max_new_tokens=1)
    assert a.prepare_resources([r2]) == [] and r2.num_reused_tokens == 14
    eng.check_all(a.get_kv_cache(r2), r2.all_tokens(), 14)


def test_reuse_during_generation(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    src = EngineRequest(1, toks(range(6)), max_new_tokens=20)
    for _ in range(8):
        assert adapter_step(a, eng, [src]) == []
    assert src.state is RequestState.GENERATION and src.num_cached_tokens == 13
    follow = EngineRequest(2, src.all_tokens() + [TokenId(77)], max_new_tokens=2)
    assert a.prepare_resources([follow]) == []
    assert follow.num_reused_tokens == 12  # src's 3 full blocks, published while it decodes
    eng.check_all(a.get_kv_cache(follow), follow.all_tokens(), 12)
    assert a.get_kv_cache(src).status is KVCacheStatus.ACTIVE


def test_freed_request_is_recomputed_from_its_own_reused_blocks(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    """Preemption by recompute: free, then prepare again; prompt + generated tokens are matched."""
    a = make_adapter(kv_layers(2, T, window=6, swa_every=2))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(9)), max_new_tokens=8, context_chunk_size=4)
    for _ in range(6):
        assert adapter_step(a, eng, [r]) == []
    assert r.state is RequestState.GENERATION and (r.num_cached_tokens, len(r.generated_tokens)) == (12, 4)
    a.free_resources(r)  # publishes 3 full blocks (no partial tail: 12 tokens)
    assert not a.has_resources(r) and r.num_cached_tokens == 0
    assert a.prepare_resources([r]) == []
    assert (r.num_reused_tokens, r.num_cached_tokens, r.num_scheduled_tokens) == (12, 12, 1)
    eng.check_all(a.get_kv_cache(r), r.all_tokens(), 12)
    run_to_end(a, eng, r, free=False)
    assert r.generated_tokens == [TokenId(5000 + 97 + i) for i in range(8)]
    # freed mid-prompt: the re-admission continues the prompt in chunks
    r2 = EngineRequest(2, toks(range(100, 118)), max_new_tokens=2, context_chunk_size=5)
    assert adapter_step(a, eng, [r2]) == [] and adapter_step(a, eng, [r2]) == []
    a.free_resources(r2)  # 10 tokens committed: 2 full blocks + a published partial tail of 2
    assert a.prepare_resources([r2]) == []
    assert r2.state is RequestState.CONTEXT and (r2.num_reused_tokens, r2.num_scheduled_tokens) == (10, 5)
    run_to_end(a, eng, r2)


def test_reuse_scope_isolates(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T))
    eng = FakeEngine(a.manager)
    run_to_end(a, eng, EngineRequest(1, toks(range(20)), 1, reuse_scope=ReuseScope(salt=1)))
    other = EngineRequest(2, toks(range(20)), 1, reuse_scope=ReuseScope(salt=2))
    same = EngineRequest(3, toks(range(20)), 1, reuse_scope=ReuseScope(salt=1))
    assert a.prepare_resources([other, same]) == []
    assert other.num_reused_tokens == 0 and same.num_reused_tokens == 19


def test_unserved_requests_are_left_exactly_as_they_were(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T), quota=6 * slot_bytes(1))  # 6 slots = 24 tokens
    eng = FakeEngine(a.manager)
    big = EngineRequest(1, toks(range(16)), max_new_tokens=8)  # at most 23 tokens: 6 blocks
    assert adapter_step(a, eng, [big]) == []  # 4 slots
    kv_big = a.get_kv_cache(big)
    small = EngineRequest(2, toks(range(100, 107)), max_new_tokens=2)  # 8 tokens: 2 blocks
    assert adapter_step(a, eng, [small]) == []  # memory full
    assert a.get_num_free_blocks() == 0
    before = (
        kv_big.capacity,
        kv_big.history_length,
        kv_big.num_committed_tokens,
        list(kv_big.get_base_page_indices(LayerGroupId(0))),
    )
    new = EngineRequest(3, toks(range(200, 205)), max_new_tokens=1)
    assert a.prepare_resources([big, new]) == [big, new]  # big needs a 5th block; new needs any
    assert (
        kv_big.capacity,
        kv_big.history_length,
        kv_big.num_committed_tokens,
        list(kv_big.get_base_page_indices(LayerGroupId(0))),
    ) == before
    assert kv_big.status is KVCacheStatus.ACTIVE and big.num_scheduled_tokens == 0 and big.num_cached_tokens == 16
    assert not a.has_resources(new) and (new.num_cached_tokens, new.num_scheduled_tokens, new.num_reused_tokens) == (
        0,
        0,
        0,
    )
    assert a.get_num_free_blocks() == 0 and a.manager.num_open_caches == 2
    a.update_resources([big])  # nothing prepared: a no-op
    assert kv_big.history_length == 16
    # preempt big by suspension; a suspended request that still cannot grow stays suspended
    a.suspend_resources(big)
    assert a.is_suspended(big) and a.prepare_resources([big]) == [big] and a.is_suspended(big)
    # small finishes; big resumes and completes with what small released
    run_to_end(a, eng, small)
    run_to_end(a, eng, big)
    assert a.num_requests == 0


def test_prepare_rolls_back_the_whole_batch_when_a_request_raises(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    a = make_adapter(kv_layers(1, T))
    eng = FakeEngine(a.manager)
    run_to_end(a, eng, EngineRequest(9, toks(range(50, 60)), 1))  # something to reuse
    dec = EngineRequest(1, toks(range(8)), max_new_tokens=10)
    assert adapter_step(a, eng, [dec]) == []  # cached 8, one token to decode
    sus = EngineRequest(2, toks(range(20, 27)), max_new_tokens=10)
    assert adapter_step(a, eng, [sus]) == []
    a.suspend_resources(sus)
    kv_dec, kv_sus = a.get_kv_cache(dec), a.get_kv_cache(sus)
    free = a.get_num_free_blocks()

    def state():
        return (
            kv_dec.capacity,
            kv_dec.history_length,
            kv_sus.status,
            kv_sus.capacity,
            a.num_requests,
            a.get_num_free_blocks(),
        )

    before = state()
    fresh = EngineRequest(3, toks(range(50, 60), range(3)), 1)  # would reuse 10 tokens
    finished = EngineRequest(4, toks(range(5)), 1)
    finished.state = RequestState.FINISHED
    with pytest.raises(LogicError, match="FINISHED"):
        a.prepare_resources([dec, sus, fresh, finished])
    assert state() == before and kv_sus.status is KVCacheStatus.SUSPENDED
    assert not a.has_resources(fresh) and fresh.num_reused_tokens == 0 and dec.num_scheduled_tokens == 0
    with pytest.raises(ValueError, match="twice"):
        a.prepare_resources([dec, fresh, dec])
    assert state() == before and not a.has_resources(fresh)
    with pytest.raises(TypeError, match="EngineRequest"):
        a.prepare_resources([dec, "nope"])  # type: ignore[list-item]
    assert state() == before and free == a.get_num_free_blocks()
    impostor = EngineRequest(1, toks(range(8)), 1)
    with pytest.raises(ValueError, match="another EngineRequest"):
        a.prepare_resources([impostor])
    assert adapter_step(a, eng, [dec, sus, fresh]) == [] and fresh.num_reused_tokens == 10


def test_misuse_raises_clear_errors(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(6)), max_new_tokens=3)
    with pytest.raises(LogicError, match="prepare"):
        a.update_resources([r])
    with pytest.raises(LogicError, match="holds no resources"):
        a.get_batch_cache_indices([r])
    with pytest.raises(LogicError, match="holds no resources"):
        a.suspend_resources(r)
    a.free_resources(r)  # unknown: a no-op
    assert adapter_step(a, eng, [r]) == []
    assert len(r.generated_tokens) == 1
    r.generated_tokens.clear()  # the engine forgot to append: no token left to compute
    with pytest.raises(LogicError, match="no uncomputed token"):
        a.prepare_resources([r])
    with pytest.raises(TypeError, match="EngineRequest"):
        a.free_resources(3)  # type: ignore[arg-type]
    r.generated_tokens.append(TokenId(1))
    assert a.prepare_resources([r]) == []
    r.generated_tokens.clear()  # shrinking generated tokens under a prepared step
    with pytest.raises(LogicError, match="only grow"):
        a.update_resources([r])
    a.shutdown()
    with pytest.raises(LogicError, match="shut down"):
        a.prepare_resources([r])


def test_update_after_a_bad_token_can_be_repeated(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T))
    eng = FakeEngine(a.manager)
    r1, r2 = EngineRequest(1, toks(range(5)), 4), EngineRequest(2, toks(range(50, 55)), 4)
    assert adapter_step(a, eng, [r1, r2]) == []
    r2.generated_tokens[-1] = np.int64(7)  # type: ignore[call-overload]  # a numpy int from argmax
    assert a.prepare_resources([r1, r2]) == []
    with pytest.raises(TypeError, match="int"):
        a.update_resources([r1, r2])
    assert (r1.num_cached_tokens, r1.num_scheduled_tokens) == (6, 0)
    assert (r2.num_cached_tokens, r2.num_scheduled_tokens) == (5, 1)
    r2.generated_tokens[-1] = TokenId(7)
    a.update_resources([r1, r2])
    assert r1.num_cached_tokens == 6 and r2.num_cached_tokens == 6
    assert a.get_kv_cache(r2).committed_tokens == [*range(50, 55), 7]


def test_suspend_drops_the_prepared_step_and_resume_continues(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(8)), max_new_tokens=6, context_chunk_size=3)
    assert adapter_step(a, eng, [r]) == []
    assert a.prepare_resources([r]) == [] and r.num_scheduled_tokens == 3
    kv = a.get_kv_cache(r)
    assert kv.capacity == 6
    a.suspend_resources(r)
    assert kv.status is KVCacheStatus.SUSPENDED and kv.capacity == 3 and r.num_scheduled_tokens == 0
    a.suspend_resources(r)  # already suspended: no-op
    a.update_resources([r])  # nothing prepared: no-op
    run_to_end(a, eng, r)
    assert r.generated_tokens == [TokenId(5000 + 97 + i) for i in range(6)]


def test_priority_sets_eviction_order(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T), quota=8 * slot_bytes(1))
    eng = FakeEngine(a.manager)
    low = EngineRequest(1, toks(range(100, 112)), 1, priority=10)
    high = EngineRequest(2, toks(range(200, 212)), 1, priority=90)
    run_to_end(a, eng, high)
    run_to_end(a, eng, low)  # released last, but lower priority
    filler = EngineRequest(3, toks(range(300, 315)), 1)  # 4 blocks: needs 2 evictions
    assert adapter_step(a, eng, [filler]) == []
    assert a.manager.probe_reuse(None, high.prompt_tokens) == 12
    assert a.manager.probe_reuse(None, low.prompt_tokens) < 12


# ---------------------------------------------------------------- capacity
def held_per_pool_group(a: KVCacheResourceManager, reqs: list[EngineRequest]) -> list[int]:
    """Distinct slots the requests' caches point at, per pool group (an independent count)."""
    groups = a.layer_group_pool_groups
    slots: list[set[int]] = [set() for _ in range(len(a.get_max_resource_count_per_pool_group()))]
    for lg, g in enumerate(groups):
        for idx in a.get_batch_cache_indices(reqs, LayerGroupId(lg)).values():
            slots[g].update(s for s in idx if s != BAD_PAGE_INDEX)
    return [len(s) for s in slots]


CAPACITY_LAYOUTS = {
    "full": lambda: kv_layers(2, T),
    "swa": lambda: kv_layers(3, T, window=9, swa_every=2),
    "swa_sinks": lambda: kv_layers(3, T, window=7, swa_every=2, sink_tokens=5),
    "mixed_group": lambda: kv_layers(2, T, window=6, swa_every=2, sink_tokens=1),  # SWA + full in one pool group
    "two_pool_groups": lambda: [*kv_layers(1, T), *kv_layers(2, 2 * T, window=6, swa_every=1)[1:]],
}
# the default quota split sizes SWA pool groups for one 8192-token request (a window's worth): share evenly
RATIO = {"full": None, "mixed_group": None, "swa": [0.5, 0.5], "swa_sinks": [0.5, 0.5], "two_pool_groups": [0.5, 0.5]}


@pytest.mark.parametrize("layout", sorted(CAPACITY_LAYOUTS))
def test_needed_to_completion_matches_the_real_peak(
    layout: str, make_adapter: Callable[..., KVCacheResourceManager]
) -> None:
    """Alone, a request's held slots peak at exactly what the adapter said it still needed."""
    a = make_adapter(CAPACITY_LAYOUTS[layout](), quota=1 << 18, initial_pool_ratio=RATIO[layout])
    eng = FakeEngine(a.manager)
    rng = random.Random(layout)
    for case in range(12):
        total = a.get_max_resource_count_per_pool_group()
        prompt = toks(range(1000 * case, 1000 * case + rng.randrange(1, 30)))
        r = EngineRequest(case, prompt, rng.randrange(1, 25), context_chunk_size=rng.choice([0, 1, 3, 5, 8]))
        bound = a.get_needed_resource_to_completion_per_pool_group(r)
        assert adapter_step(a, eng, [r]) == []
        held0 = held_per_pool_group(a, [r])
        need = a.get_needed_resource_to_completion_per_pool_group(r)
        assert a.get_needed_resource_to_completion(r) == sum(need)
        peak = list(held0)
        while len(r.generated_tokens) < r.max_new_tokens:
            assert a.prepare_resources([r]) == []
            peak = [max(p, h) for p, h in zip(peak, held_per_pool_group(a, [r]))]
            b = r.num_cached_tokens
            eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
            if r.samples_this_step:
                r.generated_tokens.append(next_token(r))
            a.update_resources([r])
            free = a.get_num_free_blocks_per_pool_group()
            assert [t - f for t, f in zip(total, free)] == held_per_pool_group(a, [r])  # nothing cached yet
        assert [p - h for p, h in zip(peak, held0)] == need, (case, r)
        assert all(p <= b for p, b in zip(peak, bound)), (case, peak, bound)
        assert a.get_needed_resource_to_completion_per_pool_group(r) == [0] * len(need)
        r.state = RequestState.FINISHED
        a.free_resources(r)
        a.manager.clear_reusable_blocks()


@pytest.mark.parametrize("layout", ["swa", "swa_sinks", "mixed_group"])
def test_admission_bound_holds_for_every_reuse_alignment(
    layout: str, make_adapter: Callable[..., KVCacheResourceManager]
) -> None:
    """With a cached prefix of any length, a new request never needs more than the admission bound."""
    a = make_adapter(CAPACITY_LAYOUTS[layout](), quota=1 << 18, initial_pool_ratio=RATIO[layout])
    eng = FakeEngine(a.manager)
    base = toks(range(40))
    run_to_end(a, eng, EngineRequest(0, base, 1))
    for cut in range(1, 40):
        r = EngineRequest(cut, base[:cut] + toks(range(900, 905)), 7, context_chunk_size=1 + cut % 6)
        bound = a.get_needed_resource_to_completion_per_pool_group(r)
        peak = [0] * len(bound)
        while len(r.generated_tokens) < r.max_new_tokens:
            assert a.prepare_resources([r]) == []
            peak = [max(p, h) for p, h in zip(peak, held_per_pool_group(a, [r]))]
            b = r.num_cached_tokens
            eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
            if r.samples_this_step:
                r.generated_tokens.append(next_token(r))
            a.update_resources([r])
        assert all(p <= b for p, b in zip(peak, bound)), (cut, peak, bound)
        r.state = RequestState.FINISHED
        a.free_resources(r)


def test_free_blocks_and_max_count_are_slot_sums(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(CAPACITY_LAYOUTS["two_pool_groups"](), quota=1 << 16, initial_pool_ratio=[0.5, 0.5])
    stats = a.manager.get_storage_statistics()
    assert len(stats) == 2 and a.get_max_resource_count_per_pool_group() == [s.total for s in stats]
    assert a.get_max_resource_count() == sum(s.total for s in stats) == a.get_num_free_blocks()
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(21)), 4)
    assert adapter_step(a, eng, [r]) == []
    held = held_per_pool_group(a, [r])
    assert a.get_num_free_blocks_per_pool_group() == [s.total - h for s, h in zip(stats, held)]
    assert a.get_num_free_blocks() == a.get_max_resource_count() - sum(held)
    a.free_resources(r)  # committed pages stay as reusable cache: still available
    assert a.get_num_free_blocks() == a.get_max_resource_count()


# ---------------------------------------------------------------- kernels' view
def test_block_tables_and_kernel_page_indices(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(3, T, window=5, swa_every=2), initial_pool_ratio=[0.5, 0.5])
    eng = FakeEngine(a.manager)
    r1 = EngineRequest(1, toks(range(30)), 3)
    r2 = EngineRequest(2, toks(range(100, 109)), 3)
    assert adapter_step(a, eng, [r1, r2]) == []
    for lg in range(2):
        tables = a.get_batch_cache_indices([r1, r2], LayerGroupId(lg))
        assert set(tables) == {1, 2}
        assert tables[1] is a.get_kv_cache(r1).get_base_page_indices(LayerGroupId(lg))  # live, no copy
    swa = a.get_batch_cache_indices([r1], LayerGroupId(0))[1]
    assert swa[1] == BAD_PAGE_INDEX and swa[7] != BAD_PAGE_INDEX  # out of the window: released
    for layer in range(3):
        for role in ("key", "value"):
            conv = a.manager.get_page_index_converter(LayerId(layer), role)
            lg = a.manager.get_layer_group_id(LayerId(layer))
            want = conv(a.get_kv_cache(r1).get_base_page_indices(lg), PageIndexMode.PER_LAYER)
            assert a.get_kernel_page_indices(r1, LayerId(layer), role) == want


def test_get_buffers_aliases_pool_memory(make_adapter: Callable[..., KVCacheResourceManager], backend: str) -> None:
    if backend != "host":
        pytest.skip("numpy views are for the host backend; CUDA returns CudaBufferView (tested below)")
    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    r = EngineRequest(1, toks(range(10)), 2)
    assert adapter_step(a, eng, [r]) == []
    m = a.manager
    for layer in range(2):
        lid = LayerId(layer)
        view = a.get_buffers(lid, "value", np.int32, (T, REC // 4))
        assert view.shape == (m.get_page_index_upper_bound(lid, "value"), T, REC // 4) and view.dtype == np.int32
        pages = a.get_kernel_page_indices(r, lid, "value")
        # the fake engine's record for position 6 (block 1, row 2) is visible through the view
        assert list(view[pages[1], 2, :6]) == [0x4B564B56, 6, 6, layer, 2 * layer + 1, 0]
        # a write through the view is what the manager's memory holds
        view[pages[1], 2, 1] = 12345
        addr = m.get_mem_pool_base_address(lid, "value", PageIndexMode.PER_LAYER) + pages[1] * m.get_page_stride(
            lid, "value"
        )
        assert np.frombuffer(m.backend.read(addr + 2 * REC, 8), np.int32).tolist() == [0x4B564B56, 12345]
        shared = a.get_buffers(lid, "value", index_mode=PageIndexMode.SHARED)
        spages = a.get_kernel_page_indices(r, lid, "value", PageIndexMode.SHARED)
        assert shared.dtype == np.uint8 and shared.shape[1] == m.get_page_stride(lid, "value")
        assert bytes(shared[spages[1]]) == bytes(view[pages[1]].tobytes())
        assert view.ctypes.data + pages[1] * view.strides[0] == shared.ctypes.data + spages[1] * shared.strides[0]
    with pytest.raises(ValueError, match="bytes"):
        a.get_buffers(LayerId(0), "key", np.float64, (T, 3))
    with pytest.raises(ValueError, match="role"):
        a.get_buffers(LayerId(0), "nope")
    with pytest.raises(ValueError, match="page_shape needs a dtype"):
        a.get_buffers(LayerId(0), "key", None, (T, REC))
    with pytest.raises(TypeError, match=arg_type_error("index_mode")):
        a.get_buffers(LayerId(0), "key", index_mode=1)  # type: ignore[arg-type]


def test_cuda_buffer_view_exposes_the_cuda_array_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cuda.bindings")
    import cuda.bindings
    from fake_cuda_driver import FakeDriver

    monkeypatch.setattr(cuda.bindings, "driver", FakeDriver())
    a = KVCacheResourceManager(make_config(kv_layers(2, T), T, 1 << 22, backend="cuda"))
    try:
        m = a.manager
        view = a.get_buffers(LayerId(1), "key", np.float32, (T, REC // 4))
        assert isinstance(view, CudaBufferView)
        cai = view.__cuda_array_interface__
        base = m.get_mem_pool_base_address(LayerId(1), "key", PageIndexMode.PER_LAYER)
        assert cai == {
            "shape": (m.get_page_index_upper_bound(LayerId(1), "key"), T, REC // 4),
            "typestr": "<f4",
            "data": (base, False),
            "strides": None,
            "version": 3,
        }
        assert view.nbytes == cai["shape"][0] * m.get_page_stride(LayerId(1), "key")
    finally:
        a.shutdown()


# ---------------------------------------------------------------- warm-up
def test_padding_requests(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1, T), quota=3 * slot_bytes(1))
    gen = a.add_padding_request(100)
    ctx = a.add_padding_request(101, is_generation=False)
    assert gen is not None and ctx is not None
    assert (gen.state, gen.num_cached_tokens, gen.num_scheduled_tokens, gen.num_tokens) == (
        RequestState.GENERATION,
        1,
        1,
        2,
    )
    assert (ctx.state, ctx.num_cached_tokens, ctx.num_scheduled_tokens, ctx.num_tokens) == (
        RequestState.CONTEXT,
        0,
        1,
        1,
    )
    assert a.get_kv_cache(gen).capacity == 2 and a.get_kv_cache(ctx).capacity == 1
    with pytest.raises(ValueError, match="in use"):
        a.add_padding_request(100)
    a.update_resources([gen, ctx])  # advances history, commits nothing
    assert a.get_kv_cache(gen).history_length == 2 and a.get_kv_cache(gen).num_committed_tokens == 0
    assert a.add_padding_request(102) is not None
    free = a.get_num_free_blocks()
    assert free == 0 and a.add_padding_request(103) is None and a.num_requests == 3
    for _rid, r in ((100, gen), (101, ctx)):
        a.free_resources(r)
    assert a.manager.probe_reuse(None, [TokenId(0), TokenId(0)]) == 0  # never published
    with pytest.raises(TypeError):
        a.add_padding_request("x")  # type: ignore[arg-type]


# ---------------------------------------------------------------- tiers, scratch, an existing manager
def test_wraps_an_existing_manager_and_leaves_it_running(make_manager: Callable[..., KVCacheManager]) -> None:
    em = KVCacheEventManager()
    m = make_manager(kv_layers(3, T, window=5, swa_every=2), T, 1 << 16, event_manager=em)
    a = KVCacheResourceManager(manager=m)
    assert a.manager is m
    infos = [m.get_layer_group_info(LayerGroupId(lg)) for lg in range(len(m.layer_grouping))]
    assert a.layer_group_pool_groups == [i.pool_group_index for i in infos]
    assert [(i.window_size, i.num_sink_blocks, i.layer_ids) for i in infos] == [
        (5, 0, (LayerId(0), LayerId(2))),
        (None, 0, (LayerId(1),)),
    ]
    r = EngineRequest(1, toks(range(13)), 3)
    run_to_end(a, FakeEngine(m), r)
    assert any(isinstance(e, BlockStoredEvent) for e in em.get_latest_events())  # events with the adapter
    a.shutdown()  # the adapter's requests are gone; the manager is the caller's
    assert m.probe_reuse(None, r.all_tokens()) > 0
    with pytest.raises(ValueError, match="exactly one of config or manager"):
        KVCacheResourceManager()
    with pytest.raises(ValueError, match="exactly one of config or manager"):
        KVCacheResourceManager(make_config(kv_layers(1, T)), manager=m)
    with pytest.raises(TypeError, match=arg_type_error("manager must be a KVCacheManager")):
        KVCacheResourceManager(manager=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_group_id must be in"):
        m.get_layer_group_info(LayerGroupId(2))
    m.shutdown()
    with pytest.raises(LogicError, match="shut down"):
        KVCacheResourceManager(manager=m)


def test_suspended_request_spills_to_host_and_resumes_intact(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    """With a host tier, suspending frees GPU memory: another request takes it (the suspended pages
    move down), and the next prepare brings them back with their data."""
    a = make_adapter(kv_layers(1, T), quota=8 * slot_bytes(1), host_quota=16 * slot_bytes(1), max_util_for_resume=1.0)
    m = a.manager
    eng = FakeEngine(m)
    host = CacheLevel(1)
    first = EngineRequest(1, toks(range(20)), max_new_tokens=4)  # 5 blocks, then 6
    assert adapter_step(a, eng, [first]) == []
    a.suspend_resources(first)
    assert a.get_needed_resource_to_completion_per_pool_group(first) == [6]  # its pages may spill: all again
    other = EngineRequest(2, toks(range(100, 124)), max_new_tokens=2)  # 6 blocks: only fits if first spills
    assert a.get_num_free_blocks() == 8  # first's pages count as free: the host can take them
    assert adapter_step(a, eng, [other]) == []
    assert m.get_tier_statistics(host).offloaded_pages >= 3
    assert a.prepare_resources([first]) == [first]  # other holds the GPU: first stays suspended
    run_to_end(a, eng, other)
    assert a.is_suspended(first) and first.num_cached_tokens == 20
    run_to_end(a, eng, first)  # resumed: the fake engine checks every page it attends to
    assert m.get_tier_statistics(host).onboarded_pages >= 3
    assert first.generated_tokens == [TokenId(5000 + 97 + i) for i in range(4)]


def test_needed_to_completion_of_a_suspended_request_gpu_only(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    """Without lower tiers a suspended request keeps its GPU pages: it needs only the rest."""
    a = make_adapter(kv_layers(1, T))
    r = EngineRequest(1, toks(range(10)), max_new_tokens=9)  # 3 blocks now, 5 at the end
    assert adapter_step(a, FakeEngine(a.manager), [r]) == []
    need = a.get_needed_resource_to_completion_per_pool_group(r)
    a.suspend_resources(r)
    assert a.get_needed_resource_to_completion_per_pool_group(r) == need == [2]


def prepare_loaded(a: KVCacheResourceManager, batch: list[EngineRequest]) -> list[EngineRequest]:
    """``prepare_resources`` again until no request of ``batch`` waits in the loading state."""
    deadline = time.monotonic() + 30.0
    while True:
        unserved = a.prepare_resources(batch)
        if not any(a.is_loading(r) for r in unserved):
            return unserved
        assert time.monotonic() < deadline, "background loads did not finish"
        time.sleep(0.001)


@pytest.mark.parametrize("load_workers", [0, 2])
def test_disk_read_errors_shorten_what_prepare_reuses_and_resumes(
    make_adapter: Callable[..., KVCacheResourceManager], tmp_path: object, load_workers: int
) -> None:
    """A resume that loses blocks to a failed disk read sets num_cached_tokens (and, at admission,
    num_reused_tokens) to what is intact; the engine recomputes the rest and the outputs hold.
    With background loads the reads fail in the background: the same misses."""
    a = make_adapter(
        kv_layers(1, T),
        quota=6 * slot_bytes(1),
        host_quota=8 * slot_bytes(1),
        disk_quota=32 * slot_bytes(1),
        disk_path=str(tmp_path),
        max_util_for_resume=1.0,
        load_workers=load_workers,
    )
    m = a.manager
    eng = FakeEngine(m)
    sus = EngineRequest(1, toks(range(16)), max_new_tokens=4)
    assert adapter_step(a, eng, [sus]) == []
    a.suspend_resources(sus)
    docs = [toks(range(100 * i, 100 * i + 20)) for i in range(2, 6)]
    for i, doc in enumerate(docs):  # push sus's pages and the earlier docs down to disk
        run_to_end(a, eng, EngineRequest(10 + i, doc, 1))
    assert m.probe_reuse_levels(None, docs[0][:-1])[0] == 2 and m.probe_reuse_levels(None, sus.prompt_tokens)[0] == 2
    disk = m._storage.levels[2].items[0].pools[0]
    disk.error_hook = lambda op, off, n: op == "read"  # type: ignore[union-attr]
    assert prepare_loaded(a, [sus]) == []
    assert sus.num_cached_tokens == a.get_kv_cache(sus).history_length == 0  # block 0 was lost: recompute all
    assert sus.num_scheduled_tokens == 17 and m.get_tier_statistics(CacheLevel(2)).io_errors > 0
    eng.step(a.get_kv_cache(sus), sus.all_tokens(), 0, 17)
    sus.generated_tokens.append(next_token(sus))
    a.update_resources([sus])
    run_to_end(a, eng, sus)
    assert sus.generated_tokens == [TokenId(5000 + 97 + i) for i in range(4)]
    again = EngineRequest(20, docs[0] + toks(range(7, 9)), max_new_tokens=2)
    assert prepare_loaded(a, [again]) == []
    disk.error_hook = None  # type: ignore[union-attr]
    assert again.num_reused_tokens == again.num_cached_tokens == 0 and again.num_reused_tokens_per_level == [0, 0, 0]
    assert again.num_scheduled_tokens == 22
    eng.step(a.get_kv_cache(again), again.all_tokens(), 0, 22)
    again.generated_tokens.append(next_token(again))
    a.update_resources([again])
    run_to_end(a, eng, again)


def test_reused_tokens_per_level_follow_probe_reuse_levels(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    a = make_adapter(kv_layers(1, T), quota=8 * slot_bytes(1), host_quota=16 * slot_bytes(1), max_util_for_resume=1.0)
    m = a.manager
    eng = FakeEngine(m)
    docs = [toks(range(100 * i, 100 * i + 16)) for i in range(1, 4)]  # 4 blocks each
    for i, doc in enumerate(docs):
        run_to_end(a, eng, EngineRequest(i, doc, 1))
    prompt = docs[0] + toks(range(7, 10))
    levels = m.probe_reuse_levels(None, prompt[:-1])
    assert levels == [1, 1, 1, 1]  # the oldest blocks went to host
    r = EngineRequest(9, prompt, 1)
    run_to_end(a, eng, r)
    assert r.num_reused_tokens == 16 and r.num_reused_tokens_per_level == [0, 16]
    mixed = docs[1][:6] + docs[2][:2]  # 1 block of docs[1], then 2 tokens of docs[1]'s block 1 (partial)
    levels = m.probe_reuse_levels(None, mixed)
    assert m.probe_reuse(None, mixed) == 6 and len(levels) == 2
    r2 = EngineRequest(10, mixed + toks(range(3)), 1)
    run_to_end(a, eng, r2)
    want = [0, 0]
    want[levels[0]] += 4
    want[levels[1]] += 2
    assert r2.num_reused_tokens_per_level == want and levels[0] == 1
    gpu_only = make_adapter(kv_layers(1, T))
    r3 = EngineRequest(11, toks(range(9)), 1)
    run_to_end(gpu_only, FakeEngine(gpu_only.manager), r3)
    r4 = EngineRequest(12, toks(range(9)), 1)
    assert adapter_step(gpu_only, FakeEngine(gpu_only.manager), [r4]) == [] and r4.num_reused_tokens_per_level == [8]


SCRATCH_LAYERS = lambda: kv_layers(4, T, window=6, swa_every=2)  # noqa: E731


def test_kernel_page_indices_pass_the_scratch_desc(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(SCRATCH_LAYERS(), swa_scratch_reuse=SwaScratchReuseConfig())
    m = a.manager
    eng = FakeEngine(m)
    r = EngineRequest(1, toks(range(40)), 2)  # one 40-token prefill step: its early blocks are scratch
    assert a.prepare_resources([r]) == []
    kv = a.get_kv_cache(r)
    swa = m.get_layer_group_id(LayerId(0))
    desc = kv.get_scratch_desc(swa)
    assert desc is not None and len(desc.range) > 0
    conv = m.get_page_index_converter(LayerId(2), "value")
    want = conv(kv.get_base_page_indices(swa), PageIndexMode.PER_LAYER, desc)
    assert a.get_kernel_page_indices(r, LayerId(2), "value") == want
    assert all(x >= 0 for x in want[: desc.range.end])  # scratch blocks are addressable
    with pytest.raises(LogicError, match="PER_LAYER"):
        a.get_kernel_page_indices(r, LayerId(2), "value", PageIndexMode.SHARED)
    eng.step(kv, r.all_tokens(), 0, 40)
    r.generated_tokens.append(next_token(r))
    a.update_resources([r])
    run_to_end(a, eng, r)


def test_needed_to_completion_is_an_upper_bound_with_scratch(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    """Scratch steps take fewer slots than the bound counts (out-of-window blocks share scratch slots)."""
    a = make_adapter(SCRATCH_LAYERS(), swa_scratch_reuse=SwaScratchReuseConfig())
    eng = FakeEngine(a.manager)
    below = 0
    for case, (n, chunk) in enumerate([(40, 0), (37, 16), (25, 8), (9, 0)]):
        r = EngineRequest(case, toks(range(1000 * case, 1000 * case + n)), 5, context_chunk_size=chunk)
        said = a.get_needed_resource_to_completion_per_pool_group(r)
        peak = [0] * len(said)
        while len(r.generated_tokens) < r.max_new_tokens:
            assert a.prepare_resources([r]) == []
            total, free = a.get_max_resource_count_per_pool_group(), a.get_num_free_blocks_per_pool_group()
            peak = [max(p, t - f) for p, t, f in zip(peak, total, free)]  # pages and scratch slots
            b = r.num_cached_tokens
            eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
            if r.samples_this_step:
                r.generated_tokens.append(next_token(r))
            a.update_resources([r])
        assert all(p <= s for p, s in zip(peak, said)), (case, peak, said)
        below += peak != said
        r.state = RequestState.FINISHED
        a.free_resources(r)
        a.manager.clear_reusable_blocks()
    assert below > 0


def test_step_tokens_cuts_at_the_next_snapshot_position() -> None:
    """A hybrid model's step ends at the next snapshot position (multiples of the interval, the prompt
    end rounded down to a block); an attention-only model's at the chunk size alone."""
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2.engine import step_tokens

    layers: list[kvm.AttentionLayerConfig | kvm.SsmLayerConfig] = [
        kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)]),
        kvm.SsmLayerConfig(kvm.LayerId(1), [kvm.BufferConfig("conv_state", 32), kvm.BufferConfig("ssm_state", 96)]),
    ]
    hybrid = [7, 8, 15, 16, 23, 24, 31, 32, 39, 40, 44, 46]
    for with_state, want in ((True, hybrid), (False, [7, 14, 21, 28, 35, 42, 46])):
        config = kvm.KVCacheManagerConfig(
            tokens_per_block=2,
            cache_tiers=[kvm.GpuCacheTierConfig(1 << 16)],
            layers=layers if with_state else layers[:1],
            ssm_reuse_interval=8 if with_state else None,
            typical_step=kvm.BatchDesc([kvm.KVCacheDesc(46, 39)]),  # the default (4096 tokens) leaves 1 state slot
            backend="host",
        )
        rm = KVCacheResourceManager(config)
        req = EngineRequest(0, list(range(46)), 1, context_chunk_size=7)  # created with 45 tokens: prompt end 44
        ends = []
        while req.state is RequestState.CONTEXT:
            assert rm.prepare_resources([req]) == []
            kv = rm.get_kv_cache(req)
            assert req.num_scheduled_tokens == step_tokens(kv, req.num_cached_tokens, 46 - req.num_cached_tokens, 7)
            ends.append(req.num_cached_tokens + req.num_scheduled_tokens)
            if req.samples_this_step:
                req.generated_tokens.append(kvm.TokenId(0))
            rm.update_resources([req])
        assert ends == want, ends
        rm.shutdown()


def held_with_states(a: KVCacheResourceManager, r: EngineRequest) -> list[int]:
    """``held_per_pool_group`` plus the request's live recurrent states (an independent count)."""
    held = held_per_pool_group(a, [r])
    kv = a.get_kv_cache(r)
    states: set[tuple[int, int]] = set()
    for lg, g in enumerate(a.layer_group_pool_groups):
        if a.manager.get_layer_group_info(LayerGroupId(lg)).kind == "recurrent":
            states.add((g, kv.get_ssm_state_index(LayerGroupId(lg))))
    for g, _ in states:
        held[g] += 1
    return held


@pytest.mark.parametrize("suspended", [False, True])
def test_needed_to_completion_counts_no_held_live_state(
    suspended: bool, make_adapter: Callable[..., KVCacheResourceManager]
) -> None:
    """Issue 38.2: an admitted hybrid request already holds its live state (ACTIVE, or suspended on
    a GPU-only manager, where it stays in GPU memory): it needs no more state slots, and its block
    slots exactly to its real peak (it once said one state slot more)."""
    a = make_adapter(attention_and_recurrent(T), initial_pool_ratio=[0.5, 0.5], ssm_reuse_interval=8)
    eng = FakeEngine(a.manager)
    kinds = [a.manager.get_layer_group_info(LayerGroupId(lg)).kind for lg in range(a.manager.num_layer_groups)]
    state_pool = a.layer_group_pool_groups[kinds.index("recurrent")]
    r = EngineRequest(1, toks(range(10)), max_new_tokens=9, context_chunk_size=3)
    assert adapter_step(a, eng, [r]) == []
    held0 = held_with_states(a, r)
    assert held0[state_pool] == 1
    need = a.get_needed_resource_to_completion_per_pool_group(r)
    if suspended:
        a.suspend_resources(r)
        assert a.get_needed_resource_to_completion_per_pool_group(r) == need
    assert need[state_pool] == 0
    peak = list(held0)
    while len(r.generated_tokens) < r.max_new_tokens:
        assert adapter_step(a, eng, [r]) == []
        if len(r.generated_tokens) < r.max_new_tokens:
            peak = [max(p, h) for p, h in zip(peak, held_with_states(a, r))]
    assert [p - h for p, h in zip(peak, held0)] == need
    assert a.get_needed_resource_to_completion_per_pool_group(r) == [0, 0]
    r.state = RequestState.FINISHED
    a.free_resources(r)


def test_an_array_prompt_is_committed_in_slices_and_reused_by_a_list_prompt(
    make_adapter: Callable[..., KVCacheResourceManager],
) -> None:
    """A prompt chunk is committed as a slice of the prompt (no token list rebuilt per step: an
    ``array('I')`` prompt's blocks stay arrays, no int object per token); its blocks are reused by
    the same tokens given as a list, with the first request's KV."""
    from array import array

    a = make_adapter(kv_layers(2, T))
    eng = FakeEngine(a.manager)
    tokens: list[TokenIdExt] = list(range(300, 300 + 6 * T + 2))
    r = EngineRequest(1, array("I", tokens), max_new_tokens=2, context_chunk_size=2 * T)
    while r.state is RequestState.CONTEXT:
        assert adapter_step(a, eng, [r]) == []
    blocks = a.get_kv_cache(r)._committed_blocks
    assert len(blocks) == 6 and all(type(b) is array for b in blocks), [type(b) for b in blocks]
    run_to_end(a, eng, r)
    r2 = EngineRequest(2, [*tokens, 7], max_new_tokens=1, context_chunk_size=2 * T)
    assert a.prepare_resources([r2]) == []
    assert r2.num_reused_tokens == len(tokens)
    eng.check_all(a.get_kv_cache(r2), r2.all_tokens(), len(tokens))  # the reused KV is r's
    a.update_resources([r2])


def test_observe_step_sets_the_managers_prefill_rate(make_adapter: Callable[..., KVCacheResourceManager]) -> None:
    a = make_adapter(kv_layers(1))
    m = a.manager
    a.observe_step(0.5, 0)  # a decode-only step says nothing about prefill
    assert m.load_plan_statistics.prefill_tokens_per_s is None
    a.observe_step(0.5, 1000)
    assert m.load_plan_statistics.prefill_tokens_per_s == 2000.0
    a.observe_step(0.25, 1000)  # 4000 tokens/s, weighted a fifth
    assert m.load_plan_statistics.prefill_tokens_per_s == pytest.approx(0.8 * 2000 + 0.2 * 4000)
    with pytest.raises(TypeError, match="prefill_tokens must be an int"):
        a.observe_step(0.5, 10.0)
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        a.observe_step(-1.0, 10)
    with pytest.raises(TypeError, match="seconds must be a number"):
        a.observe_step(True, 10)
    assert m.load_plan_statistics.prefill_tokens_per_s == pytest.approx(2400.0)
    a.observe_step(1e-320, 1000)  # too short to time: no sample (its rate would be infinite)
    a.observe_step(1e-305, 10_000)  # (10,000 / 1e-305 is infinite too, though 1 / 1e-305 is not)
    assert m.load_plan_statistics.prefill_tokens_per_s == pytest.approx(2400.0)
    assert m._planner.step_s == 0.0  # (no background loads: no request waits apart from the steps)


@pytest.mark.parametrize("decode_first", [True, False])
def test_decode_steps_get_memory_in_batch_order(
    make_adapter: Callable[..., KVCacheResourceManager], decode_first: bool
) -> None:
    """Memory goes in batch order: with one free slot, the request listed first of a decode step
    at a block boundary and an admission gets it, the other is unserved and unchanged; a decode
    step inside its block needs none."""
    a = make_adapter(kv_layers(1, T), quota=slot_bytes(1) * 4)
    eng = FakeEngine(a.manager)
    full = EngineRequest(1, toks(range(T)), 4)  # its next token starts a block
    inside = EngineRequest(2, toks(range(100, 103)), 4)
    assert adapter_step(a, eng, [full, inside]) == []  # prefill: 2 slots, then full needs its second
    newcomer = EngineRequest(3, toks(range(200, 200 + T)), 4)  # 2 blocks: one slot left, the 4th
    assert a.manager.get_storage_statistics()[0].free == 2
    filler = EngineRequest(4, toks(range(300, 301)), 4)
    assert adapter_step(a, eng, [filler]) == []  # one slot left
    batch = [inside, full, newcomer] if decode_first else [newcomer, inside, full]
    before = a.get_kv_cache(full).capacity
    unserved = a.prepare_resources(batch)
    assert unserved == ([newcomer] if decode_first else [full])
    assert a.get_kv_cache(full).capacity == (before + 1 if decode_first else before)
    assert inside.num_scheduled_tokens == 1 and inside.num_cached_tokens == 3
    served = [r for r in batch if r not in unserved]
    for r in served:
        b = r.num_cached_tokens
        eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
        if r.samples_this_step:
            r.generated_tokens.append(next_token(r))
    a.update_resources(served)
    for r in served:
        eng.check_all(a.get_kv_cache(r), r.all_tokens(), r.num_cached_tokens)
    a.manager.check_invariants()
