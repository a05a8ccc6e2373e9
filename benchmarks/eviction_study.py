"""Offline eviction-policy study on the shared Mooncake trace (issue #18).

    python benchmarks/eviction_study.py                    # every policy, 1M/3M/10M tokens
    python benchmarks/eviction_study.py --only lru_head gdsf --caps 1000000
    python benchmarks/eviction_study.py --requests 500     # a prefix of the trace (quick)

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
import sys
import time
from collections import OrderedDict
from typing import Any, Callable

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

    def bind(self, sim: "Replay") -> None:
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
        self.locked: set[int] = set()  # pages owned by the current request
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
        while stack:
            n = stack.pop()
            stack.extend(self.children.pop(n, ()))
            del self.parent[n]
            if n in self.locked:
                self.locked.discard(n)  # detached: private to its owner, freed at close
                self.detached.add(n)
            else:
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
            self.detached: set[int] = set()
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
            locked = self.locked
            for j in range(m):
                pol.remove(ids[j])
                locked.add(ids[j])
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
                locked.add(node)
                pages.append(node)
                prev = node
            # close(): tree pages go to the evictor; private pages (the partial tail, a
            # deduplicated copy was already freed at publish) and detached ones are freed
            detached = self.detached
            for node in (pages if head else pages[::-1]):
                if node in detached:
                    self.free += 1
                else:
                    pol.add(node)
            self.free += req.nb - len(pages)
            locked.clear()
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


class Counted(HeapPolicy):
    """A heap policy that counts uses: ``f[node]`` = requests that used the page (insert or
    hit). ``ghost``: an evicted page's count is remembered (``ghost_slots`` > 0: only for the
    last ``ghost_slots * slots`` evicted pages, FIFO; 0: forever) and resumes on reinsert;
    ``halve_every`` > 0: every that many requests all counts are halved (aging)."""

    def __init__(self, ghost: bool = False, ghost_slots: float = 0, halve_every: int = 0) -> None:
        super().__init__()
        self.f: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # node -> last request counted
        self.ghost = ghost
        self.ghost_slots = ghost_slots
        self.ghosts: OrderedDict[int, int] = OrderedDict()  # evicted node -> count
        self.halve_every = halve_every
        self.r = 0

    def begin(self, r: int, req: Req) -> None:
        self.r = r
        if self.halve_every and r and r % self.halve_every == 0:
            for d in (self.f, self.ghosts):
                for k in d:
                    d[k] >>= 1

    def count(self, node: int) -> None:
        if self.seen.get(node) != self.r:
            self.seen[node] = self.r
            f = self.f.get(node)
            if f is None:
                f = self.ghosts.pop(node, 0)
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
        f = self.f.pop(node)
        del self.seen[node]
        if self.ghost:
            g = self.ghosts
            g[node] = f
            if self.ghost_slots and len(g) > self.ghost_slots * self.sim.slots:
                g.popitem(last=False)


class GDSF(Counted):
    """GreedyDual-Size-Frequency with unit sizes: value = L + w(f) at release; L = the last
    victim's value (the clock only rises)."""

    def __init__(self, name: str, w: Callable[[int], float], **kw: Any) -> None:
        super().__init__(**kw)
        self.name = name
        self.w = w
        self.L = 0.0

    def key(self, node: int) -> Any:
        return self.L + self.w(self.f[node])

    def on_victim(self, node: int, key: Any) -> None:
        self.L = key
        self.forget(node)


class LFU(Counted):
    """Lowest use count first (no aging); ties: least recently released."""

    name = "lfu"

    def key(self, node: int) -> Any:
        return self.f[node]


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
    "lru_head": lambda reqs: LRU("head"),
    "lru_tail": lambda reqs: LRU("tail"),
    "belady": lambda reqs: Belady(reqs),
    "gdsf": lambda reqs: GDSF("gdsf", lambda f: f),
    "gdsf_head": lambda reqs: _head(GDSF("gdsf_head", lambda f: f)),
    "gdsf_ghost": lambda reqs: GDSF("gdsf_ghost", lambda f: f, ghost=True),
    "gdsf_sqrt": lambda reqs: GDSF("gdsf_sqrt", lambda f: f**0.5),
    "gdsf_sq": lambda reqs: GDSF("gdsf_sq", lambda f: f * f),
    "gdsf_log": lambda reqs: GDSF("gdsf_log", lambda f: math.log2(1 + f)),
    "lfu": lambda reqs: LFU(),
}


def _head(p: Policy) -> Policy:
    p.order = "head"
    return p


# ------------------------------------------------------------------ manager check
def verify_with_manager(path: str, cap_tokens: int, limit: int | None) -> dict[str, Any]:
    """Replay through the real KVCacheManager (as benchmarks/run.py's scenario_replay: one
    full-attention layer, 64-byte buffers, host backend, metadata only) and return its rates."""
    sys.path.insert(0, ROOT)
    import kv_cache_manager_v2 as kvm

    layers = [kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", 64), kvm.BufferConfig("value", 64)])]
    slots = cap_tokens // T
    cfg = kvm.KVCacheManagerConfig(T, [kvm.GpuCacheTierConfig(slots * 2 * 64)], layers, backend="host")
    m = kvm.KVCacheManager(cfg)
    total_slots = m.get_storage_statistics()[0].total
    hit_tok = tot_tok = 0
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            n = r["input_length"]
            prompt = [h * 512 + k for h in r["hash_ids"] for k in range(512)][:n]
            kv = m.create_kv_cache(input_tokens=prompt[:-1])
            hit_tok += kv.history_length
            tot_tok += n
            if not (kv.resume() and kv.resize(n)):
                raise SystemExit(f"request {i} did not fit")
            kv.commit(prompt[kv.history_length :])
            kv.close()
    st = m.reuse_statistics
    m.shutdown()
    return {"hit": hit_tok / tot_tok, "blk": st.hit_rate, "slots": total_slots, "compiled": kvm.compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="policies to run (default: all)")
    ap.add_argument("--caps", nargs="*", type=int, default=CAPS, help="capacities in tokens")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_results", "eviction_study.json"))
    ap.add_argument("--verify", type=int, metavar="TOKENS", help="also replay through the real manager at this capacity")
    args = ap.parse_args()
    if not os.path.exists(args.trace):
        print(f"skipped: {os.path.normpath(args.trace)} not found (the shared trace lives beside the repository)")
        return
    if args.verify:
        t0 = time.perf_counter()
        mres = verify_with_manager(args.trace, args.verify, args.requests)
        sres = Replay(load_trace(args.trace, args.requests), args.verify, LRU("head")).run()
        print(f"manager at {args.verify} tokens ({mres['slots']} slots, compiled={mres['compiled']}): "
              f"hit {mres['hit']:.6f} blk {mres['blk']:.6f}; simulator lru_head: hit {sres['hit']:.6f} "
              f"blk {sres['blk']:.6f} ({time.perf_counter() - t0:.0f} s)")
        return
    reqs = load_trace(args.trace, args.requests)
    names = args.only or list(POLICIES)
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
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"requests": len(reqs), "tokens_per_block": T, "results": results}, f, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
