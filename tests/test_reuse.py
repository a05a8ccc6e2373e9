"""Prefix reuse through the fake engine: full and partial blocks (partial matching scales with
siblings), reuse during generation, scopes (and their roots), dedup, eviction order, slot
accounting, and token validation."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import pytest
from conftest import REC, MakeManager, kv_layers, toks
from fake_engine import FakeEngine
from tier_helpers import publish, serve

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    LayerGroupId,
    PageStatus,
    Priority,
    ReuseScope,
    TokenIdExt,
)
from kv_cache_manager_v2._reuse._keys import BlockHasher, block_key, encode_tokens, scope_key
from kv_cache_manager_v2._reuse._node import Node, common_prefix_len
from kv_cache_manager_v2._reuse._tree import ReuseTree

T = 8
LG0 = LayerGroupId(0)


def test_same_prompt_reuses_full_blocks_with_correct_data(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(3, T))
    engine = FakeEngine(m)
    prompt = toks(1, 45)
    a = m.create_kv_cache(input_tokens=prompt)
    assert a.num_committed_tokens == 0
    serve(engine, a, prompt)
    a.close()
    assert m.probe_reuse(None, prompt) == 45  # close() published the partial tail too
    b = m.create_kv_cache(input_tokens=prompt[:40] + toks(2, 10))
    assert b.status.name == "SUSPENDED"
    assert b.num_committed_tokens == b.history_length == b.capacity == 40
    serve(engine, b, prompt[:40] + toks(2, 10))
    stats = m.reuse_statistics
    assert stats.reused_blocks == 5 and stats.hit_rate > 0
    b.close()


def test_partial_block_is_copied_and_original_stays_intact(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    writer = toks(3, 32)
    publish(m, writer, engine=engine)
    # shares 20 tokens: 2 full blocks + 4 tokens of block 2
    second = writer[:20] + toks(4, 20)
    assert m.probe_reuse(None, second) == 20
    b = m.create_kv_cache(input_tokens=second)
    assert b.history_length == 20
    serve(engine, b, second)  # writes positions 20..39 into its private copy of block 2
    idx_b = b.get_base_page_indices(LG0)
    third = m.create_kv_cache(input_tokens=writer)
    assert third.history_length == 32
    assert third.resume()
    assert third.get_base_page_indices(LG0)[2] != idx_b[2]
    engine.check_all(third, writer, 32)  # the writer's block 2 still holds the writer's tokens
    b.close()
    third.close()


def test_partial_reuse_can_be_disabled(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), enable_partial_reuse=False)
    engine = FakeEngine(m)
    writer = toks(5, 32)
    publish(m, writer, engine=engine)
    assert m.probe_reuse(None, writer[:20] + [1, 2, 3]) == 16


def test_partial_match_looks_at_a_few_siblings_whatever_their_number(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 4000)
    template = list(range(1, 2 * T + 1))  # a chat template shared by every conversation
    for conv in range(600):
        kv = m.create_kv_cache()
        kv.resume()
        toks = [*template, 7, 7, 7, conv + 100, *range(4)]  # next block: same first tokens
        assert kv.resize(len(toks))
        kv.commit(toks)
        kv.close()
    node = m._tree.roots[(None, None)].children()[0].children()[0]
    query = [7, 7, 7, 345, 0, 1]
    assert len(node.partial_candidates(query)) <= 2
    best, n = node.best_partial(query, m._tree.partial_groups)
    brute = max(node.children(), key=lambda c: sum(1 for _ in iter_common(c.tokens, query)))
    assert best is not None and n == 6 and best.tokens[:6] == brute.tokens[:6]
    assert m.probe_reuse(input_tokens=[*template, *query]) == 2 * T + 6
    assert m.probe_reuse(input_tokens=[*template, 7, 7, 7, 99999]) == 2 * T + 3


def iter_common(a: tuple[object, ...], b: list[int]) -> list[int]:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(1)
    return out


def test_block_committed_during_decode_is_reused_before_the_writer_finishes(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    full = toks(6, 40)
    a = m.create_kv_cache(input_tokens=full[:12])
    serve(engine, a, full[:30], decode=20)  # prompt 10 (+2), then decode up to 30 tokens
    assert a.status.name == "ACTIVE" and a.num_committed_tokens == 30
    assert m.probe_reuse(None, full[:30]) == 24  # the 3 full blocks committed so far
    b = m.create_kv_cache(input_tokens=full[:24] + toks(7, 8))
    assert b.history_length == 24
    assert b.get_base_page_indices(LG0).tolist() == [BAD_PAGE_INDEX] * 3  # suspended: no live indices
    serve(engine, b, full[:24] + toks(7, 8))
    assert b.get_base_page_indices(LG0)[:3].tolist() == a.get_base_page_indices(LG0)[:3].tolist()
    page = a.block_table.pages[0][0]
    assert page is not None and page.status is PageStatus.LOCKED and page.num_locks == 2
    a.close()
    b.close()


def test_scopes_isolate(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    prompt = toks(8, 24)
    a = m.create_kv_cache(ReuseScope(lora_id=1, salt=7), prompt)
    serve(engine, a, prompt)
    a.close()
    assert m.probe_reuse(ReuseScope(lora_id=1, salt=7), prompt) == 24
    assert m.probe_reuse(ReuseScope(lora_id=1, salt=8), prompt) == 0
    assert m.probe_reuse(ReuseScope(lora_id=2, salt=7), prompt) == 0
    assert m.probe_reuse(None, prompt) == 0
    b = m.create_kv_cache(ReuseScope(salt=7), prompt)
    assert b.history_length == 0
    b.close()


def test_empty_scope_roots_go_away_with_their_last_block(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * REC * T * 8)
    for salt in range(200):
        kv = m.create_kv_cache(ReuseScope(salt=salt))
        kv.resume()
        assert kv.resize(T)
        kv.commit(list(range(T)))
        kv.close()  # one cached block per salt; 8 slots: older salts are evicted
    assert len(m._tree.roots) <= 8
    m.clear_reusable_blocks()
    assert len(m._tree.roots) == 0


@pytest.mark.parametrize("decode", [0, 18])
def test_identical_blocks_are_deduplicated(make_manager: MakeManager, decode: int) -> None:
    """``decode``: the last tokens committed one at a time (the decode step's commit completes those blocks)."""
    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    prompt = toks(9, 24)
    a, b = m.create_kv_cache(input_tokens=prompt), m.create_kv_cache(input_tokens=prompt)
    serve(engine, a, prompt, decode)
    used_after_a = m.get_storage_statistics()[0].unavailable
    serve(engine, b, prompt, decode)  # computed the same blocks again; commit switches to a's pages
    assert b.get_base_page_indices(LG0).tolist() == a.get_base_page_indices(LG0).tolist()
    assert m.get_storage_statistics()[0].unavailable == used_after_a
    engine.check_all(b, prompt, 24)
    a.close()
    b.close()


def test_stop_committing_publishes_the_partial_tail(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    prompt = toks(10, 21)
    a = m.create_kv_cache(input_tokens=prompt)
    serve(engine, a, prompt)
    assert m.probe_reuse(None, prompt) == 16
    a.stop_committing()
    assert m.probe_reuse(None, prompt) == 21
    a.close()


def test_eviction_takes_lowest_priority_then_least_recently_used(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * 32 * T * 6)  # 6 slots
    engine = FakeEngine(m)
    prompts = {name: toks(20 + i, 8) for i, name in enumerate("abcd")}
    prio = {"a": 50, "b": 10, "c": 50, "d": 10}
    for name in "abcd":  # release order a, b, c, d
        kv = m.create_kv_cache(
            input_tokens=prompts[name], custom_priority_callback=lambda o, lc, p=prio[name]: Priority(p)
        )
        serve(engine, kv, prompts[name])
        kv.close()
    assert m.get_storage_statistics()[0].evictable == 4
    x = m.create_kv_cache()
    assert x.resume() and x.resize(3 * T)  # 2 free + evicts 1: b (prio 10, older than d)
    assert [m.probe_reuse(None, prompts[n]) for n in "abcd"] == [8, 0, 8, 8]
    assert x.resize(4 * T)  # evicts d
    assert [m.probe_reuse(None, prompts[n]) for n in "abcd"] == [8, 0, 8, 0]
    assert x.resize(5 * T)  # then a (prio 50, older than c)
    assert [m.probe_reuse(None, prompts[n]) for n in "abcd"] == [0, 0, 8, 0]
    assert not x.resize(7 * T)  # only 1 more is evictable: all or nothing
    assert [m.probe_reuse(None, prompts[n]) for n in "abcd"] == [0, 0, 8, 0]
    x.close()


def test_a_low_priority_parent_is_not_evicted_before_its_children(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * 32 * T * 4)
    engine = FakeEngine(m)
    prompt = toks(30, 24)
    kv = m.create_kv_cache(input_tokens=prompt, custom_priority_callback=lambda o, lc: Priority(10 if o == 0 else 60))
    serve(engine, kv, prompt)
    kv.close()  # children are capped at their parent's priority 10; the tail is the oldest
    x = m.create_kv_cache()
    assert x.resume() and x.resize(2 * T)  # 1 free + evict exactly one page: the tail (block 2)
    assert m.probe_reuse(None, prompt) == 2 * T
    st = m.get_storage_statistics()[0]
    assert st.evictable == 2 and st.free == 0
    x.close()


def test_swa_reuse_needs_only_window_pages(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T, window=12, swa_every=2))
    engine = FakeEngine(m)
    prompt = toks(40, 48)
    publish(m, prompt, engine=engine)
    assert m.probe_reuse(None, prompt) == 48
    b = m.create_kv_cache(input_tokens=prompt + toks(41, 8))
    assert b.history_length == 48
    assert b.resume()
    idx = b.get_base_page_indices(LG0)
    assert idx[0] == BAD_PAGE_INDEX and idx[5] != BAD_PAGE_INDEX
    b.suspend()
    assert set(idx) == {BAD_PAGE_INDEX}  # the live array: hidden while suspended
    serve(engine, b, prompt + toks(41, 8))
    b.close()
    m.clear_reusable_blocks()
    assert all(s.free == s.total for s in m.get_storage_statistics())


def test_everything_closed_and_cleared_returns_every_slot(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T))
    engine = FakeEngine(m)
    system = toks(50, 20)
    caches = []
    for r in range(5):
        p = system + toks(60 + r, 13)
        kv = m.create_kv_cache(input_tokens=p)
        serve(engine, kv, p, decode=3)
        caches.append(kv)
    caches[1].suspend()
    for kv in caches:
        kv.close()
    st = m.get_storage_statistics()[0]
    assert st.evictable > 0 and st.available == st.total
    m.clear_reusable_blocks()
    st = m.get_storage_statistics()[0]
    assert st.free == st.total and m.probe_reuse(None, system) == 0


