"""Slot allocation for one pool group: free slots kept as runs of consecutive slots, so a batch of
pages (a request's blocks, an offload's targets) lands in as few runs as the free space allows and
its copies merge (the copy engine copies a run of consecutive slots at once).

Free slots below the high-water mark are kept as maximal runs, indexed by their first slot, their
last slot and their length class (``length.bit_length()``): taking, freeing and merging are O(1),
finding a run that fits is one bit scan over the non-empty classes. Above the high-water mark no
memory is mapped yet; it is used only when the runs below cannot hold a request (as before runs)."""

from __future__ import annotations

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import Pool

#: runs of the length class below the asked count that are checked for one long enough, before
#: giving up on a single run (the class above always fits)
FIT_PROBES = 8


class SlotAllocator:
    """Hands out slot ids in ``[0, num_slots)``; maps pool memory as the high-water mark rises.

    A slot is one index valid in every pool of the group, so its pools grow together. ``allocate``
    returns slots ascending within each run, from one free run where one is long enough (the
    smallest length class that fits), else from the longest runs; ``after`` (the slot of the
    request's previous block) asks for the free run right after it first, else the one right
    before it (the order of a batch's slots does not matter to copies, only that they are
    consecutive: see ``paired_in_order``). Nothing in use ever moves.
    """

    def __init__(self, num_slots: int, pools: list[Pool], slot_sizes: tuple[int, ...]) -> None:
        self.num_slots = num_slots
        self._pools = pools
        self._slot_sizes = slot_sizes
        self._high_water = 0
        self._is_free: bytearray = bytearray(num_slots)
        #: free runs below the high-water mark: first slot -> last slot and back
        self._last_of: dict[int, int] = {}
        self._first_of: dict[int, int] = {}
        #: the runs (by last slot, which stays put while a run grows at the front, as releases
        #: go last block first, or is used from the front) per length class
        #: ``length.bit_length()``; bit c of ``_nonempty`` is set while class c has a run
        self._classes: list[dict[int, None]] = [{} for _ in range(65)]
        self._nonempty = 0
        self._num_free_below = 0
        #: most slots in use at once: since creation, and since ``iteration_peak`` was last reset
        self.peak_used = 0
        self.iteration_peak = 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self._high_water + self._num_free_below

    @property
    def num_used(self) -> int:
        return self._high_water - self._num_free_below

    @property
    def num_runs(self) -> int:
        """Free runs below the high-water mark (a measure of fragmentation)."""
        return len(self._last_of)

    def prepare(self, count: int) -> None:
        """Map the memory ``count`` allocations may need, so they cannot fail later.

        May raise (e.g. ``CuError``) but changes no allocation state.
        """
        rest = count - self._num_free_below
        if rest > 0:
            self._map(min(self._high_water + rest, self.num_slots))

    # ------------------------------------------------------------------ runs
    def _list(self, first: int, last: int) -> None:
        self._last_of[first] = last
        self._first_of[last] = first
        c = (last - first + 1).bit_length()
        self._classes[c][last] = None
        self._nonempty |= 1 << c

    def _unclass(self, last: int, length: int) -> None:
        c = length.bit_length()
        runs = self._classes[c]
        del runs[last]
        if not runs:
            self._nonempty &= ~(1 << c)

    def _reclass(self, last: int, old: int, new: int) -> None:
        """The run ending at ``last`` is now ``new`` slots long (it was ``old``)."""
        c = new.bit_length()
        if c != old.bit_length():
            self._unclass(last, old)
            self._classes[c][last] = None
            self._nonempty |= 1 << c

    def _take(self, first: int, want: int, out: list[SlotId]) -> None:
        """Use up to ``want`` slots from the front of the run starting at ``first``."""
        last = self._last_of.pop(first)
        length = last - first + 1
        if want >= length:
            del self._first_of[last]
            self._unclass(last, length)
            self._use(first, length, out)
            return
        self._last_of[first + want] = last  # the run keeps its last slot (its key)
        self._first_of[last] = first + want
        self._reclass(last, length, length - want)
        self._use(first, want, out)

    def _take_last(self, last: int, want: int, out: list[SlotId]) -> None:
        """Use up to ``want`` slots from the back of the run ending at ``last``."""
        first = self._first_of.pop(last)
        length = last - first + 1
        self._unclass(last, length)
        if want >= length:
            del self._last_of[first]
            self._use(first, length, out)
            return
        self._list(first, last - want)
        self._use(last - want + 1, want, out)

    def _next_to(self, slot: int, want: int, out: list[SlotId]) -> None:
        """Up to ``want`` slots of the free run right after ``slot`` (in use), else of the one
        right before."""
        is_free = self._is_free
        if slot >= self._high_water or is_free[slot]:
            return
        if slot + 1 < self._high_water and is_free[slot + 1]:
            self._take(slot + 1, want, out)
        elif slot and is_free[slot - 1]:
            self._take_last(slot - 1, want, out)

    def _use(self, first: int, count: int, out: list[SlotId]) -> None:
        is_free = self._is_free
        for s in range(first, first + count):
            is_free[s] = 0
            out.append(SlotId(s))
        self._num_free_below -= count

    def _put(self, first: int, count: int) -> None:
        """Make slots ``[first, first + count)`` (used, below the high-water mark) a free run,
        merged with the free runs on either side."""
        is_free = self._is_free
        for s in range(first, first + count):
            is_free[s] = 1
        self._num_free_below += count
        last = first + count - 1
        if first and is_free[first - 1]:  # a run ends right before
            left = self._first_of.pop(first - 1)
            del self._last_of[left]
            self._unclass(first - 1, first - left)
            first = left
        if last + 1 < self._high_water and is_free[last + 1]:  # a run starts right after: it grows
            end = self._last_of.pop(last + 1)
            self._last_of[first] = end
            self._first_of[end] = first
            self._reclass(end, end - last, end - first + 1)
        else:
            self._list(first, last)

    def _fit(self, count: int) -> int:
        """First slot of a free run to take ``count`` slots from: a run of the smallest length class
        sure to hold them, else one of the class below that is long enough, else (none holds them)
        one of the longest runs. Below the high-water mark there is at least one free slot."""
        c = count.bit_length() if count & (count - 1) == 0 else count.bit_length() + 1
        above = self._nonempty >> c
        if above:
            runs = self._classes[c + (above & -above).bit_length() - 1]
            return self._first_of[next(reversed(runs))]
        if c > 1 and self._nonempty >> (c - 1) & 1:
            for probes, last in enumerate(reversed(self._classes[c - 1])):
                first = self._first_of[last]
                if last - first + 1 >= count:
                    return first
                if probes + 1 == FIT_PROBES:
                    break
        return self._first_of[next(reversed(self._classes[self._nonempty.bit_length() - 1]))]

    # ------------------------------------------------------------------ allocation
    def allocate(self, count: int, after: int = -1) -> list[SlotId]:
        """``count`` slots (see the class), or raise ``LogicError`` if fewer are free (callers
        check first). ``after``: the slot of the request's previous block, -1 for none."""
        if count > self.num_free:
            raise LogicError(f"slot allocator: {count} slots requested, {self.num_free} free")
        rest = count - self._num_free_below
        if rest > 0:
            self._grow(self._high_water + rest)  # first: if mapping fails, nothing has changed
        out: list[SlotId] = []
        if count and after >= 0:
            self._next_to(after, count, out)
        while len(out) < count:
            need = count - len(out)
            self._take(self._fit(need), need, out)
        self._note_peak()
        return out

    def allocate_one(self, after: int = -1) -> SlotId:
        """One slot: next to ``after`` when one is free there, else as ``allocate(1)``."""
        out: list[SlotId] = []
        if self._num_free_below:
            if after >= 0:
                self._next_to(after, 1, out)
                if out:
                    self._note_peak()  # a free slot can be a new peak too (after take(), or a reset iteration peak)
                    return out[0]
            self._take(self._fit(1), 1, out)
            self._note_peak()
            return out[0]
        if self._high_water >= self.num_slots:
            raise LogicError("slot allocator: no free slot")
        s = SlotId(self._high_water)
        self._grow(s + 1)
        self._take(s, 1, out)
        self._note_peak()
        return s

    def _note_peak(self) -> None:
        used = self._high_water - self._num_free_below
        if used > self.iteration_peak:
            self.iteration_peak = used
            if used > self.peak_used:
                self.peak_used = used

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
        self._map(top)  # first: if mapping fails, nothing has changed
        self._high_water = top
        used = bytearray(top)
        for s in slots:
            used[s] = 1
        first = -1
        for i in range(top + 1):
            if i < top and not used[i]:
                if first < 0:
                    first = i
            elif first >= 0:
                self._put(first, i - first)
                first = -1
        self._note_peak()

    def allocate_below(self, limit: int, count: int) -> list[SlotId]:
        """``count`` free slots below ``limit``, lowest first (compaction before a shrink); raises
        ``LogicError`` (changing nothing) if there are fewer."""
        firsts = sorted(f for f in self._last_of if f < limit)
        have = sum(min(self._last_of[f] + 1, limit) - f for f in firsts)
        rest = count - have
        if rest > 0:
            if self._high_water + rest > limit:
                raise LogicError(f"slot allocator: {count} free slots below {limit} requested, fewer exist")
            self._grow(self._high_water + rest)  # first: if mapping fails, nothing has changed
            firsts = sorted(f for f in self._last_of if f < limit)
        out: list[SlotId] = []
        for f in firsts:
            if len(out) == count:
                break
            self._take(f, min(limit - f, count - len(out)), out)
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
        if self._high_water > num_slots:
            last = self._high_water - 1
            first = self._first_of.pop(last)  # one free run covers [num_slots, high water)
            del self._last_of[first]
            self._unclass(last, last - first + 1)
            self._num_free_below -= last - first + 1
            if first < num_slots:
                self._list(first, num_slots - 1)
                self._num_free_below += num_slots - first
            self._high_water = num_slots
        del self._is_free[num_slots:]
        self.num_slots = num_slots

    def free(self, slot: SlotId) -> None:
        if not 0 <= slot < self._high_water or self._is_free[slot]:
            raise LogicError(f"slot {slot} freed twice or never allocated")
        self._put(slot, 1)

    def _map(self, high_water: int) -> None:
        """Back slots ``[0, high_water)`` of every pool with memory."""
        for pool, size in zip(self._pools, self._slot_sizes):
            pool.ensure_mapped(high_water * size)

    def _grow(self, high_water: int) -> None:
        """Map up to ``high_water`` and list the new slots as free (merged with a free run before)."""
        self._map(high_water)
        beg = self._high_water
        self._high_water = high_water
        for s in range(beg, high_water):
            self._is_free[s] = 0  # _put marks them free
        self._put(beg, high_water - beg)

    def is_allocated(self, slot: SlotId) -> bool:
        return 0 <= slot < self._high_water and not self._is_free[slot]


def paired_in_order(sources: list[int], slots: list[SlotId]) -> list[SlotId]:
    """The target of each source slot: ``slots`` (ascending runs, as ``allocate`` returns them) in
    the sources' order, except that a stretch of sources in descending consecutive slots (a
    request's blocks, which eviction lists last first) takes its targets in reverse, so its copies
    merge too. Keeping the list order elsewhere keeps pages listed together (evicted together
    later) in consecutive targets."""
    out = list(slots)
    beg = 0
    n = len(sources)
    for i in range(1, n + 1):
        if i == n or sources[i] != sources[i - 1] - 1:
            if i - beg > 1:
                out[beg:i] = out[beg:i][::-1]
            beg = i
    return out
