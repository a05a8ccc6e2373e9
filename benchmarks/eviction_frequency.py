"""Eviction policies of ``eviction_study.py`` that count uses: GreedyDual-Size-Frequency and its
variants (rate, adaptive and shadow aging, probation), LFU, LRU-K, LRFU."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from eviction_policies import DictGhost, Ghost, HeapPolicy, TableGhost
from eviction_replay import Replay, Req


class Counted(HeapPolicy):
    """A heap policy that counts uses: ``f[node]`` = requests that used the block (insert or
    hit), ``first[node]`` = the clock when it was first used; both survive eviction as far
    as the ghost remembers. Clock: block uses (+1 per block per request that uses it)."""

    def __init__(self, ghost: Ghost | None = None) -> None:
        super().__init__()
        self.f: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # node -> last request counted
        self.ghost = ghost if ghost is not None else Ghost()
        self.r = 0
        self.now = 0

    def bind(self, sim: Replay) -> None:
        super().bind(sim)
        self.ghost.bind(sim.slots)

    def begin(self, r: int, req: Req) -> None:
        self.r = r

    def count(self, node: int) -> None:
        if self.seen.get(node) != self.r:
            self.seen[node] = self.r
            self.now += 1
            f = self.f.get(node)
            if f is None:
                g = self.ghost.get(node)
                f, self.first[node] = g if g is not None else (0, self.now)
            self.f[node] = f + 1

    def add(self, node: int) -> None:
        self.count(node)  # a new page: its first use
        super().add(node)

    def remove(self, node: int) -> None:
        HeapPolicy.remove(self, node)
        self.count(node)

    def drop(self, node: int) -> None:
        HeapPolicy.remove(self, node)
        self.forget(node)

    def on_victim(self, node: int, key: Any) -> None:
        self.forget(node)

    def forget(self, node: int) -> None:
        del self.seen[node]
        self.ghost.put(node, self.f.pop(node), self.first.pop(node))


class GDSF(Counted):
    """GreedyDual-Size-Frequency with unit sizes: value = L + w(f) at release; L = the last
    victim's value (the clock only rises)."""

    def __init__(self, name: str, w: Callable[[int], float], ghost: Ghost | None = None) -> None:
        super().__init__(ghost)
        self.name = name
        self.w = w
        self.L = 0.0

    def key(self, node: int) -> Any:
        return self.L + self.w(self.f[node])

    def on_victim(self, node: int, key: Any) -> None:
        self.L = key
        self.forget(node)


class RateGDSF(GDSF):
    """GDSF whose frequency term is a use *rate*: value = L + (f - 1) / (now - first + tau),
    tau = ``tau_slots`` * slots (in block uses). One-off blocks (f = 1) get L: they go first.

    ``leaves``: only blocks without cached children are candidates (descendants first);
    otherwise ``monotone``: a released block's value is at least its previous value and at
    least that of the child released just before it (tail-first), a local rule that keeps
    parents above children without tree callbacks."""

    def __init__(
        self, name: str, tau_slots: float = 15.0, ghost: Ghost | None = None, leaves: bool = True, power: float = 1.0
    ) -> None:
        super().__init__(name, lambda f: 0.0, ghost)
        self.tau_slots = tau_slots
        self.power = power
        self.leaves_only = leaves
        self.prev: tuple[int, float] | None = None
        self.kold: dict[int, float] = {}

    def bind(self, sim: Replay) -> None:
        super().bind(sim)
        self.tau = self.tau_slots * sim.slots

    def begin(self, r: int, req: Req) -> None:
        super().begin(r, req)
        self.prev = None

    def key(self, node: int) -> Any:
        f = self.f[node]
        k = self.L + ((f - 1) ** self.power / (self.now - self.first[node] + self.tau) if f > 1 else 0.0)
        if not self.leaves_only:
            prev = self.prev
            if prev is not None and self.sim.parent.get(prev[0]) == node:
                k = max(k, prev[1])
            k = max(k, self.kold.get(node, k))
            self.kold[node] = k
            self.prev = (node, k)
        return k

    def forget(self, node: int) -> None:
        self.kold.pop(node, None)
        super().forget(node)

    def on_victim(self, node: int, key: Any) -> None:
        self.L = max(self.L, key)  # a page parked long ago may hold a value below L
        self.forget(node)


