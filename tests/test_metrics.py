"""Prometheus metrics (issue #29): a scrape over real HTTP on loopback, parsed with prometheus-client's
text parser, equals the manager's statistics after a scripted workload through the engine adapter."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator

import pytest
from conftest import kv_layers, make_config, shut_down, toks
from fake_engine import FakeEngine, adapter_step
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kv_cache_manager_v2 import (
    CacheLevel,
    CacheTier,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
    TokenId,
    TokenIdExt,
)
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager, RequestState
from kv_cache_manager_v2.metrics import KVCacheMetricsCollector, register_metrics, serve_metrics
from kv_cache_manager_v2.redis_server import LocalRedisServer

T = 8
BLOCK = 2 * 2 * 32 * T  # bytes of one block of both layers (kv_layers(2): key + value of 32 bytes a token)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Workload:
    """Documents with shared prefixes, served twice through the adapter on a GPU that holds about two:
    the first round pushes pages down to host and disk, the second reuses them from there; one
    request is suspended and resumed, one preempted by recompute."""

    def __init__(self, adapter: KVCacheResourceManager) -> None:
        self.adapter = adapter
        self.engine = FakeEngine(adapter.manager)
        self.next_id = 0
        self.queried = 0  # tokens admission looked up (prompt minus its last token)
        self.reused = 0  # tokens admission reused, as the requests report them
        self.preemptions = 0

    def admit(self, prompt: list[TokenIdExt], new_tokens: int) -> EngineRequest:
        r = EngineRequest(self.next_id, prompt, max_new_tokens=new_tokens, context_chunk_size=16)
        self.next_id += 1
        self.queried += len(prompt) - 1
        assert adapter_step(self.adapter, self.engine, [r]) == []
        self.reused += r.num_reused_tokens
        return r

    def finish(self, r: EngineRequest) -> None:
        while len(r.generated_tokens) < r.max_new_tokens:
            assert adapter_step(self.adapter, self.engine, [r]) == []
        r.state = RequestState.FINISHED
        self.adapter.free_resources(r)

    def run(self) -> None:
        system = [TokenId(t) for t in range(7000, 7016)]
        docs = [system + [TokenId(1000 * (i + 1) + t) for t in range(40)] for i in range(10)]
        for d in [*docs, *reversed(docs)]:  # the second round finds them on the GPU, then host, then disk
            self.finish(self.admit(d + [TokenId(3)], 3))
        a = self.admit(docs[0] + [TokenId(4)] * 9, 4)
        self.adapter.suspend_resources(a)  # preempted, KV kept
        self.preemptions += 1
        self.finish(self.admit(docs[5] + [TokenId(5)], 2))
        self.finish(a)  # resumed by the next prepare
        b = self.admit(docs[1] + [TokenId(6)] * 5, 4)
        self.adapter.free_resources(b)  # preempted by recompute (not FINISHED)
        self.preemptions += 1
        b.state = RequestState.CONTEXT
        b.num_reused_tokens = 0
        self.queried += len(b.all_tokens()) - 1
        assert adapter_step(self.adapter, self.engine, [b]) == []  # re-admitted with what it had (prompt + generated)
        self.reused += b.num_reused_tokens
        self.finish(b)


@pytest.fixture
def tiered(backend: str, tmp_path: object) -> Iterator[Callable[..., tuple[KVCacheResourceManager, KVCacheManager]]]:
    made: list[KVCacheManager] = []

    def factory(**kw: object) -> tuple[KVCacheResourceManager, KVCacheManager]:
        config = make_config(
            kv_layers(2, T),
            T,
            BLOCK * 14,
            host_quota=BLOCK * 16,
            disk_quota=BLOCK * 40,
            disk_path=str(tmp_path),
            backend=backend,
            max_util_for_resume=1.0,
            load_workers=0,  # (every read on the step's thread: admitted at once, counters by the state)
        )
        m = KVCacheManager(config, KVCacheEventManager(max_events=8))
        made.append(m)
        return KVCacheResourceManager(manager=m), m

    yield factory
    shut_down(made)


def expected_samples(m: KVCacheManager, a: KVCacheResourceManager, labels: dict[str, str]) -> Samples:
    """What the scrape must say, from the manager's and the adapter's statistics."""
    base = tuple(sorted(labels.items()))

    def key(name: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted([*base, *extra.items()]))

    r = m.reuse_statistics
    em = m.event_manager
    out: Samples = {
        key("vllm:kv_cache_usage_perc"): m.gpu_utilization,
        key("vllm:prefix_cache_queries_total"): r.queried_tokens,
        key("vllm:prefix_cache_hits_total"): r.reused_tokens,
        key("vllm:num_preemptions_total"): a.num_preemptions,
        key("kvcm_prefix_cache_blocks_total", result="hit"): r.reused_blocks,
        key("kvcm_prefix_cache_blocks_total", result="miss"): r.missed_blocks,
        key("kvcm_reused_pages_total"): r.reused_pages,
        key("kvcm_allocated_pages_total"): r.allocated_pages,
        key("kvcm_open_caches"): m.num_open_caches,
    }
    if m.config.has_recurrent_layers:
        for what in ("taken", "skipped", "reused", "evicted", "evicted_unused"):
            out[key("kvcm_state_snapshots_total", event=what)] = getattr(r, f"snapshots_{what}")
        for kind in ("interval", "branch", "last", "demand"):
            out[key("kvcm_state_snapshots_total", event=f"taken_{kind}")] = getattr(r, f"snapshots_{kind}")
        out[key("kvcm_attention_matched_tokens_total")] = r.attention_matched_tokens
    if em is not None:
        out[key("kvcm_events_dropped_total")] = em.num_dropped
        out[key("kvcm_events_pending")] = em.num_pending
    names = {CacheTier.GPU_MEM: "gpu", CacheTier.HOST_MEM: "host", CacheTier.DISK: "disk", CacheTier.REMOTE: "remote"}
    for level, kind in enumerate(m.cache_tier_list):
        tier = names[kind]
        out[key("vllm:prompt_tokens_cached_total", source=tier)] = a.reused_tokens_per_level[level]
        t = m.get_tier_statistics(CacheLevel(level))
        out[key("kvcm_tier_used_bytes", tier=tier)] = t.used_bytes
        out[key("kvcm_tier_total_bytes", tier=tier)] = t.total_bytes
        out[key("kvcm_tier_peak_used_bytes", tier=tier)] = t.peak_used_bytes
        if m.config.has_recurrent_layers:
            out[key("kvcm_tier_state_bytes", tier=tier)] = t.state_bytes
        groups = m.get_storage_statistics(CacheLevel(level)) if kind is not CacheTier.REMOTE else []
        out[key("kvcm_tier_pinned_bytes", tier=tier)] = sum(g.pinned_bytes for g in groups)
        out[key("kvcm_tier_retained_bytes", tier=tier)] = sum(g.retained_bytes for g in groups)
        for what in ("offloaded", "onboarded", "dropped", "declined"):
            out[key(f"kvcm_tier_{what}_pages_total", tier=tier)] = getattr(t, f"{what}_pages")
            out[key(f"kvcm_tier_{what}_bytes_total", tier=tier)] = getattr(t, f"{what}_bytes")
        out[key("kvcm_tier_io_errors_total", tier=tier)] = t.io_errors
        lp = m.load_plan_statistics
        out[key("kvcm_load_plan_tokens_total", plan="taken", source=tier)] = lp.loaded_tokens[level]
        out[key("kvcm_load_plan_tokens_total", plan="recomputed", source=tier)] = lp.recomputed_tokens[level]
    out[key("kvcm_load_plan_saved_seconds_total", by="loads")] = m.load_plan_statistics.saved_s
    out[key("kvcm_load_plan_saved_seconds_total", by="cuts")] = m.load_plan_statistics.cut_saved_s
    rs = m.remote_statistics
    if rs is not None:
        for name, value in (
            ("lookups", rs.lookups),
            ("found_pages", rs.found_pages),
            ("fetched_pages", rs.fetched_pages),
            ("written_pages", rs.written_pages),
            ("writes_dropped", rs.dropped_writes),
            ("errors", rs.errors),
            ("corrupt_pages", rs.corrupt_pages),
            ("skipped_lookups", rs.skipped_lookups),
        ):
            out[key(f"kvcm_remote_{name}_total")] = value
        out[key("kvcm_remote_pending_bytes")] = rs.pending_bytes
        out[key("kvcm_remote_connected")] = float(rs.connected)
    return out


def test_scrape_over_http_equals_the_statistics(tiered: Callable[..., tuple]) -> None:
    a, m = tiered()
    work = Workload(a)
    disk_pools = [p for g in m._storage.levels[2] for p in g.pools]
    reads = [0]

    def flaky(op: str, offset: int, nbytes: int) -> bool:  # some disk reads fail: io_errors, shorter reuse
        if op != "read":
            return False
        reads[0] += 1
        return reads[0] % 4 == 0

    for pool in disk_pools:
        pool.error_hook = flaky
    try:
        work.run()
    finally:
        for pool in disk_pools:
            pool.error_hook = None
    labels = {"model_name": "tiny", "engine": "0"}
    server, thread, collector = serve_metrics(0, adapter=a, labels=labels)
    try:
        got = scrape(server.server_port)
        want = expected_samples(m, a, labels)
        assert got == want
        # the workload exercised what the values describe
        by = {name: v for (name, lab), v in got.items() if not dict(lab).keys() - {"model_name", "engine"}}
        src = {dict(lab)["source"]: v for (name, lab), v in got.items() if name == "vllm:prompt_tokens_cached_total"}
        assert src["host"] > 0 and src["disk"] > 0 and src["gpu"] > 0, (src, reads)
        assert sum(src.values()) == work.reused  # what the requests were told
        assert by["vllm:prefix_cache_queries_total"] == work.queried
        assert by["vllm:num_preemptions_total"] == work.preemptions == 2
        assert by["kvcm_events_dropped_total"] > 0
        tier = {(name, dict(lab)["tier"]): v for (name, lab), v in got.items() if "tier" in dict(lab)}
        assert (
            tier[("kvcm_tier_offloaded_pages_total", "host")] > 0
            and tier[("kvcm_tier_onboarded_pages_total", "disk")] > 0
        )
        assert tier[("kvcm_tier_io_errors_total", "disk")] > 0
        plan = {
            dict(lab)["source"]: v
            for (name, lab), v in got.items()
            if name == "kvcm_load_plan_tokens_total" and dict(lab)["plan"] == "taken"
        }
        assert plan["host"] > 0 and plan["disk"] > 0  # taken from the lower tiers ("auto" without a rate)
        assert tier[("kvcm_tier_total_bytes", "gpu")] == BLOCK * 14
        # scraping reads, never changes: a second scrape says the same
        assert scrape(server.server_port) == got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert collector.collect()  # still readable without a server


def test_the_same_workload_scrapes_the_same(tiered: Callable[..., tuple]) -> None:
    """Two runs of one workload give equal counters (the values come from the state, not from timing)."""
    outs = []
    for _ in range(2):
        a, _ = tiered()
        Workload(a).run()
        registry = CollectorRegistry()
        collector = register_metrics(adapter=a, registry=registry)
        outs.append(
            {
                (f.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples
            }
        )
        registry.unregister(collector)
    assert outs[0] == outs[1]


def test_a_manager_without_adapter_and_several_sources(tiered: Callable[..., tuple]) -> None:
    a1, m1 = tiered()
    a2, m2 = tiered()
    Workload(a1).run()
    collector = KVCacheMetricsCollector(m1, labels={"engine": "0"})
    collector.add(m2, labels={"engine": "1"})
    registry = CollectorRegistry()
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    hits = {s.labels["engine"]: s.value for s in fams["vllm:prefix_cache_hits"].samples if s.name.endswith("_total")}
    assert hits == {"0": m1.reuse_statistics.reused_tokens, "1": 0} and hits["0"] > 0
    assert "vllm:prompt_tokens_cached" not in fams and "vllm:num_preemptions" not in fams  # adapter counters
    with pytest.raises(ValueError, match="same label names"):
        collector.add(m2, labels={"replica": "1"})
    with pytest.raises(ValueError, match="already reported"):
        collector.add(m2, labels={"engine": "1"})
    with pytest.raises(ValueError, match="reserved"):
        KVCacheMetricsCollector(m1, labels={"tier": "x"})
    with pytest.raises(TypeError, match="str to str"):
        KVCacheMetricsCollector(m1, labels={"engine": 0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="KVCacheManager"):
        KVCacheMetricsCollector(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="another manager"):
        KVCacheMetricsCollector(m1, adapter=a2)
    with pytest.raises(ValueError, match="port"):
        serve_metrics(-1, m1)
    # a manager shut down reports nothing (its source can be removed)
    source = collector.add(
        KVCacheResourceManager(make_config(kv_layers(1, T), backend="host")).manager, labels={"engine": "2"}
    )
    source.manager.shutdown()
    engines = {s.labels["engine"] for m in collector.collect() for s in m.samples}
    assert engines == {"0", "1"}
    collector.remove(source)


# ---------------------------------------------------------------- kv-cache-sim
SIM = [
    *("--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"),
    *("--conversations", "12", "--turns", "2", "--system-tokens", "300", "--user-tokens", "100"),
    *("--output-tokens", "60", "--time-scale", "0", "--gpu", "1500tok", "--host", "20000tok", "--no-progress"),
]


def test_sim_writes_its_final_metrics(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """``kv-cache-sim --metrics-file``: the final values agree with the JSON report of the same run."""
    import json
    import os

    from kv_cache_manager_v2.sim._cli import main

    metrics_path = os.path.join(str(tmp_path), "metrics.prom")
    report_path = os.path.join(str(tmp_path), "report.json")
    assert main([*SIM, "--metrics-file", metrics_path, "--json", report_path]) == 0
    capsys.readouterr()
    with open(report_path) as f:
        doc = json.load(f)
    with open(metrics_path) as f:
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(f.read())
            for s in fam.samples
        }
    assert got[("kvcm_prefix_cache_blocks_total", (("result", "hit"),))] == doc["manager"]["reused_blocks"]
    assert got[("kvcm_prefix_cache_blocks_total", (("result", "miss"),))] == doc["manager"]["missed_blocks"]
    assert got[("kvcm_allocated_pages_total", ())] == doc["manager"]["allocated_pages"]
    pre = doc["preemptions"]
    assert got[("vllm:num_preemptions_total", ())] == pre["suspend"] + pre["recompute"] > 0
    cached = {dict(lab)["source"]: v for (n, lab), v in got.items() if n == "vllm:prompt_tokens_cached_total"}
    assert sum(cached.values()) == doc["prefill"]["reused_tokens"] and cached["host"] > 0
    for row in doc["tiers"]:
        tier = (("tier", row["tier"]),)
        for what in ("offloaded_pages", "onboarded_pages", "dropped_pages", "io_errors"):
            assert got[(f"kvcm_tier_{what}_total", tier)] == row[what], (row["tier"], what)
    assert got[("kvcm_open_caches", ())] == 0  # the end of the replay: every request finished


def test_sim_serves_metrics_on_a_port(tmp_path: object) -> None:
    from kv_cache_manager_v2.sim._cli import main
    from kv_cache_manager_v2.sim._run import SimMetrics

    metrics = SimMetrics(0, None)
    try:
        a = KVCacheResourceManager(make_config(kv_layers(1, T), backend="host"))
        metrics.attach(a)
        got = scrape(metrics.server.server_port)
        assert got[("kvcm_tier_total_bytes", (("tier", "gpu"),))] == 1 << 20
        metrics.finish(a)
        assert scrape(metrics.server.server_port) == {}  # the replay is over: nothing left to report
        a.shutdown()
    finally:
        metrics.close()
    assert main([*SIM, "--metrics-port", "70000"]) == 2
    assert main([*SIM, "--metrics-file", "x", "--sweep", "gpu=1000tok,2000tok"]) == 2


def test_remote_tier_metrics(backend: str, redis_server: LocalRedisServer) -> None:
    """Replica A writes its blocks through to Redis; replica B admits the same documents and finds
    them remote: its scrape reports them under source="remote", with the remote counters."""
    adapters = []
    for _ in range(2):
        config = KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=[
                GpuCacheTierConfig(BLOCK * 20),
                HostCacheTierConfig(BLOCK * 20),
                RemoteCacheTierConfig(redis_server.url, namespace="metrics", timeout_ms=3000, write_through=True),
            ],
            layers=kv_layers(2, T),
            backend=backend,  # type: ignore[arg-type]
            max_util_for_resume=1.0,
            load_workers=0,  # (every read on the step's thread: admitted at once)
        )
        adapters.append(KVCacheResourceManager(config))
    try:
        docs = [[TokenId(1000 * (i + 1) + t) for t in range(40)] for i in range(4)]
        wa, wb = Workload(adapters[0]), Workload(adapters[1])
        for d in docs:
            wa.finish(wa.admit(d + [TokenId(3)], 2))
        assert adapters[0].manager.flush_remote_writes(10.0)
        for d in docs:
            wb.finish(wb.admit(d + [TokenId(4)], 2))
        b = adapters[1]
        server, thread, _ = serve_metrics(0, adapter=b)
        try:
            got = scrape(server.server_port)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
        want = expected_samples(b.manager, b, {})
        assert got == want
        assert got[("vllm:prompt_tokens_cached_total", (("source", "remote"),))] == 4 * 40 > 0
        assert got[("kvcm_remote_fetched_pages_total", ())] > 0 and got[("kvcm_remote_connected", ())] == 1
    finally:
        for a in adapters:
            a.shutdown()


def test_event_publisher_counters(tiered: Callable[..., tuple]) -> None:
    """Batches a publisher dropped (full hand-off queue) are reported next to the manager's dropped events."""
    from kv_cache_manager_v2.events import ZmqEventPublisher

    a, m = tiered()
    with ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1) as pub:
        registry = CollectorRegistry()
        register_metrics(m, publisher=pub, registry=registry)
        Workload(a).run()
        events = m.event_manager.snapshot()
        with pub._sender.sent:  # the publisher thread stalls after its next send
            pub.publish(events)
            while pub._sender.queue.qsize():
                pass
            pub.publish(events)
            pub.publish(events)  # dropped
        pub.flush()
        text = generate_latest(registry).decode()
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        assert got["kvcm_event_batches_dropped_total"] == pub.num_dropped_batches == 1
        assert got["kvcm_event_batches_withheld_total"] == 0
        assert got["kvcm_events_dropped_total"] == m.event_manager.num_dropped > 0
    with pytest.raises(TypeError, match="ZmqEventPublisher"):
        KVCacheMetricsCollector(m, publisher=object())  # type: ignore[arg-type]


