"""The disk tier's checksums and the persistent disk tier (issue #27), fast vs production (mypyc) mode.

    .venv/bin/python benchmarks/disk_persistence.py            # both modes, JSON
    .venv/bin/python benchmarks/disk_persistence.py --quick    # seconds

Scenarios:

* ``checksum``: the page checksum (CRC-32C from ``crc32c``, and zlib's CRC-32 for comparison) per
  page of 16 KiB and 1 MiB, next to reading the same pages from a disk pool file with ``pread``
  (hot page cache: the fastest a disk read gets, so the ratio is an upper bound of the checksum's
  share) and through ``DiskPool.read_into`` (read + verify).
* ``index_load``: start-up of a manager whose persistent disk tier holds ``index_pages`` published
  pages (chains of 64 blocks, 32 tokens each): construction time minus that of the same manager on
  an empty directory, i.e. reading, checking and adopting the records (target <= 250 ms compiled
  for 60k pages); ``key_check_ms``: of that, what checking each block's key against its parent key
  and tokens costs (``chain_keys`` per record, as adoption calls it, timed alone).
* ``restart_hit_rate``: the shared Mooncake trace replayed one request at a time (prompt blocks,
  like ``benchmarks/run.py``'s tier_hit_rate) on GPU + persistent disk tiers; once without a restart
  (warm), once with the manager shut down and a new one opened on the same directory after
  ``restart_at`` of the requests. Hit rates of the requests after that point, and their ratio
  (target >= 0.98).

Each scenario runs in a child process per mode (``benchmarks/run.py``'s fast copy of the sources and
in-place mypyc build), modes alternating, ``--repeats`` times; the best median is reported.
Output: a table and ``bench_results/disk_persistence.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_common  # noqa: E402  (the trace)
import run as bench  # noqa: E402  (benchmarks/run.py: the fast copy, the build)

SCENARIOS = ["checksum", "index_load", "restart_hit_rate"]
DEFAULTS = dict(checksum_mib=256, index_pages=60_000, trace_requests=0, restart_percent=50, gpu_tokens=1_000_000)
QUICK = dict(checksum_mib=16, index_pages=2_000, trace_requests=200, restart_percent=50, gpu_tokens=100_000)


def _per_page(fn: Any, n: int) -> float:
    """Microseconds per call of ``fn(slot)`` over ``n`` slots, best of 5 passes."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for s in range(n):
            fn(s)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def scenario_checksum(p: dict[str, int]) -> dict[str, Any]:
    import zlib

    from kv_cache_manager_v2._storage import _disk
    from kv_cache_manager_v2._storage._disk import DiskPool

    out: dict[str, Any] = {"unit": "us/page", "checksum": _disk.CHECKSUM_NAME}
    samples: list[float] = []
    tmp = tempfile.mkdtemp(prefix="kvcm-bench-")
    try:
        for size in (16 << 10, 1 << 20):
            n = max(4, (p["checksum_mib"] << 20) // size)
            pool = DiskPool(tmp, n * size, size)
            page = memoryview(bytearray(os.urandom(size)))
            for s in range(n):
                pool.write_from(page, s * size)
            buf = memoryview(bytearray(size))
            fd = pool.fd
            crc = _per_page(lambda s, page=page: _disk.checksum(page), n)
            crc32 = _per_page(lambda s, page=page: zlib.crc32(page), n)
            raw, verified = float("inf"), float("inf")
            for _ in range(3):  # alternating, so a noisy stretch hits both
                raw = min(raw, _per_page(lambda s, fd=fd, buf=buf, size=size: os.preadv(fd, [buf], s * size), n))
                verified = min(
                    verified, _per_page(lambda s, pool=pool, buf=buf, size=size: pool.read_into(buf, s * size), n)
                )
            pool.release()
            out[f"{size >> 10}KiB"] = {
                "pages": n,
                "checksum_us": crc,
                "checksum_gb_per_s": size / crc / 1e3,
                "zlib_crc32_us": crc32,
                "zlib_crc32_gb_per_s": size / crc32 / 1e3,
                "pread_us": raw,
                "pread_gb_per_s": size / raw / 1e3,
                "read_and_verify_us": verified,
                "read_and_verify_gb_per_s": size / verified / 1e3,
                "checksum_share_of_hot_read": crc / raw,
            }
            samples.append(crc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["samples"] = samples
    out["note"] = (
        "best passes over the pages; pread from the page cache (hot): a real disk reads at 1-7 GB/s, so "
        "the checksum's share of a disk read is smaller than checksum_share_of_hot_read"
    )
    return out


def _persistent_manager(path: str, t: int, gpu_slots: int, disk_slots: int) -> Any:
    import kv_cache_manager_v2 as kvm

    size = 64  # metadata only: bytes per buffer page
    layers = [
        kvm.AttentionLayerConfig(kvm.LayerId(0), [kvm.BufferConfig("key", size), kvm.BufferConfig("value", size)])
    ]
    tiers = [
        kvm.GpuCacheTierConfig(gpu_slots * 2 * size),
        kvm.DiskCacheTierConfig(disk_slots * 2 * size, path, persistent=True),
    ]
    return kvm.KVCacheManager(kvm.KVCacheManagerConfig(t, tiers, layers, backend="host"))


def scenario_index_load(p: dict[str, int]) -> dict[str, Any]:
    from kv_cache_manager_v2._common import DEFAULT_REUSE_SCOPE
    from kv_cache_manager_v2._reuse._keys import block_key, chain_keys, scope_key
    from kv_cache_manager_v2._storage import _disk

    t, n, chain = 32, p["index_pages"], 64
    tmp = tempfile.mkdtemp(prefix="kvcm-bench-")
    empty = tempfile.mkdtemp(prefix="kvcm-bench-")
    try:
        m = _persistent_manager(tmp, t, 64, n)
        persist = m._storage.persist
        zero = _disk.checksum(memoryview(bytes(128)))  # the (zero) bytes of every slot
        root = scope_key(DEFAULT_REUSE_SCOPE)
        parent = root
        written: list[tuple[bytes, Any, bytes]] = []
        for slot in range(n):
            if slot % chain == 0:
                parent = root
            tokens = array("I", range(slot * t, (slot + 1) * t))
            key = block_key(parent, tokens)
            persist.write(0, slot, 0, 35, (None, None), parent, key, tokens, [zero])
            written.append((parent, tokens, key))
            parent = key
        m.shutdown()
        checks = []
        for _ in range(3):
            t0 = time.perf_counter()
            for parent, tokens, key in written:
                if chain_keys(parent, tokens.tobytes(), 4 * len(tokens)) != [key]:
                    raise AssertionError("a key that is not its block's")
            checks.append(time.perf_counter() - t0)
        loads, bases = [], []
        adopted = 0
        for _ in range(3):
            t0 = time.perf_counter()
            m = _persistent_manager(tmp, t, 64, n)
            loads.append(time.perf_counter() - t0)
            adopted = m.num_adopted_pages
            assert adopted == n, adopted
            m.shutdown()
            t0 = time.perf_counter()
            m = _persistent_manager(empty, t, 64, n)
            bases.append(time.perf_counter() - t0)
            m.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(empty, ignore_errors=True)
    ms = [(a - b) * 1e3 for a, b in zip(sorted(loads), sorted(bases))]
    return {
        "unit": "ms",
        "samples": ms,
        "pages": adopted,
        "ms_per_60k_pages": min(ms) * 60_000 / adopted,
        "construction_with_records_ms": min(loads) * 1e3,
        "construction_empty_dir_ms": min(bases) * 1e3,
        "key_check_ms": min(checks) * 1e3,
        "note": "start-up with the records of `pages` published pages minus start-up on an empty directory; "
        "key_check_ms: the key checks alone (one chain_keys per block, from the benchmark's loop)",
    }


def _replay(m: Any, reqs: list[dict[str, Any]]) -> tuple[int, int]:
    """Replay ``reqs`` one at a time; (reused blocks, prompt blocks) as the manager counts them."""
    st = m.reuse_statistics
    hit0, miss0 = st.reused_blocks, st.missed_blocks
    for r in reqs:
        n = r["input_length"]
        prompt = array("I", bench_common._trace_prompt(r))
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(n):
            kv.commit(prompt[kv.history_length :])
        kv.close()
    st = m.reuse_statistics
    reused = st.reused_blocks - hit0
    return reused, reused + st.missed_blocks - miss0


def scenario_restart_hit_rate(p: dict[str, int]) -> dict[str, Any]:
    trace = os.environ.get("KVCM_BENCH_TRACE", bench_common.TRACE)
    if not os.path.exists(trace):
        return {"unit": "ratio", "samples": [0.0], "note": f"trace not found at {trace} (--trace PATH)"}
    t = 512  # the trace's hash blocks: one block per hash id
    reqs = bench_common._trace(p["trace_requests"], trace)
    cut = len(reqs) * p["restart_percent"] // 100
    gpu_slots = p["gpu_tokens"] // t
    disk_slots = 3 * gpu_slots
    out: dict[str, Any] = {"unit": "ratio", "requests": len(reqs), "restart_after_requests": cut}
    for restart in (False, True):
        tmp = tempfile.mkdtemp(prefix="kvcm-bench-")
        try:
            m = _persistent_manager(tmp, t, gpu_slots, disk_slots)
            _replay(m, reqs[:cut])
            t0 = time.perf_counter()
            if restart:
                m.shutdown()
                m = _persistent_manager(tmp, t, gpu_slots, disk_slots)
            restart_s = time.perf_counter() - t0
            adopted = m.num_adopted_pages
            hit, total = _replay(m, reqs[cut:])
            m.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        name = "restart" if restart else "warm"
        out[f"{name}_hit_rate_after_cut"] = hit / max(total, 1)
        if restart:
            out["adopted_pages"] = adopted
            out["restart_seconds"] = restart_s
    ratio = out["restart_hit_rate_after_cut"] / max(out["warm_hit_rate_after_cut"], 1e-12)
    out["samples"] = [ratio]
    out.update(gpu_tokens=gpu_slots * t, disk_tokens=disk_slots * t, tokens_per_block=t)
    out["note"] = (
        "hit rate (reused / prompt blocks) of the requests after the cut; restart: shutdown (GPU blocks written "
        "back to the disk tier) and a new manager adopting the directory"
    )
    return out


def worker(name: str, params: dict[str, int]) -> dict[str, Any]:
    import kv_cache_manager_v2

    out: dict[str, Any] = globals()[f"scenario_{name}"](params)
    out["compiled"] = kv_cache_manager_v2.compiled
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, default=SCENARIOS)
    ap.add_argument("--modes", nargs="*", choices=["fast", "compiled"], default=["fast", "compiled"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--trace", default=bench_common.TRACE, help="the Mooncake trace (JSONL) for restart_hit_rate")
    ap.add_argument("--out", default=os.path.join(bench.ROOT, "bench_results", "disk_persistence.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.params))))
        return
    params = dict(QUICK if args.quick else DEFAULTS)
    os.environ["KVCM_BENCH_TRACE"] = os.path.abspath(args.trace)  # (the children read it)
    bench.prepare_modes(args.modes)
    results = []
    for name in args.only:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for _ in range(args.repeats):
            for mode in args.modes:
                r = bench.run_child(mode, name, params, os.path.abspath(__file__))
                r.update(scenario=name, mode=mode, median=statistics.median(r["samples"]))
                runs[mode].append(r)
        for mode in args.modes:
            higher = runs[mode][0]["unit"] == "ratio"
            best = (max if higher else min)(runs[mode], key=lambda x: float(x["median"]))
            results.append(best)
            print(f"{name:18s} {mode:9s} {best['median']:>12.4f} {best['unit']}", flush=True)
    bench.write_results(args.out, params, results)


if __name__ == "__main__":
    main()
