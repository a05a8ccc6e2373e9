"""The decode step's fast paths (a one-token commit, a resize within the blocks a cache holds, the
adapter's records found by slot) against the cases they must leave to the full paths: a step that
crosses a block boundary or shrinks below one, a commit that completes a block or moves a window,
copy-on-write beams, chunked prefill, hybrid models, bad tokens, and requests the adapter does not
hold. KV data through the fake engine, with the invariant checker after every step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import MakeManager, attention_and_recurrent, kv_layers, used_slots
from fake_engine import FakeEngine, next_token

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    BeamIndex,
    KVCache,
    LayerGroupId,
    LayerId,
    LogicError,
    SwaScratchReuseConfig,
    TokenId,
    TokenIdExt,
)
from kv_cache_manager_v2._config import LayerConfig
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState

T = 4
LG0 = LayerGroupId(0)


def pages(kv: KVCache, layer_group: LayerGroupId = LG0, beam: int = 0) -> list[int]:
    return [i for i in kv.get_base_page_indices(layer_group, BeamIndex(beam)) if i != BAD_PAGE_INDEX]


def test_resize_allocates_and_releases_exactly_at_block_boundaries(make_manager: MakeManager) -> None:
    """A capacity within the blocks held changes no page; one past the last block, or at or below
    the start of it, takes the full path (allocates, releases); misuse raises as before."""
    m = make_manager(kv_layers(2, T), T)
    kv = m.create_kv_cache()
    assert kv.resume()
    for capacity, blocks in [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (12, 3), (8, 2), (5, 2), (4, 1), (0, 0), (3, 1)]:
        assert kv.resize(capacity)
        assert (kv.capacity, len(pages(kv)), used_slots(m)) == (capacity, blocks, blocks), capacity
        m.check_invariants()
    eng = FakeEngine(m)
    tokens: list[TokenIdExt] = [TokenId(t) for t in range(100, 110)]
    for h in range(10):  # the decode step's resize and commit, through a block boundary and back
        assert kv.resize(h + 1)
        eng.step(kv, tokens, h, h + 1)
        kv.commit([tokens[h]])
        assert (kv.history_length, len(pages(kv))) == (h + 1, h // T + 1)
        m.check_invariants()
    eng.check_all(kv, tokens, 10)
    with pytest.raises(LogicError, match="below history_length"):
        kv.resize(9)
    with pytest.raises(TypeError):
        kv.resize(True)  # a bool is not a capacity, even where 1 would fit the blocks held
    with pytest.raises(ValueError):
        kv.resize(-1)
    with pytest.raises(LogicError, match="never shrinks"):
        kv.resize(10, 9)
    assert (kv.capacity, kv.history_length) == (10, 10)
    kv.suspend()
    with pytest.raises(LogicError, match="ACTIVE"):
        kv.resize(11)
    assert kv.capacity == 10
    kv.close()


def test_resize_within_a_shared_block_copies_it_for_each_beam(make_manager: MakeManager) -> None:
    """After beams fork on a partial block, the next resize must copy it (copy-on-write), even
    when the capacity stays within the blocks held."""
    m = make_manager(kv_layers(1, T), T)
    eng = FakeEngine(m)
    eng.check_beam_field = False  # the beams share the prompt's records
    kv = m.create_kv_cache(beam_width=2)
    assert kv.resume()
    prompt: list[TokenIdExt] = [TokenId(t) for t in range(6)]
    assert kv.resize(6)
    eng.step(kv, prompt, 0, 6)
    kv.commit([prompt, prompt], [0, 0])  # forks: the partial block [4, 6) is shared by both beams
    assert pages(kv, beam=0) == pages(kv, beam=1)
    assert kv.resize(7)  # within the second block
    assert pages(kv, beam=0)[:1] == pages(kv, beam=1)[:1] and pages(kv, beam=0)[1] != pages(kv, beam=1)[1]
    m.check_invariants()
    seqs = [[*prompt, TokenId(50 + b)] for b in range(2)]
    for b in range(2):
        eng.step(kv, seqs[b], 6, 7, beam=b)
    with pytest.raises(LogicError, match="beam_search_indices"):
        kv.commit([seqs[0][6]])  # one token without indices after the fork: refused, nothing changed
    assert kv.num_committed_tokens == 6
    kv.commit([[seqs[0][6]], [seqs[1][6]]], [0, 1])
    for b in range(2):
        eng.check_all(kv, seqs[b], 7, beam=b)
    kv.close()


def test_resize_within_the_blocks_held_moves_the_scratch_range(make_manager: MakeManager) -> None:
    """With SWA scratch reuse a prefill step's scratch blocks depend on its capacity: a smaller one
    within the same blocks takes the full path, which narrows them, so the KV still needed stays."""
    # (window 7: the scratch range of a step [0, capacity) changes within the fourth block, at 14)
    m = make_manager(kv_layers(4, T, window=7, swa_every=2), T, swa_scratch_reuse=SwaScratchReuseConfig())
    swa = m.get_layer_group_id(LayerId(0))
    eng = FakeEngine(m)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(16)
    wide = kv.get_scratch_desc(swa)
    assert kv.resize(13)
    fresh = m.create_kv_cache()
    assert fresh.resume() and fresh.resize(13)
    desc, want = kv.get_scratch_desc(swa), fresh.get_scratch_desc(swa)
    assert wide is not None and want is not None and desc is not None
    assert desc.range == want.range != wide.range
    fresh.close()
    tokens: list[TokenIdExt] = [TokenId(t) for t in range(13)]
    eng.step(kv, tokens, 0, 13)
    kv.commit(tokens)
    m.check_invariants()
    kv.close()


def test_one_token_commit_refuses_what_the_full_checks_refuse(make_manager: MakeManager) -> None:
    """Bad tokens, no room, a stopped or suspended cache: the same errors, nothing committed; a
    bytes token, an int subclass or a tuple take the full checks and commit."""
    m = make_manager(kv_layers(1, T), T)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(3)
    bad: list[tuple[object, type[Exception], str]] = [
        (True, TypeError, "bool"),
        (np.int64(3), TypeError, "int or bytes"),
        (-1, ValueError, "outside"),
        (1 << 32, ValueError, "outside"),
        (b"", ValueError, "empty"),
        ("a", TypeError, "int or bytes"),
    ]
    for token, error, match in bad:
        with pytest.raises(error, match=match):
            kv.commit([token])  # type: ignore[arg-type]
        assert kv.num_committed_tokens == 0 and kv.history_length == 0
    kv.commit([TokenId(7)])
    kv.commit([b"digest"])
    kv.commit((TokenId(9),))
    assert kv.committed_tokens == [7, b"digest", 9]
    with pytest.raises(LogicError, match="beyond capacity"):
        kv.commit([TokenId(1)])
    assert kv.num_committed_tokens == 3
    kv.suspend()
    with pytest.raises(LogicError, match="ACTIVE"):
        kv.commit([TokenId(1)])
    assert kv.resume() and kv.resize(5)
    kv.stop_committing()
    with pytest.raises(LogicError, match="stop_committing"):
        kv.commit([TokenId(1)])
    kv.close()


def test_one_token_commit_is_refused_inside_a_priority_callback(make_manager: MakeManager) -> None:
    """A commit from within another call into the manager raises before the token goes in."""
    m = make_manager(kv_layers(1, T), T)
    other = m.create_kv_cache()
    assert other.resume() and other.resize(2)
    seen: list[str] = []

    def callback(block: int, layer_group: LayerGroupId) -> int:
        try:
            other.commit([TokenId(5)])
        except LogicError as e:
            seen.append(str(e))
        return 35

    kv = m.create_kv_cache(custom_priority_callback=callback)  # type: ignore[arg-type]
    assert kv.resume() and kv.resize(1)
    assert seen and "in progress" in seen[0]
    assert other.num_committed_tokens == 0
    other.commit([TokenId(5)])
    assert other.committed_tokens == [5]
    kv.close()
    other.close()


MODELS: dict[str, tuple[Callable[[], list[LayerConfig]], dict[str, object]]] = {
    "full": (lambda: list(kv_layers(2, T)), {}),
    "window": (lambda: list(kv_layers(4, T, window=6, swa_every=2)), {}),
    "scratch": (lambda: list(kv_layers(4, T, window=6, swa_every=2)), {"swa_scratch_reuse": SwaScratchReuseConfig()}),
    "hybrid": (lambda: attention_and_recurrent(T), {"initial_pool_ratio": [0.5, 0.5], "ssm_reuse_interval": 8}),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_decode_through_the_adapter_matches_the_kv_and_publishes_every_block(
    model: str, make_manager: MakeManager
) -> None:
    """Chunked prefill, then decode steps across several block boundaries, interleaved requests: the
    KV the fake engine reads back, the invariants after every step, a window's stale pages released,
    and every block completed during decode reusable by a later request (published at once)."""
    layers, kw = MODELS[model]
    m = make_manager(layers(), T, 1 << 20, **kw)
    a = KVCacheResourceManager(manager=m)
    eng = FakeEngine(m)
    reqs = [EngineRequest(i, [TokenId(1000 * i + k) for k in range(9 + i)], 13, context_chunk_size=5) for i in range(3)]
    while any(r.state is not RequestState.FINISHED for r in reqs):
        batch = [r for r in reqs if r.state is not RequestState.FINISHED]
        assert a.prepare_resources(batch) == []
        for r in batch:
            b = r.num_cached_tokens
            want = 1 if b >= len(r.prompt_tokens) else min(5, len(r.prompt_tokens) - b)
            if model == "hybrid" and want > 1:
                want = min(want, 8 - b % 8)  # a chunk ends at the next snapshot position
            assert r.num_scheduled_tokens == want
            eng.step(a.get_kv_cache(r), r.all_tokens(), b, b + r.num_scheduled_tokens)
            if r.samples_this_step:
                r.generated_tokens.append(next_token(r))
        a.update_resources(batch)
        m.check_invariants()
        for r in batch:
            kv = a.get_kv_cache(r)
            assert kv.history_length == r.num_cached_tokens == kv.num_committed_tokens
            assert kv.capacity == kv.history_length
            if model == "full":
                assert len(pages(kv)) == (kv.history_length + T - 1) // T
            if len(r.generated_tokens) == r.max_new_tokens:
                r.state = RequestState.FINISHED
                a.free_resources(r)
    for r in reqs:  # the whole sequence but its last token (never computed) was published
        again = EngineRequest(10 + r.request_id, r.all_tokens(), 2)
        assert a.prepare_resources([again]) == []
        full = (r.num_tokens - 1) // T * T
        assert again.num_reused_tokens >= (full if model != "hybrid" else 8 * ((full - 1) // 8))
        eng.check_all(a.get_kv_cache(again), again.all_tokens(), again.num_cached_tokens)
        a.free_resources(again)
    m.check_invariants()
    a.shutdown()


def test_records_follow_their_requests_across_adapters_and_reused_slots(make_manager: MakeManager) -> None:
    """One EngineRequest in two adapters, slots freed and taken again by other requests, another
    request with a held id, a freed request prepared again: each adapter finds exactly its own."""
    a = KVCacheResourceManager(manager=make_manager(kv_layers(1, T), T))
    b = KVCacheResourceManager(manager=make_manager(kv_layers(1, T), T))
    r1 = EngineRequest(1, [TokenId(t) for t in range(6)], 4)
    r2 = EngineRequest(2, [TokenId(t) for t in range(10, 16)], 4)
    assert b.prepare_resources([r2]) == [] and a.prepare_resources([r1, r2]) == []
    assert b.prepare_resources([r1]) == []  # r1 is at slot 1 in b, slot 0 in a; r2 the other way round
    assert a.get_kv_cache(r1) is not b.get_kv_cache(r1)
    a.update_resources([r1, r2])
    b.update_resources([r2, r1])
    assert (r1.num_cached_tokens, r2.num_cached_tokens) == (6, 6)
    twin = EngineRequest(1, [TokenId(0)], 2)  # the id of a request a holds
    with pytest.raises(ValueError, match="another EngineRequest"):
        a.prepare_resources([twin])
    with pytest.raises(ValueError, match="another EngineRequest"):
        a.free_resources(twin)
    assert not a.has_resources(twin)
    a.free_resources(r1)
    assert not a.has_resources(r1) and b.has_resources(r1) and a.num_requests == 1
    r4 = EngineRequest(4, [TokenId(t) for t in range(30, 36)], 4)
    assert a.prepare_resources([r4]) == []  # r4 in a's freed slot 0, then freed: slot 0 empty again
    a.free_resources(r4)
    b.free_resources(r2)
    assert b.prepare_resources([r4]) == []  # r4 in b's slot 0: its hint names slot 0 in a too
    assert not a.has_resources(r4) and a.num_requests == 1 and b.has_resources(r4)
    b.free_resources(r4)
    assert b.prepare_resources([r2]) == [] and r2.num_reused_tokens == 5  # all but the last token
    b.update_resources([r2])
    r3 = EngineRequest(3, [TokenId(t) for t in range(20, 26)], 4)
    assert a.prepare_resources([r3]) == []  # takes r1's freed slot in a
    with pytest.raises(LogicError, match="holds no resources"):
        a.update_resources([r1])  # r1's slot in a now holds r3
    a.update_resources([r3])
    assert a.get_kv_cache(r3).history_length == 6
    for r in (r1, r2):
        r.generated_tokens.append(TokenId(99))
    assert a.prepare_resources([r1, r2]) == []  # r1 admitted again (its blocks reused), r2 decodes
    assert r1.num_reused_tokens == 6 and r2.num_scheduled_tokens == 1
    assert b.prepare_resources([r1, r2]) == []
    a.update_resources([r2, r1])
    b.update_resources([r1, r2])
    assert a.get_kv_cache(r1).history_length == b.get_kv_cache(r1).history_length == 7
    a.shutdown()
    assert b.get_kv_cache(r2).history_length == 7
    b.free_resources(r2)
    with pytest.raises(LogicError, match="holds no resources"):
        b.update_resources([r2])
    b.shutdown()


@pytest.mark.parametrize("batch", [[3], (3,), [None]])
def test_a_batch_item_that_is_no_request_is_named_in_both_modes(make_manager: MakeManager, batch: object) -> None:
    a = KVCacheResourceManager(manager=make_manager(kv_layers(1, T), T))
    for call in (a.prepare_resources, a.update_resources):
        with pytest.raises(TypeError, match="batch items must be EngineRequest, got"):
            call(batch)  # type: ignore[arg-type]
    a.shutdown()


def test_a_bad_chunk_size_on_a_decode_step_rolls_the_batch_back(make_manager: MakeManager) -> None:
    """A decode step does not use ``context_chunk_size``, but still checks it first."""
    m = make_manager(kv_layers(1, T), T)
    a = KVCacheResourceManager(manager=m)
    eng = FakeEngine(m)
    r1 = EngineRequest(1, [TokenId(t) for t in range(7)], 4)
    assert a.prepare_resources([r1]) == []
    eng.step(a.get_kv_cache(r1), r1.all_tokens(), 0, 7)
    r1.generated_tokens.append(TokenId(70))
    a.update_resources([r1])
    r2 = EngineRequest(2, [TokenId(t) for t in range(20, 27)], 4)
    r1.context_chunk_size = -1
    with pytest.raises(ValueError, match="context_chunk_size must be >= 0"):
        a.prepare_resources([r2, r1])
    assert not a.has_resources(r2) and (r1.num_cached_tokens, r1.num_scheduled_tokens) == (7, 0)
    assert a.get_kv_cache(r1).capacity == 7
    m.check_invariants()
    r1.context_chunk_size = 0
    assert a.prepare_resources([r2, r1]) == [] and r1.num_scheduled_tokens == 1
    a.shutdown()
