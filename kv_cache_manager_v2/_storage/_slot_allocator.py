"""Slot allocation for one pool group: free slots kept as runs of consecutive slots, so a batch of
pages (a request's blocks, an offload's targets) lands in few runs and its copies merge (the copy
engine copies a run of consecutive slots at once).

A freed slot goes on a list of loose slots (O(1), as a plain stack of slots). Below the high-water
mark the free slots are those loose ones and a stack of runs (first slot, length). An allocation
that takes every free slot (a full pool: eviction freed exactly what it takes) takes them as they
are; one with a choice to make (fewer slots than are free) first folds the loose slots into runs
(sorted once), takes the top run when it holds the batch, else sorts the runs into maximal ones
by length and takes the shortest that holds it (else the longest ones). Above the high-water
mark no memory is mapped yet; it is used only when the slots below cannot hold a request."""

from __future__ import annotations

from bisect import bisect_left
from typing import cast

from .._common import SlotId
from .._exceptions import LogicError
from ._backend import Pool


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
        self._in_runs = 0
        #: freed slots not yet folded into runs
        self._free: list[SlotId] = []
        #: the runs are maximal and sorted by length (set by ``_merge``, cleared by any change)
        self._tidy = True
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
    def allocate(self, count: int, after: int = -1) -> list[SlotId]:
        """``count`` slots (see the class), or raise ``LogicError`` if fewer are free (callers
        check first). ``after``: the slot of the request's previous block, -1 for none."""
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
                if self._counts[-1] >= need:
                    self._take(len(self._counts) - 1, need, out)
                else:
                    self._best(need, out)
        self._note_peak()
        return cast(list[SlotId], out)

    def allocate_one(self, after: int = -1) -> SlotId:
        """One slot: the one right after ``after`` when it is free, else the last one freed."""
        is_free = self._is_free
        if after >= 0:
            nxt = after + 1
            if nxt < self._high_water and is_free[nxt] and not is_free[after]:
                self._fold()
                out: list[int] = []
                self._take(self._firsts.index(nxt), 1, out)  # runs are disjoint: only one starts there
                self._note_peak()
                return SlotId(nxt)
        free = self._free
        if free:
            slot = free.pop()
            is_free[slot] = 0
            self._note_peak()  # a free slot can be a new peak too (after take(), or a reset iteration peak)
            return slot
        if self._in_runs:
            out = []
            self._take(len(self._counts) - 1, 1, out)
            self._note_peak()
            return SlotId(out[0])
        if self._high_water >= self.num_slots:
            raise LogicError("slot allocator: no free slot")
        s = self._high_water
        self._map(s + 1)
        self._high_water = s + 1
        self._note_peak()
        return SlotId(s)

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
        if want == 1:
            self._is_free[first] = 0
            out.append(first)
        else:
            self._is_free[first : first + want] = bytes(want)
            out.extend(range(first, first + want))
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
            is_free[s] = 0
        out.extend(free)
        free.clear()
        for first, count in zip(self._firsts, self._counts):
            if count == 1:
                is_free[first] = 0
                out.append(first)
            elif count:
                is_free[first : first + count] = bytes(count)
                out.extend(range(first, first + count))
        self._firsts.clear()
        self._counts.clear()
        self._num_dead = self._in_runs = 0
        self._tidy = True

    def _best(self, need: int, out: list[int]) -> None:
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
        self._firsts = [self._firsts[i] for i in live]
        self._counts = [self._counts[i] for i in live]
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
        is_free[slot] = 1
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
        order = sorted((firsts[i], i) for i in range(len(counts)) if counts[i] and firsts[i] < limit)
        have = sum(min(counts[i], limit - first) for first, i in order)
        rest = count - have
        beg = self._high_water
        if rest > 0:
            if beg + rest > limit:
                raise LogicError(f"slot allocator: {count} free slots below {limit} requested, fewer exist")
            self._map(beg + rest)  # first: if mapping fails, nothing has changed
            self._high_water = beg + rest
        out: list[int] = []
        need = count - max(rest, 0)
        for first, i in order:  # (taking a run never moves the runs below it in the stack)
            if not need:
                break
            need -= self._take(i, min(limit - first, need), out)
        if rest > 0:
            out.extend(range(beg, beg + rest))
        self._note_peak()
        return cast(list[SlotId], out)

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
