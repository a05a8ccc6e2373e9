"""Sliding-window rematch and free against vLLM's KV cache manager, same run, alternating.

    python benchmarks/peer_vllm.py --vllm-python /path/to/venv-with-vllm/bin/python [--rounds 5]

Both sides run the workload of ``run.py --only rematch_swa free_swa`` (256 requests of 1,536
tokens, 1,024 shared, 32 tokens per block, 32 layers, every layer window-128): *rematch* is a
prefix lookup of a prompt whose blocks are all cached (ours: ``probe_reuse`` of the tokens; vLLM:
``get_computed_blocks`` of a ``Request`` whose block hashes it computed when the request was
made, so its rematch hashes nothing and compares no token); *free* releases a request after 256
decode steps (ours: ``close``; vLLM: ``free``). Each side runs in its own process (vLLM needs its
own environment); the sides alternate ``--rounds`` times; the report is the median of each
round's median, in us per call, and, with ``--instructions``, instructions per rematch under
callgrind (a run without the rematches subtracted). vLLM is not a dependency of this project: the
benchmark needs a Python where ``import vllm`` works (vLLM's manager runs on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
T, LAYERS, REQUESTS, SHARED, UNIQUE, STEPS, WINDOW = 32, 32, 256, 1024, 512, 256, 128


def _prompts() -> list[list[int]]:
    system = list(range(10_000, 10_000 + SHARED))
    return [system + [r * 100_003 + i for i in range(UNIQUE)] for r in range(REQUESTS)]


def ours(timed: bool) -> dict[str, Any]:
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    from bench_common import _admit, _manager

    import kv_cache_manager_v2 as kvm

    prompts = _prompts()
    m = _manager(LAYERS, T, 2 * REQUESTS * (SHARED + UNIQUE + STEPS) // T + 64, 1, window=WINDOW)
    for prompt in prompts:
        _admit(m, prompt).close()
    queries = [prompt[:-1] for prompt in prompts]
    for query in queries:  # the first probe of each (hashes); the timed ones are later probes
        m.probe_reuse(None, query)
    rematch = []
    for query in queries if timed else []:
        t0 = time.perf_counter()
        m.probe_reuse(None, query)
        rematch.append((time.perf_counter() - t0) * 1e6)
    caches = [_admit(m, prompt) for prompt in prompts]
    for step in range(STEPS):
        m.resize_batch(caches)
        m.commit_batch(caches, [step] * len(caches))
    free = []
    for kv in caches:
        t0 = time.perf_counter()
        kv.close()
        free.append((time.perf_counter() - t0) * 1e6)
    m.shutdown()
    return {"compiled": kvm.compiled, "rematch": rematch, "free": free}


def vllm(timed: bool) -> dict[str, Any]:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spec = SlidingWindowSpec(block_size=T, num_kv_heads=1, head_size=16, dtype=torch.float16, sliding_window=WINDOW)
    blocks = 2 * REQUESTS * (SHARED + UNIQUE + STEPS) // T + 64
    group = KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)], spec)
    m = KVCacheManager(KVCacheConfig(blocks, [], [group]), 8192, T, T)
    hasher = get_request_block_hasher(T, sha256)
    params = SamplingParams(max_tokens=STEPS + 1)
    serial = iter(range(1 << 30))

    def admit(prompt: list[int]) -> Any:
        request = Request(str(next(serial)), prompt, params, None, block_hasher=hasher)
        computed, n, _ = m.get_computed_blocks(request)
        assert m.allocate_slots(request, len(prompt) - n, n, computed) is not None
        request.num_computed_tokens = len(prompt)
        return request

    prompts = _prompts()
    for prompt in prompts:
        m.free(admit(prompt))
    requests = [Request(str(next(serial)), prompt, params, None, block_hasher=hasher) for prompt in prompts]
    rematch = []
    for request in requests if timed else []:
        t0 = time.perf_counter()
        m.get_computed_blocks(request)
        rematch.append((time.perf_counter() - t0) * 1e6)
    running = [admit(prompt) for prompt in prompts]
    for step in range(STEPS):
        for request in running:
            request.append_output_token_ids(step)
            assert m.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
    free = []
    for request in running:
        t0 = time.perf_counter()
        m.free(request)
        free.append((time.perf_counter() - t0) * 1e6)
    return {"compiled": False, "rematch": rematch, "free": free}


def _side(python: str, side: str, timed: bool, callgrind: bool) -> tuple[dict[str, Any], int]:
    """Run one side in a child process: its samples, and its instruction count under callgrind (else 0)."""
    cmd = [python, __file__, "--side", side] + ([] if timed else ["--untimed"])
    with tempfile.TemporaryDirectory() as tmp:
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out"] + cmd
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    found = re.search(r"Collected : (\d+)", done.stderr)
    return out, int(found.group(1)) if found else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--untimed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", ""), help="a Python with vLLM installed")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of both sides")
    ap.add_argument("--instructions", action="store_true", help="also count instructions per call (callgrind)")
    ap.add_argument("--out", default=str(HERE / "peer_vllm_results.json"))
    args = ap.parse_args()
    if args.side:
        print(json.dumps((ours if args.side == "ours" else vllm)(not args.untimed)))
        return
    if not args.vllm_python:
        sys.exit("give --vllm-python (or VLLM_PYTHON): a Python where `import vllm` works")
    pythons = {"ours": sys.executable, "vllm": args.vllm_python}
    medians: dict[str, dict[str, list[float]]] = {side: {"rematch": [], "free": []} for side in pythons}
    compiled = False
    for _ in range(args.rounds):
        for side, python in pythons.items():
            out, _ = _side(python, side, True, False)
            compiled = compiled or (side == "ours" and out["compiled"])
            for phase in ("rematch", "free"):
                medians[side][phase].append(statistics.median(out[phase]))
    report: dict[str, Any] = {"ours_compiled": compiled, "unit": "us per call (median of round medians)"}
    for side in pythons:
        report[side] = {phase: statistics.median(values) for phase, values in medians[side].items()}
        report[side]["rounds"] = medians[side]
    if args.instructions:  # a callgrind run with and one without the timed rematches: the difference per call
        for side, python in pythons.items():
            timed, untimed = _side(python, side, True, True)[1], _side(python, side, False, True)[1]
            report[side]["instructions_per_rematch"] = (timed - untimed) / REQUESTS
    for phase in ("rematch", "free"):
        report[f"{phase}_ours_over_vllm"] = report["ours"][phase] / report["vllm"][phase]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("ours", "vllm")}, indent=2))
    for side in pythons:
        print(side, {k: v for k, v in report[side].items() if k != "rounds"})


if __name__ == "__main__":
    main()
