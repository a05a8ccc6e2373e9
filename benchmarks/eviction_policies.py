"""Eviction policies of ``eviction_study.py`` without use counts: LRU, the heap every keyed
policy builds on (``HeapPolicy``), S3FIFO, the offline optimum (``Belady``), and the ghosts that
remember evicted blocks for the counting policies."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from eviction_replay import Policy, Req, lookups


class LRU(Policy):
    """Least recently released first (the manager's evictor with one priority)."""

    def __init__(self, order: str) -> None:
        self.order = order
        self.name = f"lru_{order}"
        self.od: OrderedDict[int, None] = OrderedDict()

    def add(self, node: int) -> None:
        self.od[node] = None

    def remove(self, node: int) -> None:
        del self.od[node]

    def pop(self) -> int:
        return self.od.popitem(last=False)[0]


class HeapPolicy(Policy):
    """Lowest key first, a heap with lazy deletion; ties: first added first (tail-first
    release makes that the deepest block). Subclasses compute ``key(node)`` at add.

    ``leaves_only``: a droppable page with cached children is parked outside the heap and
    enters it (with the key it got at release) when its last child leaves the tree, so a
    block never goes before its descendants whatever the keys (no subtree collateral)."""

    leaves_only = False

    def __init__(self) -> None:
        self.heap: list[tuple[Any, int, int]] = []
        self.live: dict[int, int] = {}  # node -> seq of its valid heap entry
        self.parked: dict[int, Any] = {}  # droppable non-leaf node -> its key
        self.seq = 0

    def key(self, node: int) -> Any:
        raise NotImplementedError

    def add(self, node: int) -> None:
        k = self.key(node)
        if self.leaves_only and node in self.sim.children:
            self.parked[node] = k
            return
        self.seq += 1
        self.live[node] = self.seq
        heapq.heappush(self.heap, (k, self.seq, node))

    def remove(self, node: int) -> None:
        if self.live.pop(node, None) is None:
            del self.parked[node]

    def became_leaf(self, node: int) -> None:
        k = self.parked.pop(node, None)
        if k is not None:
            self.seq += 1
            self.live[node] = self.seq
            heapq.heappush(self.heap, (k, self.seq, node))

    def pop(self) -> int:
        heap = self.heap
        live = self.live
        while True:
            k, seq, node = heapq.heappop(heap)
            if live.get(node) == seq:
                del live[node]
                self.on_victim(node, k)
                return node

    def on_victim(self, node: int, key: Any) -> None:
        pass


class Ghost:
    """Memory of evicted blocks: ``get`` returns (uses, first_use) of an evicted block and
    forgets it (it is cached again), ``put`` records a victim. This one remembers nothing."""

    name = "none"

    def bind(self, slots: int) -> None:
        pass

    def get(self, node: int) -> tuple[int, int] | None:
        return None

    def put(self, node: int, uses: int, first: int) -> None:
        pass


class DictGhost(Ghost):
    """Remembers every evicted block forever (an ideal, unbounded ghost)."""

    name = "unbounded"

    def __init__(self) -> None:
        self.d: dict[int, tuple[int, int]] = {}

    def get(self, node: int) -> tuple[int, int] | None:
        return self.d.pop(node, None)

    def put(self, node: int, uses: int, first: int) -> None:
        self.d[node] = (uses, first)


class TableGhost(Ghost):
    """A fixed table of ``k * slots`` entries in sets of ``ways`` (set-associative, keyed by a
    hash of the block key); a full set replaces its entry with the fewest uses (then the
    oldest). What the manager can afford: a few array entries per slot, no per-key objects."""

    def __init__(self, k: float, ways: int = 4) -> None:
        self.k = k
        self.ways = ways
        self.name = f"table {k:g}x{ways}"
        self.stamp = 0

    def bind(self, slots: int) -> None:
        self.nsets = max(1, int(self.k * slots) // self.ways)
        n = self.nsets * self.ways
        self.keys = [-1] * n  # flat: set s holds entries s*ways .. s*ways+ways-1
        self.uses = [0] * n
        self.first = [0] * n
        self.stamps = [0] * n

    def get(self, node: int) -> tuple[int, int] | None:
        base = (node * 2654435761 % 4294967296) % self.nsets * self.ways
        keys = self.keys
        for i in range(base, base + self.ways):
            if keys[i] == node:
                keys[i] = -1
                return self.uses[i], self.first[i]
        return None

    def put(self, node: int, uses: int, first: int) -> None:
        base = (node * 2654435761 % 4294967296) % self.nsets * self.ways
        keys, us, st = self.keys, self.uses, self.stamps
        self.stamp += 1
        j = base
        for i in range(base, base + self.ways):
            if keys[i] == -1:
                j = i
                break
            if us[i] < us[j] or (us[i] == us[j] and st[i] < st[j]):
                j = i
        keys[j] = node
        us[j] = uses
        self.first[j] = first
        st[j] = self.stamp


class S3FIFO(Policy):
    """S3-FIFO (Yang et al. 2023) adapted to take/release: new blocks enter a small FIFO
    (10% of slots), blocks seen in the ghost or reused go to the main FIFO; the small FIFO's
    head is evicted (to the ghost) unless reused, the main FIFO's head is reinserted while its
    counter (max 3) is positive."""

    name = "s3fifo"

    def __init__(self) -> None:
        self.S: OrderedDict[int, None] = OrderedDict()
        self.M: OrderedDict[int, None] = OrderedDict()
        self.G: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self.where: dict[int, str] = {}  # node -> queue it was in (also while in use)

    def add(self, node: int) -> None:
        q = self.where.get(node)
        if q is None:  # a new page
            self.freq[node] = 0
            if self.G.pop(node, 0) is not None:
                self.where[node] = "M"
                self.M[node] = None
            else:
                self.where[node] = "S"
                self.S[node] = None
        elif q == "S":  # reused while in S: promote
            self.where[node] = "M"
            self.M[node] = None
        else:
            self.M[node] = None

    def remove(self, node: int) -> None:
        (self.S if self.where[node] == "S" else self.M).pop(node)
        self.freq[node] = min(3, self.freq[node] + 1)

    def drop(self, node: int) -> None:
        (self.S if self.where.pop(node) == "S" else self.M).pop(node)
        del self.freq[node]

    def pop(self) -> int:
        small = max(1, self.sim.slots // 10)
        while True:
            if self.S and (len(self.S) >= small or not self.M):
                node = self.S.popitem(last=False)[0]
                if self.freq[node] > 0:
                    self.where[node] = "M"
                    self.M[node] = None
                    continue
                self.G[node] = None
                if len(self.G) > self.sim.slots:
                    self.G.popitem(last=False)
            else:
                node = self.M.popitem(last=False)[0]
                if self.freq[node] > 0:
                    self.freq[node] -= 1
                    self.M[node] = None
                    continue
            del self.where[node]
            del self.freq[node]
            return node


class Belady(HeapPolicy):
    """Offline: evict the page whose next lookup is farthest away (never: first); ties: deeper."""

    name = "belady"

    def __init__(self, reqs: list[Req]) -> None:
        super().__init__()
        never = len(reqs) + 1
        last: dict[int, int] = {}
        self.nxt: list[list[int]] = [[]] * len(reqs)
        for r in range(len(reqs) - 1, -1, -1):
            lk = lookups(reqs[r])
            self.nxt[r] = [last.get(n, never) for n in lk]
            for n in lk:
                last[n] = r
        self.cur: dict[int, int] = {}

    def begin(self, r: int, req: Req) -> None:
        self.cur = {n: (-x, -j) for j, (n, x) in enumerate(zip(lookups(req), self.nxt[r]))}

    def key(self, node: int) -> Any:
        return self.cur[node]
