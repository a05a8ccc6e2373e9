"""Slot allocation for one pool group: free slots kept as runs of consecutive slots, so a batch of
pages (a request's blocks, an offload's targets) lands in few runs and its copies merge (the copy
engine copies a run of consecutive slots at once).

The free slots below the high-water mark are a stack of runs (first slot, length). A freed slot
extends the top run when it touches either end of it (a request's pages are released in block
order, so they rebuild the run they came from), else it is pushed as a run of one: O(1), as cheap
as a stack of slots. Runs are merged lazily: only an allocation with a choice to make (fewer
slots than are free, more than the top run holds) sorts the runs into maximal ones, by length,
once per stretch of frees, and takes the shortest that holds the batch. Above the high-water mark
no memory is mapped yet; it is used only when the runs below cannot hold a request."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import cast

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import Pool


def _slots(first: int, count: int) -> Iterable[SlotId]:
    return cast(Iterable[SlotId], range(first, first + count))


class SlotAllocator:
    """Hands out slot ids in ``[0, num_slots)``; maps pool memory as the high-water mark rises.

    A slot is one index valid in every pool of the group, so its pools grow together. ``allocate``
    returns consecutive slots ascending within each run: from the top run where it holds the whole
    batch, else from the shortest free run that does, else from the longest runs. ``after`` (the
    slot of the request's previous block) asks for the free run starting right after it first.
    Nothing in use ever moves.
    """

    def __init__(self, num_slots: int, pools: list[Pool], slot_sizes: tuple[int, ...]) -> None:
        self.num_slots = num_slots
        self._pools = pools
        self._slot_sizes = slot_sizes
        self._high_water = 0
        self._is_free: bytearray = bytearray(num_slots)
        #: the stack of free runs below the high-water mark, top last: first slot and length; a
        #: run used up below the top stays as first -1, length 0 until the top comes down to it
        self._firsts: list[int] = []
        self._counts: list[int] = []
        self._num_dead = 0
        self._num_free_below = 0
        #: the runs are maximal and sorted by length (set by ``_tidy``, cleared by any change)
        self._tidy = True
        #: most slots in use at once: since creation, and since ``iteration_peak`` was last reset
        self.peak_used = 0
        self.iteration_peak = 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self._high_water + self._num_free_below

    @property
    def num_used(self) -> int:
        return self._high_water - self._num_free_below

    def free_runs(self) -> list[tuple[int, int]]:
        """The maximal runs of free slots below the high-water mark, ``(first, length)``, by first
        slot (for tests and statistics: not the hot path)."""
        return self._maximal()

    def prepare(self, count: int) -> None:
        """Map the memory ``count`` allocations may need, so they cannot fail later.

        May raise (e.g. ``CuError``) but changes no allocation state.
        """
        rest = count - self._num_free_below
        if rest > 0:
            self._map(min(self._high_water + rest, self.num_slots))

    # ------------------------------------------------------------------ allocation
    def allocate(self, count: int, after: int = -1) -> list[SlotId]:
        """``count`` slots (see the class), or raise ``LogicError`` if fewer are free (callers
        check first). ``after``: the slot of the request's previous block, -1 for none."""
        if count > self.num_free:
            raise LogicError(f"slot allocator: {count} slots requested, {self.num_free} free")
        out: list[SlotId] = []
        rest = count - self._num_free_below
        if rest >= 0:  # every free run, then fresh slots: nothing to choose
            beg = self._high_water
            if rest > 0:
                self._map(beg + rest)  # first: if mapping fails, nothing has changed
                self._high_water = beg + rest
            self._take_all(out)
            if rest > 0:
                out.extend(_slots(beg, rest))
        else:
            if after >= 0:
                self._next_to(after, count, out)
            need = count - len(out)
            if need:
                if self._counts[-1] >= need:
                    self._take(len(self._counts) - 1, need, out)
                else:
                    self._best(need, out)
        self._note_peak()
        return out

    def allocate_one(self, after: int = -1) -> SlotId:
        """One slot: the one right after ``after`` when it is free, else the top run's first."""
        if self._num_free_below:
            out: list[SlotId] = []
            if after >= 0:
                self._next_to(after, 1, out)
            if not out:
                self._take(len(self._counts) - 1, 1, out)
            self._note_peak()  # a free slot can be a new peak too (after take(), or a reset iteration peak)
            return out[0]
        if self._high_water >= self.num_slots:
            raise LogicError("slot allocator: no free slot")
        s = SlotId(self._high_water)
        self._map(s + 1)
        self._high_water = s + 1
        self._note_peak()
        return s

    def _next_to(self, slot: int, want: int, out: list[SlotId]) -> None:
        """Up to ``want`` slots of the free run starting right after ``slot`` (in use)."""
        nxt = slot + 1
        if nxt < self._high_water and self._is_free[nxt] and not self._is_free[slot]:
            self._take(self._firsts.index(nxt), want, out)  # runs are disjoint: only one starts there

    def _take(self, i: int, want: int, out: list[SlotId]) -> int:
        """Up to ``want`` slots from the front of run ``i`` of the stack; returns how many."""
        firsts, counts = self._firsts, self._counts
        first = firsts[i]
        count = counts[i]
        if want > count:
            want = count
        if want == 1:
            self._is_free[first] = 0
            out.append(SlotId(first))
        else:
            self._is_free[first : first + want] = bytes(want)
            out.extend(_slots(first, want))
        self._num_free_below -= want
        self._tidy = False
        if want < count:
            firsts[i] = first + want
            counts[i] = count - want
        elif i == len(counts) - 1:
            firsts.pop()
            counts.pop()
            while counts and not counts[-1]:  # used-up runs below come off with it
                firsts.pop()
                counts.pop()
                self._num_dead -= 1
        else:
            firsts[i] = -1
            counts[i] = 0
            self._num_dead += 1
            if self._num_dead > 32 and self._num_dead * 2 > len(counts):
                self._drop_dead()
        return want

    def _take_all(self, out: list[SlotId]) -> None:
        is_free = self._is_free
        for first, count in zip(self._firsts, self._counts):
            if count:
                is_free[first : first + count] = bytes(count)
                out.extend(_slots(first, count))
        self._firsts.clear()
        self._counts.clear()
        self._num_dead = self._num_free_below = 0
        self._tidy = True

    def _best(self, need: int, out: list[SlotId]) -> None:
        """``need`` slots when the top run is shorter (and more are free): from the shortest run
        that holds them all, else from the longest runs down."""
        if not self._tidy:
            self._merge()
        counts = self._counts
        if counts[-1] >= need:
            self._take(bisect_left(counts, need), need, out)
            return
        while need:  # (sorted by length: the top is the longest)
            need -= self._take(len(counts) - 1, need, out)

    def _drop_dead(self) -> None:
        live = [i for i, count in enumerate(self._counts) if count]
        self._firsts = [self._firsts[i] for i in live]
        self._counts = [self._counts[i] for i in live]
        self._num_dead = 0

    def _maximal(self) -> list[tuple[int, int]]:
        """The free runs merged into maximal ones, ``(first, length)`` by first slot."""
        out: list[tuple[int, int]] = []
        end = -2
        for first, count in sorted(zip(self._firsts, self._counts)):
            if not count:
                continue
            if first == end:
                out[-1] = (out[-1][0], out[-1][1] + count)
            else:
                out.append((first, count))
            end = first + count
        return out

    def _merge(self) -> None:
        """Merge adjacent runs into maximal ones and sort them by length (the longest on top)."""
        by_length = sorted([(count, first) for first, count in self._maximal()])
        self._firsts = [first for _, first in by_length]
        self._counts = [count for count, _ in by_length]
        self._num_dead = 0
        self._tidy = True

    def free(self, slot: SlotId) -> None:
        is_free = self._is_free
        if not 0 <= slot < self._high_water or is_free[slot]:
            raise LogicError(f"slot {slot} freed twice or never allocated")
        is_free[slot] = 1
        self._num_free_below += 1
        self._tidy = False
        counts = self._counts
        if counts:
            firsts = self._firsts
            first = firsts[-1]
            count = counts[-1]
            if slot == first + count:
                counts[-1] = count + 1
                return
            if slot == first - 1:
                firsts[-1] = slot
                counts[-1] = count + 1
                return
        self._firsts.append(slot)
        counts.append(1)

    def _note_peak(self) -> None:
        used = self._high_water - self._num_free_below
        if used > self.iteration_peak:
            self.iteration_peak = used
            if used > self.peak_used:
                self.peak_used = used

    # ------------------------------------------------------------------ adoption, compaction, size
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
        for s in range(top - 1, -1, -1):  # pushed from the top down: the lowest run ends on top
            if not used[s]:
                self.free(SlotId(s))
        self._note_peak()

    def allocate_below(self, limit: int, count: int) -> list[SlotId]:
        """``count`` free slots below ``limit``, lowest first (compaction before a shrink); raises
        ``LogicError`` (changing nothing) if there are fewer."""
        firsts, counts = self._firsts, self._counts
        order = sorted((firsts[i], i) for i in range(len(counts)) if counts[i] and firsts[i] < limit)
        have = sum(min(counts[i], limit - first) for first, i in order)
        rest = count - have
        beg = self._high_water
        if rest > 0:
            if beg + rest > limit:
                raise LogicError(f"slot allocator: {count} free slots below {limit} requested, fewer exist")
            self._map(beg + rest)  # first: if mapping fails, nothing has changed
            self._high_water = beg + rest
        out: list[SlotId] = []
        need = count - max(rest, 0)
        for first, i in order:  # (taking a run never moves the runs below it in the stack)
            if not need:
                break
            need -= self._take(i, min(limit - first, need), out)
        if rest > 0:
            out.extend(_slots(beg, rest))
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
            firsts, counts = self._firsts, self._counts
            for i in range(len(counts)):
                first, count = firsts[i], counts[i]
                if count and first + count > num_slots:
                    keep = max(0, num_slots - first)
                    self._num_free_below -= count - keep
                    firsts[i], counts[i] = (first, keep) if keep else (-1, 0)
            self._drop_dead()
            self._tidy = False
            self._high_water = num_slots
        del self._is_free[num_slots:]
        self.num_slots = num_slots

    def _map(self, high_water: int) -> None:
        """Back slots ``[0, high_water)`` of every pool with memory."""
        for pool, size in zip(self._pools, self._slot_sizes):
            pool.ensure_mapped(high_water * size)

    def is_allocated(self, slot: SlotId) -> bool:
        return 0 <= slot < self._high_water and not self._is_free[slot]


def pair_sorted(sources: list[int], targets: list[SlotId]) -> list[SlotId]:
    """The target of each source slot: ``targets`` sorted, given to ``sources`` in ascending slot
    order, so that wherever both sides are consecutive their copies merge. The pages keep their
    own order (the order they are listed in again, which decides later evictions)."""
    targets = sorted(targets)
    out = list(targets)
    for k, i in enumerate(sorted(range(len(sources)), key=sources.__getitem__)):
        out[i] = targets[k]
    return out
