"""Remote-tier scenarios of ``benchmarks/run.py`` on private loopback redis-servers: onboarding
from Redis, the write path's cost on the decode step, one server vs a 3-master cluster."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench_common import (
    _admit,
    _manager,
)


def _redis() -> Any:
    """A private redis-server on a loopback port, or None when no binary is installed."""
    from kv_cache_manager_v2.redis_server import LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        return None
    server = LocalRedisServer()
    server.start()
    return server


def _remote_onboard_once(p: dict[str, int], url: str, size: int, requests: int) -> dict[str, Any]:
    import kv_cache_manager_v2 as kvm

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    gpu_slots = blocks + 8
    remote = kvm.RemoteCacheTierConfig(url, f"bench-{size}", write_through=True, timeout_ms=1000)
    writer = _manager(p["layers"], t, gpu_slots, size=size, remote=remote)
    prefix = list(range(10_000, 10_000 + p["shared"]))
    _admit(writer, prefix + [1]).close()
    assert writer.flush_remote_writes()
    writer.shutdown()
    m = _manager(p["layers"], t, gpu_slots, host_slots=4 * gpu_slots, size=size, remote=remote)
    samples, host_samples = [], []
    for r in range(requests):
        m.clear_reusable_blocks()  # this replica forgets the prefix: only Redis has it
        prompt = prefix + [1_000_000 + r]
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        samples.append((time.perf_counter() - t0) * 1e6)
        assert kv.history_length == p["shared"], kv.history_length
        kv.close()
        filler = m.create_kv_cache()  # the whole GPU: the prefix moves to the host tier
        assert filler.resume() and filler.resize(gpu_slots * t)
        filler.close()
        t0 = time.perf_counter()
        kv = m.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        host_samples.append((time.perf_counter() - t0) * 1e6)
        assert kv.history_length == p["shared"]
        kv.close()
    st = m.remote_statistics
    m.shutdown()
    us = statistics.median(samples)
    host_us = statistics.median(host_samples)
    return {
        "samples": samples,
        "page_bytes": p["layers"] * 2 * size,
        "blocks_per_request": blocks,
        "remote_blocks_per_s": blocks / (us / 1e6),
        "remote_mb_per_s": blocks * p["layers"] * 2 * size / us,
        "host_onboard_us": host_us,
        "host_blocks_per_s": blocks / (host_us / 1e6),
        "remote_vs_host": us / host_us,
        "fetched_pages": st.fetched_pages if st else 0,
    }


def scenario_remote_onboard(p: dict[str, int]) -> dict[str, Any]:
    """create_kv_cache + resume of a prefix only Redis holds (one lookup + one MGET, placed in the host
    tier, onboarded), vs. the same prefix onboarded from the host tier; small and 64 KiB pages."""
    server = _redis()
    if server is None:
        return {"unit": "us/request", "skipped": "no redis-server binary"}
    try:
        small = _remote_onboard_once(p, server.url, p["onboard_buffer_bytes"], p["onboard_requests"])
        big = _remote_onboard_once(p, server.url, p["remote_big_buffer_bytes"], max(5, p["onboard_requests"] // 4))
    finally:
        server.close()
    big.pop("samples")
    big["us_per_request"] = big["host_onboard_us"] * big["remote_vs_host"]
    small["prefix_tokens"] = p["shared"]
    small["big_pages"] = big
    small["unit"] = "us/request"
    small["note"] = (
        "loopback redis-server on this machine; a fresh local cache per request (clear_reusable_blocks), "
        "so every block comes from Redis; host_onboard_us: the same prefix from the host tier"
    )
    return small


def _touch(m: Any) -> None:
    """Write every GPU slot once, as kernels would have (untouched memory reads as a page fault)."""
    for g in m.pool_group_descs:
        for pool in g.pools:
            n = g.num_slots * pool.slot_bytes
            for off in range(0, n, 1 << 20):
                m.backend.write(pool.base_address + off, b"\x01" * min(1 << 20, n - off))


class _EvictingDecode:
    """Decode steps of GPU + host (+ remote) while every new block evicts: a GPU page moves to the
    host tier, whose oldest page is dropped (written to the remote tier when there is one)."""

    def __init__(self, p: dict[str, int], remote: Any, size: int) -> None:
        t, n_req, steps = p["tokens_per_block"], p["remote_requests"], p["steps"]
        live = n_req * (p["shared"] // t + p["unique"] // t + 2 + steps // t + 1)
        gpu_slots = live + n_req * (steps // t + 1) + 64
        m = self.m = _manager(p["layers"], t, gpu_slots, host_slots=gpu_slots, size=size, remote=remote)
        _touch(m)
        system = list(range(10_000, 10_000 + p["shared"]))
        # staggered lengths: block boundaries (the steps that allocate, evict and write) spread over steps
        self.caches = [_admit(m, system + [r * 100_003 + i for i in range(p["unique"] + r % t)]) for r in range(n_req)]
        r = 0
        while m.get_storage_statistics(0)[0].free or m.get_storage_statistics(1)[0].free:
            r += 1  # reusable pages fill the rest of GPU memory, then push down until the host tier is full
            free = m.get_storage_statistics(0)[0].free or 16
            _admit(m, [7_000_000 + r * 1000 + i for i in range(min(free, 16) * t)]).close()
        m.flush_remote_writes()
        self.step = 0
        self.samples: list[float] = []
        self.total = 0.0

    def run(self, steps: int, gap_us: int) -> None:
        """``steps`` decode steps; ``gap_us``: the model's forward pass after each (a sleep, not timed)."""
        caches = self.caches
        for _ in range(steps):
            t0 = time.perf_counter()
            for kv in caches:
                kv.resize(kv.capacity + 1)
                kv.commit([self.step])
                kv.get_base_page_indices(0)
            dt = time.perf_counter() - t0
            self.total += dt
            self.samples.append(dt / len(caches) * 1e6)
            self.step += 1
            if gap_us:
                time.sleep(gap_us / 1e6)

    def close(self) -> Any:
        for kv in self.caches:
            kv.close()
        self.m.flush_remote_writes()
        st = self.m.remote_statistics
        self.m.shutdown()
        return st


