"""Offline eviction-policy study on the shared Mooncake trace (issue #18).

    python benchmarks/eviction_study.py                    # the main policies, 1M/3M/10M tokens (~3 min)
    python benchmarks/eviction_study.py --all              # every policy tried (~10 min)
    python benchmarks/eviction_study.py --only lru_head rgdsf --caps 1000000
    python benchmarks/eviction_study.py --requests 500     # a prefix of the trace (quick)
    python benchmarks/eviction_study.py --jitter 5         # also 5 equally likely orderings
    .venv/bin/python benchmarks/eviction_study.py --verify 1000000                      # real manager, LRU
    .venv/bin/python benchmarks/eviction_study.py --verify 1000000 --policy frequency   # real manager, rgdsf

The proposal (``rgdsf``, see docs/eviction_proposal.md): GreedyDual values per priority,
value = L + (uses - 1) / (now - first_use + tau), L = the last victim's value, tau = 15 x slots
(clock: block uses), a block with cached children waits for them (descendants first), and the
uses / first use of evicted blocks are remembered in a set-associative table of 8 x slots.

A block-level replay of the manager's reuse path, one request at a time, without tokens or
hashing. It reproduces exactly what ``benchmarks/run.py``'s ``scenario_replay`` does with one
full-attention layer group (checked against the real manager, see ``--verify``):

* ``create_kv_cache(prompt[:-1])``: the longest cached prefix of full T-token blocks of the
  query (input_length - 1 tokens) is matched; if every full query block matched and the query
  ends inside a block whose full version is cached, that block is a partial hit (its page is
  held as the copy source).
* ``resume()``: a partial hit gets a private copy (one slot: ``make_room(1)``); the source
  page is released again (back to the evictor).
* ``resize(input_length)``: slots for the remaining blocks (``make_room``: evict victims until
  enough slots are free). The last block of the prompt may be partial.
* ``commit(prompt[h:])``: full blocks are published to the tree (a block already there is
  deduplicated: the tree's page is taken, the private one freed).
* ``close()``: pages released; committed pages go to the evictor, others are freed. The
  manager today releases in ascending block order ("head" order); issue #19 releases
  tail-first ("tail" order).
* Evicting a page removes the subtree behind it (full attention): its droppable pages are
  freed too ("collateral" evictions).

Blocks are identified without hashing: trace hash ids are prefix-unique (an id fixes the
whole prefix before it; checked at load), so T-token block j of a request is node
``hash_ids[j // S] * S + j % S`` with S = 512 / T, and its parent is block j - 1's node.

Hit rates reported (all over the whole trace):

* ``hit`` (token hit rate) = sum of matched tokens (32 per matched full block, plus the
  partial length) / sum of input_length. This is the issue's "reused prompt tokens / prompt
  tokens" and the column the issue's table uses.
* ``blk`` = the manager's ``ReuseStatistics.hit_rate``: reused blocks (a partial hit counts
  as one) / query blocks (ceil((input_length - 1) / T)).

Output: a table on stdout and JSON (default ``bench_results/eviction_study.json``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
T = 32
S = 512 // T  # manager blocks per trace hash block
CAPS = [1_000_000, 3_000_000, 10_000_000]


# ------------------------------------------------------------------------------ trace
class Req:
    __slots__ = ("n", "ids", "nfull", "nq", "qpart", "nb", "t")

    def __init__(self, n: int, hash_ids: list[int], t: int) -> None:
        self.n = n
        self.nb = (n + T - 1) // T  # blocks of the prompt (the last may be partial)
        self.nfull = n // T  # full blocks of the prompt (published)
        self.nq = (n - 1) // T  # full blocks of the query prompt[:-1]
        self.qpart = (n - 1) % T  # tokens of the query's last, partial block (0: none)
        # node id of every block (the partial last one: the id of its full version)
        self.ids = [hash_ids[j // S] * S + j % S for j in range(self.nb)]
        self.t = t  # arrival time (ms)


def load_trace(path: str, limit: int | None = None) -> list[Req]:
    reqs: list[Req] = []
    prev: dict[int, tuple[int, int]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            ids = r["hash_ids"]
            for i, h in enumerate(ids):  # prefix-uniqueness: node ids stand for key chains
                p = (ids[i - 1] if i else -1, i)
                if prev.setdefault(h, p) != p:
                    raise SystemExit(f"hash id {h} has two different prefixes: the node-id shortcut is invalid")
            reqs.append(Req(r["input_length"], ids, r["timestamp"]))
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


def jittered(reqs: list[Req], seed: int, ms: float) -> list[Req]:
    """The same requests with arrival times moved by up to +-``ms`` (uniform) and re-sorted:
    an equally likely Poisson ordering, to see how much a policy's rate owes to luck."""
    rng = random.Random(seed)
    keyed = sorted((r.t + rng.uniform(-ms, ms), i) for i, r in enumerate(reqs))
    return [reqs[i] for _, i in keyed]


