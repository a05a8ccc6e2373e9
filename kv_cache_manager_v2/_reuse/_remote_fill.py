"""Extending a local match with the remote tier: look up the following blocks' pages in one round
trip, fetch the hits in one more, and place them in the local cache as ordinary reusable tree pages
(in the host tier, else GPU memory), where the match then finds them and ``resume`` onboards them
like any lower-tier page.

The rule for how far a match may go is the tree's: at ``matched_blocks`` blocks every layer group
needs a page for each block it does not consider stale at ``matched_blocks * T`` tokens (full attention: every
block; a window: sinks and the window). A page counts when the local tree has it or the remote
tier has a value of the right length for it. ``probe_reuse`` only looks up (and remembers what it
learned for the ``create_kv_cache`` of the same tokens); ``create_kv_cache`` fetches. A probe reports
exactly what the create of the same tokens reuses when every value it found is still intact and
the target level has room for them (``project``: the tree's own match, run over the local tree plus
the pages the create would fetch, so a partial block or local blocks past the fetched ones count
the same in both). A fetched value that fails its checks is a miss, so create may find less than
probe said, never wrong data.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import cast

import rawref

from .._common import CacheLevel, LayerGroupId, ReuseScope, SlotId, TokenIdExt
from .._layers._policy import LayerGroup
from .._page import NO_HINT, NO_SERIAL, Page, PoolGroupStorage
from .._storage._remote._backend import Value
from .._storage._remote._store import RemoteStore
from .._storage._remote._value import HEADER_BYTES, Carried, decode_value, value_retention
from .._storage._shelf import Shelf
from .._storage._storage_manager import StorageManager
from .._storage._tiers._remote_tier import RemoteTier, fetched_page
from .._typed import TypedList
from ._keys import BlockHasher, BlockKey, scope_key, validate_tokens
from ._node import Node
from ._tree import ReuseTree
from ._walk import ChainNode

#: what a lookup learned: (block ordinal, layer group) -> the remote tier has a value of the right length
Found = dict[tuple[int, int], bool]
#: what a background prefetch fetched: (block ordinal, layer group) -> the value (None: absent)
Fetched = dict[tuple[int, int], bytes | None]
#: what a create would match after fetching: full-block nodes (None: a block the fetch would add),
#: the partial node and its length, and the (block ordinal, layer group) pages it would fetch
Projection = tuple[list[Node | None], Node | None, int, set[tuple[int, int]]]


class RemoteFill:
    """Match extension through one :class:`RemoteStore` for one manager."""

    def __init__(
        self,
        tree: ReuseTree,
        storage: StorageManager,
        remote: RemoteStore,
        layer_groups: TypedList[LayerGroupId, LayerGroup],
        tokens_per_block: int,
        target: CacheLevel,
    ) -> None:
        self.tree = tree
        self.storage = storage
        self.remote = remote
        self.layer_groups = layer_groups
        self.tokens_per_block = tokens_per_block
        #: the local level fetched pages are placed in (host if configured, else GPU)
        self.target = target
        #: recurrent-state groups (hybrid models): a match must end at a block with a snapshot of each,
        #: local or fetched (the tree's ``cut_to_snapshot``)
        self.state_groups: list[int] = tree.state_groups
        #: the pages the last ``extend`` placed from a prefetch's values, until the prefetch takes
        #: them (``take_placed``: its group keeps them; the fill keeps no page alive)
        self.placed: list[Page] = []
        #: payload bytes of one page of each layer group (the slot's bytes over its pool group's pools)
        self.page_bytes: list[int] = [
            storage.layout.pool_groups[storage.layout.pool_group_of_layer_group[LayerGroupId(layer_group)]].slot_bytes
            for layer_group in range(len(layer_groups))
        ]

    def take_placed(self) -> list[Page]:
        """The pages the last ``extend`` placed from a prefetch's values (``placed``), handed over once."""
        placed = self.placed
        self.placed = []
        return placed

    def extend(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        nodes: list[Node],
        fetch: bool,
        known: Found | None,
        partial: bool,
        fetched: Fetched | None = None,
        limit: int = -1,
    ) -> tuple[int, Found, Projection | None]:
        """How many full blocks the match reaches with the remote tier (``len(nodes)`` when it does not
        help), what the lookup found (for a later call with ``known``), and without ``fetch``, when
        the remote tier helps, the match a create would make (``project``). With ``fetch`` the pages
        are fetched and placed in the tree, so a new local match reaches that far. ``fetched``: the
        values a background prefetch read (``known`` its lookup): nothing goes over the network,
        and a page neither knows of is a miss. ``limit`` (>= 0): extend to at most that many blocks
        (the load plan's cut)."""
        local_blocks = len(nodes)
        self.placed = []
        plan = self.lookup_plan(scope, hasher, local_blocks, known, fetched is None, limit)
        if plan is None:
            return local_blocks, {} if known is None else known, None
        chain, keys, ask, found = plan
        if ask and fetched is None:
            remote = self.remote
            have = remote.lookup(
                [remote.page_key(keys[ordinal], layer_group) for ordinal, layer_group in ask], self.value_bytes(ask)
            )
            if have is None:
                return local_blocks, found, None
            self.record_lookup(ask, have, found)
        matched_blocks = self._best(chain, local_blocks, len(chain), found)
        if matched_blocks <= local_blocks:
            return matched_blocks, found, None
        if not fetch:
            return matched_blocks, found, self.project(chain, hasher, local_blocks, matched_blocks, partial)
        return self._fetch(scope, hasher, chain, keys, local_blocks, matched_blocks, found, fetched), found, None

    def lookup_plan(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        local_blocks: int,
        known: Found | None,
        may_skip: bool = True,
        limit: int = -1,
    ) -> tuple[list[Node | None], list[BlockKey], list[tuple[int, int]], Found] | None:
        """The blocks after a local match of ``local_blocks`` the remote tier may extend it with:
        their tree nodes (None: absent) and keys, the (block ordinal, layer group) pages to look up
        (those missing locally that ``known`` does not tell of) and what is known; None when the
        remote tier cannot help (no block to look up, or the server is down and nothing is known).
        ``limit`` (>= 0): at most that many blocks in all."""
        tokens_per_block = self.tokens_per_block
        end = min(len(hasher.tokens) // tokens_per_block, local_blocks + self.remote.cfg.max_lookup_blocks)
        if 0 <= limit < end:
            end = limit
        found: Found = {} if known is None else known
        if end <= local_blocks:
            return None
        remote = self.remote
        if known is None and may_skip and remote.is_down:
            remote.skipped_lookups += 1
            return None
        root = self.tree.root(scope, False)
        chain, keys = self._chain(root, scope_key(scope) if root is None else root.key, hasher, end)
        n_lc = len(self.layer_groups)
        ask: list[tuple[int, int]] = []
        for ordinal in range(local_blocks, end):
            node = chain[ordinal]
            for layer_group in range(n_lc):
                if (node is None or node.page(layer_group) is None) and (ordinal, layer_group) not in found:
                    ask.append((ordinal, layer_group))
        return chain, keys, ask, found

    def record_lookup(self, ask: list[tuple[int, int]], have: list[bool], found: Found) -> None:
        """Note in ``found`` which of the pages ``ask`` the remote tier holds (``have``: a value of the
        right length, ``value_bytes``)."""
        remote = self.remote
        for (ordinal, layer_group), ok in zip(ask, have):
            found[(ordinal, layer_group)] = ok
            if ok:
                remote.found_pages += 1

    def value_bytes(self, pages: Iterable[tuple[int, int]]) -> list[int]:
        """The length of a whole value (header and page) for each (block ordinal, layer group)."""
        return [HEADER_BYTES + self.page_bytes[layer_group] for _, layer_group in pages]

    def fetch_plan(
        self, chain: list[Node | None], local_blocks: int, found: Found
    ) -> tuple[int, list[tuple[int, int]]]:
        """The blocks a match reaches with what ``found`` says the remote tier holds, and the pages
        to fetch for it (none when it reaches no further than ``local_blocks``)."""
        matched_blocks = self._best(chain, local_blocks, len(chain), found)
        if matched_blocks <= local_blocks:
            return local_blocks, []
        return matched_blocks, self._needed(chain, local_blocks, matched_blocks)

    def project(
        self, chain: list[Node | None], hasher: BlockHasher, local_blocks: int, matched_blocks: int, partial: bool
    ) -> Projection:
        """The match a create reaches when it fetches what ``matched_blocks`` blocks need: ``ReuseTree.match``'s
        walk and shortening (full blocks by key, then the best partial child, shortened at the first
        block missing a needed page), over the local tree with blocks ``[0, matched_blocks)`` present and the
        fetched pages counted as there."""
        tokens_per_block = self.tokens_per_block
        tokens = hasher.tokens
        walk = self.tree.walk
        fetched = set(self._needed(chain, local_blocks, matched_blocks))
        nodes: list[Node | None] = list(chain[:matched_blocks])
        node = chain[matched_blocks - 1]  # None: the fetch creates it, without children
        if node is not None:
            more: list[Node] = []
            walk.descend(node, hasher, matched_blocks, len(tokens) // tokens_per_block, cast("list[ChainNode]", more))
            if more:
                nodes += more
                node = more[-1]
        part: Node | None = None
        part_len = 0
        if partial and node is not None and len(nodes) * tokens_per_block < len(tokens) and node.has_children:
            rest = tokens[len(nodes) * tokens_per_block : (len(nodes) + 1) * tokens_per_block]
            validate_tokens(rest, hasher.name)
            part, part_len = node.best_partial(rest, self.tree.partial_groups)
        num_full, part_len = walk.shorten(nodes, len(nodes), part, part_len, walk.gap(nodes, fetched), fetched)
        del nodes[num_full:]
        if self.state_groups:  # hybrid: end at a snapshot, local or fetched (``cut_to_snapshot``)
            del nodes[walk.snapshot_cut(nodes, len(nodes), fetched) :]
            return nodes, None, 0, fetched
        return nodes, part if part_len else None, part_len, fetched

    def _chain(
        self, root: Node | None, root_key: BlockKey, hasher: BlockHasher, end: int
    ) -> tuple[list[Node | None], list[BlockKey]]:
        """Tree node (None: absent) and key of every block below ``end``."""
        found: list[Node] = []
        if root is not None:
            self.tree.walk.descend(root, hasher, 0, end, cast("list[ChainNode]", found))
        out: list[Node | None] = list(found)
        out += [None] * (end - len(found))
        keys: list[BlockKey] = []
        parent = root_key
        for ordinal in range(end):
            parent = hasher.key(parent, ordinal)
            keys.append(parent)
        return out, keys

    def _best(self, chain: list[Node | None], local_blocks: int, end: int, have: Found) -> int:
        """The longest match ``matched_blocks`` in ``[local_blocks, end]`` blocks whose needed pages all exist (locally, or
        ``have[(ordinal, layer_group)]`` at blocks from ``local_blocks`` on): the tree's walk rules
        (``Walk.shorten``, ``Walk.snapshot_cut``) over ``chain`` with those pages counted;
        ``local_blocks`` when none is longer."""
        extra = {k for k, ok in have.items() if ok and k[0] >= local_blocks}
        walk = self.tree.walk
        nodes = chain[:end]
        matched_blocks = walk.shorten(nodes, end, None, 0, walk.gap(nodes, extra), extra)[0]
        if self.state_groups:
            matched_blocks = walk.snapshot_cut(nodes, matched_blocks, extra)
        return matched_blocks if matched_blocks > local_blocks else local_blocks

    def _needed(self, chain: list[Node | None], local_blocks: int, matched_blocks: int) -> list[tuple[int, int]]:
        """Pages a match of ``matched_blocks`` blocks needs that the local tree lacks (all at or after block ``local_blocks``)."""
        return self.tree.walk.needed(chain, local_blocks, matched_blocks)

    def _fits(self, needed: list[tuple[int, int]]) -> bool:
        storage = self.storage
        counts = [0] * storage.num_pool_groups
        for _, layer_group in needed:
            counts[storage.layout.pool_group_of_layer_group[LayerGroupId(layer_group)]] += 1
        return all(n == 0 or n <= storage.available(self.target, pool_group) for pool_group, n in enumerate(counts))

    def _fetch(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        chain: list[Node | None],
        keys: list[BlockKey],
        local_blocks: int,
        matched_blocks: int,
        found: Found,
        fetched: Fetched | None,
    ) -> int:
        """Fetch what a match of (up to) ``matched_blocks`` blocks needs (or take it from ``fetched``)
        and publish it; returns the blocks reached."""
        # Keep what the match stands on: the chain's pages (shelved: out of every evictor, no use
        # of them) and its deepest node (an extender), so making room for the fetched pages cannot
        # take them away.
        kept: list[Page] = []
        deepest: Node | None = None
        for node in chain:
            if node is None:
                break
            deepest = node
            for layer_group in range(len(node.pages)):
                p = node.page(layer_group)
                if p is not None:
                    kept.append(p)
        shelf = Shelf()
        if deepest is not None:
            deepest.num_extenders += 1
        try:
            shelf.put(kept)
            return self._fetch_pinned(scope, hasher, chain, keys, local_blocks, matched_blocks, found, fetched)
        finally:
            shelf.restore()
            if deepest is not None:
                deepest.num_extenders -= 1
                self.tree.prune(deepest)

    def _fetch_pinned(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        chain: list[Node | None],
        keys: list[BlockKey],
        local_blocks: int,
        matched_blocks: int,
        found: Found,
        fetched: Fetched | None,
    ) -> int:
        needed = self._needed(chain, local_blocks, matched_blocks)
        if not self._fits(needed):
            # room for fewer blocks: the longest reusable length whose pages fit (halving the range)
            lo, hi = local_blocks, matched_blocks
            while lo < hi:
                mid = (lo + hi + 1) // 2
                m2 = self._best(chain, local_blocks, mid, found)
                if m2 > local_blocks and self._fits(self._needed(chain, local_blocks, m2)):
                    lo = mid
                else:
                    hi = mid - 1
            matched_blocks = self._best(chain, local_blocks, lo, found)
            if matched_blocks <= local_blocks:
                return local_blocks
            needed = self._needed(chain, local_blocks, matched_blocks)
        remote = self.remote
        tier = self.storage.remote_tier
        into = fetched is None and tier is not None and reads_into_slots(self.storage, self.target, tier, needed)
        good: Found = {}
        payloads: dict[tuple[int, int], memoryview] = {}
        slots: dict[tuple[int, int], tuple[PoolGroupStorage, SlotId]] = {}
        carried: dict[tuple[int, int], Carried] = {}  # each value's retention (its header's)
        t0 = time.perf_counter()
        if into:  # straight into new slots, verified there (a zero-copy backend: no copy at all)
            assert tier is not None
            read = self._read_into_slots(tier, needed, keys, carried)
            if read is None:
                return local_blocks
            slots = read
            nbytes = sum(self.value_bytes(slots))
            good = dict.fromkeys(slots, True)
        else:
            if fetched is not None:
                values: list[Value | None] | None = [fetched.get(x) for x in needed]
            else:
                values = remote.fetch(
                    [remote.page_key(keys[ordinal], layer_group) for ordinal, layer_group in needed],
                    self.value_bytes(needed),
                )
            if values is None:
                return local_blocks
            nbytes = sum(len(v) for v in values if v is not None)
            fp = remote.fingerprint
            for (ordinal, layer_group), value in zip(needed, values):
                if value is None:
                    continue
                payload = decode_value(value, layer_group, fp, keys[ordinal], self.page_bytes[layer_group])
                if payload is None:
                    remote.corrupt_pages += 1
                    continue
                good[(ordinal, layer_group)] = True
                payloads[(ordinal, layer_group)] = payload
                carried[(ordinal, layer_group)] = value_retention(value)
        costs = self.storage.costs  # (the read cost of load_policy="auto": a timed fetch refines it)
        if costs is not None and fetched is None:  # (a prefetch's values: timed on its worker, ``RemoteReads``)
            costs.observe(costs.remote_level, nbytes, time.perf_counter() - t0)
        if len(good) < len(needed):  # some values were gone or bad: shorten to what is intact
            matched_blocks = self._best(chain, local_blocks, matched_blocks, good)
            if matched_blocks <= local_blocks:
                for dst, slot in slots.values():
                    dst.allocator.free(slot)
                return local_blocks
            needed = self._needed(chain, local_blocks, matched_blocks)
        placed = RemoteTier.adopt(needed, slots, carried) if into else self._place(needed, payloads, carried)
        self._publish(scope, hasher, chain, keys, matched_blocks, placed)
        self.placed = list(placed.values()) if fetched is not None else []
        expiries = self.storage.expiries
        for x, page in placed.items():  # the retention the values kept, for the time left
            r = carried[x]
            node = page.node
            if node is not None and (r[3] != 0.0 or r[4] != NO_HINT):
                expiries.restore(page, node.ordinal, r[1], r[2], r[3], r[4])
        remote.fetched_pages += len(placed)
        remote.fetched_bytes += sum(self.value_bytes(placed))
        remote.hit_blocks += matched_blocks - local_blocks
        return matched_blocks

    def _read_into_slots(
        self,
        tier: RemoteTier,
        needed: list[tuple[int, int]],
        keys: list[BlockKey],
        carried: dict[tuple[int, int], Carried],
    ) -> dict[tuple[int, int], tuple[PoolGroupStorage, SlotId]] | None:
        """Read the values of ``needed`` into new slots at the target level in one call: the slot of
        each value read whole and intact (the others are given back), its retention into ``carried``;
        None: the call failed."""
        storage = self.storage
        level = storage.levels.items[self.target]
        order: list[tuple[int, int]] = []
        targets: list[tuple[PoolGroupStorage, SlotId]] = []
        try:
            for pool_group, items in by_pool_group(self.storage, needed).items():
                dst = level.items[pool_group]
                storage.make_room(dst, len(items))
                for item, slot in zip(items, dst.allocator.allocate(len(items))):
                    order.append(item)
                    targets.append((dst, slot))
        except BaseException:
            for dst, slot in targets:
                dst.allocator.free(slot)
            raise
        remote = self.remote
        ok = tier.read_into_slots(
            [remote.page_key(keys[ordinal], layer_group) for ordinal, layer_group in order],
            [(layer_group, keys[ordinal]) for ordinal, layer_group in order],
            targets,
        )
        if ok is None:
            return None
        read: dict[tuple[int, int], tuple[PoolGroupStorage, SlotId]] = {}
        for item, target, retention in zip(order, targets, ok):
            if retention is not None:
                read[item] = target
                carried[item] = retention
        return read

    def _place(
        self,
        needed: list[tuple[int, int]],
        payloads: dict[tuple[int, int], memoryview],
        carried: dict[tuple[int, int], Carried],
    ) -> dict[tuple[int, int], Page]:
        """New locked pages at the target level (host or GPU memory: writes cannot fail there)
        holding the payloads of ``needed``, one batch per pool group, at the base priority their
        values kept."""
        storage = self.storage
        placed: dict[tuple[int, int], Page] = {}
        level = storage.levels.items[self.target]
        try:
            for pool_group, items in by_pool_group(self.storage, needed).items():
                dst = level.items[pool_group]
                storage.make_room(dst, len(items))
                slots = dst.allocator.allocate(len(items))
                try:
                    bad = storage.copier.write_slots(
                        dst.pools, dst.layout.slot_sizes, slots, [payloads[x] for x in items]
                    )
                    assert not bad, "the remote tier places pages in memory, where writes cannot fail"
                except BaseException:
                    for s in slots:
                        dst.allocator.free(s)
                    raise
                for item, slot in zip(items, slots):
                    placed[item] = fetched_page(dst, slot, item[1], carried[item])
        except BaseException:
            for p in placed.values():
                p.release(True)  # not in the tree: freed
            raise
        return placed

    def _publish(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        chain: list[Node | None],
        keys: list[BlockKey],
        matched_blocks: int,
        placed: dict[tuple[int, int], Page],
    ) -> None:
        """Insert blocks ``[0, matched_blocks)`` with the placed pages into the tree, then let the pages go
        (last block first: tails are evicted before the prefixes they hang from)."""
        tree = self.tree
        tokens_per_block = self.tokens_per_block
        n_lc = len(self.layer_groups)
        tokens: Sequence[TokenIdExt] = hasher.tokens
        parent = tree.root(scope, True)
        assert parent is not None
        for ordinal in range(matched_blocks):
            pages: list[Page | None] = [placed.get((ordinal, layer_group)) for layer_group in range(n_lc)]
            node = chain[ordinal]
            if node is None or any(p is not None for p in pages):
                # NO_SERIAL: a fetch is no use; the request matching these blocks next counts its use
                toks = rawref.untrack(tuple(tokens[ordinal * tokens_per_block : (ordinal + 1) * tokens_per_block]))
                node = tree.publish(parent, toks, pages, True, NO_SERIAL, keys[ordinal])
                assert node is not None  # a full block is always published
            parent = node
        for ordinal in range(matched_blocks - 1, -1, -1):
            for layer_group in range(n_lc):
                p = placed.get((ordinal, layer_group))
                if p is not None:
                    p.release(True)


def by_pool_group(storage: StorageManager, needed: list[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """The (block, layer group) items ``needed`` by pool group, in order."""
    of_layer_group = storage.layout.pool_group_of_layer_group
    by_group: dict[int, list[tuple[int, int]]] = {}
    for item in needed:
        by_group.setdefault(int(of_layer_group[LayerGroupId(item[1])]), []).append(item)
    return by_group


def reads_into_slots(storage: StorageManager, target: int, tier: RemoteTier, needed: list[tuple[int, int]]) -> bool:
    """Whether the storages of ``needed`` at level ``target`` take reads straight into their slots."""
    level = storage.levels.items[target]
    return all(tier.reads_into(level.items[pool_group]) for pool_group in by_pool_group(storage, needed))
