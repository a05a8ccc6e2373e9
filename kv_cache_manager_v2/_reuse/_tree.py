"""The radix tree of committed blocks (docs/design.md, "Reuse"): matching, publishing (insert and dedup)
and removal. It is the one place blocks enter and leave the reuse cache."""

from __future__ import annotations

from typing import cast

from .._common import (
    BlockTokens,
    CacheLevel,
    LayerGroupId,
    Priority,
    RequestSerial,
    ReuseScope,
    SessionId,
)
from .._events import NOT_MOVED, BlockStoredEvent, KVCacheEventManager
from .._layers._policy import LayerGroup
from .._page import Page
from .._storage._storage_manager import PageDropListener, StorageManager
from .._typed import TypedList
from ._keys import BlockHasher, BlockKey, block_key, scope_key, validate_tokens
from ._node import Node
from ._walk import ChainNode, Walk


class ReuseTree(PageDropListener):
    """Roots per reuse scope; matching, publishing and removal of committed blocks."""

    def __init__(self, layer_groups: TypedList[LayerGroupId, LayerGroup], tokens_per_block: int) -> None:
        self.layer_groups = layer_groups
        self.tokens_per_block = tokens_per_block
        #: the walk down the tree and its stop rules (the layer groups by what a match needs of them)
        self.walk = Walk(tokens_per_block, list(enumerate(layer_groups)))
        #: groups whose pages are snapshots of a live state (recurrent layers): a match ends at a
        #: block holding a snapshot of each
        self.state_groups = self.walk.state_groups
        #: the others: a partially matched block must hold a page of each (it is the match's last block)
        self.partial_groups = self.walk.partial_groups
        #: snapshot pages that left the tree (evicted, or with their block)
        self.snapshots_evicted = 0
        #: of those, the ones no match took
        self.snapshots_evicted_unused = 0
        #: (node id, layer group) of the snapshots in the tree a match took
        self._used_snapshots: set[tuple[int, int]] = set()
        #: what the last ``match`` of a hybrid model saw before its cut to a snapshot: the full
        #: blocks the attention layers matched, and whether the tree goes on past them (the
        #: tokens leave a cached path there)
        self.attention_blocks = 0
        self.branches = False
        #: the full-block nodes the last ``match`` walked, before it shortened the match
        self.walked: list[Node] = []
        self.roots: dict[tuple[int | None, int | None], Node] = {}
        #: told about every page that enters, leaves or moves within the tree (None: nobody listens)
        self.event_sink: KVCacheEventManager | None = None
        #: remote tier with write-through: every full block published is queued for writing there
        self.write_through: StorageManager | None = None
        #: tell the evictors when a node loses its last child (the frequency policy parks pages)
        self.reports_leaves = False

    def root(self, scope: ReuseScope, create: bool) -> Node | None:
        """The root node of a scope (keyed by the scope's digest), created on first publish."""
        ident = (scope.lora_id, scope.salt)
        node = self.roots.get(ident)
        if node is None and create:
            node = self.roots[ident] = Node(scope_key(scope), None, (), len(self.layer_groups))
            node.scope = ident
            node.lora_id = scope.lora_id
        return node

    # ------------------------------------------------------------------ matching
    def match(
        self, root: Node, hasher: BlockHasher, partial: bool, walked: list[Node] | None = None, record: bool = False
    ) -> tuple[list[Node], Node | None, int]:
        """Longest reusable prefix: matched full-block nodes, then an optional partial node and its length.

        Walks full blocks by key (``hasher`` computes and keeps them), checking on the way the
        pages of the layer groups that keep every block; at the first miss picks the child with
        the longest common token prefix; then shortens until every layer group has the pages it
        needs there (a sliding window only those outside its stale range). Only the tokens of
        the blocks looked at are validated.

        ``walked``: the nodes an earlier walk of the same tokens passed, all still in the tree
        (the deepest one is: a node leaves with its subtree), ``hasher`` holding their keys; the
        walk goes on after them, and only the groups keeping every block look at their pages.
        With ``record``, the nodes this walk passed (before shortening) are left in ``self.walked``.
        """
        t = self.tokens_per_block
        tokens = hasher.tokens
        walk = self.walk
        nodes: list[Node] = walked if walked is not None else []
        n_full = len(tokens) // t
        ordinal = len(nodes)
        # the first block walked that lacks a page of a group keeping every block
        gap = walk.gap(nodes, None) if ordinal and walk.keeping else -1
        node = nodes[-1] if ordinal else root
        found = walk.descend(node, hasher, ordinal, n_full, cast("list[ChainNode]", nodes))
        if gap < 0:
            gap = found
        ordinal = len(nodes)
        if ordinal:
            node = nodes[-1]
        if record:
            self.walked = nodes[:]
        part: Node | None = None
        part_len = 0
        if partial and ordinal * t < len(tokens) and node.has_children:
            rest = tokens[ordinal * t : (ordinal + 1) * t]
            validate_tokens(rest, hasher.name)  # compared token by token below
            part, part_len = node.best_partial(rest, self.partial_groups)  # holds every page it needs
        # Shorten until the pages needed at the matched length exist for every layer group.
        missing = walk.first_missing(nodes, part, ordinal * t + part_len, gap, None) if walk.releasing else gap
        if missing >= 0:
            del nodes[walk.cut_at(nodes, ordinal, missing) :]
            part, part_len = None, 0
        if self.state_groups:
            self.attention_blocks = len(nodes)
            self.branches = len(nodes) > 0 and nodes[-1].has_children
            self.cut_to_snapshot(nodes)
            return nodes, None, 0
        return nodes, part, part_len

    def cut(self, nodes: list[Node], num_blocks: int) -> None:
        """Shorten a match (full blocks) to at most ``num_blocks`` blocks, then by ``match``'s rules
        until every layer group has the pages it needs there (a hybrid model's: at a snapshot)."""
        del nodes[num_blocks:]
        if self.walk.releasing:
            num_full = self.walk.shorten(nodes, len(nodes), None, 0, -1)[0]
            if num_full < len(nodes):
                del nodes[num_full:]
        if self.state_groups:
            self.cut_to_snapshot(nodes)

    def cut_to_snapshot(self, nodes: list[Node]) -> None:
        """Shorten a match (full blocks) to end at the last block holding a snapshot of every
        state group, then until the attention groups have their pages there; again until both
        hold (a shorter match may need pages a sliding window did not). Never longer than before."""
        num_full = self.walk.snapshot_cut(nodes, len(nodes))
        if num_full < len(nodes):
            del nodes[num_full:]

    def attach_snapshot(self, node: Node, layer_group: int, page: Page, serial: RequestSerial) -> None:
        """Make ``page`` (a new private copy of a live state, locked by the caller) ``node``'s
        snapshot for ``layer_group``; its priority is capped like the block's other pages."""
        self._attach(node, layer_group, page, node.prio_cap, serial)

    def snapshot_used(self, node: Node, layer_group: int) -> None:
        """A match took ``node``'s snapshot of ``layer_group`` (statistics)."""
        self._used_snapshots.add((id(node), layer_group))

    def _snapshot_left(self, node: Node, layer_group: int) -> None:
        self.snapshots_evicted += 1
        key = (id(node), layer_group)
        if key in self._used_snapshots:
            self._used_snapshots.discard(key)
        else:
            self.snapshots_evicted_unused += 1

    # ------------------------------------------------------------------ publishing
    def publish(
        self,
        parent: Node,
        tokens: BlockTokens,
        pages: list[Page | None],
        locked: bool,
        serial: RequestSerial,
        key: BlockKey | None = None,
        session: SessionId | None = None,
    ) -> Node | None:
        """Insert one committed block under ``parent`` (a partial tail when shorter than a block);
        ``key`` is its ``block_key`` when the caller computed it (with its neighbours', in one call).

        ``pages[layer_group]`` is the publishing request's page of the block (None: it has none there).
        Where the tree already holds a page for the block, the request switches to it (dedup):
        ``pages[layer_group]`` becomes the tree's page, taken (locked if ``locked``, else held), and the
        request's own is released; if the tree's page sits in a lower cache level, the two swap
        places first (same data), so an active request keeps a GPU page. Either way request
        ``serial`` uses the block (use counting, frequency policy). Returns the block's
        node, or None when a longer sibling already covers a partial tail (then nothing is
        published).

        A published page's priority is capped by the anchor pages above it, so a block is never
        evicted after its ancestors' anchors (whose eviction would take it along). ``key``: the
        block's key when the caller has it already; ``session``: the publishing request's session (a
        new node's ``session``).
        """
        if len(tokens) < self.tokens_per_block and parent.covers(tokens):
            return None
        if key is None:
            key = block_key(parent.key, tokens)
        node = parent.child(key)
        if node is None:
            node = Node(key, parent, tokens, len(pages))
            node.session = session
            parent.add_child(node)
        priority_cap = parent.prio_cap
        for layer_group in range(len(pages)):
            mine = pages[layer_group]
            theirs = node.page(layer_group)
            if theirs is None:
                if mine is not None and mine.node is None:  # owned by the request
                    self._attach(node, layer_group, mine, priority_cap, serial)
            elif mine is not None and theirs is not mine:
                if theirs.level > mine.level:  # the tree's copy is in a lower tier: it takes our place
                    source_level = theirs.level
                    theirs.exchange_location(mine)
                    self.page_moved(theirs, source_level)
                theirs.take(locked)
                theirs.used(serial, True)
                pages[layer_group] = theirs
                mine.release(locked)
        return node

    def _attach(self, node: Node, layer_group: int, page: Page, priority_cap: Priority, serial: RequestSerial) -> None:
        """Make ``page`` (owned, in no tree) ``node``'s page for layer group ``layer_group``, its priority
        capped at ``priority_cap``; request ``serial`` uses it; subscribers and write-through hear of it."""
        self._cap_priority(page, priority_cap)
        self._link(node, layer_group, page)
        self._count_use(page, serial)
        if self.state_groups:
            self._value_attached(node, page)
        if self.event_sink is not None:
            self._report_stored(node, layer_group, page)
        if self.write_through is not None:
            self._queue_write_through(node, page)

    def _cap_priority(self, page: Page, priority_cap: Priority) -> None:
        """Priority: a published page evicts no later than the anchors above it (``priority_cap``),
        its base priority too (where retention ends)."""
        if page.priority > priority_cap:
            page.set_priority(priority_cap)
        if page.base_priority > priority_cap:
            page.base_priority = priority_cap

    def _link(self, node: Node, layer_group: int, page: Page) -> None:
        """Anchors: ``page`` becomes ``node``'s page of ``layer_group``; an anchor page (its group's
        ``is_anchor`` at the block) caps the priority of the pages published below ``node``."""
        page.node = node
        node.pages[layer_group] = page.ref()
        anchor = self.layer_groups.items[layer_group].is_anchor(node.ordinal)
        page.anchor = anchor
        if anchor and page.priority < node.prio_cap:
            node.prio_cap = page.priority

    def _count_use(self, page: Page, serial: RequestSerial) -> None:
        """Use counts: request ``serial`` used the page (its eviction policy hears of it; a new page, not a reuse)."""
        page.used(serial, False)

    def _report_stored(self, node: Node, layer_group: int, page: Page) -> None:
        """Events: subscribers hear that the block gained a page of ``layer_group``."""
        sink = self.event_sink
        assert sink is not None
        sink.block_stored(_event(sink, node, layer_group, page, NOT_MOVED))

    def _queue_write_through(self, node: Node, page: Page) -> None:
        """Write-through: a full block's page not fetched from the remote tier is queued for writing there."""
        wt = self.write_through
        assert wt is not None
        if len(node.tokens) == self.tokens_per_block and not page.stored_below:
            wt.queue_write_through(page)

    # ------------------------------------------------------------------ value (hybrid models)
    def _value_attached(self, node: Node, page: Page) -> None:
        """Value a page just attached to ``node``: KV is low-value while no match can end at or
        below its block; a snapshot completing the block's reaches the ancestors (``_reach``)."""
        if not self.layer_groups.items[page.layer_group].keeps_live_state:
            page.set_low_value(node.snapshot_reach == 0)
        elif node.holds_pages(self.state_groups):
            self._reach(node, 1)
        else:
            page.set_low_value(True)  # the block's snapshot is incomplete so far: no match ends here

    def _reach(self, node: Node, delta: int) -> None:
        """``node.snapshot_reach`` changes by ``delta`` (its own snapshot came or went, or a child
        started or stopped reaching one; its snapshot pages are low-value while incomplete): when a
        node starts or stops reaching a snapshot its KV is revalued and its parent told, and so on up."""
        state_groups = self.state_groups
        incomplete = not node.holds_pages(state_groups)
        for layer_group in state_groups:
            page = node.page(layer_group)
            if page is not None:
                page.set_low_value(incomplete)
        n = node
        while True:
            before = n.snapshot_reach
            after = before + delta
            n.snapshot_reach = after
            parent = n.parent
            if (before > 0) == (after > 0) or parent is None:
                return
            for layer_group in self.partial_groups:
                page = n.page(layer_group)
                if page is not None:
                    page.set_low_value(after == 0)
            n = parent

    # ------------------------------------------------------------------ removal
    def page_dropped(self, page: Page) -> None:
        """Forget an evicted page; remove what can no longer be reused without it."""
        node = page.node
        if node is None:
            return
        assert isinstance(node, Node)  # (narrows without typing.cast, a call when interpreted)
        layer_group = page.layer_group
        policy = self.layer_groups.items[layer_group]
        had_snapshot = policy.keeps_live_state and node.holds_pages(self.state_groups)
        if page.low_value:
            page.set_low_value(False)
        page.node = None
        node.pages[layer_group] = None
        if policy.keeps_live_state:
            self._snapshot_left(node, layer_group)
            if had_snapshot:
                self._reach(node, -1)
        sink = self.event_sink
        if sink is not None:
            sink.block_removed(node.key, layer_group, page.level, node.session)
        if page.anchor:  # (``is_anchor`` of its block, set with ``page.node``)
            self.remove_subtree(node)
        else:
            self.prune(node)

    def remove_subtree(self, node: Node, free_unused: bool = False) -> None:
        """Unlink ``node`` and its descendants; pages in use are detached (private to their owners).

        Unused pages become garbage, evicted before anything else, so an eviction never frees
        more slots than it was asked for; with ``free_unused`` they are freed at once.
        """
        parent = node.parent
        if parent is not None:
            parent.remove_child(node)
            if node.snapshot_reach > 0:
                self._reach(parent, -1)
            if self.reports_leaves and not parent.has_children:
                self._became_leaf(parent)
        if node.has_children:
            stack = [node]
            while stack:
                n = stack.pop()
                stack.extend(n.drop_children())
                self._detach(n, free_unused)
        else:  # a leaf (the usual eviction): no stack
            self._detach(node, free_unused)
        if parent is not None:
            self.prune(parent)

    def _detach(self, n: Node, free_unused: bool) -> None:
        """``remove_subtree`` for one node already unlinked from its children: it leaves its
        parent, and its pages leave it (unused ones become garbage, or are freed)."""
        n.parent = None
        sink = self.event_sink
        pages = n.pages
        for layer_group in range(len(pages)):
            r = pages[layer_group]
            p = r() if r is not None else None
            pages[layer_group] = None
            if p is not None:
                if self.layer_groups.items[layer_group].keeps_live_state:
                    self._snapshot_left(n, layer_group)
                if sink is not None:
                    sink.block_removed(n.key, layer_group, p.level, n.session)
                p.set_low_value(False)
                unused = p.num_locks == 0 and p.num_holds == 0
                if unused and not free_unused:
                    p.dropped()  # the block leaves the cache (its policy may remember its uses)
                p.node = None
                if unused:
                    if free_unused:
                        p.storage.evictor.remove(p)
                        p.free()
                    else:
                        if p.pin_held:  # (its block left the tree: a pin cannot keep it)
                            p.unhold_pins()
                            p.relist()
                        p.storage.evictor.to_garbage(p)

    def page_moved(self, page: Page, source_level: CacheLevel) -> None:
        """A tree page moved between tiers (it is at ``page.level`` now): only subscribers care."""
        sink = self.event_sink
        if sink is not None and page.node is not None:
            sink.block_stored(_event(sink, cast(Node, page.node), page.layer_group, page, source_level))

    def prune(self, node: Node) -> None:
        """Remove removable nodes upward, and the scope's root once it holds nothing."""
        n: Node | None = node
        while n is not None and n.parent is not None and n.is_removable:
            parent: Node | None = n.parent
            assert parent is not None
            parent.remove_child(n)
            n.parent = None
            if self.reports_leaves and not parent.has_children:
                self._became_leaf(parent)
            n = parent
        # (only a root has no parent: the loop stopped at a node with one that is not removable)
        if (
            n is not None
            and n.parent is None
            and n.scope is not None
            and n.is_removable
            and self.roots.get(n.scope) is n
        ):
            del self.roots[n.scope]

    def _became_leaf(self, node: Node) -> None:
        """``node`` lost its last child: its listed pages may stop waiting for descendants."""
        for r in node.pages:
            p = r() if r is not None else None
            if p is not None and p.in_evictor:
                p.storage.evictor.became_leaf(p)

    def clear(self) -> None:
        """Remove every block (callers made sure no request uses any); subscribers get one event."""
        sink = self.event_sink
        self.event_sink = None
        try:
            for root in list(self.roots.values()):
                for child in root.children():
                    self.remove_subtree(child, free_unused=True)
            self.roots = {}
        finally:
            self.event_sink = sink
        if sink is not None:
            sink.all_cleared()

    def stored_block_events(self, events: KVCacheEventManager) -> list[BlockStoredEvent]:
        """A stored event per page in the tree, parents first (an event subscriber's resync)."""
        out: list[BlockStoredEvent] = []
        for node in self.nodes():  # pre-order: a parent before its children
            for lc in range(len(node.pages)):
                page = node.page(lc)
                if page is not None:
                    out.append(_event(events, node, lc, page, NOT_MOVED))
        return out

    def nodes(self) -> list[Node]:
        """Every node below the roots (for checks and statistics)."""
        out: list[Node] = []
        stack = [c for root in self.roots.values() for c in root.children()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children())
        return out


def _event(events: KVCacheEventManager, node: Node, lc: int, page: Page, source_level: int) -> BlockStoredEvent:
    """The event of ``page`` being ``node``'s page of layer group ``lc`` (moved from ``source_level``)."""
    parent = node.parent
    assert parent is not None
    return events.stored_event(
        node.key,
        parent.key,
        parent.parent is None,
        node.tokens,
        node.lora_id,
        lc,
        page.priority,
        page.level,
        source_level,
        node.session,
    )
