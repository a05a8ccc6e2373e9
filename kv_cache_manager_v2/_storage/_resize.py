"""Tier resizing: a level's pool groups grow in place (their tier maps more), or shrink by
evicting what no longer fits (down the cascade; HELD pages only move) and moving the pages of
the cut range into free slots below it. The remote tier's headroom is set aside meanwhile."""

from __future__ import annotations

from typing import Final

from .._common import CacheLevel, PoolGroupIndex
from .._page import Page, PoolGroupStorage
from .._typed import TypedList
from ._backend import MAX_GROWTH
from ._cascade import EvictionCascade
from ._slot_allocator import pair_sorted

#: how long a tier resize waits for the remote tier's writer to finish with handed-off slots
RESIZE_FLUSH_S: Final = 30.0


class TierResizer:
    """Resizes the levels of ``storage``."""

    def __init__(self, storage: EvictionCascade) -> None:
        self.storage = storage

    def check_resize(self, level: CacheLevel, slots: list[int]) -> None:
        """Raise ``ValueError`` if a memory pool cannot grow to ``slots`` in its reserved address space."""
        for g, num_slots in enumerate(slots):
            group = self.storage.levels[level].items[g]
            for pool, size in zip(group.pools, group.layout.slot_sizes):
                if num_slots * size > pool.reserved_bytes:
                    raise ValueError(
                        f"cache level {level}: pool group {g} would need {num_slots * size} bytes in a pool whose "
                        f"reserved address space holds {pool.reserved_bytes}; a memory tier grows to at most "
                        f"{MAX_GROWTH}x its configured quota"
                    )

    def resize_level(self, level: CacheLevel, slots: list[int], live: list[Page]) -> bool:
        """Give ``level`` ``slots[g]`` slots per pool group. Shrinking evicts what no longer fits
        (cascading down; HELD pages only move) and moves pages out of the cut range. Returns False,
        changing nothing, when what must be kept cannot be placed. ``live`` lists every page
        (callers collect them; no request may be ACTIVE).
        """
        storage = self.storage
        groups = storage.levels[level]
        self.check_resize(level, slots)
        # pins beyond the share of the slots left go first (they are ordinary pages then)
        released = [p for g, num_slots in enumerate(slots) for p in storage.pins.fit_share(groups.items[g], num_slots)]
        for g, num_slots in enumerate(slots):
            group = groups.items[g]
            must_leave = group.num_used - num_slots
            if must_leave > 0 and must_leave > storage.available(level, g) - group.allocator.num_free:
                storage.pins.hold_again(released)
                return False
        remote = storage.remote_tier
        if remote is not None and not remote.settle():  # slots a late remote read may still write
            storage.pins.hold_again(released)
            return False
        headroom = [remote.headroom_of(group) if remote is not None else 0 for group in groups]
        if any(headroom):
            # the writer may still read handed-off slots: wait for it, then work without headroom
            assert remote is not None
            if not remote.remote.flush(RESIZE_FLUSH_S):
                storage.pins.hold_again(released)
                return False
            for group in groups:
                remote.drop_headroom(group)  # its slots are ordinary ones now: the resize moves pages out of them
        grown = [group for group, num_slots in zip(groups, slots) if num_slots > group.num_slots]
        try:
            self._resize_slots(groups, slots, live)
        except BaseException:
            storage.pins.hold_again(released)  # (a driver error growing a pool: nothing else changed)
            raise
        finally:
            if remote is not None:
                for group in groups:
                    if headroom[group.index]:
                        remote.add_headroom(group, remote.headroom_for(group, group.num_slots))
        for group in grown:
            storage.pins.grown(group)  # pins a shrink let go of hold again within the larger share
        return True

    def _resize_slots(
        self, groups: TypedList[PoolGroupIndex, PoolGroupStorage], slots: list[int], live: list[Page]
    ) -> None:
        for g, num_slots in enumerate(slots):  # may raise (driver, disk space): nothing logical changed yet
            group = groups.items[g]
            if num_slots > group.num_slots:
                group.tier.grow(group.pools, group.layout.slot_sizes, num_slots)
        for g, num_slots in enumerate(slots):
            group = groups.items[g]
            shrinking = num_slots < group.num_slots
            if shrinking:
                self.storage.make_room(group, group.num_slots - num_slots)
                self._compact(group, num_slots, live)
            group.allocator.resize(num_slots)
            group.evictor.resize(num_slots)
            if shrinking:
                for pool, size in zip(group.pools, group.layout.slot_sizes):
                    pool.shrink(num_slots * size)

    def _compact(self, group: PoolGroupStorage, num_slots: int, live: list[Page]) -> None:
        """Move the pages of ``group`` in slots ``>= num_slots`` to free slots below ``num_slots``."""
        movers = [p for p in live if p.storage is group and p.slot >= num_slots]
        if not movers:
            return
        storage = self.storage
        slots = pair_sorted([p.slot for p in movers], group.allocator.allocate_below(num_slots, len(movers)))
        try:
            failed = storage.copier.copy(
                group.pools, group.pools, group.layout.slot_sizes, [(p.slot, s) for p, s in zip(movers, slots)]
            )
        except BaseException:
            for s in slots:
                group.allocator.free(s)
            raise
        for i, (p, s) in enumerate(zip(movers, slots)):
            if i in failed:
                group.allocator.free(s)
                group.num_io_errors += 1
                if p.in_evictor:
                    group.evictor.remove(p)
                storage.lose(p)
                continue
            group.allocator.free(p.slot)
            p.slot = s  # same storage: the evictor listing is unaffected
        if group.level == storage.persist_level:
            storage.persist_pages(movers)