def lookups(req: Req) -> list[int]:
    """Nodes a request looks up: its full query blocks, then the block of a partial tail."""
    return req.ids[: req.nq + (1 if req.qpart else 0)]


# ---------------------------------------------------------------------------- replay
class Policy:
    """Evictor interface as the replay sees it (nodes stand for pages: one layer group).

    add(node): a page becomes droppable (released by its last owner); remove(node): a
    droppable page is taken again (reuse); pop(): choose, remove and return a victim;
    drop(node): a droppable page was freed as part of an evicted subtree.
    Policies may read the replay's tree (``sim``) for structure: ``sim.children[node]``.
    """

    name = "?"
    order = "tail"  # release order at close: "head" (ascending, today) or "tail" (issue #19)

    def bind(self, sim: Replay) -> None:
        self.sim = sim

    def add(self, node: int) -> None: ...
    def remove(self, node: int) -> None: ...
    def pop(self) -> int: ...
    def drop(self, node: int) -> None:
        self.remove(node)

    def begin(self, r: int, req: Req) -> None:
        """A new request starts (its arrival index ``r``): a logical clock if needed."""

    def became_leaf(self, node: int) -> None:
        """``node``'s last cached child left the tree (the node may be droppable or in use)."""


class Replay:
    def __init__(self, reqs: list[Req], cap_tokens: int, policy: Policy) -> None:
        self.reqs = reqs
        self.slots = cap_tokens // T
        self.policy = policy
        self.parent: dict[int, int] = {}  # node -> parent node (-1: root) for nodes in the tree
        self.children: dict[int, set[int]] = {}  # node -> cached children (absent: none)
        self.free = self.slots
        self.collateral = 0
        self.victims = 0
        policy.bind(self)

    # the tree -----------------------------------------------------------------
    def insert(self, node: int, parent: int) -> None:
        self.parent[node] = parent
        if parent >= 0:
            ch = self.children.get(parent)
            if ch is None:
                self.children[parent] = {node}
            else:
                ch.add(node)

    def evict(self, victim: int) -> None:
        """drop_page + remove_subtree: the victim and every page behind it leave the tree."""
        self.victims += 1
        par = self.parent.pop(victim)
        if par >= 0:
            ch = self.children[par]
            ch.discard(victim)
            if not ch:
                del self.children[par]
        self.free += 1
        if par >= 0 and par not in self.children:
            self.policy.became_leaf(par)
        stack = list(self.children.pop(victim, ()))
        # Evictions happen before this request publishes, while it holds only its matched
        # prefix (and maybe the partial source), whose ancestors it holds too: a droppable
        # victim never has pages in use below it, so nothing is ever detached here.
        while stack:
            n = stack.pop()
            stack.extend(self.children.pop(n, ()))
            del self.parent[n]
            self.policy.drop(n)
            self.free += 1
            self.collateral += 1

    def make_room(self, k: int) -> None:
        pop = self.policy.pop
        while self.free < k:
            self.evict(pop())

    # the replay ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        pol = self.policy
        head = pol.order == "head"
        parent = self.parent
        hit_tok = tot_tok = hit_blk = q_blk = 0
        for r, req in enumerate(self.reqs):
            pol.begin(r, req)
            ids = req.ids
            # create_kv_cache(prompt[:-1]): match and take (hold) the matched pages
            m = 0
            nq = req.nq
            while m < nq and ids[m] in parent:
                m += 1
            part = m == nq and req.qpart > 0 and ids[m] in parent
            hit_tok += m * T + (req.qpart if part else 0)
            tot_tok += req.n
            hit_blk += m + part
            q_blk += nq + (req.qpart > 0)
            for j in range(m):
                pol.remove(ids[j])
            if part:
                src = ids[m]
                pol.remove(src)  # held as the copy source
                # resume(): copy into a private page, release the source
                self.make_room(1)
                self.free -= 1
                pol.add(src)
            # resize(n): pages for the remaining blocks
            need = req.nb - m - part
            self.make_room(need)
            self.free -= need
            # commit(prompt[h:]): publish full blocks m..nfull-1
            pages: list[int] = ids[:m]  # tree pages this request owns, in block order
            prev = ids[m - 1] if m else -1
            for o in range(m, req.nfull):
                node = ids[o]
                if prev >= 0 and prev not in parent:
                    break  # our last node left the tree: nothing after it is published
                if node in parent:  # already in the tree (the partial source): dedup
                    pol.remove(node)
                    self.free += 1  # our private page is freed
                else:
                    self.insert(node, prev)
                pages.append(node)
                prev = node
            # close(): tree pages go to the evictor; private pages (the partial tail; a
            # deduplicated copy was already freed at publish) are freed
            for node in pages if head else pages[::-1]:
                pol.add(node)
            self.free += req.nb - len(pages)
        return {
            "hit": hit_tok / tot_tok,
            "blk": hit_blk / q_blk,
            "victims": self.victims,
            "collateral": self.collateral,
        }