def test_adapter_counters_roll_back_with_a_failed_batch(tiered: Callable[..., tuple]) -> None:
    a, _ = tiered()
    work = Workload(a)
    doc = [TokenId(900 + t) for t in range(40)]
    work.finish(work.admit(doc + [TokenId(3)], 2))
    before, preemptions = list(a.reused_tokens_per_level), a.num_preemptions
    r = EngineRequest(100, doc + [TokenId(5)], 2)
    with pytest.raises(ValueError, match="twice"):
        a.prepare_resources([r, r])  # admitted (reusing 40 tokens), then refused: the batch is undone
    assert a.reused_tokens_per_level == before and r.num_reused_tokens == 0 and not a.has_resources(r)
    assert adapter_step(a, work.engine, [r]) == []
    assert sum(a.reused_tokens_per_level) == sum(before) + 40
    a.free_resources(r)  # not finished: a preemption
    assert a.num_preemptions == preemptions + 1


def test_hybrid_model_reports_its_state_snapshots() -> None:
    from test_recurrent import hybrid_layers, prefill

    m = KVCacheManager(make_config(hybrid_layers(), 32, ssm_reuse_interval=64))
    engine = FakeEngine(m)
    prompt = toks(1, 150)
    for _ in range(2):
        kv = m.create_kv_cache(input_tokens=prompt)
        prefill(engine, kv, prompt, 150)
        kv.close()
    registry = CollectorRegistry()
    registry.register(KVCacheMetricsCollector(m))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    got = {s.labels["event"]: s.value for s in fams["kvcm_state_snapshots"].samples if s.name.endswith("_total")}
    r = m.reuse_statistics
    assert got == {
        "taken": 2,  # at 64 and 128 (the prompt end)
        "skipped": 0,
        "reused": 1,
        "evicted": 0,
        "evicted_unused": 0,
        "taken_interval": 1,
        "taken_branch": 0,
        "taken_last": 1,
        "taken_demand": 0,
    }
    assert got["taken"] == r.snapshots_taken and got["reused"] == r.snapshots_reused
    # state bytes by tier: the two snapshots (3 recurrent layers of 64 + 256 bytes each); no live state
    state = {s.labels["tier"]: s.value for s in fams["kvcm_tier_state_bytes"].samples}
    assert state == {"gpu": 2 * 3 * (64 + 256)} and m.get_tier_statistics(CacheLevel(0)).state_bytes == state["gpu"]
    kv = m.create_kv_cache(input_tokens=prompt)
    assert kv.resume()  # its live state
    assert m.get_tier_statistics(CacheLevel(0)).state_bytes == 3 * 3 * (64 + 256)
    kv.close()
    m.shutdown()
    plain = KVCacheManager(make_config(kv_layers(1, T), backend="host"))
    registry = CollectorRegistry()
    registry.register(KVCacheMetricsCollector(plain))
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "kvcm_state_snapshots" not in names and "kvcm_tier_state_bytes" not in names
    assert plain.get_tier_statistics(CacheLevel(0)).state_bytes == 0
    plain.shutdown()
