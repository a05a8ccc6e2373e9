"""Slot allocation for one pool group: free slots kept as runs of consecutive slots, so a batch of
pages (a request's blocks, an offload's targets) lands in few runs and its copies merge (the copy
engine copies a run of consecutive slots at once).

A freed slot goes on a list of loose slots (O(1), as a plain stack of slots). Below the high-water
mark the free slots are those loose ones and a stack of runs (first slot, length). An allocation
that takes every free slot (a full pool: eviction freed exactly what it takes) takes them as they
are; one with a choice to make (fewer slots than are free) first folds the loose slots into runs
(sorted once), takes the top run when it holds the batch, else sorts the runs into maximal ones
by length and takes the shortest that holds it (else the longest ones). Above the high-water
mark no memory is mapped yet; it is used only when the slots below cannot hold a request.

Soft reservations: the last slot of a request's allocation is its tail, and the free slot right
after a tail is reserved for that request's next block. Other allocations take runs that are not
reserved first; when they must take a reserved one, they take its middle, so both requests keep
room to grow. Nothing in use ever moves: the allocator only chooses which free slot."""

from __future__ import annotations

from bisect import bisect_left
from typing import Final, cast

import rawref

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import Pool

#: bound once: mypyc looks a module's attribute up at every call
_untrack: Final = rawref.untrack

#: how many runs from the top of the stack a one-slot allocation with a choice looks at (O(1))
ONE_SCAN: Final = 16