# -------------------------------------------------------------------------- policies
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


POLICIES: dict[str, Callable[[list[Req]], Policy]] = {
    # baselines
    "lru_head": lambda reqs: LRU("head"),  # the manager today (ascending release)
    "lru_tail": lambda reqs: LRU("tail"),  # issue #19 (tail-first release)
    "belady": lambda reqs: Belady(reqs),  # offline: farthest next use first
    # frequency with GDSF aging
    "gdsf": lambda reqs: GDSF("gdsf", lambda f: f),  # counts forgotten on eviction
    "gdsf_ghost": lambda reqs: GDSF("gdsf_ghost", lambda f: f, DictGhost()),  # the "aged frequency"
    "gdsf1_ghost": lambda reqs: GDSF("gdsf1_ghost", lambda f: f - 1, DictGhost()),  # one-off blocks first
    "gdsf1_sqrt": lambda reqs: GDSF("gdsf1_sqrt", lambda f: (f - 1) ** 0.5, DictGhost()),
    "gdsf1_sq": lambda reqs: GDSF("gdsf1_sq", lambda f: (f - 1) ** 2, DictGhost()),
    "lfu_ghost": lambda reqs: LFU(DictGhost()),
    # recency + frequency classics
    "lru2": lambda reqs: LRUK(2),
    "lrfu": lambda reqs: LRFU(15.0),
    "arc_gdsf": lambda reqs: ProbationGDSF(),
    "s3fifo": lambda reqs: S3FIFO(),
    # use-rate GDSF (the proposal) and its variants
    "rgdsf": lambda reqs: RateGDSF("rgdsf", 15.0, TableGhost(8)),
    # what the manager ships (eviction_policy="frequency"): 16-way ghost sets
    "rgdsf16": lambda reqs: RateGDSF("rgdsf16", 15.0, TableGhost(8, 16)),
    # issue #31, first version: rgdsf16 + adaptive aging from LRU deadlines; step variants
    "adaptive_aging": lambda reqs: AdaptiveAging("adaptive_aging"),
    "adaptive_aging_fast": lambda reqs: AdaptiveAging("adaptive_aging_fast", step=0.01),
    "adaptive_aging_slow": lambda reqs: AdaptiveAging("adaptive_aging_slow", step=0.0003),
    # issue #31, second version: aging learnt from a simulated LRU (the manager's "frequency" now)
    "shadow_aging": lambda reqs: ShadowAging("shadow_aging"),
    "shadow_aging_slow": lambda reqs: ShadowAging("shadow_aging_slow", step=0.001),
    "shadow_aging_fast": lambda reqs: ShadowAging("shadow_aging_fast", step=0.002),
    "shadow_aging_from_floor": lambda reqs: ShadowAging("shadow_aging_from_floor", init=1e-4),
    "shadow_aging_from_on": lambda reqs: ShadowAging("shadow_aging_from_on", init=0.01),
    "shadow_aging_floor3": lambda reqs: ShadowAging("shadow_aging_floor3", lo=1e-3),
    "shadow_aging_no_threshold": lambda reqs: ShadowAging("shadow_aging_no_threshold", on=0.0),
    "shadow_aging_trim": lambda reqs: ShadowAging("shadow_aging_trim", trim=True),
    "rgdsf_table4": lambda reqs: RateGDSF("rgdsf_table4", 15.0, TableGhost(4)),
    "rgdsf_ideal": lambda reqs: RateGDSF("rgdsf_ideal", 15.0, DictGhost()),
    "rgdsf_noghost": lambda reqs: RateGDSF("rgdsf_noghost", 15.0, Ghost()),
    "rgdsf_local": lambda reqs: RateGDSF("rgdsf_local", 15.0, TableGhost(8), leaves=False),
    "rgdsf_tau5": lambda reqs: RateGDSF("rgdsf_tau5", 5.0, TableGhost(8)),
    "rgdsf_tau50": lambda reqs: RateGDSF("rgdsf_tau50", 50.0, TableGhost(8)),
    "rgdsf_pow1.5": lambda reqs: RateGDSF("rgdsf_pow1.5", 15.0, TableGhost(8), power=1.5),
    "rgdsf_pow0.5": lambda reqs: RateGDSF("rgdsf_pow0.5", 15.0, TableGhost(8), power=0.5),
}
DEFAULT = ["lru_head", "lru_tail", "belady", "gdsf_ghost", "gdsf1_ghost", "rgdsf", "rgdsf_ideal"]


