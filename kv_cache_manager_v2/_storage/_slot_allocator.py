"""Slot allocation for one pool group: a stack of freed slots over a high-water mark."""

from __future__ import annotations

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import Pool


class SlotAllocator:
    """Hands out slot ids in ``[0, num_slots)``; maps pool memory as the high-water mark rises.

    A slot is one index valid in every pool of the group, so its pools grow together.
    """

    def __init__(self, num_slots: int, pools: list[Pool], slot_sizes: tuple[int, ...]) -> None:
        self.num_slots = num_slots
        self._pools = pools
        self._slot_sizes = slot_sizes
        self._free: list[SlotId] = []
        self._high_water = 0
        self._is_free: bytearray = bytearray(num_slots)
        #: most slots in use at once: since creation, and since ``iteration_peak`` was last reset
        self.peak_used = 0
        self.iteration_peak = 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self._high_water + len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def prepare(self, count: int) -> None:
        """Map the memory ``count`` allocations may need, so they cannot fail later.

        May raise (e.g. ``CuError``) but changes no allocation state.
        """
        rest = count - len(self._free)
        if rest > 0:
            self._map(min(self._high_water + rest, self.num_slots))

    def allocate(self, count: int) -> list[SlotId]:
        """``count`` slots, or raise ``LogicError`` if fewer are free (callers check first)."""
        if count > self.num_free:
            raise LogicError(f"slot allocator: {count} slots requested, {self.num_free} free")
        free = self._free
        rest = count - len(free)
        beg = self._high_water
        if rest > 0:
            self._grow(beg + rest)  # first: if mapping fails, nothing has changed
        out: list[SlotId] = []
        while len(out) < count and free:
            s = free.pop()
            self._is_free[s] = 0
            out.append(s)
        if rest > 0:
            out.extend([SlotId(s) for s in range(beg, beg + rest)])
        self._note_peak()
        return out

    def _note_peak(self) -> None:
        used = self._high_water - len(self._free)
        if used > self.iteration_peak:
            self.iteration_peak = used
            if used > self.peak_used:
                self.peak_used = used

    def allocate_one(self) -> SlotId:
        free = self._free
        if free:
            s = free.pop()
            self._is_free[s] = 0
            self._note_peak()  # a free-list slot can be a new peak too (after take(), or a reset iteration peak)
            return s
        if self._high_water >= self.num_slots:
            raise LogicError("slot allocator: no free slot")
        s = SlotId(self._high_water)
        self._grow(s + 1)
        self._note_peak()
        return s

    def take(self, slots: list[SlotId]) -> None:
        """Mark ``slots`` (distinct, below ``num_slots``) used in a fresh allocator: the pages a
        persistent disk tier adopts. The slots between them are free."""
        if self._high_water or not slots:
            if slots:
                raise LogicError("slot allocator: take() is for a fresh allocator")
            return
        top = max(slots) + 1
        if top > self.num_slots:
            raise LogicError(f"slot allocator: slot {top - 1} is beyond its {self.num_slots} slots")
        self._grow(top)  # first: if mapping fails, nothing has changed
        used = bytearray(top)
        for s in slots:
            used[s] = 1
        self._free = [SlotId(s) for s in range(top - 1, -1, -1) if not used[s]]  # the lowest pops first
        for s in self._free:
            self._is_free[s] = 1
        self._note_peak()

    def allocate_below(self, limit: int, count: int) -> list[SlotId]:
        """``count`` free slots below ``limit`` (compaction before a shrink); raises ``LogicError``
        (changing nothing) if there are fewer."""
        out = [s for s in self._free if s < limit][:count]
        rest = count - len(out)
        beg = self._high_water
        if rest > 0:
            if beg + rest > limit:
                raise LogicError(f"slot allocator: {count} free slots below {limit} requested, fewer exist")
            self._grow(beg + rest)  # first: if mapping fails, nothing has changed
        taken = set(out)
        self._free = [s for s in self._free if s not in taken]
        for s in out:
            self._is_free[s] = 0
        out.extend([SlotId(s) for s in range(beg, beg + max(rest, 0))])
        self._note_peak()
        return out

    def resize(self, num_slots: int) -> None:
        """Grow, or shrink to ``num_slots`` (every slot from there on must be free)."""
        if num_slots >= self.num_slots:
            self._is_free.extend(bytearray(num_slots - self.num_slots))
            self.num_slots = num_slots
            return
        for s in range(num_slots, self._high_water):
            if not self._is_free[s]:
                raise LogicError(f"slot allocator: cannot shrink to {num_slots} slots, slot {s} is in use")
        self._high_water = min(self._high_water, num_slots)
        self._free = [s for s in self._free if s < num_slots]
        del self._is_free[num_slots:]
        self.num_slots = num_slots

    def free(self, slot: SlotId) -> None:
        if not 0 <= slot < self._high_water or self._is_free[slot]:
            raise LogicError(f"slot {slot} freed twice or never allocated")
        self._is_free[slot] = 1
        self._free.append(slot)

    def _map(self, high_water: int) -> None:
        """Back slots ``[0, high_water)`` of every pool with memory."""
        for pool, size in zip(self._pools, self._slot_sizes):
            pool.ensure_mapped(high_water * size)

    def _grow(self, high_water: int) -> None:
        self._map(high_water)
        self._high_water = high_water

    def is_allocated(self, slot: SlotId) -> bool:
        return 0 <= slot < self._high_water and not self._is_free[slot]