class SlotAllocator:
    """Hands out slot ids in ``[0, num_slots)``; maps pool memory as the high-water mark rises.

    A slot is one index valid in every pool of the group, so its pools grow together. ``allocate``
    returns consecutive slots ascending within each run: from the top run where it holds the whole
    batch, else from the shortest free run that does, else from the longest runs, taking a run
    reserved for a tail (see the module) last and from its middle. ``after`` (the slot of the
    request's previous block) asks for the free run starting right after it first. Nothing in use
    ever moves.
    """

    def __init__(self, num_slots: int, pools: list[Pool], slot_sizes: tuple[int, ...]) -> None:
        self.num_slots = num_slots
        self._pools = pools
        self._slot_sizes = slot_sizes
        self._high_water = 0
        #: a list, not a bytearray: compiled, list items are read and written natively (untracked by
        #: the GC, which would otherwise visit every slot's entry at each full collection)
        self._is_free: list[bool] = _untrack([False] * num_slots)
        #: the stack of free runs below the high-water mark, top last: first slot and length; a
        #: run used up below the top stays as first -1, length 0 until the top comes down to it
        self._firsts: list[int] = []
        self._counts: list[int] = []
        self._num_dead = 0
        self._in_runs = 0
        #: freed slots not yet folded into runs
        self._free: list[SlotId] = []
        #: the runs are maximal and sorted by length (set by ``_merge``, cleared by any change)
        self._tidy = True
        #: True at the last slot each allocation handed out (a request's tail, which may grow): the free
        #: slot right after it is soft-reserved (see ``_reserved``); cleared when the slot is freed
        self._tail: list[bool] = _untrack([False] * num_slots)
        #: most slots in use at once: since creation, and since ``iteration_peak`` was last reset
        self.peak_used = 0
        self.iteration_peak = 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self._high_water + self._in_runs + len(self._free)

    @property
    def num_used(self) -> int:
        return self._high_water - self._in_runs - len(self._free)

    def free_runs(self) -> list[tuple[int, int]]:
        """The maximal runs of free slots below the high-water mark, ``(first, length)``, by first
        slot (for tests and statistics: not the hot path)."""
        return self._maximal()

    def prepare(self, count: int) -> None:
        """Map the memory ``count`` allocations may need, so they cannot fail later.

        May raise (e.g. ``CuError``) but changes no allocation state.
        """
        rest = count - self._in_runs - len(self._free)
        if rest > 0:
            self._map(min(self._high_water + rest, self.num_slots))

    # ------------------------------------------------------------------ allocation
    def allocate(self, count: int, after: int = -1, grows: bool = False) -> list[SlotId]:
        """``count`` slots (see the class), or raise ``LogicError`` if fewer are free (callers
        check first). ``after``: the slot of the request's previous block, -1 for none. ``grows``:
        the slots are a request's blocks, so the last one becomes its tail."""
        if count > self.num_free:
            raise LogicError(f"slot allocator: {count} slots requested, {self.num_free} free")
        out: list[int] = []
        rest = count - self._in_runs - len(self._free)
        if rest >= 0:  # every free run, then fresh slots: nothing to choose
            beg = self._high_water
            if rest > 0:
                self._map(beg + rest)  # first: if mapping fails, nothing has changed
                self._high_water = beg + rest
            self._take_all(out)
            if rest > 0:
                out.extend(range(beg, beg + rest))
        else:
            self._fold()
            if after >= 0:
                self._next_to(after, count, out)
            need = count - len(out)
            if need:
                top = len(self._counts) - 1
                if self._counts[top] >= need and not self._reserved(self._firsts[top]):
                    self._take(top, need, out)
                else:
                    self._best(need, out)
        if grows and out:
            self._retail(after, out[-1])
        self._note_peak()
        return cast(list[SlotId], out)

    def allocate_one(self, after: int = -1) -> SlotId:
        """One slot for a request's next block (its new tail): the one right after ``after`` (its
        previous block) when free, else the only free one, else one with room after it (``_one``)."""
        is_free = self._is_free
        if after >= 0:
            nxt = after + 1
            if nxt < self._high_water and is_free[nxt] and not is_free[after]:
                self._fold()
                out: list[int] = []
                self._take(self._firsts.index(nxt), 1, out)  # runs are disjoint: only one starts there
                self._retail(after, nxt)
                self._note_peak()
                return SlotId(nxt)
        free = self._free
        if len(free) == 1 and not self._in_runs:  # no choice (e.g. eviction freed just this one)
            slot: int = free.pop()
            is_free[slot] = False
        elif free or self._in_runs:
            self._fold()
            slot = self._one()
        else:
            if self._high_water >= self.num_slots:
                raise LogicError("slot allocator: no free slot")
            slot = self._high_water
            self._map(slot + 1)
            self._high_water = slot + 1
        self._retail(after, slot)
        self._note_peak()  # a free slot can be a new peak too (after take(), or a reset iteration peak)
        return SlotId(slot)

    def _one(self) -> int:
        """One slot when there is a choice (runs folded): the front of the shortest run of two or more
        slots that is not reserved among the top ``ONE_SCAN`` of the stack (room to grow, O(1)), else
        a run of one that is not reserved, else the middle of the top run."""
        firsts, counts = self._firsts, self._counts
        top = len(counts) - 1
        best = single = -1
        for i in range(top, max(top - ONE_SCAN, -1), -1):
            count = counts[i]
            if count and not self._reserved(firsts[i]):
                if count == 1:
                    if single < 0:
                        single = i
                elif best < 0 or count < counts[best]:
                    best = i
        out: list[int] = []
        if best >= 0 or single >= 0:
            self._take(best if best >= 0 else single, 1, out)
        else:
            self._split(top, 1, out)
        return out[0]

    def _reserved(self, slot: int) -> bool:
        """Whether free ``slot`` comes right after a tail (soft-reserved for that request to grow into)."""
        return slot > 0 and self._tail[slot - 1]

    def _retail(self, after: int, last: int) -> None:
        """The request whose previous block is at ``after`` (-1: none) now ends at ``last``."""
        tail = self._tail
        if 0 <= after < len(tail):
            tail[after] = False
        tail[last] = True

    def end_tail(self, slot: SlotId) -> None:
        """``slot`` (in use) ends a request that no longer grows (it closed): the free slot after it
        is no longer reserved."""
        self._tail[slot] = False

    def _next_to(self, slot: int, want: int, out: list[int]) -> None:
        """Up to ``want`` slots of the free run starting right after ``slot`` (in use)."""
        nxt = slot + 1
        if nxt < self._high_water and self._is_free[nxt] and not self._is_free[slot]:
            self._take(self._firsts.index(nxt), want, out)  # runs are disjoint: only one starts there

    def _take(self, i: int, want: int, out: list[int]) -> int:
        """Up to ``want`` slots from the front of run ``i`` of the stack; returns how many."""
        firsts, counts = self._firsts, self._counts
        first = firsts[i]
        count = counts[i]
        if want > count:
            want = count
        self._use(first, want, out)
        self._in_runs -= want
        self._tidy = False
        if want < count:
            firsts[i] = first + want
            counts[i] = count - want
        elif i == len(counts) - 1:
            firsts.pop()
            counts.pop()
            self._pop_dead()
        else:
            firsts[i] = -1
            counts[i] = 0
            self._num_dead += 1
            if self._num_dead > 32 and self._num_dead * 2 > len(counts):
                self._drop_dead()
        return want

    def _pop_dead(self) -> None:
        """Pop the used-up runs that the top's removal left on top."""
        firsts, counts = self._firsts, self._counts
        while counts and not counts[-1]:
            firsts.pop()
            counts.pop()
            self._num_dead -= 1

    def _take_all(self, out: list[int]) -> None:
        is_free = self._is_free
        free = self._free
        for s in free:
            is_free[s] = False
        out.extend(free)
        free.clear()
        for first, count in zip(self._firsts, self._counts):
            if count:
                self._use(first, count, out)
        self._firsts.clear()
        self._counts.clear()
        self._num_dead = self._in_runs = 0
        self._tidy = True

    def _best(self, need: int, out: list[int]) -> None:
        """``need`` slots when the top run cannot give them (and more are free): from the shortest
        run that holds them all and is not reserved, else from the middle of the longest one (room
        for both tails), else from the longest runs down (the last one, if reserved, from its middle)."""
        if not self._tidy:
            self._merge()
        firsts, counts = self._firsts, self._counts
        if counts[-1] >= need:
            i = bisect_left(counts, need)
            while i < len(counts) and self._reserved(firsts[i]):
                i += 1
            if i < len(counts):
                self._take(i, need, out)
            else:
                self._split(len(counts) - 1, need, out)
            return
        while need:  # (sorted by length: the top is the longest)
            top = len(counts) - 1
            if counts[top] > need and self._reserved(firsts[top]):
                self._split(top, need, out)
                return
            need -= self._take(top, need, out)

    def _use(self, first: int, n: int, out: list[int]) -> None:
        """Mark free slots ``[first, first + n)`` used and append them to ``out`` (the caller updates the runs)."""
        if n == 1:
            self._is_free[first] = False
            out.append(first)
        else:
            self._is_free[first : first + n] = [False] * n
            out.extend(range(first, first + n))

    def _split(self, i: int, want: int, out: list[int]) -> None:
        """``want`` slots from the middle of run ``i`` (reserved): the slots before them (half the
        rest, rounded up) stay with the tail the run comes after, those after them go on top of the
        stack as a run, room for the new tail."""
        first, count = self._firsts[i], self._counts[i]
        gap = (count - want + 1) // 2
        if not gap:
            self._take(i, want, out)
            return
        beg = first + gap
        self._use(beg, want, out)
        self._in_runs -= want
        self._counts[i] = gap
        if count > gap + want:
            self._firsts.append(beg + want)
            self._counts.append(count - gap - want)
        self._tidy = False

    def _fold(self) -> None:
        """Push the loose free slots onto the stack as runs (the lowest run on top)."""
        free = self._free
        if not free:
            return
        free.sort(reverse=True)
        firsts, counts = self._firsts, self._counts
        end = -2
        for s in free:
            if s == end - 1:
                firsts[-1] = s
                counts[-1] += 1
            else:
                firsts.append(s)
                counts.append(1)
            end = s
        self._in_runs += len(free)
        free.clear()
        self._tidy = False

    def _drop_dead(self) -> None:
        live = [i for i, count in enumerate(self._counts) if count]
        self._firsts[:] = [self._firsts[i] for i in live]  # in place: callers may hold the lists
        self._counts[:] = [self._counts[i] for i in live]
        self._num_dead = 0

    def _maximal(self) -> list[tuple[int, int]]:
        """The free runs merged into maximal ones, ``(first, length)`` by first slot."""
        out: list[tuple[int, int]] = []
        end = -2
        for first, count in sorted([*zip(self._firsts, self._counts), *((s, 1) for s in self._free)]):
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
        is_free[slot] = True
        self._tail[slot] = False
        self._free.append(slot)

    def _note_peak(self) -> None:
        used = self._high_water - self._in_runs - len(self._free)
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
        for free in range(top - 1, -1, -1):  # pushed from the top down: the lowest run ends on top
            if not used[free]:
                self.free(SlotId(free))
        self._note_peak()

    def allocate_below(self, limit: int, count: int) -> list[SlotId]:
        """``count`` free slots below ``limit``, lowest first (compaction before a shrink); raises
        ``LogicError`` (changing nothing) if there are fewer."""
        self._fold()
        firsts, counts = self._firsts, self._counts
        order = sorted((firsts[i], counts[i]) for i in range(len(counts)) if counts[i] and firsts[i] < limit)
        have = sum(min(n, limit - first) for first, n in order)
        rest = count - have
        beg = self._high_water
        if rest > 0:
            if beg + rest > limit:
                raise LogicError(f"slot allocator: {count} free slots below {limit} requested, fewer exist")
            self._map(beg + rest)  # first: if mapping fails, nothing has changed
            self._high_water = beg + rest
        out: list[int] = []
        need = count - max(rest, 0)
        for first, _ in order:
            if not need:
                break
            # found by its first slot: taking a run may compact the stack (``_drop_dead``), moving the others
            need -= self._take(firsts.index(first), min(limit - first, need), out)
        if rest > 0:
            out.extend(range(beg, beg + rest))
        self._note_peak()
        return cast(list[SlotId], out)

    def resize(self, num_slots: int) -> None:
        """Grow, or shrink to ``num_slots`` (every slot from there on must be free)."""
        if num_slots >= self.num_slots:
            self._is_free.extend([False] * (num_slots - self.num_slots))
            self._tail.extend([False] * (num_slots - self.num_slots))
            self.num_slots = num_slots
            return
        for s in range(num_slots, self._high_water):
            if not self._is_free[s]:
                raise LogicError(f"slot allocator: cannot shrink to {num_slots} slots, slot {s} is in use")
        if self._high_water > num_slots:
            self._fold()
            firsts, counts = self._firsts, self._counts
            for i in range(len(counts)):
                first, count = firsts[i], counts[i]
                if count and first + count > num_slots:
                    keep = max(0, num_slots - first)
                    self._in_runs -= count - keep
                    firsts[i], counts[i] = (first, keep) if keep else (-1, 0)
            self._drop_dead()
            self._tidy = False
            self._high_water = num_slots
        del self._is_free[num_slots:]
        del self._tail[num_slots:]
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
