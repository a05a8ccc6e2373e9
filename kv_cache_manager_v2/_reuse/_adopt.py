"""A persistent disk tier's records published into the reuse tree at start-up: the chains of
blocks a previous manager left, validated (records are checksummed, not trusted: a crafted or
damaged directory must neither crash the manager nor leak a slot)."""

from __future__ import annotations

from typing import cast

import rawref

from .._common import (
    MAX_PRIORITY,
    BlockTokens,
    CacheLevel,
    LayerGroupId,
    PoolGroupIndex,
    Priority,
    RequestSerial,
    ReuseScope,
    SlotId,
)
from .._page import NO_HINT, Page, PoolGroupStorage
from .._storage._expiry import ExpiryQueue
from .._storage._persist import SEQ_LIMIT, DiskRecord
from .._storage._storage_manager import StorageManager
from .._typed import TypedList
from ._keys import chain_keys
from ._node import Node
from ._tree import ReuseTree


def adopt_records(
    tree: ReuseTree,
    records: list[list[DiskRecord]],
    storage: StorageManager,
    pool_group_of: TypedList[LayerGroupId, PoolGroupIndex],
) -> tuple[int, list[DiskRecord], list[DiskRecord]]:
    """Publish the pages a persistent disk tier kept from a previous manager: ``records[g]`` are
    the valid records of pool group ``g`` (slots already taken in the persistent level of ``storage``), in any order
    (ancestors are adopted first). A record is ignored and its slot freed when its key is not the
    key of its tokens under its parent (``chain_keys``: SHA-256 of the parent key and the tokens;
    the scope is in its root's key), when its chain of parent blocks does not reach its scope's
    root through other records (a missing parent, a cycle, a record of another scope on the way),
    when it is keyed like a scope's root, when its layer group is not of that pool group, when it
    repeats a (block, layer group) with another parent or tokens than the block's newest record,
    or when its write sequence is ``SEQ_LIMIT`` or more. An older record of a page that was written
    again (the page left the disk and came back to another slot) is superseded: its slot freed
    too, not an error. Pages become reusable (DROPPABLE) oldest first, so eviction order follows
    their write order, each with the retention its record kept (``expiries.restore``: the time
    left of a duration); subscribers hear of each (stored at the disk medium). Returns the pages
    adopted, the records ignored and those superseded."""
    storages = storage.levels[CacheLevel(storage.persist_level)]  # (slots already taken there)
    run = _Adoption(tree, storages, pool_group_of, storage.expiries)
    write_through = tree.write_through
    tree.write_through = None  # what a previous manager wrote is not sent again
    try:
        run.adopt(records)
    finally:
        tree.write_through = write_through
    run.finish()
    return len(run.placed), run.rejected, run.superseded


