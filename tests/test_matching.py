"""Kept probes (``PrefixMatcher``): a probe's block keys and walk serve a later match of the same
tokens (the create that follows, another probe), and never one of other tokens, another scope, a
list changed in place or blocks that left the tree. Matches equal the reference walk; KV data is
checked through the fake engine."""

from __future__ import annotations

import random
from array import array

import pytest
from conftest import MakeManager, kv_layers, toks
from fake_engine import FakeEngine
from test_reuse import _reference_match
from tier_helpers import publish, serve

from kv_cache_manager_v2 import KVCacheManager, ReuseScope
from kv_cache_manager_v2._reuse._keys import BlockHasher

T = 8
#: (window, swa_every, sink tokens): every layer windowed, alternating with full attention, sinks
CONFIGS = [(12, 1, None), (12, 2, None), (20, 1, 8), (None, 0, None)]


def _reference_length(m: KVCacheManager, tokens: list[int], scope: ReuseScope | None = None) -> int:
    """Tokens the reference walk (fresh keys, every needed page checked) reuses."""
    root = m._tree.root(scope if scope is not None else ReuseScope(), False)
    if root is None:
        return 0
    nodes, _, part_len = _reference_match(m._tree, root, BlockHasher(tokens, T, "q"), True)
    return len(nodes) * T + part_len


@pytest.mark.parametrize("window, swa_every, sink_tokens", CONFIGS)
def test_kept_probes_equal_the_reference_while_the_tree_changes(
    make_manager: MakeManager, window: int | None, swa_every: int, sink_tokens: int | None
) -> None:
    """Queries probed again and again (kept walks reused) while publishing evicts blocks and
    window pages: every probe and every create equals the reference; the created caches' KV is
    exact."""
    m = make_manager(
        kv_layers(2, T, window=window, swa_every=swa_every, sink_tokens=sink_tokens), quota=2 * 32 * T * 40
    )
    engine = FakeEngine(m)
    rng = random.Random(window or 0 + swa_every)
    prefixes = [toks(200 + i, 4 * T) for i in range(3)]
    queries = [rng.choice(prefixes) + toks(300 + i, rng.randrange(1, 4 * T)) for i in range(12)]
    reused = 0
    for step in range(120):
        query = rng.choice(queries)
        assert m.probe_reuse(None, query) == _reference_length(m, query), step
        if step % 4 == 0:  # the create after a probe of the same tokens: computes it, publishes it
            want = _reference_length(m, query)
            kv = m.create_kv_cache(input_tokens=query)
            assert kv.history_length == want, step
            reused += want
            serve(engine, kv, query)  # checks the reused prefix's KV, then prefills the rest
            kv.close()
        elif step % 4 == 2:  # other requests evict blocks (and window pages) of the kept walks
            publish(m, toks(1000 + step, rng.randrange(2 * T, 6 * T)), engine=engine)
    assert reused > 0 and m._matcher.kept  # probes were kept and creates reused blocks


def test_create_after_a_probe_refuses_a_bool_token(make_manager: MakeManager) -> None:
    """``True == 1``: a create whose tokens equal the probed ones by ``==`` must still refuse a bool
    (the kept keys do not make its tokens valid)."""
    m = make_manager(kv_layers(1, T))
    prompt = [1, *range(100, 100 + 4 * T)]
    assert m.probe_reuse(None, prompt) == 0
    bad: list[object] = list(prompt)
    bad[0] = True
    with pytest.raises(TypeError, match="bool"):
        m.create_kv_cache(input_tokens=bad)  # type: ignore[arg-type]
    assert m.num_open_caches == 0