class AdaptiveAging(RateGDSF):
    """rgdsf with adaptive aging (issue #31; what the manager ships as ``eviction_policy="frequency"``):
    each victim also raises the clock by ``aging / slots**2``. A page listed gets an LRU deadline,
    victims so far + pages listed (under LRU it would leave after about that many victims). A
    hit on a page past its deadline (kept where LRU would have lost it) divides ``aging`` by
    ``1 + step``; a block that comes back from the ghost before its deadline (lost where LRU
    would still have it) multiplies it. ``aging`` starts at ``lo`` (pure use-rate order) and
    stays in [lo, hi] (at hi: recency order)."""

    def __init__(self, name: str, step: float = 0.001, lo: float = 1e-4, hi: float = 1e4) -> None:
        super().__init__(name, 15.0, TableGhost(8, 16))
        self.step, self.lo, self.hi = step, lo, hi
        self.aging = lo
        self.victims = 0
        self.deadline: dict[int, int] = {}  # listed node -> its LRU deadline
        self.ghost_deadline: dict[int, int] = {}  # evicted node -> its deadline (read while the ghost has it)

    def add(self, node: int) -> None:
        self.deadline[node] = self.victims + len(self.live) + len(self.parked) + 1
        super().add(node)

    def remove(self, node: int) -> None:  # a hit
        if self.victims > self.deadline.pop(node):
            self.aging = max(self.lo, self.aging / (1 + self.step))
        super().remove(node)

    def drop(self, node: int) -> None:
        del self.deadline[node]
        super().drop(node)

    def count(self, node: int) -> None:
        if self.seen.get(node) != self.r and node not in self.f:
            d = self.ghost_deadline.pop(node, None)
            g = self.ghost
            base = (node * 2654435761 % 4294967296) % g.nsets * g.ways
            if d is not None and self.victims <= d and node in g.keys[base : base + g.ways]:
                self.aging = min(self.hi, self.aging * (1 + self.step))
        super().count(node)

    def on_victim(self, node: int, key: Any) -> None:
        self.victims += 1
        self.L = max(self.L, key) + (self.aging / (self.sim.slots * self.sim.slots) if self.aging > self.lo else 0.0)
        self.ghost_deadline[node] = self.deadline.pop(node)
        self.forget(node)


class ShadowAging(RateGDSF):
    """rgdsf16 with adaptive aging learnt from a simulated LRU (issue #31, second version; what the
    manager ships as ``eviction_policy="frequency"``): each victim raises the clock by
    ``aging / slots**2`` once ``aging`` exceeds ``on``. ``sh`` holds the blocks LRU would hold:
    the last ``slots`` released, in release order (tail-first); ``trim``: also trimmed at each
    victim to the number of evictable pages (here, unlike in the manager, the misses were
    checked before this request's victims). At each
    request, a hit ``sh`` lacks divides ``aging`` by ``1 + step`` (frequency kept what LRU lost),
    a published block ``sh`` has multiplies it (LRU would have hit); ``aging`` starts at
    ``init`` and stays in [lo, hi]."""

    def __init__(
        self,
        name: str,
        step: float = 0.0015,
        on: float = 0.01,
        init: float = 1e-3,
        trim: bool = False,
        lo: float = 1e-4,
        hi: float = 1e4,
    ) -> None:
        super().__init__(name, 15.0, TableGhost(8, 16))
        self.step, self.on, self.trim, self.lo, self.hi = step, on, trim, lo, hi
        self.aging = init
        self.sh: OrderedDict[int, None] = OrderedDict()

    def begin(self, r: int, req: Req) -> None:
        super().begin(r, req)
        ids, parent, sh = req.ids, self.sim.parent, self.sh
        m = 0
        while m < req.nq and ids[m] in parent:
            m += 1
        part = int(m == req.nq and req.qpart > 0 and ids[m] in parent)
        up, down = 1.0 + self.step, 1.0 / (1.0 + self.step)
        for j in range(req.nfull if req.nfull > m else m + part):
            hit = j < m + part
            if hit != (ids[j] in sh):
                self.aging = max(self.lo, self.aging * down) if hit else min(self.hi, self.aging * up)

    def add(self, node: int) -> None:
        sh = self.sh
        if node in sh:
            sh.move_to_end(node)
        else:
            sh[node] = None
            if len(sh) > self.sim.slots:
                sh.popitem(last=False)
        super().add(node)

    def on_victim(self, node: int, key: Any) -> None:
        self.L = max(self.L, key) + (self.aging / (self.sim.slots * self.sim.slots) if self.aging > self.on else 0.0)
        self.forget(node)
        if self.trim:
            n = len(self.live) + len(self.parked)
            while len(self.sh) > n:
                self.sh.popitem(last=False)