class _Adoption:
    """The state of one ``adopt_records``."""

    def __init__(
        self,
        tree: ReuseTree,
        storages: TypedList[PoolGroupIndex, PoolGroupStorage],
        pool_group_of: TypedList[LayerGroupId, PoolGroupIndex],
        expiries: ExpiryQueue,
    ) -> None:
        self.tree = tree
        self.expiries = expiries
        #: the placed pages whose records kept retention, and those records
        self.retained: list[tuple[Page, DiskRecord]] = []
        self.storages = storages
        self.pool_group_of = pool_group_of
        #: a block's records (one per layer group)
        self.by_key: dict[bytes, list[DiskRecord]] = {}
        #: blocks adopted, and the roots (None: a block whose chain does not reach a root)
        self.nodes: dict[bytes, Node | None] = {}
        self.roots: dict[tuple[int | None, int | None], Node] = {}
        self.placed: list[Page] = []
        #: each placed page's write sequence
        self.seqs: list[int] = []
        self.rejected: list[DiskRecord] = []
        #: older records of a (block, layer group) that has a newer one
        self.superseded: list[DiskRecord] = []
        #: nodes none of whose records could be placed
        self.made: list[Node] = []

    def adopt(self, records: list[list[DiskRecord]]) -> None:
        by_key = self.by_key
        nodes = self.nodes
        roots = self.roots
        for found in records:
            for r in found:
                if r.seq >= SEQ_LIMIT:  # later writes could not order after it
                    self.rejected.append(r)
                    continue
                same = by_key.get(r.key)
                if same is None:
                    by_key[r.key] = rawref.untrack([r])  # (records hold no containers: nothing for the GC)
                else:
                    same.append(r)
                ident = (r.lora_id, r.salt)
                if ident not in roots:
                    root = self.tree.root(ReuseScope(r.lora_id, r.salt), True)
                    assert root is not None
                    roots[ident] = root
                    nodes[root.key] = root
        for root in roots.values():  # a record keyed like a scope's root is no block
            rooted = by_key.pop(root.key, None)
            if rooted is not None:
                self.rejected.extend(rooted)
        for same in by_key.values():  # a block's newest records first: they are its pages
            if len(same) > 1:
                same.sort(key=_newest_first)
        for found in records:
            for r in found:
                if r.key not in nodes:
                    self._chain(r.key)

    def _chain(self, key: bytes) -> None:
        """Block ``key`` and its ancestors not adopted yet, ancestors first (their anchors cap the
        descendants' priorities); a chain that does not reach a root is rejected, and so is a block
        whose newest record is not keyed by its parent and tokens (hashed once per block: its other
        records must name the same parent and tokens)."""
        by_key = self.by_key
        nodes = self.nodes
        chain: list[list[DiskRecord]] = []
        on_chain: set[bytes] = set()
        k = key
        while k not in nodes and k not in on_chain:
            same = by_key.get(k)
            if same is None:  # a missing ancestor
                break
            first = same[0]
            if chain_keys(first.parent, first.tokens.tobytes(), 4 * len(first.tokens)) != [k]:
                nodes[k] = None  # not the block its key names (one hung under another parent, say)
                self.rejected.extend(same)
                break
            on_chain.add(k)
            chain.append(same)
            k = same[0].parent
        parent = nodes.get(k)  # None: missing, rejected before, or a cycle (``k`` is on the chain)
        if parent is None:
            for same in chain:
                nodes[same[0].key] = None
                self.rejected.extend(same)
            return
        tree = self.tree
        num_layer_groups = len(tree.layer_groups)
        scope = parent.scope
        for same in reversed(chain):
            first = same[0]
            node = Node(first.key, parent, cast(BlockTokens, first.tokens), num_layer_groups)
            parent.add_child(node)
            nodes[first.key] = node
            empty = True
            for r in same:
                layer_group = r.layer_group
                if (
                    layer_group >= num_layer_groups
                    or self.pool_group_of.items[layer_group] != r.group
                    or (r.lora_id, r.salt) != scope
                    or r.parent != parent.key
                    or r.tokens != first.tokens
                ):
                    self.rejected.append(r)
                    continue
                if node.pages[layer_group] is not None:
                    self.superseded.append(r)  # an older record of this page
                    continue
                prio = r.priority if r.priority <= MAX_PRIORITY else MAX_PRIORITY
                storage = self.storages.items[r.group]
                page = Page(storage, SlotId(r.slot), LayerGroupId(layer_group), Priority(prio), True)
                tree._attach(node, layer_group, page, parent.prio_cap, RequestSerial(0))
                self.placed.append(page)
                self.seqs.append(r.seq)
                if r.retain_s != 0.0 or r.hint_end != NO_HINT:
                    self.retained.append((page, r))
                empty = False
            if empty:
                self.made.append(node)
            parent = node

    def finish(self) -> None:
        """Free the rejected records' slots, release the placed pages oldest first (evictors keep
        write order) and prune what holds nothing."""
        tree = self.tree
        for r in self.rejected + self.superseded:
            self.storages.items[r.group].allocator.free(SlotId(r.slot))
        placed = self.placed
        for i in sorted(range(len(placed)), key=self.seqs.__getitem__):
            placed[i].release(True)
        for page, r in self.retained:
            node = page.node
            if node is not None:
                self.expiries.restore(page, node.ordinal, r.retained_priority, r.expires, r.retain_s, r.hint_end)
        for node in self.made:
            if node.parent is not None and node.is_removable:
                tree.prune(node)
        for root in self.roots.values():
            tree.prune(root)


def _newest_first(record: DiskRecord) -> int:
    return -record.seq
