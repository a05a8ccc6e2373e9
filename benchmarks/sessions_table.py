"""Issue 52: what sessions, their end and reasoning-range hints are worth, against LRU, today's
close-time continuation hints and the offline optimum, on the built-in conversations and the
shared Mooncake trace, each with a reasoning share of 0.4.

    .venv/bin/python benchmarks/sessions_table.py                      # both workloads, 3 capacities each
    .venv/bin/python benchmarks/sessions_table.py --workloads trace --caps 3000000

Each request is replayed alone through a fresh manager (as ``benchmarks/retention_hints.py`` does:
T = 32, GPU tier only, one full-attention layer, host backend: metadata only; whole blocks only,
``enable_partial_reuse=False``, as the optimum counts them), its manager clock
the arrival time: ``create_kv_cache(prompt[:-1])``, ``resume``, ``resize``, ``commit`` of the
prompt *and its output* (the first 40 % of which is reasoning: the built-in next turn leaves it
out, a trace's later prompts never hold outputs), ``close``. Runs:

* ``lru``: no hints;
* ``hints_0.9``: today's close-time continuation hints (``sim._hints.hint_retentions`` from the
  workload's future, a share 0.1 of the labels flipped, seed 0; a request said not to continue
  drops its blocks after its system prompt);
* ``sessions_close_0.9``: sessions (``create_kv_cache(session_id=)``, ``sim._sessions.session_ids``:
  the built-in conversations; the trace's documents, ``document_sessions``: requests whose prompts
  share a 512-token block beyond their template, the prefix more than 8 conversations start with)
  and the close-time hints of an engine that knows whether the request's session comes back and
  after what pause (``sim._hints.session_hints``: the same oracle as ``hints_0.9``, per session
  instead of per exact continuation, a share 0.1 of the labels flipped, seed 0): one that does
  keeps the prefix its prompt shares with its session's other requests (its document, whose
  extent is taken from the workload exactly; a conversation's turn: all of it) at
  ``keep_priority`` of the pause, the rest (question, output, reasoning) at ``DROP_PRIORITY``
  (token-range hints); one that does not drops all but its template; ``directives.end`` when a
  session's last request closes (keeping the template other sessions share); reasoning tokens
  dropped by a token-range hint;
* ``sessions_0.9``: the same, and the engine raises a kept prefix (``directives.retain`` by prefix)
  each time the time left until its session's predicted return halves, to ``keep_priority`` of
  the time left (``sim._hints.SessionReturns``: the same knowledge, used as time passes; a
  priority fixed at close ranks a session due soon below one kept later for a shorter pause);
  ``sessions_frequency_0.9``: the same under ``eviction_policy="frequency"``;
* ``optimum``: Belady's eviction over the same 32-token prompt blocks knowing the whole future
  (``retention_hints.belady``: a bound, not a policy; the same capacity in blocks as the
  manager's, ``cap // 32``; outputs are never reused here (a trace's later prompts hold none, a
  built-in next turn leaves the reasoning that starts each answer out, so it diverges there), so
  it never keeps them; the farthest next use first keeps the cached blocks a prefix-closed set,
  each one a hit when used), and ``infinite``: the hit rate of a cache that never evicts.

The capacities: per workload, three, including one where LRU reaches at most 0.8 of the infinite
cache's hit rate. Hit rate = matched prompt tokens / prompt tokens. Output: a table and
``benchmarks/sessions_table_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from array import array
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from retention_hints import TRACE, TraceClock, belady, block_keys, gpu_manager  # noqa: E402

import kv_cache_manager_v2 as kvm  # noqa: E402
from kv_cache_manager_v2.sim import SimRequest, load_trace  # noqa: E402
from kv_cache_manager_v2.sim._hints import (  # noqa: E402
    SessionReturns,
    hint_retentions,
    kept_prefix,
    session_hints,
)
from kv_cache_manager_v2.sim._sessions import (  # noqa: E402
    continuation_pauses,
    session_ids,
    session_templates,
    sessions_of,
    system_prompts,
)
from kv_cache_manager_v2.sim._workload import (  # noqa: E402
    TRACE_BLOCK_TOKENS,
    ConversationParams,
    generate_conversations,
    mark_reasoning,
)

T = 32
REASONING = 0.4
ACCURACY = 0.9
CAPS = {"conversations": [24_000, 48_000, 96_000], "trace": [1_000_000, 3_000_000, 10_000_000]}
RUNS = ["lru", "hints_0.9", "sessions_close_0.9", "sessions_0.9", "sessions_frequency_0.9", "optimum"]


def workload(name: str, trace: str, limit: int) -> list[SimRequest]:
    if name == "trace":
        reqs = load_trace(trace, limit)
        mark_reasoning(reqs, REASONING)
        return reqs
    return generate_conversations(ConversationParams(), limit, REASONING)


def replay(
    reqs: list[SimRequest],
    cap_tokens: int,
    retain: list[Any] | None,
    sessions: list[str] | None = None,
    ends: set[int] | None = None,
    keep: list[int] | None = None,
    policy: str = "lru",
    groups: list[int] | None = None,
) -> tuple[float, dict[str, int]]:
    """Hit rate of one replay through a fresh manager, and what the sessions' ends did (blocks;
    ``groups``: per request, its session's index: the engine raises the kept prefixes as their
    sessions' returns near, ``SessionReturns``; counted as ``raised``)."""
    clock = TraceClock()
    m = gpu_manager(cap_tokens, policy, clock, enable_partial_reuse=False)  # (whole blocks, as the optimum counts them)
    hit = total = 0
    ended = {"dropped": 0, "deferred": 0, "kept": 0, "raised": 0}
    returns = SessionReturns() if groups is not None and retain is not None else None
    for i, r in enumerate(reqs):
        clock.now = r.arrival_ms / 1000.0
        if returns is not None:
            assert retain is not None
            for k, priority, duration in returns.due(clock.now):
                m.directives.retain(reqs[k].prompt_tokens()[: kept_prefix(reqs[k], retain[k])], priority, duration)
                ended["raised"] += 1
        prompt = r.prompt_tokens()
        n = len(prompt)
        tokens = prompt + array("I", range(r.output_base, r.output_base + r.output_length))
        session = kvm.SessionId(sessions[i]) if sessions is not None else None
        kv = m.create_kv_cache(input_tokens=prompt[:-1], session_id=session)
        hit += kv.history_length
        total += n
        if not (kv.resume() and kv.resize(len(tokens))):
            raise SystemExit(f"request {i} did not fit")
        kv.commit(tokens[kv.history_length :])
        kv.close(retain[i] if retain is not None else None)
        if returns is not None and groups is not None and retain is not None:
            returns.closed(groups[i], i, clock.now, retain[i])
        if session is not None and ends is not None and i in ends:
            k = keep[i] if keep is not None else 0
            out = m.directives.end(session, prompt[:k] if k else None)
            ended["dropped"] += out.num_blocks
            ended["deferred"] += out.num_deferred
            ended["kept"] += out.num_kept
    m.shutdown()
    return hit / total, ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=list(CAPS), choices=list(CAPS))
    ap.add_argument("--caps", nargs="*", type=int, help="capacities in tokens (default: per workload)")
    ap.add_argument("--runs", nargs="*", default=RUNS, choices=RUNS)
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "sessions_table_results.json"))
    args = ap.parse_args()
    doc: dict[str, Any] = {
        "benchmark": "sessions_table",
        "compiled": kvm.compiled,
        "tokens_per_block": T,
        "metric": "matched prompt tokens / prompt tokens",
        "reasoning_share": REASONING,
        "accuracy": ACCURACY,
        "workloads": {},
    }
    for name in args.workloads:
        reqs = workload(name, args.trace, args.requests)
        granularity = TRACE_BLOCK_TOKENS if name == "trace" else 1
        pauses = continuation_pauses(reqs, granularity)
        shared = [p[1] if p is not None else 0 for p in system_prompts(reqs, 1, T)]
        hints = hint_retentions(pauses, ACCURACY, 0, drop=True, shared=shared)
        ids, ends = session_ids(reqs)
        per_session = session_hints(reqs, ACCURACY, T)
        groups = sessions_of(reqs)
        keep = session_templates(reqs, groups, granularity if granularity > 1 else T)
        blocks = block_keys(reqs)
        infinite = belady(blocks, 1 << 40)
        w: dict[str, Any] = {
            "requests": len(reqs),
            "sessions": len(set(ids)),
            "infinite": round(infinite, 4),
            "capacities": {},
        }
        doc["workloads"][name] = w
        print(f"{name}: {len(reqs)} requests, {len(set(ids))} sessions; infinite cache {infinite:.4f}")
        for cap in args.caps or CAPS[name]:
            row: dict[str, Any] = {}
            w["capacities"][str(cap)] = row
            for run in args.runs:
                t0 = time.perf_counter()
                if run == "optimum":
                    row[run] = round(belady(blocks, cap), 4)
                elif run == "lru":
                    row[run] = round(replay(reqs, cap, None)[0], 4)
                elif run == "hints_0.9":
                    row[run] = round(replay(reqs, cap, list(hints))[0], 4)
                else:
                    policy = "frequency" if "frequency" in run else "lru"
                    raises = None if "close" in run else groups
                    rate, ended = replay(reqs, cap, list(per_session), ids, ends, keep, policy, raises)
                    row[run] = round(rate, 4)
                    row[f"{run}_ended_blocks"] = ended
                row[f"{run}_seconds"] = round(time.perf_counter() - t0, 1)
                print(f"{name:>14} {cap / 1e6:>7g}M {run:>14} {row[run]:.4f}", flush=True)
            if "lru" in row:
                row["lru_of_infinite"] = round(row["lru"] / infinite, 3)
            if "optimum" in row:
                for run in RUNS[:-1]:
                    if run in row:
                        row[f"{run}_of_optimum"] = round(row[run] / row["optimum"], 3)
            with open(args.json, "w") as f:  # after each capacity: a long run keeps what it measured
                json.dump(doc, f, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
