"""Each remote backend against the host tier, in one run: onboarding a 1,024-block prefix (a fresh
local cache: create_kv_cache + resume, every block fetched from the store into the host tier, then
onboarded) and writing one back (write-through of a 1,024-block request: close() hands its blocks to the
writer, until the store has them all), at page sizes 16 KiB - 1 MiB. Stores: a loopback redis-server,
a 3-master Redis Cluster, a Mooncake Store master (TCP transport), all private to the run; "host": the
same prefix onboarded from (and offloaded to) the host tier.

    .venv/bin/python benchmarks/remote_backends.py [--out benchmarks/remote_backends_results.json]
        [--pages 16,64,256,1024] [--reps 3]

Writes JSON: per backend and page size, ms per request and bytes/s (payload bytes) of each direction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("GLOG_minloglevel", "2")

from bench_common import _admit, _manager

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2._storage._remote._value import HEADER_BYTES

BLOCKS = 1024
T = 16


def _filler(m: Any, slots: int) -> None:
    """A request taking every GPU slot: the reusable pages there move to the host tier."""
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(slots * T)
    kv.close()


def _host(page: int, reps: int) -> dict[str, Any]:
    slots = BLOCKS + 8
    m = _manager(1, T, slots, host_slots=slots, size=page // 2, max_util_for_resume=1.0)
    prefix = list(range(BLOCKS * T))
    _admit(m, prefix + [1]).close()
    offload: list[float] = []
    onboard: list[float] = []
    for r in range(reps):
        t0 = time.perf_counter()
        _filler(m, slots)  # writing back: 1,024 pages GPU -> host
        offload.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prefix + [2 + r])
        assert kv.resume() and kv.history_length == BLOCKS * T
        onboard.append(time.perf_counter() - t0)
        kv.close()
    m.shutdown()
    return _row(page, onboard, offload)


def _remote(url: str, page: int, reps: int, tag: str) -> dict[str, Any]:
    slots = BLOCKS + 8
    value = page + HEADER_BYTES
    big = BLOCKS * value + (4 << 20)
    common: dict[str, Any] = {"timeout_ms": 60_000, "retry_interval_ms": 100}
    write = kvm.RemoteCacheTierConfig(
        url if "segment=" not in url else url.replace("segment=0", f"segment={max(2 * big, 512 << 20)}"),
        f"bench-{tag}-{page}",
        write_through=True,
        max_pending_bytes=big,
        **common,
    )
    read = kvm.RemoteCacheTierConfig(
        url.replace("segment=0", "segment=16777216"), f"bench-{tag}-{page}", max_pending_bytes=1 << 20, **common
    )
    writer = _manager(1, T, slots, size=page // 2, remote=write)
    reader = _manager(1, T, slots, host_slots=slots, size=page // 2, remote=read, max_util_for_resume=1.0)
    onboard: list[float] = []
    writeback: list[float] = []
    try:
        for r in range(reps):
            prefix = [r * 10_000_000 + i for i in range(BLOCKS * T)]
            kv = _admit(writer, prefix + [1])
            t0 = time.perf_counter()
            kv.close()  # write-through: its 1,024 blocks go to the writer
            assert writer.flush_remote_writes(120.0)
            writeback.append(time.perf_counter() - t0)
            st = writer.remote_statistics
            assert st is not None and st.dropped_writes == 0, st
            reader.clear_reusable_blocks()
            t0 = time.perf_counter()
            kv = reader.create_kv_cache(input_tokens=prefix + [2])
            assert kv.resume()
            onboard.append(time.perf_counter() - t0)
            assert kv.history_length == BLOCKS * T, kv.history_length
            kv.close()
            writer.clear_reusable_blocks()
            _delete(writer, prefix)  # (the store's memory holds one prefix at a time)
    finally:
        reader.shutdown()
        writer.shutdown()
    return _row(page, onboard, writeback)


def _delete(m: Any, tokens: list[int]) -> None:
    """Remove the pages of ``tokens``' full blocks from ``m``'s remote store."""
    from kv_cache_manager_v2._common import DEFAULT_REUSE_SCOPE
    from kv_cache_manager_v2._reuse._keys import BlockHasher, scope_key

    remote = m._remote
    hasher = BlockHasher(tokens, T, "toks", None, 0)
    parent = scope_key(DEFAULT_REUSE_SCOPE)
    keys = []
    for o in range(len(tokens) // T):
        parent = hasher.key(parent, o)
        keys.append(remote.page_key(parent, 0))
    remote.backend.delete(keys)


def _row(page: int, onboard: list[float], write: list[float]) -> dict[str, Any]:
    n = BLOCKS * page
    on, wr = statistics.median(onboard), statistics.median(write)
    return {
        "page_bytes": page,
        "blocks": BLOCKS,
        "onboard_ms": on * 1e3,
        "onboard_bytes_per_s": n / on,
        "write_back_ms": wr * 1e3,
        "write_back_bytes_per_s": n / wr,
        "onboard_ms_samples": [x * 1e3 for x in onboard],
        "write_back_ms_samples": [x * 1e3 for x in write],
    }


def _stores() -> list[tuple[str, Callable[[], Any]]]:
    from kv_cache_manager_v2.mooncake_master import LocalMooncakeMaster, mooncake_unusable_reason
    from kv_cache_manager_v2.redis_server import LocalRedisCluster, LocalRedisServer, find_redis_server

    out: list[tuple[str, Callable[[], Any]]] = []
    if find_redis_server() is not None:
        out.append(("redis", LocalRedisServer))
        # (a node busy with a 1 GiB batch must not be voted down: CLUSTERDOWN refuses the writes)
        out.append(("redis_cluster", lambda: LocalRedisCluster(3, node_timeout_ms=30_000)))
    if mooncake_unusable_reason() is None:
        out.append(("mooncake", LocalMooncakeMaster))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "remote_backends_results.json"))
    ap.add_argument("--pages", default="16,64,256,1024", help="page sizes in KiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="", help="comma-separated subset of redis,redis_cluster,mooncake")
    a = ap.parse_args()
    pages = [int(x) << 10 for x in a.pages.split(",")]
    results: dict[str, Any] = {
        "unit": "ms per request, payload bytes per second",
        "compiled": kvm.compiled,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "note": "loopback stores on this machine (shared CPUs); timeout_ms raised to 60 s so a 1 GiB MGET is not "
        "cut; Mooncake over its TCP transport, the client's segment sized for the prefix",
        "backends": {},
    }
    results["backends"]["host"] = [_host(p, a.reps) for p in pages]
    print("host", [round(r["onboard_bytes_per_s"] / 1e9, 2) for r in results["backends"]["host"]], flush=True)
    for name, make in _stores():
        if a.backends and name not in a.backends.split(","):
            continue
        server = make()
        server.start()
        try:
            url = server.url if name != "mooncake" else server.url_with(0)
            rows = [_remote(url, p, a.reps, name) for p in pages]
        finally:
            server.close()
        results["backends"][name] = rows
        print(name, [round(r["onboard_bytes_per_s"] / 1e9, 2) for r in rows], flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(_table(results))
    return 0


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| backend | page | onboard ms | onboard GB/s | write-back ms | write-back GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results["backends"].items():
        for r in rows:
            lines.append(
                f"| {name} | {r['page_bytes'] >> 10} KiB | {r['onboard_ms']:.1f} | {r['onboard_bytes_per_s'] / 1e9:.2f} "
                f"| {r['write_back_ms']:.1f} | {r['write_back_bytes_per_s'] / 1e9:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