def test_keys_are_collision_free_and_scoped() -> None:
    root = scope_key(ReuseScope())
    assert scope_key(ReuseScope(salt=1)) != root != scope_key(ReuseScope(lora_id=1))
    assert scope_key(ReuseScope(lora_id=1)) != scope_key(ReuseScope(salt=1))
    one = (1).to_bytes(4, "little")
    assert encode_tokens([one]) != encode_tokens([1])  # type: ignore[list-item]
    assert encode_tokens([b"\x01\x00\x00\x00\x02\x00\x00\x00"]) != encode_tokens([one, (2).to_bytes(4, "little")])
    assert block_key(root, [1, 2]) != block_key(root, [1, 2, 0])  # type: ignore[list-item]
    assert len(block_key(root, [5])) == 32  # type: ignore[list-item]


def test_bytes_tokens_are_reused_only_when_equal(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    img1, img2 = b"\x11" * 32, b"\x22" * 32
    p1 = [img1] * 8 + toks(70, 8)
    kv = m.create_kv_cache(input_tokens=p1)
    serve(engine, kv, p1)  # type: ignore[arg-type]
    kv.close()
    assert m.probe_reuse(None, p1) == 16
    assert m.probe_reuse(None, [img2] * 8 + toks(70, 8)) == 0


def test_block_hasher_matches_block_key() -> None:
    from array import array

    from kv_cache_manager_v2._reuse._keys import BlockHasher

    root = scope_key(ReuseScope(salt=3))
    plain = toks(80, 150)  # several lazily encoded chunks of 16 blocks of 4
    mixed: list[object] = plain[:70] + [b"\x01" * 32] + plain[71:]
    for seq in (plain, mixed, array("I", plain)):
        keys = BlockHasher(seq, 4, "tokens").chain(root)  # type: ignore[arg-type]
        assert len(keys) == 38  # the last block is partial
        parent = root
        for o, k in enumerate(keys):
            assert k == block_key(parent, list(seq[o * 4 : (o + 1) * 4]))  # type: ignore[arg-type]
            parent = k
    with pytest.raises(ValueError, match="outside"):
        BlockHasher(plain[:100] + [-5], 4, "tokens").chain(root)  # type: ignore[arg-type]


def test_array_tokens_match_list_tokens(make_manager: MakeManager) -> None:
    from array import array

    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    prompt = toks(90, 40)
    publish(m, prompt, engine=engine)
    ids = array("I", prompt)
    assert m.probe_reuse(None, ids) == m.probe_reuse(None, prompt) == 40
    kv = m.create_kv_cache(input_tokens=ids)
    assert kv.history_length == 40 and kv.committed_tokens == prompt
    kv.close()
    with pytest.raises(ValueError, match="outside"):
        m.probe_reuse(None, prompt[:20] + [-1] + prompt[21:])


def test_resume_refuses_above_max_util_and_changes_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=2 * 32 * T * 10, max_util_for_resume=0.8)  # 10 slots
    engine = FakeEngine(m)
    writer = toks(95, 16)
    a = m.create_kv_cache(input_tokens=writer)
    serve(engine, a, writer)  # 2 slots, kept locked
    filler = m.create_kv_cache()
    assert filler.resume() and filler.resize(6 * T)  # 8 of 10 slots used
    b = m.create_kv_cache(input_tokens=writer[:12] + [7, 7, 7])  # partial match: needs a private copy
    assert b.history_length == 12
    assert not b.resume()  # 9/10 > 0.8
    assert b.status.name == "SUSPENDED" and b.history_length == 12
    assert filler.resize(4 * T)
    assert b.resume()
    engine.check_all(b, writer[:12], 12)
    for kv in (a, b, filler):
        kv.close()


