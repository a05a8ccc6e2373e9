"""The decode step against SGLang's batched allocator, same run, interleaved.

    python benchmarks/peer_sglang.py --sglang-python /work/side-sglang/bin/python [--rounds 2]

Workload (``run.py``'s decode phase): requests of 1,536 prompt tokens (1,024 shared), 32 tokens
per block, 256 decode steps, at batch sizes 64, 256 and 1,024. Per step, in us per request:

- *SGLang*: what its scheduler does for a paged decode batch (``alloc_for_decode``): the last
  slot of each request read from ``req_to_token``, ``PagedTokenToKVPoolAllocator.alloc_decode`` for
  the whole batch, the new slots written to ``req_to_token``, the lengths raised (CPU tensors:
  SGLang's native path when Triton is absent). No per-request Python work, no tree work. Torch's
  first-call costs are paid before the timed run (the same steps on a tiny batch).
- *ours, batched*: ``resize_batch(caches)`` before the forward pass, ``commit_batch(caches,
  tokens)`` after it, every request's page indices mirrored into an engine-owned int32 table
  (``set_base_page_index_buf``), 32 layers; full blocks are published for reuse as they complete
  (SGLang inserts into its tree when a request ends). Compiled and interpreted.
- *ours, per request*: ``kv.resize(kv.capacity + 1)`` and ``kv.commit([token])`` for each cache.

``--before DIR`` adds the batched calls of another checkout's compiled build (same run).
The figure is the mean over all steps (block crossings included): a step's time over the batch
size; ``crossing_steps_share`` is the part of it spent in the steps where the requests cross a
block (2 of every 32 here: a new page, a block completed); the load average is recorded (the
figures are wall clock). Each side runs in its own process (SGLang in its own environment: it is not a dependency of
this project, and CI does not install it); sides alternate ``--rounds`` times; the report holds the
median of the rounds. Without a Python where ``import sglang`` works, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
T, LAYERS, SHARED, UNIQUE, STEPS = 32, 32, 1024, 512, 256
BATCHES = (64, 256, 1024)
DEFAULT_SIDE_PYTHON = "/work/side-sglang/bin/python"


def _prompts(n: int) -> list[list[int]]:
    system = list(range(10_000, 10_000 + SHARED))
    return [system + [r * 100_003 + i for i in range(UNIQUE)] for r in range(n)]


def ours(batch: int, steps: int, per_request: bool) -> dict[str, Any]:
    """Mean us per request per step of our decode step (batched calls, or per-request calls)."""
    import numpy as np  # (the package comes from $PYTHONPATH: the compiled tree or the fast copy)
    from bench_common import _admit, _manager

    import kv_cache_manager_v2 as kvm

    m = _manager(LAYERS, T, batch * (SHARED + UNIQUE + steps) // T + 64)
    caches = [_admit(m, prompt) for prompt in _prompts(batch)]
    table = np.full((batch, (SHARED + UNIQUE + steps) // T + 2), -1, dtype=np.int32)
    for r, kv in enumerate(caches):
        kv.set_base_page_index_buf(0, 0, memoryview(table[r]))
    tokens = [[step] * batch for step in range(steps)]
    clock = time.perf_counter
    times = [0.0] * steps
    if per_request:
        for step in range(steps):
            t0 = clock()
            one = [step]
            for kv in caches:
                kv.resize(kv.capacity + 1)
                kv.commit(one)
            times[step] = clock() - t0
    else:
        for step in range(steps):
            t0 = clock()
            assert not m.resize_batch(caches)
            m.commit_batch(caches, tokens[step])
            times[step] = clock() - t0
    assert all(kv.history_length == SHARED + UNIQUE + steps for kv in caches)
    for kv in caches:
        kv.close()
    m.shutdown()
    return {"compiled": kvm.compiled, **_per_step(times, batch)}


def _per_step(times: list[float], batch: int) -> dict[str, float]:
    """The mean over all steps, and the share of the time in the steps where the requests cross a
    block boundary (a new page for the step's token, or a block completed by it)."""
    prompt = SHARED + UNIQUE
    crossing = sum(t for s, t in enumerate(times) if (prompt + s) % T == 0 or (prompt + s + 1) % T == 0)
    return {
        "us_per_request_step": sum(times) / len(times) / batch * 1e6,
        "crossing_steps_share": crossing / sum(times),
    }


def sglang(batch: int, steps: int, per_request: bool) -> dict[str, Any]:
    """Mean us per request per step of SGLang's paged decode allocation (``alloc_for_decode``'s tensor work)."""
    import warnings

    warnings.filterwarnings("ignore")
    import sglang as sgl
    import torch

    _sglang_steps(2, T, [0.0] * (T + 1))  # torch's first-call costs, outside the timed run
    times = [0.0] * steps
    triton = _sglang_steps(batch, SHARED + UNIQUE, times)
    return {
        "compiled": False,
        **_per_step(times, batch),
        "sglang": sgl.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "triton_kernels": triton,
    }


def _sglang_steps(batch: int, prompt: int, times: list[float]) -> bool:
    """``len(times)`` decode steps of ``batch`` requests of ``prompt`` tokens (a multiple of ``T``)
    through SGLang's paged allocator, each step's seconds into ``times``; whether it used Triton."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    steps = len(times)
    pool = ReqToTokenPool(batch, prompt + steps + T, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(batch * ((prompt + steps) // T + 2) * T, T, torch.float16, "cpu", None, False)
    rows = torch.tensor(pool.alloc_rows(batch), dtype=torch.int64)
    for r in range(batch):  # the prompts' slots (prefill), page-aligned
        pool.write((rows[r], slice(0, prompt)), alloc.alloc(prompt).to(torch.int32))
    seq_lens = torch.full((batch,), prompt, dtype=torch.int64)
    seq_lens_cpu = seq_lens.clone()
    clock = time.perf_counter
    for step in range(steps):
        t0 = clock()
        last_loc = pool.req_to_token[rows, seq_lens - 1]
        out = alloc.alloc_decode(seq_lens + 1, seq_lens_cpu + 1, last_loc)
        assert out is not None
        pool.write((rows, seq_lens.clone()), out.to(torch.int32))
        seq_lens.add_(1)
        seq_lens_cpu.add_(1)
        times[step] = clock() - t0
    assert int(seq_lens[0]) == prompt + steps
    return bool(alloc.use_triton_kernels)


def _side(python: str, side: str, batch: int, steps: int, env: dict[str, str]) -> dict[str, Any]:
    cmd = [python, __file__, "--side", side, "--batch", str(batch), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
    if done.returncode != 0:
        raise SystemExit(f"{side} (batch {batch}) failed:\n{done.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _sglang_python(given: str) -> str | None:
    """The Python with SGLang, or None (said why) when there is none."""
    python = given or (DEFAULT_SIDE_PYTHON if os.path.exists(DEFAULT_SIDE_PYTHON) else "")
    if not python:
        print("skipped: no Python with SGLang (give --sglang-python or $SGLANG_PYTHON; SGLang is not our dependency)")
        return None
    probe = [python, "-c", "import sglang.srt.mem_cache.allocator.paged"]
    try:
        found = subprocess.run(probe, capture_output=True, text=True).returncode == 0
    except OSError:
        found = False
    if not found:
        print(f"skipped: `import sglang.srt.mem_cache.allocator.paged` fails with {python}")
        return None
    return python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["ours", "ours_per_request", "sglang"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", ""), help="a Python with SGLang")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every side")
    ap.add_argument("--steps", type=int, default=STEPS, help="decode steps per run")
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--before", default="", help="another checkout with its own compiled build: its decode step too")
    ap.add_argument("--out", default=str(HERE / "peer_sglang_results.json"))
    args = ap.parse_args()
    if args.side:
        fn = sglang if args.side == "sglang" else ours
        print(json.dumps(fn(args.batch, args.steps, args.side == "ours_per_request")))
        return
    python = _sglang_python(args.sglang_python)
    if python is None:
        return
    sys.path.insert(0, str(HERE))
    import run as bench

    bench.prepare_modes(["fast", "compiled"])
    root_env = dict(os.environ, PYTHONPATH=bench.ROOT)
    fast_env = dict(os.environ, PYTHONPATH=bench.FAST_DIR + os.pathsep + bench.ROOT)
    sides = {  # name: (python, side, env, compiled)
        "sglang": (python, "sglang", dict(os.environ), False),
        "ours_compiled": (sys.executable, "ours", root_env, True),
        "ours_compiled_per_request": (sys.executable, "ours_per_request", root_env, True),
        "ours_interpreted": (sys.executable, "ours", fast_env, False),
        "ours_interpreted_per_request": (sys.executable, "ours_per_request", fast_env, False),
    }
    if args.before:  # the same calls on another tree's compiled package (e.g. before a change)
        sides["before_compiled"] = (sys.executable, "ours", dict(os.environ, PYTHONPATH=args.before), True)
    rounds: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in sides}
    shares: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in sides}
    info: dict[str, Any] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, (py, side, env, compiled) in sides.items():
                out = _side(py, side, batch, args.steps, env)
                if out["compiled"] != compiled:
                    raise SystemExit(f"{name}: expected compiled={compiled}, the package imported {out['compiled']}")
                rounds[name][batch].append(out.pop("us_per_request_step"))
                shares[name][batch].append(out.pop("crossing_steps_share"))
                if name == "sglang":
                    info.update(out)
    medians = {name: {str(b): statistics.median(v) for b, v in by.items()} for name, by in rounds.items()}
    report: dict[str, Any] = {
        "unit": "us per request per step (mean over the steps; median of interleaved rounds)",
        "workload": {"prompt": SHARED + UNIQUE, "shared": SHARED, "tokens_per_block": T, "layers": LAYERS},
        "steps": args.steps,
        "rounds": args.rounds,
        "sglang_side": info,
        "load_average_1_5_15_min": {"before": list(load_before), "after": list(os.getloadavg())},
        "medians": medians,
        "crossing_steps_share": {  # of each side's time: the steps where requests cross a block (1 in 32 + 1 in 32)
            name: {str(b): statistics.median(v) for b, v in by.items()} for name, by in shares.items()
        },
        "sglang_over_ours": {
            name: {b: medians["sglang"][b] / v for b, v in by.items()}
            for name, by in medians.items()
            if name != "sglang"
        },
        "samples": {name: {str(b): v for b, v in by.items()} for name, by in rounds.items()},
    }
    bench.write_results(args.out, {"batches": args.batches, "rounds": args.rounds}, [report])
    print(f"{'us/request/step':32s}" + "".join(f"{b:>10d}" for b in args.batches))
    for name in sides:
        print(f"{name:32s}" + "".join(f"{medians[name][str(b)]:10.4f}" for b in args.batches))
    for name, by in report["sglang_over_ours"].items():
        print(f"sglang / {name:23s}" + "".join(f"{by[str(b)]:9.2f}x" for b in args.batches))


if __name__ == "__main__":
    main()