class LFU(Counted):
    """Lowest use count first (no aging); ties: least recently released."""

    name = "lfu"

    def key(self, node: int) -> Any:
        return self.f[node]


class History(Counted):
    """Keeps every block's use times (study only: LRU-K, LRFU need them)."""

    def __init__(self) -> None:
        super().__init__(DictGhost())
        self.times: dict[int, list[int]] = {}

    def count(self, node: int) -> None:
        if self.seen.get(node) != self.r:
            super().count(node)
            self.times.setdefault(node, []).append(self.now)


class LRUK(History):
    """LRU-K: evict the block whose K-th most recent use is oldest (fewer uses: first, by
    last use). Classic O'Neil et al.; heap-friendly (the key is fixed at release)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.name = f"lru{k}"

    def key(self, node: int) -> Any:
        t = self.times[node]
        return (t[-self.k] if len(t) >= self.k else -1, t[-1])


class LRFU(History):
    """LRFU (Lee et al.): combined recency-frequency CRF = sum 2^(-lam * age); ordering by
    CRF now equals ordering by lam * t_last + log2 CRF(t_last) (fixed at release)."""

    def __init__(self, lam_slots: float) -> None:
        super().__init__()
        self.lam_slots = lam_slots
        self.name = "lrfu"

    def bind(self, sim: Replay) -> None:
        super().bind(sim)
        self.lam = 1.0 / (self.lam_slots * sim.slots)

    def key(self, node: int) -> Any:
        t = self.times[node]
        last = t[-1]
        return self.lam * last + math.log2(sum(2.0 ** (-self.lam * (last - x)) for x in t[-64:]))


class ProbationGDSF(GDSF):
    """ARC-like split: first-use blocks (f = 1) in a FIFO of adaptive target size p, the rest
    by GDSF value L + (f - 1). A miss on a block recently evicted from the FIFO grows p, one
    on a block recently evicted by value shrinks it (ARC's rule, ghost lists of ``slots``)."""

    name = "arc_gdsf"

    def __init__(self) -> None:
        super().__init__("arc_gdsf", lambda f: f - 1, DictGhost())
        self.P: OrderedDict[int, None] = OrderedDict()
        self.B1: OrderedDict[int, None] = OrderedDict()
        self.B2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0

    def add(self, node: int) -> None:
        if node not in self.f:
            if node in self.B1:
                del self.B1[node]
                self.p = min(self.sim.slots, self.p + max(1.0, len(self.B2) / max(1, len(self.B1))))
            elif node in self.B2:
                del self.B2[node]
                self.p = max(0.0, self.p - max(1.0, len(self.B1) / max(1, len(self.B2))))
        self.count(node)
        if self.f[node] == 1:
            self.P[node] = None
        else:
            HeapPolicy.add(self, node)

    def remove(self, node: int) -> None:
        if self.P.pop(node, 0) is not None:
            HeapPolicy.remove(self, node)
        self.count(node)

    def drop(self, node: int) -> None:
        if self.P.pop(node, 0) is not None:
            HeapPolicy.remove(self, node)
        self.forget(node)

    def pop(self) -> int:
        if self.P and (len(self.P) > self.p or not self.live):
            node = self.P.popitem(last=False)[0]
            self.forget(node)
            self._remember(self.B1, node)
            return node
        node = HeapPolicy.pop(self)
        self._remember(self.B2, node)
        return node

    def _remember(self, b: OrderedDict[int, None], node: int) -> None:
        b[node] = None
        if len(b) > self.sim.slots:
            b.popitem(last=False)