def _head(p: Policy) -> Policy:
    p.order = "head"
    return p


# ------------------------------------------------------------------ manager check
def verify_with_manager(path: str, cap_tokens: int, limit: int | None, policy: str = "lru") -> dict[str, Any]:
    """Replay through the real KVCacheManager with ``eviction_policy=policy`` (see
    benchmarks/eviction_hit_rate.py, which this delegates to) and return its rates."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import eviction_hit_rate

    return eviction_hit_rate.replay(eviction_hit_rate.load(path, limit), cap_tokens, policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(POLICIES), help="policies to run")
    ap.add_argument("--all", action="store_true", help="every policy (default: " + ", ".join(DEFAULT) + ")")
    ap.add_argument("--caps", nargs="*", type=int, default=CAPS, help="capacities in tokens")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--jitter", type=int, metavar="SEEDS", help="also replay SEEDS jittered orderings (arrivals +-3 s)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "eviction_study.json"))
    ap.add_argument("--verify", type=int, metavar="TOKENS", help="replay through the real manager at this capacity")
    ap.add_argument(
        "--policy",
        default="lru",
        choices=["lru", "frequency"],
        help="--verify: the manager's eviction_policy (compared with lru_tail / shadow_aging here)",
    )
    args = ap.parse_args()
    if not os.path.exists(args.trace):
        print(f"skipped: {os.path.normpath(args.trace)} not found (the shared trace lives beside the repository)")
        return
    if args.verify:
        t0 = time.perf_counter()
        mres = verify_with_manager(args.trace, args.verify, args.requests, args.policy)
        sim = "lru_tail" if args.policy == "lru" else "shadow_aging"
        sres = Replay(load_trace(args.trace, args.requests), args.verify, POLICIES[sim]([])).run()
        print(
            f"manager ({args.policy}) at {args.verify} tokens ({mres['slots']} slots, compiled={mres['compiled']}): "
            f"hit {mres['hit']:.6f} blk {mres['blk']:.6f}; simulator {sim}: hit {sres['hit']:.6f} "
            f"blk {sres['blk']:.6f} ({time.perf_counter() - t0:.0f} s)"
        )
        return
    reqs = load_trace(args.trace, args.requests)
    names = args.only or (list(POLICIES) if args.all else DEFAULT)
    results: dict[str, dict[str, Any]] = {}
    hdr = f"{'policy':<22}" + "".join(f"{c / 1e6:>7g}M hit   blk" for c in args.caps)
    print(f"{len(reqs)} requests, T={T}; hit = matched tokens / input tokens, blk = manager hit_rate")
    print(hdr)
    for name in names:
        row: dict[str, Any] = {}
        line = f"{name:<22}"
        for cap in args.caps:
            t0 = time.perf_counter()
            res = Replay(reqs, cap, POLICIES[name](reqs)).run()
            res["seconds"] = round(time.perf_counter() - t0, 2)
            row[str(cap)] = res
            line += f"   {res['hit']:.4f} {res['blk']:.4f}"
        results[name] = row
        print(line, flush=True)
    jitter: dict[str, dict[str, Any]] = {}
    if args.jitter:
        print(f"jittered orderings (arrival +-3 s, {args.jitter} seeds): mean / min token hit rate")
        print(hdr.replace(" hit   blk", "  mean   min"))
        variants = [jittered(reqs, seed, 3000.0) for seed in range(args.jitter)]
        for name in names:
            row = {}
            line = f"{name:<22}"
            for cap in args.caps:
                hits = [Replay(v, cap, POLICIES[name](v)).run()["hit"] for v in variants]
                row[str(cap)] = {"hits": hits, "mean": statistics.mean(hits), "min": min(hits)}
                line += f"   {statistics.mean(hits):.4f} {min(hits):.4f}"
            jitter[name] = row
            print(line, flush=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"requests": len(reqs), "tokens_per_block": T, "results": results, "jitter": jitter}, f, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
