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
hashing. It reproduces exactly what ``benchmarks/run.py``'s ``replay`` scenario does with one
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
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from eviction_frequency import GDSF, LFU, LRFU, LRUK, AdaptiveAging, ProbationGDSF, RateGDSF, ShadowAging
from eviction_policies import LRU, S3FIFO, Belady, DictGhost, Ghost, TableGhost
from eviction_replay import CAPS, ROOT, TRACE, Policy, Replay, Req, T, jittered, load_trace

__all__ = ["CAPS", "DEFAULT", "POLICIES", "TRACE", "Replay", "T", "load_trace"]


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