def test_a_create_of_other_tokens_with_the_same_fingerprint_walks_its_own(make_manager: MakeManager) -> None:
    """Same length, last and middle token (where kept probes are filed), another first block: the
    create reuses its own prefix, not the probed one's."""
    m = make_manager(kv_layers(2, T, window=12, swa_every=2))
    engine = FakeEngine(m)
    a = toks(1, 6 * T)
    b = toks(2, 2 * T) + a[2 * T :]  # differs in blocks 0-1 only
    publish(m, a, engine=engine)
    publish(m, b[: 2 * T], engine=engine)
    assert m.probe_reuse(None, a) == 6 * T
    kv = m.create_kv_cache(input_tokens=b)
    assert kv.history_length == 2 * T == _reference_length(m, b)
    serve(engine, kv, b)
    kv.close()
    assert m.probe_reuse(None, a) == 6 * T and m.probe_reuse(None, b) == 6 * T


@pytest.mark.parametrize("other", [ReuseScope(salt=2), ReuseScope(lora_id=3), ReuseScope()])
def test_a_kept_probe_serves_only_its_scope(make_manager: MakeManager, other: ReuseScope) -> None:
    m = make_manager(kv_layers(2, T, window=12, swa_every=1))
    engine = FakeEngine(m)
    mine = ReuseScope(salt=1)
    prompt = toks(5, 5 * T)
    for scope, tokens in ((mine, prompt), (other, toks(6, 2 * T))):  # (the other scope has a root)
        kv = m.create_kv_cache(scope, input_tokens=tokens)
        serve(engine, kv, tokens)
        kv.close()
    assert m.probe_reuse(mine, prompt) == 5 * T
    assert m.probe_reuse(other, prompt) == 0
    kv = m.create_kv_cache(other, input_tokens=prompt)
    assert kv.history_length == 0
    kv.close()
    assert m.probe_reuse(mine, prompt) == 5 * T  # (kept again, under its own scope)
    kv = m.create_kv_cache(other, input_tokens=prompt)
    assert kv.history_length == 0
    kv.close()


@pytest.mark.parametrize("as_array", [False, True])
def test_a_probed_list_changed_in_place_is_matched_as_it_is(make_manager: MakeManager, as_array: bool) -> None:
    m = make_manager(kv_layers(2, T, window=12, swa_every=1))
    engine = FakeEngine(m)
    prompt = toks(7, 5 * T)
    publish(m, prompt, engine=engine)
    query: list[int] | array[int] = array("I", prompt) if as_array else list(prompt)
    assert m.probe_reuse(None, query) == 5 * T
    query[3 * T + 1] ^= 1  # the caller edits its tokens (block 3) between probe and create
    prompt[3 * T + 1] ^= 1
    kv = m.create_kv_cache(input_tokens=query)
    assert kv.history_length == 3 * T + 1 == _reference_length(m, prompt)  # (block 3: one token, partially)
    serve(engine, kv, prompt)
    kv.close()


@pytest.mark.parametrize("window, swa_every", [(12, 1), (12, 2)])
def test_a_kept_walk_whose_blocks_left_the_tree_is_walked_again(
    make_manager: MakeManager, window: int, swa_every: int
) -> None:
    """The probed blocks are evicted, then published again (new nodes): the kept walk is stale,
    the next probe and create find the new nodes and their exact KV."""
    m = make_manager(kv_layers(2, T, window=window, swa_every=swa_every), quota=2 * 32 * T * 16)
    engine = FakeEngine(m)
    prompt = toks(9, 6 * T)
    publish(m, prompt, engine=engine)
    assert m.probe_reuse(None, prompt) == 6 * T
    for i in range(6):  # fill the GPU tier with other blocks: every block of the prompt is evicted
        publish(m, toks(50 + i, 6 * T), engine=engine)
    assert _reference_length(m, prompt) == 0
    assert m.probe_reuse(None, prompt) == 0
    publish(m, prompt, engine=engine)  # new nodes for the same keys
    assert m.probe_reuse(None, prompt) == 6 * T
    kv = m.create_kv_cache(input_tokens=prompt)
    assert kv.history_length == 6 * T
    serve(engine, kv, prompt)
    kv.close()
