"""The walk down a tree of blocks and its stop rules (``_reuse/_walk.py``), used by the reuse tree,
the remote fill and the router's index: the walk stops at the first miss or its limit and reports
the first block lacking a page of a group keeping every block; the shortening reaches the longest
reusable length (checked against every length, one by one) for any mix of full attention, windows
with sinks and recurrent groups, with pages counted present by a fetch (``extra``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2._layers._full_attention import FullAttentionGroup
from kv_cache_manager_v2._layers._policy import LayerGroup
from kv_cache_manager_v2._layers._recurrent import RecurrentGroup
from kv_cache_manager_v2._layers._sliding_window import SlidingWindowGroup
from kv_cache_manager_v2._reuse._walk import ChainNode, Walk
from kv_cache_manager_v2._router_index import BlockTree, RNode

T = 4


def block(groups: list[int]) -> RNode:
    """A node holding pages of ``groups`` (the router index's node: ``holds`` is membership)."""
    node = RNode(0, None, (), 0)
    node.groups = {g: "GPU" for g in groups}
    return node


def test_descend_stops_at_a_miss_or_the_limit_and_reports_the_gap() -> None:
    tree = BlockTree()
    tree.store((None, None), None, [11, 12, 13, 14], list(range(4 * T)), None, T, 0, "GPU")
    tree.store((None, None), None, [11, 12], list(range(2 * T)), None, T, 1, "GPU")
    root = tree.roots[(None, None)]
    walk = Walk(T, [(0, FullAttentionGroup(T)), (1, FullAttentionGroup(T))])
    out: list[ChainNode] = []
    assert walk.descend(root, [11, 12, 13, 14, 15], 0, 5, out) == 2  # block 2 lacks group 1's page
    assert [n.hash for n in out if isinstance(n, RNode)] == [11, 12, 13, 14]
    out = []
    assert walk.descend(root, [11, 12, 13, 14], 0, 2, out) == -1  # the limit: blocks 0-1 hold both
    assert len(out) == 2
    out = []
    assert walk.descend(root, [11, 12, 99, 14], 0, 4, out) == -1  # a miss at block 2
    assert len(out) == 2
    more: list[ChainNode] = []
    assert walk.descend(out[1], [11, 12, 13, 14], 2, 4, more) == 2  # going on from block 1
    assert len(more) == 2
    tree.clear()


def test_the_docstring_example() -> None:
    walk = Walk(T, [(0, FullAttentionGroup(T)), (1, SlidingWindowGroup(T, 0, T))])
    kept = [block([0, 1]), block([0]), block([0]), block([0, 1])]
    assert walk.shorten(kept, 4, None, 0, walk.gap(kept, None)) == (4, 0)
    cut = [block([0, 1]), block([0]), block([0, 1]), block([0])]
    assert walk.shorten(cut, 4, None, 0, walk.gap(cut, None)) == (3, 0)


def policy(kind: int, window: int, sinks: int) -> LayerGroup:
    if kind == 0:
        return FullAttentionGroup(T)
    if kind == 1:
        return SlidingWindowGroup(window, sinks, T)
    return RecurrentGroup(T, "state")


def reference(
    policies: list[LayerGroup],
    present: list[set[int]],
    part: set[int] | None,
    part_len: int,
    extra: set[tuple[int, int]],
) -> int:
    """The longest reusable length, every candidate checked on its own: each group has a page at
    every block the length needs (outside its stale range), a hybrid match ends at a full block
    holding a snapshot of every recurrent group."""
    n = len(present)
    hybrid = any(p.keeps_live_state for p in policies)

    def has(o: int, g: int) -> bool:
        if o < n:
            return g in present[o] or (o, g) in extra
        return part is not None and g in part

    candidates = [k * T for k in range(n + 1)] + ([n * T + part_len] if part is not None and not hybrid else [])
    best = 0
    for length in candidates:
        ok = True
        for g, p in enumerate(policies):
            beg, end = p.stale_range(length)
            if any(not has(o, g) for o in range((length + T - 1) // T) if not beg <= o < end):
                ok = False
        if hybrid and length > 0:
            last = length // T - 1
            ok = ok and all(has(last, g) for g, p in enumerate(policies) if p.keeps_live_state)
        if ok and length > best:
            best = length
    return best


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_shortening_reaches_the_longest_reusable_length(data: st.DataObject) -> None:
    kinds = data.draw(
        st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3 * T), st.integers(0, 2)), min_size=1, max_size=3)
    )
    policies = [policy(*k) for k in kinds]
    groups = list(range(len(policies)))
    n = data.draw(st.integers(0, 8))
    present = [set(data.draw(st.lists(st.sampled_from(groups), unique=True))) for _ in range(n)]
    extra = {(o, g) for o in range(n) for g in groups if data.draw(st.integers(0, 5)) == 0}
    hybrid = any(p.keeps_live_state for p in policies)
    part: set[int] | None = None
    part_len = 0
    if not hybrid and data.draw(st.booleans()):  # (a partial block holds a page of every attention group)
        part, part_len = set(groups), data.draw(st.integers(1, T - 1))
    walk = Walk(T, list(enumerate(policies)))
    nodes: list[ChainNode | None] = [None if not p and data.draw(st.booleans()) else block(sorted(p)) for p in present]
    part_node = block(sorted(part)) if part is not None else None
    num_full, kept = walk.shorten(nodes, n, part_node, part_len, walk.gap(nodes, extra or None), extra or None)
    if hybrid:
        num_full = walk.snapshot_cut(nodes, num_full, extra or None)
        kept = 0
    assert num_full * T + kept == reference(policies, present, part, part_len, extra)
