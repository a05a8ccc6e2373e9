"""The block-level replay of ``eviction_study.py``: the trace as block node ids (``Req``), the
evictor interface a policy implements (``Policy``) and the replay of the manager's reuse path
(``Replay``); the module docstring of ``eviction_study.py`` says what it reproduces."""

from __future__ import annotations

import json
import os
import random
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
T = 32
S = 512 // T  # manager blocks per trace hash block
CAPS = [1_000_000, 3_000_000, 10_000_000]


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
