"""Write ``traces/multi_turn.jsonl``: the repository's own small Mooncake-format trace.

Deterministic (fixed seed, no dependencies): ``python scripts/make_trace.py`` rewrites the file
byte for byte, and ``tests/test_trace_file.py`` checks that it does. The workload is synthetic:

- long multi-turn conversations: every turn's prompt is the previous prompt, its answer and a new
  user message, so a turn shares every full 512-token block of the previous turn's prompt (the
  block that straddled the end of that prompt gets a new id, as in a real trace);
- conversations start with one of a few system prompts (popular ones more often), shared by
  every conversation that uses them;
- one-off requests (document questions) between them: a few popular long documents plus unique text;
- Poisson arrivals of conversations and one-off requests; a next turn arrives after the answer
  (its output at 40 tokens/s) and a think time: usually seconds, sometimes many minutes.

Format (one JSON object per line, sorted by timestamp): ``timestamp`` (ms), ``input_length``,
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the prompt; equal ids at
the same position mean the same prefix block).
"""

from __future__ import annotations

import argparse
import json
import os
import random

BLOCK = 512
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "traces", "multi_turn.jsonl")


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int) -> int:
    return (tokens + BLOCK - 1) // BLOCK


def generate(
    seed: int = 2026,
    conversations: int = 150,
    one_off: int = 320,
    duration_s: float = 1800.0,
    max_context: int = 32_768,
    message_tokens: float = 350.0,
) -> list[dict[str, object]]:
    """The trace's records, sorted by timestamp."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [(rng.randint(600, 3500), []) for _ in range(8)]  # (tokens, ids)
    for tokens, sys_ids in systems:
        sys_ids.extend(ids.take(_blocks(tokens)))
    sys_weights = [1.0 / (k + 1) for k in range(len(systems))]
    documents = [(rng.randint(3_000, 16_000), []) for _ in range(40)]
    for tokens, doc_ids in documents:
        doc_ids.extend(ids.take(_blocks(tokens)))
    doc_weights = [1.0 / (k + 1) ** 0.7 for k in range(len(documents))]
    records: list[dict[str, object]] = []

    for _ in range(conversations):
        t_ms = rng.uniform(0, duration_s * 0.85) * 1000.0
        sys_tokens, sys_ids = rng.choices(systems, sys_weights)[0]
        turns = min(40, 1 + int(rng.expovariate(1 / 7.0)))  # mean about 7, some far longer
        length = sys_tokens
        known = list(sys_ids[: sys_tokens // BLOCK])  # ids of the full blocks that stay as they are
        for _turn in range(turns):
            length += max(16, int(rng.expovariate(1 / message_tokens)))  # the new user message
            if length > max_context:
                break
            hash_ids = known + ids.take(_blocks(length) - len(known))
            output = min(2_000, max(8, int(rng.expovariate(1 / 220.0))))
            records.append(
                {"timestamp": int(t_ms), "input_length": length, "output_length": output, "hash_ids": hash_ids}
            )
            known = hash_ids[: length // BLOCK]
            length += output  # the answer is part of the next turn's prompt
            think_s = rng.expovariate(1 / 20.0) if rng.random() < 0.7 else rng.expovariate(1 / 400.0)
            t_ms += output / 40.0 * 1000.0 + think_s * 1000.0

    for _ in range(one_off):
        t_ms = rng.uniform(0, duration_s) * 1000.0
        question = max(32, int(rng.expovariate(1 / 600.0)))
        if rng.random() < 0.6:  # a question about a popular document
            doc_tokens, doc_ids = rng.choices(documents, doc_weights)[0]
            known = list(doc_ids[: doc_tokens // BLOCK])
            length = doc_tokens + question
        else:  # a unique long text
            known = []
            length = rng.randint(1_000, 16_000) + question
        hash_ids = known + ids.take(_blocks(length) - len(known))
        output = min(2_000, max(4, int(rng.expovariate(1 / 150.0))))
        records.append({"timestamp": int(t_ms), "input_length": length, "output_length": output, "hash_ids": hash_ids})

    records.sort(key=lambda r: (r["timestamp"], r["hash_ids"][0]))  # type: ignore[index]
    return records


def render(records: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write (default: traces/multi_turn.jsonl)")
    ap.add_argument(
        "--long", action="store_true", help="a larger trace: 12,024 requests, mean prompt about 12k tokens, 4.5 hours"
    )
    args = ap.parse_args()
    if args.long:  # longer user messages, a 64k context, 9x the requests over 9x the time
        records = generate(
            conversations=1300, one_off=2550, duration_s=16_200.0, max_context=65_536, message_tokens=1300.0
        )
    else:
        records = generate()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(render(records))
    prompt = sum(int(r["input_length"]) for r in records)  # type: ignore[call-overload]
    print(f"wrote {args.out}: {len(records)} requests, mean prompt {prompt // len(records):,} tokens")


if __name__ == "__main__":
    main()
