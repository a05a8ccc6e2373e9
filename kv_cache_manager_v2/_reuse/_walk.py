"""The walk down a tree of blocks along a prompt's chain of block keys, and the rules that stop
and shorten it, written once for the reuse tree (``_tree``), the remote fill (``_remote_fill``)
and the router's index (``_router_index``).

A walk goes down from a root one full block at a time (``Walk.descend``: the child holding the
prompt's next block, until a miss or a limit), then a match may take a partial block, then it is
shortened until every layer group holds the pages the match needs (``Walk.shorten``: full
attention every block, a window its sinks and the blocks of the window; ``Walk.snapshot_cut``:
a hybrid model's match ends at a block holding a snapshot of every recurrent group). For example,
with one full-attention group ``F`` and a window ``W`` of one block (no sinks), 4 tokens a block::

    block        0    1    2    3        the walk passed blocks 0-3 (a miss at block 4)
    F page       x    x    x    x
    W page       x    .    .    x        -> 16 tokens need F at 0-3 and W at block 3 only: kept

    W page       x    .    x    .        -> W lacks block 3: cut to 12 tokens, which need W at
                                            block 2 (the window moved): kept, 3 blocks

Each cut is exact: a block a length needs and lacks is needed by every shorter length that
still reaches it (a window only moves back, sinks and full attention need every block), so no
length between the cut and the old one is reusable, and the rules may run in any order.

The trees differ in their nodes (``ChainNode``: the reuse tree's ``Node`` keyed by SHA-256
digests, the index's ``RNode`` by 64-bit hashes); each node finds its child for a prompt's block
(``next``) and says whether it holds a page of a layer group (``holds``): one native vtable call
each, no closure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from .._layers._policy import LayerGroup


class ChainNode:
    """A block of a tree a :class:`Walk` goes down (the base of the reuse tree's and the router
    index's nodes)."""

    __slots__ = ()

    def next(self, prompt: object, ordinal: int) -> ChainNode | None:
        """The child holding full block ``ordinal`` of the prompt (this node holds block
        ``ordinal - 1``), None when none does. ``prompt``: what the tree's keys come from (the
        reuse tree: the prompt's ``BlockHasher``; the router index: its list of block hashes)."""
        raise NotImplementedError

    def holds(self, layer_group: int) -> bool:
        """Whether the block holds a page of ``layer_group``."""
        raise NotImplementedError


#: a list of nodes as its owner types it (``list[Node]``, ``list[Node | None]``, ``list[RNode]``):
#: read as a list (mypyc: erased to ``ChainNode | None``, a list's fast item access)
M = TypeVar("M", bound="ChainNode | None")
#: (block ordinal, layer group) pages a walk counts as present though the tree lacks them (a
#: remote fetch will bring them)
Extra = set[tuple[int, int]]


class Walk:
    """The stop rules of one tree's matches: its block size and its layer groups by what a match
    needs of them.

    ``groups``: (layer group id, policy) pairs. Groups keeping every block are checked on the way
    down (``descend``: the first block lacking one is the walk's *gap*), the ones releasing
    blocks at the end (``shorten``), the recurrent ones last (``snapshot_cut``)."""

    def __init__(self, tokens_per_block: int, groups: Sequence[tuple[int, LayerGroup]]) -> None:
        self.tokens_per_block = tokens_per_block
        self._groups = list(groups)
        #: groups keeping every block: a match needs their page at each block it reaches
        self.keeping = [g for g, policy in groups if not policy.releases_blocks]
        #: groups releasing blocks and their policies: a match needs their pages outside ``stale_range``
        self.releasing = [g for g, policy in groups if policy.releases_blocks]
        self._releasing_policies = [policy for _, policy in groups if policy.releases_blocks]
        #: recurrent groups (hybrid models): a match ends at a block holding a snapshot of each
        self.state_groups = [g for g, policy in groups if policy.keeps_live_state]
        #: the others: a partially matched block holds a page of each (it is the match's last block)
        self.partial_groups = [g for g, policy in groups if not policy.keeps_live_state]

    def descend(self, node: ChainNode, prompt: object, ordinal: int, end: int, out: list[ChainNode]) -> int:
        """Go down from ``node`` (block ``ordinal - 1``; a root at ``ordinal`` 0) along the
        prompt's blocks, appending each child found to ``out``, until block ``end`` or the first
        miss. Returns the gap: the first block appended lacking a page of a group keeping every
        block (-1: none). ``out`` holds the tree's own node type: callers pass their list cast
        (no conversion; the nodes appended are children of ``node``, of its type)."""
        keeping = self.keeping
        gap = -1
        while ordinal < end:
            child = node.next(prompt, ordinal)
            if child is None:
                break
            if gap < 0:
                for layer_group in keeping:
                    if not child.holds(layer_group):
                        gap = ordinal
                        break
            out.append(child)
            node = child
            ordinal += 1
        return gap

    def gap(self, nodes: list[M], extra: Extra | None) -> int:
        """The first of ``nodes`` (None: a block the tree lacks) without a page of a group keeping
        every block, unless ``extra`` has it (-1: none)."""
        keeping = self.keeping
        for ordinal in range(len(nodes)):
            node = nodes[ordinal]
            for layer_group in keeping:
                if (node is None or not node.holds(layer_group)) and (
                    extra is None or (ordinal, layer_group) not in extra
                ):
                    return ordinal
        return -1

    def first_missing(
        self, nodes: list[M], part: ChainNode | None, length: int, first: int, extra: Extra | None
    ) -> int:
        """The first block a match of ``length`` tokens over ``nodes`` (full blocks; None: a block
        the tree lacks) and ``part`` (the partial block, if any) needs a page of a group releasing
        blocks for but has none (nor ``extra``), or ``first`` (the walk's gap; -1: none) if lower."""
        t = self.tokens_per_block
        num_nodes = len(nodes)
        groups = self.releasing
        policies = self._releasing_policies
        for i in range(len(groups)):
            layer_group = groups[i]
            beg, end = policies[i].stale_range(length)
            limit = (length + t - 1) // t if first < 0 else first  # blocks past a known miss do not matter
            # the blocks before and after the stale range (all of them when it is empty)
            for o in range(beg if beg < limit else limit):
                node = nodes[o] if o < num_nodes else part
                if (node is None or not node.holds(layer_group)) and (extra is None or (o, layer_group) not in extra):
                    first = limit = o
                    break
            for o in range(end if end > beg else beg, limit):
                node = nodes[o] if o < num_nodes else part
                if (node is None or not node.holds(layer_group)) and (extra is None or (o, layer_group) not in extra):
                    first = o
                    break
        return first

    def shorten(
        self,
        nodes: list[M],
        num_full: int,
        part: ChainNode | None,
        part_len: int,
        first: int,
        extra: Extra | None = None,
    ) -> tuple[int, int]:
        """Shorten a match of ``num_full`` full blocks (``nodes``' first) and ``part_len`` tokens of
        ``part`` until every group releasing blocks has the pages it needs, ``first`` being the
        walk's gap: the full blocks and partial tokens kept (0: ``part`` is dropped)."""
        missing = self.first_missing(nodes, part, num_full * self.tokens_per_block + part_len, first, extra)
        if missing < 0:
            return num_full, part_len
        return self.cut_at(nodes, num_full, missing, extra), 0

    def cut_at(self, nodes: list[M], num_full: int, missing: int, extra: Extra | None = None) -> int:
        """``shorten`` from its first cut: the full blocks of ``nodes`` kept when block ``missing``
        (``first_missing``'s answer, >= 0; ``num_full``: the partial block) lacks a needed page."""
        t = self.tokens_per_block
        while missing >= 0:
            if missing < num_full:
                num_full = missing
            missing = self.first_missing(nodes, None, num_full * t, -1, extra)
        return num_full

    def snapshot_cut(self, nodes: list[M], num_full: int, extra: Extra | None = None) -> int:
        """Shorten a match (``num_full`` full blocks of ``nodes``) to end at the last block holding
        a snapshot of every recurrent group, then until the other groups have their pages there;
        again until both hold (a shorter match may need pages a window did not). The blocks kept."""
        t = self.tokens_per_block
        state_groups = self.state_groups
        n = num_full
        while True:
            while n > 0 and not self._holds_all(nodes[n - 1], n - 1, state_groups, extra):
                n -= 1
            missing = self.first_missing(nodes, None, n * t, -1, extra)
            if missing < 0:
                return n
            n = missing

    def needed(self, nodes: list[M], beg: int, num_full: int) -> list[tuple[int, int]]:
        """The (block ordinal, layer group) pages at blocks ``[beg, num_full)`` a match of
        ``num_full`` full blocks of ``nodes`` needs and lacks: group by group (in ``groups``' order)
        the blocks outside its stale range, then the recurrent groups' snapshots at the last block."""
        out: list[tuple[int, int]] = []
        for layer_group, policy in self._groups:
            stale_beg, stale_end = policy.stale_range(num_full * self.tokens_per_block)
            for ordinal in range(beg, num_full):
                if stale_beg <= ordinal < stale_end:
                    continue
                node = nodes[ordinal]
                if node is None or not node.holds(layer_group):
                    out.append((ordinal, layer_group))
        last = num_full - 1
        if last >= beg:
            node = nodes[last]
            for layer_group in self.state_groups:
                if node is None or not node.holds(layer_group):
                    out.append((last, layer_group))
        return out

    def _holds_all(self, node: ChainNode | None, ordinal: int, groups: list[int], extra: Extra | None) -> bool:
        for layer_group in groups:
            if (node is None or not node.holds(layer_group)) and (extra is None or (ordinal, layer_group) not in extra):
                return False
        return True
