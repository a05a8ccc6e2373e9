"""A synthetic long multi-turn chat trace in Mooncake format (issue #31), where recency matters.

    python benchmarks/multiturn_trace.py                          # bench_results/multiturn_trace.jsonl
    python benchmarks/multiturn_trace.py --conversations 300 --out /tmp/mt.jsonl

Conversations arrive as a Poisson process; each starts from one of ``--system-prompts`` shared
system prompts (a few popular ones: weights 1/(k+1)) and a long first message of its own (a
pasted document), then runs about ``--turns`` turns (1 + exponential). Turn k's prompt is the
whole conversation so far plus a new question, so prompts grow (12k-token mean prompts with the
defaults); the next question comes after an exponential think time, long enough that hundreds of
conversations are open at once. A large cache should hold the most recent turns of the open
conversations; the shared system prompts are what a small cache can keep.

Block ids follow the conversation's token stream: block ``b`` of a conversation is one id for
every request that contains any of its tokens (a prompt ending inside a block uses the id of the
block it will become, and ``benchmarks/eviction_hit_rate.py`` turns id ``h`` into tokens
``h*512 ..``, so the shorter prompt is a token prefix of the longer one, as in a real
conversation). Ids are prefix-unique, as the study's replay requires. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 512  # tokens per hash id (Mooncake)


def _around(rng: random.Random, mean: float) -> int:
    """A length uniform in [mean/2, 3*mean/2] (at least 1)."""
    return max(1, int(rng.uniform(0.5, 1.5) * mean))


def generate(
    conversations: int = 700,
    turns: float = 8.0,
    system_prompts: int = 24,
    system_tokens: int = 3072,
    first_tokens: int = 5000,
    user_tokens: int = 900,
    output_tokens: int = 500,
    rate: float = 1.0,
    think_s: float = 120.0,
    seed: int = 0,
) -> list[dict[str, object]]:
    """The trace's records (Mooncake fields), sorted by timestamp (ms)."""
    rng = random.Random(seed)
    next_id = 0
    systems: list[list[int]] = []
    for _ in range(system_prompts):
        n = max(1, round(_around(rng, system_tokens) / BLOCK))  # whole blocks: conversations start on a boundary
        systems.append(list(range(next_id, next_id + n)))
        next_id += n
    weights = [1.0 / (k + 1) for k in range(system_prompts)]
    records: list[tuple[int, int, dict[str, object]]] = []
    t_ms = 0.0
    for c in range(conversations):
        t_ms += rng.expovariate(rate) * 1000.0
        n_turns = 1 + int(rng.expovariate(1.0 / (turns - 1.0))) if turns > 1 else 1
        ids = list(systems[rng.choices(range(system_prompts), weights)[0]])
        length = len(ids) * BLOCK
        at = t_ms
        for k in range(n_turns):
            length += _around(rng, first_tokens if k == 0 else user_tokens)
            while len(ids) * BLOCK < length:  # blocks of the stream (the last may be partial)
                ids.append(next_id)
                next_id += 1
            n_out = _around(rng, output_tokens)
            rec = {"timestamp": int(at), "input_length": length, "output_length": n_out, "hash_ids": ids[:]}
            records.append((int(at), c, rec))
            length += n_out  # the answer is part of the next prompt
            at += rng.expovariate(1.0 / think_s) * 1000.0
    records.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=700)
    ap.add_argument("--turns", type=float, default=8.0, help="mean turns per conversation")
    ap.add_argument("--system-prompts", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=3072)
    ap.add_argument("--first-tokens", type=int, default=5000, help="mean first message (a document)")
    ap.add_argument("--user-tokens", type=int, default=900, help="mean later question")
    ap.add_argument("--output-tokens", type=int, default=500)
    ap.add_argument("--rate", type=float, default=1.0, help="new conversations per second")
    ap.add_argument("--think-s", type=float, default=120.0, help="mean pause between turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "multiturn_trace.jsonl"))
    args = ap.parse_args()
    recs = generate(
        args.conversations,
        args.turns,
        args.system_prompts,
        args.system_tokens,
        args.first_tokens,
        args.user_tokens,
        args.output_tokens,
        args.rate,
        args.think_s,
        args.seed,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    total = sum(int(str(r["input_length"])) for r in recs)
    print(f"{len(recs)} requests, {total / len(recs):,.0f} mean prompt tokens, {total:,} in all: {args.out}")


if __name__ == "__main__":
    main()
