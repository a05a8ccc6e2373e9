"""Mooncake's read step, old path against new, interleaved in one run (one build, the same load):
1,024 values of 1 MiB read by ``read()`` into the reading thread's registered buffer and copied into
host slots (the path for a GPU-only cache, and every path before reads went into slots), against
``read_into()`` straight into the registered slots (the host tier's path). A loopback Mooncake master
over TCP; the slots are registered and faulted in first.

    .venv/bin/python benchmarks/mooncake_reads.py [--out benchmarks/mooncake_reads_results.json] [--reps 7]

Writes JSON: seconds per rep of each path, and the median bytes/s.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("GLOG_minloglevel", "2")

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2._storage._remote._mooncake import MooncakeBackend
from kv_cache_manager_v2._storage._remote._value import HEADER_BYTES
from kv_cache_manager_v2.mooncake_master import LocalMooncakeMaster, mooncake_unusable_reason

N = 1024
PAGE = 1 << 20
BATCH = 256  # (read() in the batches read_into issues)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "mooncake_reads_results.json"))
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    reason = mooncake_unusable_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    master = LocalMooncakeMaster()
    master.start()
    try:
        cfg = kvm.RemoteCacheTierConfig(master.url_with(2 * N * (PAGE + HEADER_BYTES)), "reads", timeout_ms=60_000)
        writer = MooncakeBackend(cfg, PAGE + HEADER_BYTES)
        reader = MooncakeBackend(
            kvm.RemoteCacheTierConfig(master.url_with(16 << 20), "reads", timeout_ms=60_000), PAGE + HEADER_BYTES
        )
        keys = [b"kvcm:reads:%d" % i for i in range(N)]
        value = memoryview(bytearray(os.urandom(HEADER_BYTES + PAGE)))
        for i in range(0, N, 64):
            results: list[object] = []
            writer.write(keys[i : i + 64], [[value] for _ in range(64)], results)
            assert all(x is True for x in results), [x for x in results if x is not True][:3]
        pool = mmap.mmap(-1, N * PAGE)
        view = memoryview(pool)
        view[:] = b"\1" * len(view)  # faulted in, as the host tier's used slots are
        reader.register(view)
        slots = [view[i * PAGE : (i + 1) * PAGE] for i in range(N)]
        headers = memoryview(bytearray(HEADER_BYTES * N))
        old: list[float] = []
        new: list[float] = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for b in range(0, N, BATCH):
                values = reader.read(keys[b : b + BATCH], [HEADER_BYTES + PAGE] * BATCH)
                assert values is not None and all(v is not None for v in values)
                for j, v in enumerate(values):
                    slots[b + j][:] = v[HEADER_BYTES:]
            old.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ok = reader.read_into(
                keys, [[headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], slots[i]] for i in range(N)]
            )
            new.append(time.perf_counter() - t0)
            assert ok is not None and all(ok) and bytes(slots[7]) == bytes(value[HEADER_BYTES:])
        out = {
            "unit": "seconds per 1,024 x 1 MiB read; median payload bytes per second",
            "compiled": kvm.compiled,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
            "read_then_copy_s": old,
            "read_into_slots_s": new,
            "read_then_copy_bytes_per_s": N * PAGE / statistics.median(old),
            "read_into_slots_bytes_per_s": N * PAGE / statistics.median(new),
        }
        del slots, view
        writer.close()
        reader.close()
    finally:
        master.close()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"read + copy {out['read_then_copy_bytes_per_s'] / 1e9:.2f} GB/s, into slots "
        f"{out['read_into_slots_bytes_per_s'] / 1e9:.2f} GB/s (median of {a.reps})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
