"""Extending a local match with the remote tier: look up the following blocks' pages in one round
trip, fetch the hits in one more, and place them in the local cache as ordinary reusable tree pages
(in the host tier, else GPU memory), where the match then finds them and ``resume`` onboards them
like any lower-tier page.

The rule for how far a match may go is the tree's (SPEC 5.3): at ``m`` blocks every layer group
needs a page for each block it does not consider stale at ``m * T`` tokens (full attention: every
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

from collections.abc import Sequence

import rawref

from .._common import DEFAULT_PRIORITY, CacheLevel, LayerGroupId, ReuseScope, TokenIdExt
from .._eviction import NO_SERIAL
from .._layers._policy import LayerGroup
from .._page import Page
from .._storage._remote import HEADER_BYTES, RemoteStore, decode_value
from .._storage._storage_manager import StorageManager
from .._typed import TypedList
from ._keys import BlockHasher, BlockKey, scope_key, validate_tokens
from ._tree import Node, ReuseTree

#: what a lookup learned: (block ordinal, layer group) -> the remote tier has a value of the right length
Found = dict[tuple[int, int], bool]
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
        #: payload bytes of one page of each layer group (the slot's bytes over its pool group's pools)
        self.page_bytes: list[int] = [
            storage.layout.pool_groups[storage.layout.pool_group_of_layer_group[LayerGroupId(lc)]].slot_bytes
            for lc in range(len(layer_groups))
        ]

    def extend(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        nodes: list[Node],
        fetch: bool,
        known: Found | None,
        partial: bool,
    ) -> tuple[int, Found, Projection | None]:
        """How many full blocks the match reaches with the remote tier (``len(nodes)`` when it does not
        help), what the lookup found (for a later call with ``known``), and without ``fetch``, when
        the remote tier helps, the match a create would make (``project``). With ``fetch`` the pages
        are fetched and placed in the tree, so a new local match reaches that far."""
        k = len(nodes)
        t = self.tokens_per_block
        end = min(len(hasher.tokens) // t, k + self.remote.cfg.max_lookup_blocks)
        found: Found = {} if known is None else known
        if end <= k:
            return k, found, None
        remote = self.remote
        if known is None and remote.is_down:
            remote.skipped_lookups += 1
            return k, found, None
        root = self.tree.root(scope, False)
        chain, keys = self._chain(root, scope_key(scope) if root is None else root.key, hasher, end)
        n_lc = len(self.layer_groups)
        cand: list[tuple[int, int]] = []
        for o in range(k, end):
            node = chain[o]
            for lc in range(n_lc):
                if node is None or node.page(lc) is None:
                    cand.append((o, lc))
        ask = [c for c in cand if c not in found]
        if ask:
            lengths = remote.lookup([remote.page_key(keys[o], lc) for o, lc in ask])
            if lengths is None:
                return k, found, None
            for (o, lc), n in zip(ask, lengths):
                ok = n == HEADER_BYTES + self.page_bytes[lc]
                found[(o, lc)] = ok
                if ok:
                    remote.found_pages += 1
        m = self._best(chain, k, end, found)
        if m <= k:
            return m, found, None
        if not fetch:
            return m, found, self.project(chain, hasher, k, m, partial)
        return self._fetch(scope, hasher, chain, keys, k, m, found), found, None

    def project(self, chain: list[Node | None], hasher: BlockHasher, k: int, m: int, partial: bool) -> Projection:
        """The match a create reaches when it fetches what ``m`` blocks need: ``ReuseTree.match``'s
        walk and shortening (full blocks by key, then the best partial child, shortened at the first
        block missing a needed page), over the local tree with blocks ``[0, m)`` present and the
        fetched pages counted as there."""
        t = self.tokens_per_block
        tokens = hasher.tokens
        fetched = set(self._needed(chain, k, m))
        nodes: list[Node | None] = list(chain[:m])
        node = chain[m - 1]  # None: the fetch creates it, without children
        if node is not None:
            n_full = len(tokens) // t
            while len(nodes) < n_full and node.has_children:
                child = node.child(hasher.key(node.key, len(nodes)))
                if child is None:
                    break
                nodes.append(child)
                node = child
        part: Node | None = None
        part_len = 0
        if partial and node is not None and len(nodes) * t < len(tokens) and node.has_children:
            rest = tokens[len(nodes) * t : (len(nodes) + 1) * t]
            validate_tokens(rest, hasher.name)
            part, part_len = node.best_partial(rest)
        layer_groups = self.layer_groups.items
        while True:
            length = len(nodes) * t + part_len
            nb = (length + t - 1) // t
            missing = -1
            for lc, layer_group in enumerate(layer_groups):
                beg, stale_end = layer_group.stale_range(length)
                for o in range(nb):
                    if beg <= o < stale_end or (o, lc) in fetched:
                        continue
                    at = nodes[o] if o < len(nodes) else part
                    if at is None or at.page(LayerGroupId(lc)) is None:
                        if missing < 0 or o < missing:
                            missing = o
                        break
            if missing < 0:
                return nodes, part, part_len, fetched
            del nodes[missing:]
            part, part_len = None, 0

    def _chain(
        self, root: Node | None, root_key: BlockKey, hasher: BlockHasher, end: int
    ) -> tuple[list[Node | None], list[BlockKey]]:
        """Tree node (None: absent) and key of every block below ``end``."""
        out: list[Node | None] = []
        keys: list[BlockKey] = []
        node = root
        parent = root_key
        for o in range(end):
            key = hasher.key(parent, o)
            child = node.child(key) if node is not None else None
            out.append(child)
            keys.append(key)
            node = child
            parent = key
        return out, keys

    def _best(self, chain: list[Node | None], k: int, end: int, have: Found) -> int:
        """The longest match ``m`` in ``[k, end]`` blocks whose needed pages all exist (locally, or
        ``have[(o, lc)]``); ``k`` when none is longer. A length is reusable for a layer group when
        every block missing a page below it lies in the group's stale range there."""
        t = self.tokens_per_block
        layer_groups = self.layer_groups.items
        n_lc = len(layer_groups)
        first = [-1] * n_lc  # first block missing a page, per layer group
        last = [-1] * n_lc  # last one so far
        best = k
        for o in range(end):
            node = chain[o]
            for lc in range(n_lc):
                present = node is not None and node.page(lc) is not None
                if not present and o >= k:
                    present = have.get((o, lc), False)
                if not present:
                    if first[lc] < 0:
                        first[lc] = o
                    last[lc] = o
            m = o + 1
            if m <= k:
                continue
            ok = True
            for lc in range(n_lc):
                if first[lc] >= 0:
                    beg, stale_end = layer_groups[lc].stale_range(m * t)
                    if first[lc] < beg or last[lc] >= stale_end:
                        ok = False
                        break
            if ok:
                best = m
        return best

    def _needed(self, chain: list[Node | None], k: int, m: int) -> list[tuple[int, int]]:
        """Pages a match of ``m`` blocks needs that the local tree lacks (all at or after block ``k``)."""
        out: list[tuple[int, int]] = []
        for lc, layer_group in enumerate(self.layer_groups):
            beg, end = layer_group.stale_range(m * self.tokens_per_block)
            for o in range(k, m):
                if beg <= o < end:
                    continue
                node = chain[o]
                if node is None or node.page(lc) is None:
                    out.append((o, lc))
        return out

    def _fits(self, needed: list[tuple[int, int]]) -> bool:
        storage = self.storage
        counts = [0] * storage.num_pool_groups
        for _, lc in needed:
            counts[storage.layout.pool_group_of_layer_group[LayerGroupId(lc)]] += 1
        return all(n == 0 or n <= storage.available(self.target, g) for g, n in enumerate(counts))

    def _fetch(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        chain: list[Node | None],
        keys: list[BlockKey],
        k: int,
        m: int,
        found: Found,
    ) -> int:
        """Fetch what a match of (up to) ``m`` blocks needs and publish it; returns the blocks reached."""
        # Pin what the match stands on: the chain's pages (locked, out of every evictor) and its
        # deepest node (an extender), so making room for the fetched pages cannot take them away.
        pinned: list[Page] = []
        deepest: Node | None = None
        for node in chain:
            if node is None:
                break
            deepest = node
            for lc in range(len(node.pages)):
                p = node.page(lc)
                if p is not None:
                    p.take(True)
                    pinned.append(p)
        if deepest is not None:
            deepest.num_extenders += 1
        try:
            return self._fetch_pinned(scope, hasher, chain, keys, k, m, found)
        finally:
            for p in reversed(pinned):
                p.release(True)
            if deepest is not None:
                deepest.num_extenders -= 1
                self.tree.prune(deepest)

    def _fetch_pinned(
        self,
        scope: ReuseScope,
        hasher: BlockHasher,
        chain: list[Node | None],
        keys: list[BlockKey],
        k: int,
        m: int,
        found: Found,
    ) -> int:
        needed = self._needed(chain, k, m)
        if not self._fits(needed):
            # room for fewer blocks: the longest reusable length whose pages fit (halving the range)
            lo, hi = k, m
            while lo < hi:
                mid = (lo + hi + 1) // 2
                m2 = self._best(chain, k, mid, found)
                if m2 > k and self._fits(self._needed(chain, k, m2)):
                    lo = mid
                else:
                    hi = mid - 1
            m = self._best(chain, k, lo, found)
            if m <= k:
                return k
            needed = self._needed(chain, k, m)
        remote = self.remote
        values = remote.fetch([remote.page_key(keys[o], lc) for o, lc in needed])
        if values is None:
            return k
        fp = remote.fingerprint
        good: Found = {}
        payloads: dict[tuple[int, int], memoryview] = {}
        for (o, lc), value in zip(needed, values):
            payload = decode_value(value, lc, fp, keys[o], self.page_bytes[lc]) if value is not None else None
            if payload is None:
                if value is not None:
                    remote.corrupt_pages += 1
                continue
            good[(o, lc)] = True
            payloads[(o, lc)] = payload
        if len(payloads) < len(needed):  # some values were gone or bad: shorten to what is intact
            m = self._best(chain, k, m, good)
            if m <= k:
                return k
            needed = self._needed(chain, k, m)
        placed = self._place(needed, payloads)
        self._publish(scope, hasher, chain, keys, m, placed)
        remote.fetched_pages += len(placed)
        remote.fetched_bytes += sum(HEADER_BYTES + self.page_bytes[lc] for _, lc in placed)
        remote.hit_blocks += m - k
        return m

    def _place(
        self, needed: list[tuple[int, int]], payloads: dict[tuple[int, int], memoryview]
    ) -> dict[tuple[int, int], Page]:
        """New locked pages at the target level (host or GPU memory: writes cannot fail there)
        holding the payloads of ``needed``, one batch per pool group."""
        storage = self.storage
        by_group: dict[int, list[tuple[int, int]]] = {}
        for o, lc in needed:
            g = int(storage.layout.pool_group_of_layer_group[LayerGroupId(lc)])
            found = by_group.get(g)
            if found is None:
                by_group[g] = [(o, lc)]
            else:
                found.append((o, lc))
        placed: dict[tuple[int, int], Page] = {}
        level = storage.levels.items[self.target]
        try:
            for g, items in by_group.items():
                dst = level.items[g]
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
                for (o, lc), slot in zip(items, slots):
                    page = Page(dst, slot, LayerGroupId(lc), DEFAULT_PRIORITY, True)
                    page.remote_copy = True
                    placed[(o, lc)] = page
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
        m: int,
        placed: dict[tuple[int, int], Page],
    ) -> None:
        """Insert blocks ``[0, m)`` with the placed pages into the tree, then let the pages go
        (last block first: tails are evicted before the prefixes they hang from)."""
        tree = self.tree
        t = self.tokens_per_block
        n_lc = len(self.layer_groups)
        tokens: Sequence[TokenIdExt] = hasher.tokens
        parent = tree.root(scope, True)
        assert parent is not None
        for o in range(m):
            pages: list[Page | None] = [placed.get((o, lc)) for lc in range(n_lc)]
            node = chain[o]
            if node is None or any(p is not None for p in pages):
                # NO_SERIAL: a fetch is no use; the request matching these blocks next counts its use
                toks = rawref.untrack(tuple(tokens[o * t : (o + 1) * t]))
                node = tree.publish(parent, toks, pages, True, NO_SERIAL, keys[o])
                assert node is not None  # a full block is always published
            parent = node
        for o in range(m - 1, -1, -1):
            for lc in range(n_lc):
                p = placed.get((o, lc))
                if p is not None:
                    p.release(True)