def scenario_remote_decode(p: dict[str, int]) -> dict[str, Any]:
    """The write path's cost on the decode step (GPU + host tiers, every new block evicts): no remote
    tier, a remote tier (host pages dropped are handed to the writer), and write-through; 4 KiB and
    larger pages; with a model step between decode steps and back to back. The three run side by
    side, alternating blocks of 16 steps (each writer drained before a block), so a noisy stretch of
    the machine hits all of them."""
    import kv_cache_manager_v2 as kvm

    server = _redis()
    if server is None:
        return {"unit": "us/request/step", "skipped": "no redis-server binary"}
    out: dict[str, Any] = {"unit": "us/request/step"}
    names = ("none", "remote", "write_through")
    try:
        for size in (64, p["remote_big_buffer_bytes"]):
            for gap in (p["remote_step_gap_us"], 0):
                runs: dict[str, _EvictingDecode] = {}
                for name in names:
                    remote = None
                    if name != "none":
                        remote = kvm.RemoteCacheTierConfig(
                            server.url, f"bench-{name}-{size}-{gap}", write_through=name == "write_through"
                        )
                    runs[name] = _EvictingDecode(p, remote, size)
                block = 16
                for b in range(0, p["steps"], block):
                    order = names[b // block % 3 :] + names[: b // block % 3]
                    for name in order:
                        for other in runs.values():
                            other.m.flush_remote_writes()
                        runs[name].run(min(block, p["steps"] - b), gap)
                n = p["remote_requests"] * p["steps"]
                row: dict[str, Any] = {"page_bytes": p["layers"] * 2 * size, "model_step_us": gap}
                for name, run in runs.items():
                    row[f"{name}_mean_us"] = run.total / n * 1e6
                    row[f"{name}_median_us"] = statistics.median(run.samples)
                    samples = run.samples
                    st = run.close()
                    if st is not None:
                        row[f"{name}_written_pages"] = st.written_pages
                        row[f"{name}_dropped_writes"] = st.dropped_writes
                    if size == 64 and gap and name == "remote":
                        out["samples"] = samples
                base = row["none_mean_us"]
                row["remote_overhead"] = row["remote_mean_us"] / base - 1.0
                row["write_through_overhead"] = row["write_through_mean_us"] / base - 1.0
                label = f"{'small' if size == 64 else 'big'}_pages_{'model_step' if gap else 'back_to_back'}"
                out[label] = row
                if size == 64 and gap:
                    out["remote_overhead"] = row["remote_overhead"]
                    out["write_through_overhead"] = row["write_through_overhead"]
    finally:
        server.close()
    out["note"] = (
        "GPU + host tiers, every new block evicts (GPU -> host, host drops its oldest page); the manager's calls "
        "per request per step (mean); the three configurations alternate blocks of 16 steps; model_step: a "
        "sleep of model_step_us after each step (the forward pass: the writer thread and redis-server work "
        "meanwhile), back_to_back: none (on 2 cores the writer and redis-server then compete for the CPU)"
    )
    return out


def _remote_write_once(p: dict[str, int], url: str, size: int, prompts: int, seed: int) -> dict[str, Any]:
    """Write throughput: ``prompts`` distinct prefixes published with write-through, timed from the
    first publish until the writer has sent everything (flush)."""
    import kv_cache_manager_v2 as kvm

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    remote = kvm.RemoteCacheTierConfig(
        url, f"bench-write-{size}", write_through=True, timeout_ms=2000, max_pending_bytes=256 << 20
    )
    m = _manager(p["layers"], t, blocks + 8, size=size, remote=remote)
    t0 = time.perf_counter()
    for r in range(prompts):
        prefix = [seed * 100_000_000 + r * 100_000 + i for i in range(p["shared"])]
        _admit(m, prefix + [1]).close()  # publishes (write-through); the next prompt evicts it
    assert m.flush_remote_writes(120.0)
    dt = time.perf_counter() - t0
    st = m.remote_statistics
    m.shutdown()
    assert st is not None
    return {
        "pages_per_s": st.written_pages / dt,
        "mb_per_s": st.written_bytes / dt / 1e6,
        "written_pages": st.written_pages,
        "dropped_writes": st.dropped_writes,
        "seconds": dt,
    }


def _redis_py_cluster_fetch(p: dict[str, int], url: str, size: int, rounds: int) -> dict[str, Any]:
    """The same prefix's pages read by our cluster fetch (one MGET per slot group, every master's
    pipelined at once) vs redis-py's ``RedisCluster.mget_nonatomic``; lookups by our lookup vs a
    ``RedisCluster`` pipeline of STRLEN."""
    from redis.cluster import ClusterNode, RedisCluster

    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2._config import cluster_seed_nodes
    from kv_cache_manager_v2._storage._remote._store import RemoteStore

    t = p["tokens_per_block"]
    blocks = p["shared"] // t
    remote = kvm.RemoteCacheTierConfig(url, f"bench-rp-{size}", write_through=True, timeout_ms=2000)
    m = _manager(p["layers"], t, blocks + 8, size=size, remote=remote)
    prefix = list(range(20_000, 20_000 + p["shared"]))
    _admit(m, prefix + [1]).close()
    assert m.flush_remote_writes()
    store: RemoteStore = m._remote
    keys = sorted(k for k in _cluster_keys(url) if k.startswith(store.prefix))
    assert len(keys) == blocks, len(keys)
    rc = RedisCluster(startup_nodes=[ClusterNode(h, port) for h, port in cluster_seed_nodes(url)])
    ours_fetch, theirs_fetch, ours_lookup, theirs_lookup = [], [], [], []
    for _ in range(rounds):
        sizes = [len(v) for v in rc.mget_nonatomic(keys)]
        t0 = time.perf_counter()
        got = store.fetch(keys, sizes)
        ours_fetch.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        ref = rc.mget_nonatomic(keys)
        theirs_fetch.append((time.perf_counter() - t0) * 1e6)
        assert got == ref
        t0 = time.perf_counter()
        have = store.lookup(keys, sizes)
        ours_lookup.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        pipe = rc.pipeline()
        for k in keys:
            pipe.strlen(k)
        ref_lengths = pipe.execute()
        theirs_lookup.append((time.perf_counter() - t0) * 1e6)
        assert have == [n == size for n, size in zip(ref_lengths, sizes)]
    rc.close()
    m.shutdown()
    return {
        "keys": len(keys),
        "fetch_us": statistics.median(ours_fetch),
        "redis_py_mget_nonatomic_us": statistics.median(theirs_fetch),
        "lookup_us": statistics.median(ours_lookup),
        "redis_py_pipeline_strlen_us": statistics.median(theirs_lookup),
    }


def _cluster_keys(url: str) -> list[bytes]:
    from kv_cache_manager_v2._config import cluster_seed_nodes
    from kv_cache_manager_v2.redis_server import command

    out: list[bytes] = []
    for _, port in cluster_seed_nodes(url):
        keys = command(port, "KEYS", "kvcm:*")
        assert isinstance(keys, list)
        out.extend(k for k in keys if isinstance(k, bytes))
    return out


def scenario_remote_cluster(p: dict[str, int]) -> dict[str, Any]:
    """One redis-server vs a 3-master Redis Cluster on loopback, same run: onboarding (create_kv_cache +
    resume of a prefix only the remote tier holds) and write throughput (write-through of distinct
    prefixes until flushed), 4 KiB and 64 KiB pages; plus our cluster fetch/lookup vs redis-py's
    RedisCluster on the same keys."""
    from kv_cache_manager_v2.redis_server import LocalRedisCluster, find_redis_server

    if find_redis_server() is None:
        return {"unit": "blocks/s", "samples": [0.0], "note": "no redis-server binary: skipped"}
    server = _redis()
    cluster = LocalRedisCluster(3)
    cluster.start()
    out: dict[str, Any] = {"unit": "blocks/s"}
    try:
        for size in (p["onboard_buffer_bytes"], p["remote_big_buffer_bytes"]):
            page = p["layers"] * 2 * size
            row: dict[str, Any] = {"page_bytes": page}
            requests = (
                p["onboard_requests"] if size == p["onboard_buffer_bytes"] else max(5, p["onboard_requests"] // 4)
            )
            prompts = (
                p["remote_write_prompts"]
                if size == p["onboard_buffer_bytes"]
                else max(4, p["remote_write_prompts"] // 4)
            )
            for name, url in (("server", server.url), ("cluster", cluster.url)):
                on = _remote_onboard_once(p, url, size, requests)
                on.pop("samples")
                row[f"{name}_onboard_blocks_per_s"] = on["remote_blocks_per_s"]
                row[f"{name}_onboard_mb_per_s"] = on["remote_mb_per_s"]
            for rep in range(2):  # alternating, the better of two each
                for name, url in (("server", server.url), ("cluster", cluster.url)):
                    w = _remote_write_once(p, url, size, prompts, 1 + rep * 2 + (name == "cluster"))
                    if w["pages_per_s"] > row.get(f"{name}_write_pages_per_s", 0.0):
                        row[f"{name}_write_pages_per_s"] = w["pages_per_s"]
                        row[f"{name}_write_mb_per_s"] = w["mb_per_s"]
                        row[f"{name}_write_dropped"] = w["dropped_writes"]
            row["cluster_vs_server_onboard"] = row["cluster_onboard_blocks_per_s"] / row["server_onboard_blocks_per_s"]
            row["cluster_vs_server_write"] = row["cluster_write_pages_per_s"] / row["server_write_pages_per_s"]
            out[f"pages_{page}_bytes"] = row
        out["redis_py_cluster"] = _redis_py_cluster_fetch(p, cluster.url, p["onboard_buffer_bytes"], 50)
    finally:
        server.close()
        cluster.close()
    out["samples"] = [out[f"pages_{p['layers'] * 2 * p['onboard_buffer_bytes']}_bytes"]["cluster_onboard_blocks_per_s"]]
    out["note"] = (
        "loopback on this 2-core VM: the cluster's 3 redis-servers share the cores with the client, so "
        "this measures the client's per-node pipelining cost, not a cluster's bandwidth (which scales "
        "with machines); onboarding: blocks of a 1024-token prefix per second (one lookup + one fetch); "
        "write: pages per second from the first publish until flushed"
    )
    return out