def test_failing_priority_callback_on_resume_changes_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    engine = FakeEngine(m)
    writer = toks(97, 16)
    publish(m, writer, engine=engine)
    calls = []

    def cb(o: int, lc: int) -> Priority:
        calls.append(o)
        if len(calls) == 1:
            raise RuntimeError("scheduler bug")
        return Priority(40)

    b = m.create_kv_cache(input_tokens=writer[:12] + [1, 2], custom_priority_callback=cb)  # type: ignore[arg-type]
    stats = m.get_storage_statistics()
    with pytest.raises(RuntimeError, match="scheduler bug"):
        b.resume()
    assert b.status.name == "SUSPENDED" and m.get_storage_statistics() == stats
    assert b.resume()  # the second try copies the partial block
    engine.check_all(b, writer[:12], 12)
    b.close()


def test_bad_tokens_in_create_leave_nothing_open(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    publish(m, toks(99, 16))
    with pytest.raises(TypeError):
        m.create_kv_cache(input_tokens=toks(99, 8) + [1.5] + toks(5, 8))  # type: ignore[list-item]
    assert m.num_open_caches == 0
    stats = m.get_storage_statistics()[0]
    assert stats.evictable == 2  # the published blocks are untouched (no holds taken)


def test_partially_matched_tokens_are_validated(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(3)
    kv.commit([11, 12, 13])
    kv.close()
    with pytest.raises(TypeError, match="input_tokens"):
        m.create_kv_cache(input_tokens=[11.0, 12.0, 13.0, 14.0])  # type: ignore[list-item]
    assert m.num_open_caches == 0


@pytest.mark.parametrize(
    "tokens, error",
    [
        ([1, -1], ValueError),
        ([1, 2**32], ValueError),
        ([True, 2], TypeError),
        ([np.int64(3), 2], TypeError),
        (np.arange(20, dtype=np.int64), TypeError),
        ([1, b""], ValueError),
        ([1, 2.5], TypeError),
        ([*range(100), -3], ValueError),  # far past any block the match looks at
    ],
)
def test_bad_tokens_are_refused_in_both_modes(make_manager: MakeManager, tokens: object, error: type) -> None:
    m = make_manager(kv_layers(1, T))
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(2 * T)
    kv.commit(list(range(2 * T)))
    kv.close()
    with pytest.raises(error, match="input_tokens"):
        m.create_kv_cache(input_tokens=tokens)  # type: ignore[arg-type]
    with pytest.raises(error, match="input_tokens"):
        m.probe_reuse(input_tokens=tokens)  # type: ignore[arg-type]
    k = m.create_kv_cache()
    k.resume()
    assert k.resize(200)
    with pytest.raises(error, match="accepted_input_tokens"):
        k.commit(tokens)  # type: ignore[arg-type]
    assert k.num_committed_tokens == 0
    k.close()
    assert m.num_open_caches == 0


def test_bytes_are_not_a_token_sequence(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    with pytest.raises(TypeError, match=r"\[digest\]"):
        m.create_kv_cache(input_tokens=b"\x01" * 32)
    with pytest.raises(TypeError, match="input_tokens"):
        m.probe_reuse(None, b"abc")
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(T)
    for bad in (b"a", b"abc", "abc"):
        with pytest.raises(TypeError, match="accepted_input_tokens"):
            kv.commit(bad)  # type: ignore[arg-type]
    assert kv.num_committed_tokens == 0
    kv.commit([b"a digest"])  # a digest token in a list is fine
    assert kv.committed_tokens == [b"a digest"]
    kv.close()


def _reference_match(
    tree: ReuseTree, root: Node, hasher: BlockHasher, partial: bool
) -> tuple[list[Node], Node | None, int]:
    """The match as first specified: walk every full block by key, pick the best partial child
    (the longest common prefix among the children holding a page of every attention group, scanning
    them all), then drop everything from the first block some layer group needs a page for but has
    none (checking every block outside each group's stale range), until nothing is missing."""
    t = tree.tokens_per_block
    tokens = hasher.tokens
    nodes: list[Node] = []
    node = root
    while len(nodes) < len(tokens) // t and node.has_children:
        child = node.child(hasher.key(node.key, len(nodes)))
        if child is None:
            break
        nodes.append(child)
        node = child
    part: Node | None = None
    part_len = 0
    if partial and len(nodes) * t < len(tokens) and node.has_children:
        rest = tokens[len(nodes) * t : (len(nodes) + 1) * t]
        groups = [g for g, policy in enumerate(tree.layer_groups) if not policy.keeps_live_state]
        for child in node.children():
            n = common_prefix_len(child.tokens, rest)
            if n > part_len and all(child.page(g) is not None for g in groups):
                part, part_len = child, n
    while True:
        length = len(nodes) * t + part_len
        first = -1
        for layer_group, policy in enumerate(tree.layer_groups):
            beg, end = policy.stale_range(length)
            for o in range(-(-length // t)):
                if beg <= o < end:
                    continue
                n = nodes[o] if o < len(nodes) else part
                if n is None or n.page(layer_group) is None:
                    first = o if first < 0 else min(first, o)
                    break
        if first < 0:
            return nodes, part, part_len
        del nodes[first:]
        part, part_len = None, 0


@pytest.mark.parametrize("window, swa_every, sink_tokens", [(12, 2, None), (12, 2, 8), (20, 1, None), (12, 1, 8)])
def test_match_equals_the_reference_walk_under_eviction(
    make_manager: MakeManager, window: int, swa_every: int, sink_tokens: int | None
) -> None:
    """The tree's match (one walk, window groups checked only outside their stale range) finds
    exactly what the reference does on trees that eviction left with holes."""
    m = make_manager(
        kv_layers(2, T, window=window, swa_every=swa_every, sink_tokens=sink_tokens), quota=2 * 32 * T * 48
    )
    rng = random.Random(window * 7 + swa_every + (sink_tokens or 0))
    prefixes = [toks(100 + i, 5 * T) for i in range(3)]
    tree = m._tree
    shortened = 0
    for step in range(150):
        tokens = rng.choice(prefixes) + toks(1000 + rng.randrange(40), rng.randrange(1, 5 * T))
        for partial in (False, True):
            root = tree.root(ReuseScope(), False)
            if root is None:
                continue
            query = tokens[: rng.randrange(1, len(tokens) + 1)]
            # hide a page for the match only (holes eviction does not leave: a full group's or a sink's)
            unhidden = _reference_match(tree, root, BlockHasher(query, T, "q"), partial)
            on_path = unhidden[0] + ([unhidden[1]] if unhidden[1] is not None else [])
            hidden = []
            for _ in range(rng.randrange(1, 5)):
                node = rng.choice(on_path if on_path and rng.random() < 0.8 else tree.nodes())
                layer_group = rng.randrange(len(node.pages))
                hidden.append((node, layer_group, node.pages[layer_group]))
                node.pages[layer_group] = None
            try:
                got = tree.match(root, BlockHasher(query, T, "q"), partial)
                want = _reference_match(tree, root, BlockHasher(query, T, "q"), partial)
            finally:
                for node, layer_group, ref in reversed(hidden):
                    node.pages[layer_group] = ref
            assert same_match(got, want), step
            walked = _reference_walk_length(tree, root, BlockHasher(query, T, "q"))
            shortened += len(got[0]) < walked
            got = tree.match(root, BlockHasher(query, T, "q"), partial)
            want = _reference_match(tree, root, BlockHasher(query, T, "q"), partial)
            assert same_match(got, want), step
        if step % 3 == 0:  # fill the GPU tier: publishing evicts earlier blocks page by page
            kv = m.create_kv_cache(input_tokens=tokens)
            if kv.resume():
                h = kv.history_length
                if kv.resize(len(tokens)):
                    kv.commit(tokens[h:])
            kv.close()
    assert shortened > 0  # some matches stopped at a missing page, not at a missing key


def same_match(got: tuple[list[Node], Node | None, int], want: tuple[list[Node], Node | None, int]) -> bool:
    """Equal matches: the same full blocks and partial length; the partial block is the same one or
    a sibling sharing as many tokens that holds every page (ties are equally good)."""
    if got[0] != want[0] or got[2] != want[2] or (got[1] is None) != (want[1] is None):
        return False
    a, b = got[1], want[1]
    if a is None or b is None or a is b:
        return True
    held = all(a.page(g) is not None for g in range(len(a.pages)))
    return a.parent is b.parent and a.tokens[: got[2]] == b.tokens[: got[2]] and held


def _reference_walk_length(tree: ReuseTree, root: Node, hasher: BlockHasher) -> int:
    """Full blocks found by key, pages aside."""
    node: Node | None = root
    n = 0
    while node is not None and n < len(hasher.tokens) // tree.tokens_per_block:
        node = node.child(hasher.key(node.key, n))
        n += node is not None
    return n


def test_common_prefix_len_equals_the_token_by_token_count() -> None:
    rng = random.Random(5)
    kinds: list[Callable[[list[TokenIdExt]], Sequence[TokenIdExt]]] = [tuple, list, lambda x: x]
    for _ in range(2000):
        base: list[TokenIdExt] = [rng.choice([1, 2, 2**32 - 1, b"d" * 32, b"e" * 32]) for _ in range(rng.randrange(9))]
        other = list(base[: rng.randrange(len(base) + 1)])
        other += [rng.choice([1, 2, 3, b"d" * 32]) for _ in range(rng.randrange(4))]
        a, b = rng.choice(kinds)(base), rng.choice(kinds)(other)
        if all(type(t) is int for t in other) and rng.random() < 0.3:
            b = array("I", cast("list[int]", other))
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix_len(a, b) == expected, (a, b)
        assert common_prefix_len(b, a) == expected, (a, b)


def test_publishing_and_evicting_a_chain_repeat_no_prune_walks(
    make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committing a prompt publishes its blocks without a prune walk per block, and evicting the
    chain (tails first) asks each node once whether it can go (issue 39.3: work per block on the
    adapter path). The KV data and reuse stay those of the plain path."""
    import kv_cache_manager_v2

    if kv_cache_manager_v2.compiled:
        pytest.skip("counts calls by patching the interpreted classes")
    counts = {"prune": 0, "is_removable": 0, "in_prune": 0}
    prune, is_removable = ReuseTree.prune, Node.is_removable

    def counted_prune(tree: ReuseTree, node: Node) -> None:
        counts["prune"] += 1
        counts["in_prune"] = 1
        try:
            prune(tree, node)
        finally:
            counts["in_prune"] = 0

    def counted_is_removable(node: Node) -> bool:
        counts["is_removable"] += counts["in_prune"]  # (the invariant checker asks too)
        return bool(is_removable.fget(node))  # type: ignore[attr-defined]

    monkeypatch.setattr(ReuseTree, "prune", counted_prune)
    monkeypatch.setattr(Node, "is_removable", property(counted_is_removable))
    blocks = 16
    m = make_manager(kv_layers(1, T), quota=2 * 32 * T * blocks)  # one slot per block of the prompt
    engine = FakeEngine(m)
    prompt = toks(7, blocks * T)
    publish(m, prompt, engine=engine)
    assert m.probe_reuse(None, prompt) == blocks * T
    assert counts["prune"] <= 1, counts  # (closing the request lets go of its last node: one walk)
    counts.update(prune=0, is_removable=0)
    other = toks(8, blocks * T)
    kv = m.create_kv_cache(input_tokens=other)
    serve(engine, kv, other)  # evicts the whole chain, last block first
    assert m.probe_reuse(None, prompt) == 0
    assert counts["is_removable"] <= blocks, counts  # one question per evicted node
    kv.close()
    assert m.probe_reuse(None, other) == blocks * T
