"""kv-cache-sim --replicas: N round-robin replicas with private caches vs. sharing a remote tier on a
real redis-server; the shared tier must raise the hit rate, and --check-data proves that KV written
by one replica and read by another is right (records hold token, position, layer and buffer)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import NO_REDIS_REASON, REDIS_SERVER, TRACE

from kv_cache_manager_v2 import KVCacheManagerConfig, RemoteCacheTierConfig
from kv_cache_manager_v2.engine import KVCacheResourceManager
from kv_cache_manager_v2.redis_server import LocalRedisServer
from kv_cache_manager_v2.sim import ConversationParams, SchedulerOptions, generate_conversations, load_trace, main
from kv_cache_manager_v2.sim._models import ModelShape, TierSpec, manager_config, proxy_page_bytes
from kv_cache_manager_v2.sim._replicas import merge_results, run_replicas
from kv_cache_manager_v2.sim._run import simulate_replicas

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)

SMALL = ModelShape("small", 4, 2, 16, "fp16")  # 256 bytes per token


def configs(n: int, tokens: int, url: str | None, check_data: bool) -> list[KVCacheManagerConfig]:
    t = 16
    base = manager_config(
        SMALL, t, [TierSpec("gpu", tokens * SMALL.bytes_per_token, "x")], False, proxy_page_bytes(t, check_data)
    )
    if url is None:
        return [base] * n
    remote = RemoteCacheTierConfig(url, "sim-test", write_through=True, max_pending_bytes=1 << 20, timeout_ms=3000)
    return [dataclasses.replace(base, cache_tiers=[*base.cache_tiers, remote]) for _ in range(n)]


def invariants(rm: KVCacheResourceManager) -> None:
    rm.manager.check_invariants()


def test_conversations_over_replicas_share_through_redis_with_correct_data(redis_server: LocalRedisServer) -> None:
    # every next turn lands on another replica (round-robin): only a shared tier has its history
    params = ConversationParams(
        conversations=8, turns=3, system_prompts=2, system_tokens=300, user_tokens=60, output_tokens=20, seed=3
    )
    reqs = generate_conversations(params, 0)
    opts = SchedulerOptions(max_batch=8)
    private, _ = run_replicas(configs(3, 20_000, None, True), reqs, opts, check_data=True, on_step=invariants)
    shared, remote = run_replicas(
        configs(3, 20_000, redis_server.url, True), reqs, opts, check_data=True, on_step=invariants
    )
    p, s = merge_results(private), merge_results(shared)
    assert p.finished == s.finished == len(reqs)
    assert s.records_checked > 0  # every record read through each replica's own pages was right
    assert s.reused_tokens > p.reused_tokens
    assert sum(r.fetched_pages for r in remote if r is not None) > 0


def test_trace_hit_rate_gain_and_cli_report(redis_server: LocalRedisServer, tmp_path: Any) -> None:
    reqs = load_trace(TRACE, 300)
    doc = simulate_replicas(
        SMALL,
        [TierSpec("gpu", 300_000 * SMALL.bytes_per_token, "300ktok")],
        512,
        reqs,
        {},
        SchedulerOptions(prompt_only=True),
        3,
        redis_server.url,
    )
    assert doc["count"] == 3 and doc["hit_rate_gain"]["blocks"] > 0
    assert doc["shared"]["remote"]["fetched_pages"] > 0 and doc["shared"]["remote"]["errors"] == 0
    out = tmp_path / "r.json"
    args = ["--model", "llama-3-8b", "--trace", TRACE, "--requests", "60", "--prompt-only", "--no-progress"]
    assert main([*args, "--replicas", "2", "--remote-url", redis_server.url, "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["replicas"]["count"] == 2 and set(rep["replicas"]) >= {"private", "shared", "hit_rate_gain"}
    assert rep["replicas"]["shared"]["eviction_policy"] == "lru"
    policy = ["--eviction-policy", "frequency"]  # the replicas' managers use it (it used to be ignored)
    assert main([*args, *policy, "--replicas", "2", "--remote-url", redis_server.url, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["replicas"]["private"]["eviction_policy"] == "frequency"
    assert main([*args, "--replicas", "2", "--sweep", "gpu=1,2"]) == 2  # does not combine
    assert main([*args, "--replicas", "2", "--eviction-policy", "all"]) == 2  # one policy per fleet
    assert main([*args, "--replicas", "1", "--remote-url", redis_server.url]) == 2  # nothing to compare


def test_cli_replicas_share_a_private_cluster(tmp_path: Any, redis_server: LocalRedisServer) -> None:
    """--remote-cluster: the replicas share a 3-master cluster on loopback ports (records checked)."""
    out = tmp_path / "c.json"
    args = ["--conversations", "6", "--turns", "2", "--check-data", "--no-progress", "--replicas", "2"]
    assert main([*args, "--remote-cluster", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())["replicas"]
    assert rep["remote_url"].startswith("redis+cluster://127.0.0.1:") and rep["remote_url"].count(",") == 2
    remote = rep["shared"]["remote"]
    assert remote["fetched_pages"] > 0 and remote["errors"] == 0 and remote["dropped_writes"] == 0
    assert rep["hit_rate_gain"]["blocks"] > 0
    assert main([*args, "--remote-cluster", "--remote-url", redis_server.url]) == 2  # one or the other
    assert main([*args[:-2], "--remote-cluster"]) == 2  # a shared tier needs replicas to share it


def _redis_children(pid: int) -> list[int]:
    """The redis-server processes whose parent is ``pid`` (from /proc)."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"redis" in cmd:
            out.append(int(entry))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_sigterm_stops_the_private_redis_server() -> None:
    """Issue 38.16: SIGTERM (as from a job runner) ends the run like Ctrl-C: its redis-server goes too."""
    args = ["--replicas", "2", "--conversations", "2000", "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "kv_cache_manager_v2.sim", *args], stdout=subprocess.DEVNULL)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not servers:
            assert proc.poll() is None and time.monotonic() < deadline, "no redis-server started"
            time.sleep(0.05)
            servers = _redis_children(proc.pid)
        time.sleep(1.0)  # the replay is under way
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert [p for p in servers if os.path.exists(f"/proc/{p}")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in servers:  # left behind by a failing run: ours, stop it
            if os.path.exists(f"/proc/{p}"):
                os.kill(p, signal.SIGKILL)
