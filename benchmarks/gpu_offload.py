"""Offload (GPU -> host) and onboard (host -> GPU) bandwidth of a 100-block batch by how its slots
are laid out: what merging copies of consecutive slots is worth on a real GPU.

    python benchmarks/gpu_offload.py                  # CUDA (needs a GPU and cuda-python), JSON
    python benchmarks/gpu_offload.py --backend host   # the host-emulated device (the script's own check)

A manager with a GPU tier and a (page-locked) host tier; 100 GPU slots and 100 host slots are
copied through the manager's copy engine (``CopyEngine.copy``: one copy per run of slots
consecutive on both sides, per pool; queued on the copy stream, timed until the script's wait for
it returns) in three layouts of the same slots:

- ``contiguous``: both sides one run (1 copy per pool);
- ``runs_of_N``: runs of N slots (``--run``, default 20: what `benchmarks/contiguity.py` measures
  in a fragmented pool after a long random mix);
- ``scattered``: the host slots in reverse order, so no two pairs merge (100 copies per pool: a
  device copy per block, as engines that allocate blocks anywhere issue).

Each layout is timed ``--reps`` times in both directions, interleaved; the best and the median are
reported in GB/s, with the copies issued per pool. The default sizes are Llama-3-8B's (32 layers,
key and value, 32 tokens of 8 heads x 128 bf16: 64 KiB per layer buffer, 4 MiB a block).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import write_results

import kv_cache_manager_v2 as kvm

BLOCKS = 100


def make_manager(backend: str, layers: int, buffer_bytes: int, slots: int) -> Any:
    cfg_layers = [
        kvm.AttentionLayerConfig(
            kvm.LayerId(i), [kvm.BufferConfig("key", buffer_bytes), kvm.BufferConfig("value", buffer_bytes)]
        )
        for i in range(layers)
    ]
    slot = layers * 2 * buffer_bytes
    tiers = [kvm.GpuCacheTierConfig(slots * slot), kvm.HostCacheTierConfig(slots * slot)]
    return kvm.KVCacheManager(kvm.KVCacheManagerConfig(32, tiers, cfg_layers, backend=backend))


def layouts(run: int) -> dict[str, list[tuple[int, int]]]:
    """(GPU slot, host slot) pairs of each layout; the GPU side ascending in all of them."""
    gpu = list(range(BLOCKS))
    return {
        "contiguous": list(zip(gpu, range(BLOCKS))),
        # runs of ``run`` slots with a one-slot gap between them on the host side
        f"runs_of_{run}": [(g, g + g // run) for g in gpu],
        "scattered": list(zip(gpu, range(2 * BLOCKS, 0, -2))),  # descending, never adjacent: no merge
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--buffer-bytes", type=int, default=64 * 1024, help="per layer, key and value alike")
    ap.add_argument("--run", type=int, default=20, help="the run length of the middle layout")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_offload_results.json")
    )
    args = ap.parse_args()
    m = make_manager(args.backend, args.layers, args.buffer_bytes, 3 * BLOCKS)
    storage = m._storage
    gpu, host = storage.levels[0][0], storage.levels[1][0]
    gpu.allocator.allocate(3 * BLOCKS)  # maps the slots the layouts use (the manager itself holds none)
    host.allocator.allocate(3 * BLOCKS)
    copier = storage.copier
    sizes = gpu.layout.slot_sizes
    nbytes = BLOCKS * sum(sizes)
    pools = len(gpu.pools)
    cases = layouts(args.run)
    times: dict[str, list[float]] = {f"{name}_{d}": [] for name in cases for d in ("offload", "onboard")}
    copies: dict[str, float] = {}
    for rep in range(args.reps + 1):  # the first repetition warms up (not timed)
        for name, pairs in cases.items():
            back = [(h, g) for g, h in pairs]
            for d, (src, dst, ps) in (("offload", (gpu, host, pairs)), ("onboard", (host, gpu, back))):
                before = copier.num_runs
                t0 = time.perf_counter()
                failed = copier.copy(src.pools, dst.pools, sizes, ps)
                copier.backend.synchronize()  # (the copies are queued, ordered by events)
                dt = time.perf_counter() - t0
                assert not failed
                copies[name] = (copier.num_runs - before) / pools
                if rep:
                    times[f"{name}_{d}"].append(dt)
    results = []
    for key, ts in times.items():
        name = key.rsplit("_", 1)[0]
        row = {
            "scenario": key,
            "copies_per_pool": copies[name],
            "best_gb_per_s": nbytes / min(ts) / 1e9,
            "median_gb_per_s": nbytes / statistics.median(ts) / 1e9,
            "best_ms": min(ts) * 1e3,
        }
        results.append(row)
        print(
            f"{key:22} {row['copies_per_pool']:6.0f} copies/pool  best {row['best_gb_per_s']:7.2f} GB/s  "
            f"median {row['median_gb_per_s']:7.2f} GB/s  ({row['best_ms']:.2f} ms)"
        )
    params = {
        "backend": args.backend,
        "layers": args.layers,
        "buffer_bytes": args.buffer_bytes,
        "pools": pools,
        "blocks": BLOCKS,
        "bytes": nbytes,
        "reps": args.reps,
        "run": args.run,
    }
    m.shutdown()
    write_results(args.out, params, results, label=os.environ.get("GPU_NAME", ""), compiled=kvm.compiled)


if __name__ == "__main__":
    main()
