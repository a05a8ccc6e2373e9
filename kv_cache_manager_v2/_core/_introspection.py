"""Invariant checker: walks every request, page, evictor and tree node and verifies they agree
(per cache level: evictors list exactly the DROPPABLE pages and the HELD pages above the last
level, in a consistent structure (LRU lists; the frequency policy's heaps, positions, parked
pages and counts), every slot has at most one page, allocators count what pages hold, lost pages only in
suspended requests, active requests only in GPU memory).

``KVCacheManager.check_invariants()`` calls it; tests run it after every step. Cost: a walk over
all state, so it is for tests and debugging only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from .._common import BAD_PAGE_INDEX, KVCacheStatus, LayerGroupId
from .._page import GARBAGE_PRIORITY, LISTED_DROPPABLE, LISTED_HELD, NO_EXPIRY, NOT_LISTED, Page
from .._reuse._node import Node
from .._reuse._tree import ReuseTree
from .._storage._storage_manager import StorageManager
from ._block_table import BlockTable
from ._kv_cache import KVCache


def _fail(what: str) -> NoReturn:
    raise AssertionError(f"kv_cache_manager_v2 invariant broken: {what}")


class _Census:
    """What the walk found: every page seen (by id), the locks and holds requests own on each,
    the scratch slots ``(level, pool group, slot)`` and the pages the evictors list."""

    def __init__(self) -> None:
        self.pages: dict[int, Page] = {}
        self.locks: dict[int, int] = {}
        self.holds: dict[int, int] = {}
        self.scratch: set[tuple[int, int, int]] = set()
        self.evictable: set[int] = set()

    def own(self, p: Page, locked: bool) -> None:
        """A request owns ``p`` once more (a lock when active, else a hold)."""
        self.pages[id(p)] = p
        counts = self.locks if locked else self.holds
        counts[id(p)] = counts.get(id(p), 0) + 1


class _PageCounts:
    """Pages per pool group (by the storage's id): live, lost, pinned, retained."""

    def __init__(
        self, used: dict[int, int], lost: dict[int, int], pinned: dict[int, int], retained: dict[int, int]
    ) -> None:
        self.used = used
        self.lost = lost
        self.pinned = pinned
        self.retained = retained


def check_invariants(storage: StorageManager, tree: ReuseTree, caches: list[KVCache]) -> None:
    """Raise ``AssertionError`` describing the first broken invariant."""
    census = _Census()
    for kv in caches:
        _check_request(kv, census)
    _check_evictors(storage, census)
    _check_tree(tree, caches, census)
    _check_pool_groups(storage, census.scratch, _check_pages(storage, census))


def _check_request(kv: KVCache, census: _Census) -> None:
    """Each beam's table of ``kv``, its live states (one page per beam) and its scratch slots."""
    states: set[int] = set()
    for beam, table in enumerate(kv.block_tables):
        _check_cache(kv, table, beam, census.own)
        for state_page in table.state_pages:
            if state_page is not None:
                if id(state_page) in states:
                    _fail(f"{kv!r}: two beams share one live-state page")
                states.add(id(state_page))
    for i, slots in enumerate(kv.block_table.scratch_slots):
        group = kv._ctx.storage.lc_storage[LayerGroupId(i)]
        for slot in slots:
            if not group.allocator.is_allocated(slot):
                _fail(f"{kv!r}: scratch slot {slot} is not allocated")
            scratch_key = (int(group.level), int(group.index), int(slot))
            if scratch_key in census.scratch:
                _fail(f"scratch slot {scratch_key} is owned twice")
            census.scratch.add(scratch_key)


def _check_evictors(storage: StorageManager, census: _Census) -> None:
    """Each evictor is consistent and lists exactly unlocked, not lost pages of its pool group:
    DROPPABLE ones (garbage exactly when out of the tree) and, above the last level, HELD ones."""
    for level in storage.levels:
        for group in level:
            ev = group.evictor
            broken = ev.structure_error()
            if broken is not None:
                _fail(f"evictor of pool group {group.index} at level {group.level}: {broken}")
            listed = ev.pages()
            if len(listed) != ev.count:
                _fail(
                    f"evictor of pool group {group.index} at level {group.level} counts {ev.count} but lists {len(listed)}"
                )
            held = 0
            for p in listed:
                if p.num_locks or p.lost or p.pin_held:
                    _fail(f"evictor at level {group.level} lists page {p.slot}, which is locked, lost or pinned")
                if p.num_holds:
                    held += 1
                    if group.is_last:
                        _fail(f"the last level's evictor lists HELD page {p.slot}: it could be dropped")
                    if p.in_evictor != LISTED_HELD:
                        _fail(f"HELD page {p.slot} is listed as DROPPABLE")
                elif p.in_evictor != LISTED_DROPPABLE or (p.node is None) != (p.priority == GARBAGE_PRIORITY):
                    _fail(f"evictor lists page {p.slot} as held, or garbage that is in the tree, or neither")
                if p.storage is not group:
                    _fail(f"evictor of pool group {group.index} at level {group.level} lists a page of another storage")
                census.evictable.add(id(p))
                census.pages[id(p)] = p
            if held != ev.num_held:
                _fail(f"evictor at level {group.level} counts {ev.num_held} HELD pages but lists {held}")


def _check_tree(tree: ReuseTree, caches: list[KVCache], census: _Census) -> None:
    """Every node is linked from its parent, counts the requests extending it, is kept only while
    needed, and agrees with its pages, each owned or evictable."""
    extenders: dict[int, int] = {}
    for kv in caches:
        last = kv._last_node
        if last is not None:
            extenders[id(last)] = extenders.get(id(last), 0) + 1
    for node in tree.nodes():
        parent = node.parent
        if parent is None or parent.child(node.key) is not node:
            _fail(f"tree node at ordinal {node.ordinal} is not linked from its parent")
        if node.num_extenders != extenders.get(id(node), 0):
            _fail(f"tree node at ordinal {node.ordinal} counts {node.num_extenders} extending requests")
        if node.is_removable:
            _fail(f"tree node at ordinal {node.ordinal} has no pages, children or extenders but was kept")
        _check_value(tree, node)
        for layer_group, r in enumerate(node.pages):
            if r is None:
                continue
            tree_page = r()
            if tree_page is None:
                _fail(f"tree node at ordinal {node.ordinal} refers to a freed page (layer group {layer_group})")
            p = tree_page
            if p.node is not node or p.layer_group != layer_group:
                _fail(f"page {p.slot} and tree node at ordinal {node.ordinal} disagree")
            census.pages[id(p)] = p
            if p.num_locks == 0 and p.num_holds == 0 and not p.pin_held and id(p) not in census.evictable:
                _fail(f"unowned tree page {p.slot} (ordinal {node.ordinal}) is not evictable")


def _check_value(tree: ReuseTree, node: Node) -> None:
    """A hybrid model's node counts its own complete snapshot and its children reaching one
    (``snapshot_reach``); its KV is low-value exactly when it reaches none, its snapshot pages when
    incomplete. No page is low-value in other models."""
    state_groups = tree.state_groups
    complete = bool(state_groups) and node.holds_pages(state_groups)
    reach = int(complete) + sum(1 for child in node.children() if child.snapshot_reach > 0) if state_groups else 0
    if node.snapshot_reach != reach:
        _fail(f"tree node at ordinal {node.ordinal} counts snapshot reach {node.snapshot_reach}, not {reach}")
    for layer_group, r in enumerate(node.pages):
        p = r() if r is not None else None
        if p is None:
            continue
        if not state_groups:
            low = False
        elif layer_group in state_groups:
            low = not complete
        else:
            low = reach == 0
        if p.low_value != low:
            _fail(f"page {p.slot} (ordinal {node.ordinal}, layer group {layer_group}) is low-value: {p.low_value}")


def _check_pages(storage: StorageManager, census: _Census) -> _PageCounts:
    """Every page seen counts exactly the owners found, lives at its level, is listed exactly when
    an evictor lists it and holds one slot of its own (a lost one none), and a retained one is in
    the expiry queue exactly while no request owns it; returns the pages counted per pool group."""
    owner_of: dict[tuple[int, int, int], int] = {}
    used: dict[int, int] = {}
    lost: dict[int, int] = {}
    pinned: dict[int, int] = {}
    retained: dict[int, int] = {}
    expiring = storage.expiries.pending()
    locks, holds, evictable = census.locks, census.holds, census.evictable
    for key, p in census.pages.items():
        owned = p.num_locks != 0 or p.num_holds != 0
        if p.expires != NO_EXPIRY:  # a retention's duration runs only while no request owns the page
            if (key, p.expires) not in expiring or owned or p.retain_s == 0.0:
                _fail(
                    f"page {p.slot} is retained until {p.expires} ({p.retain_s} s) but the expiry queue does not "
                    f"have it, or a request owns it ({p.num_locks} locks / {p.num_holds} holds)"
                )
        elif p.retain_s != 0.0 and not owned:
            _fail(f"reusable page {p.slot} is retained for {p.retain_s} s but its duration does not run")
        if p.num_locks != locks.get(key, 0) or p.num_holds != holds.get(key, 0):
            _fail(
                f"page {p.slot} counts {p.num_locks} locks / {p.num_holds} holds but requests own "
                f"{locks.get(key, 0)} / {holds.get(key, 0)}"
            )
        if p.level != p.storage.level or storage.levels[p.level].items[p.storage.index] is not p.storage:
            _fail(f"page {p.slot} says level {p.level} but lives in storage of level {p.storage.level}")
        if p.node is None and p.low_value:
            _fail(f"page {p.slot} is in no tree but low-value")
        if (key in evictable) != (p.in_evictor != NOT_LISTED):
            _fail(f"page {p.slot} at level {p.level} thinks it is listed ({p.in_evictor}) but is not, or the reverse")
        if p.lost:
            if p.slot != BAD_PAGE_INDEX or p.node is not None or locks.get(key, 0):
                _fail("a lost page keeps a slot, a tree node or a lock")
            lost[id(p.storage)] = lost.get(id(p.storage), 0) + 1
            continue
        if p.num_holds and not p.num_locks and not p.pin_held and not p.storage.is_last and key not in evictable:
            _fail(f"HELD page {p.slot} at level {p.level} (not the last) is not evictable")
        if p.slot == BAD_PAGE_INDEX or not p.storage.allocator.is_allocated(p.slot):
            _fail(f"live page of pool group {p.storage.index} has no allocated slot ({p.slot})")
        slot_key = (int(p.level), int(p.storage.index), int(p.slot))
        if owner_of.setdefault(slot_key, key) != key or slot_key in census.scratch:
            _fail(f"slot {slot_key} (level, pool group, slot) is owned twice")
        used[id(p.storage)] = used.get(id(p.storage), 0) + 1
        if p.pin_held:
            if not p.num_pins:
                _fail(f"page {p.slot} at level {p.level} holds pins but has none")
            pinned[id(p.storage)] = pinned.get(id(p.storage), 0) + 1
        if p.retained:
            retained[id(p.storage)] = retained.get(id(p.storage), 0) + 1
    return _PageCounts(used, lost, pinned, retained)


def _check_pool_groups(storage: StorageManager, scratch: set[tuple[int, int, int]], counts: _PageCounts) -> None:
    """Each allocator counts exactly the slots of live pages, scratch and parked headroom; each
    pool group counts its lost, pinned and retained pages, its pinned ones within its share."""
    used, lost, pinned, retained = counts.used, counts.lost, counts.pinned, counts.retained
    for level in storage.levels:
        for group in level:
            n_scratch = len([1 for lv, g, _ in scratch if lv == group.level and g == group.index])
            remote = storage.remote_tier
            headroom = remote.headroom_of(group) if remote is not None else 0
            idle = remote.parked_of(group) if remote is not None else []
            held = remote.held_of(group) if remote is not None else []
            if len(idle) > headroom or any(not group.allocator.is_allocated(x) for x in idle + held):
                _fail(f"pool group {group.index} at level {group.level}: set-aside slots are not reserved")
            if group.set_aside != headroom + len(held):
                _fail(
                    f"pool group {group.index} at level {group.level}: {group.set_aside} slots set aside, not {headroom} + {len(held)}"
                )
            if group.allocator.num_used != used.get(id(group), 0) + n_scratch + group.set_aside:
                _fail(
                    f"pool group {group.index} at level {group.level}: allocator counts "
                    f"{group.allocator.num_used} used slots, pages hold {used.get(id(group), 0)}, scratch {n_scratch}, "
                    f"set aside (remote-tier headroom, held reads) {group.set_aside}"
                )
            if group.num_pinned != pinned.get(id(group), 0) or group.num_retained != retained.get(id(group), 0):
                _fail(
                    f"pool group {group.index} at level {group.level} counts {group.num_pinned} pinned / "
                    f"{group.num_retained} retained pages, not {pinned.get(id(group), 0)} / {retained.get(id(group), 0)}"
                )
            if group.num_pinned > group.pin_limit:
                _fail(
                    f"pool group {group.index} at level {group.level} holds {group.num_pinned} pinned pages, beyond "
                    f"max_pinned_share of its {group.num_slots} slots ({group.pin_limit})"
                )
            if group.num_lost != lost.get(id(group), 0):
                _fail(f"pool group {group.index} at level {group.level} counts {group.num_lost} lost pages")


def _check_cache(kv: KVCache, table: BlockTable, beam: int, own: Callable[[Page, bool], None]) -> None:
    """One beam's table of ``kv`` (each beam's table owns its pages once)."""
    status = kv.status
    if not kv.num_committed_tokens <= kv.history_length <= kv.capacity:
        _fail(f"{kv!r}: lengths out of order")
    t = kv.tokens_per_block
    if kv.num_blocks != (kv.capacity + t - 1) // t:
        _fail(f"{kv!r}: {kv.num_blocks} blocks for capacity {kv.capacity}")
    locked = status is KVCacheStatus.ACTIVE
    if status is not KVCacheStatus.CLOSED and table.live != locked:
        _fail(f"{kv!r}: its indices are {'live' if table.live else 'hidden'}")
    layer_groups = kv._ctx.layer_groups
    for i in range(len(table)):
        layer_group = LayerGroupId(i)
        lc_pages = table.pages[layer_group]
        indices = table.views[layer_group]
        if status is KVCacheStatus.CLOSED:
            if lc_pages or len(indices):
                _fail(f"{kv!r}: a closed cache still has pages")
            continue
        if len(lc_pages) != kv.num_blocks or len(indices) != kv.num_blocks:
            _fail(f"{kv!r} beam {beam}: layer group {layer_group} has {len(lc_pages)} pages / {len(indices)} indices")
        buf = table.user_bufs[layer_group]
        src = kv.block_table.pending_copy[layer_group]  # beam 0 holds it for every beam
        stale_end = table.stale_end[layer_group]
        if stale_end != layer_groups[layer_group].stale_end(kv.history_length):
            _fail(
                f"{kv!r}: layer group {layer_group} released blocks below {stale_end}, its window at history "
                f"{kv.history_length} ends at {layer_groups[layer_group].stale_end(kv.history_length)}"
            )
        sb, se = table.scratch[layer_group]
        slots_needed = (se - sb) > 0 and status is not KVCacheStatus.SUSPENDED
        if slots_needed != bool(table.scratch_slots[layer_group]):
            _fail(
                f"{kv!r}: layer group {layer_group} has scratch blocks {sb}..{se} but {len(table.scratch_slots[layer_group])} slots"
            )
        for ordinal, p in enumerate(lc_pages):
            stale = layer_groups[layer_group].is_stale(ordinal, kv.history_length) or sb <= ordinal < se
            if stale and p is not None:
                _fail(
                    f"{kv!r}: block {ordinal} of layer group {layer_group} is out of the window or scratch but keeps a page"
                )
            if not stale and p is None and not (src is not None and ordinal == kv.num_blocks - 1):
                _fail(f"{kv!r}: block {ordinal} of layer group {layer_group} needs a page but has none")
            want = BAD_PAGE_INDEX if p is None or not locked else p.slot
            if indices[ordinal] != want or (buf is not None and buf[ordinal] != want):
                _fail(
                    f"{kv!r}: index of block {ordinal} (layer group {layer_group}) is {indices[ordinal]}, its page is at {want}"
                )
            if p is not None:
                if locked and (p.level != 0 or p.lost):
                    _fail(
                        f"{kv!r}: block {ordinal} of layer group {layer_group} is at cache level {p.level} (lost: {p.lost})"
                    )
                own(p, locked)
        if buf is not None and any(x != BAD_PAGE_INDEX for x in buf[kv.num_blocks :]):
            _fail(f"{kv!r}: the caller's index buffer has entries past the blocks")
        if src is not None and beam == 0:
            own(src, False)
    for k, state_page in enumerate(table.state_pages):
        layer_group = table.state_groups[k]
        if status is KVCacheStatus.CLOSED or (status is KVCacheStatus.ACTIVE and state_page is None):
            if state_page is not None or status is KVCacheStatus.ACTIVE:
                _fail(f"{kv!r} beam {beam}: layer group {layer_group} has a live state page: {state_page is not None}")
            continue
        if state_page is None:
            continue  # allocated at the first resume
        if state_page.node is not None or state_page.layer_group != layer_group:
            _fail(f"{kv!r} beam {beam}: the live state of layer group {layer_group} is in the tree or another group")
        if locked and (state_page.level != 0 or state_page.lost):
            _fail(f"{kv!r} beam {beam}: live state at cache level {state_page.level} (lost: {state_page.lost})")
        own(state_page, locked)
        if status is KVCacheStatus.ACTIVE and kv.block_table.pending_copy[layer_group] is not None:
            _fail(f"{kv!r}: the matched snapshot of layer group {layer_group} was not copied at resume")
