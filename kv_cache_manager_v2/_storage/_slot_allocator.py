"""Slot allocation for one pool group: a stack of freed slots over a high-water mark."""

from __future__ import annotations

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import DevicePool


class SlotAllocator:
    """Hands out slot ids in ``[0, num_slots)``; maps pool memory as the high-water mark rises.

    A slot is one index valid in every pool of the group, so its pools grow together.
    """

    def __init__(self, num_slots: int, pools: list[DevicePool], slot_sizes: tuple[int, ...]) -> None:
        self.num_slots = num_slots
        self._pools = pools
        self._slot_sizes = slot_sizes
        self._free: list[SlotId] = []
        self._high_water = 0
        self._is_free: bytearray = bytearray(num_slots)

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
        return out

    def allocate_one(self) -> SlotId:
        free = self._free
        if free:
            s = free.pop()
            self._is_free[s] = 0
            return s
        if self._high_water >= self.num_slots:
            raise LogicError("slot allocator: no free slot")
        s = SlotId(self._high_water)
        self._grow(s + 1)
        return s

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
