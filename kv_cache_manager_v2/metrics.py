"""Prometheus metrics of KV-cache managers (issue #29): a collector read at scrape time.

Needs the ``metrics`` extra (``pip install 'kv_cache_manager_v2[metrics]'``: prometheus-client).
Nothing runs on the scheduler's path: :class:`KVCacheMetricsCollector` reads the statistics the
manager already keeps (``get_tier_statistics``, ``reuse_statistics``, ``remote_statistics``,
``gpu_utilization``, the event queue's and the engine adapter's counters) each time the registry
is scraped. Register it in the engine's own registry, or serve one on a port::

    collector = register_metrics(manager, adapter=adapter, labels={"model_name": "m"})  # default REGISTRY
    server, thread, collector = serve_metrics(9400, manager)                                # own registry

Names: vLLM's where vLLM has the metric (``vllm:`` prefix, same meaning, so its dashboards work),
``kvcm_`` for the rest. See README "Metrics" for the list. Not compiled by mypyc (plain Python,
off the hot path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

try:
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kv_cache_manager_v2.metrics needs prometheus-client: pip install 'kv_cache_manager_v2[metrics]'"
    ) from e

from ._common import CacheLevel, CacheTier
from ._core._kv_cache_manager import KVCacheManager
from ._exceptions import LogicError
from ._routing import ReplicaLoad
from .engine._resource_manager import KVCacheResourceManager

#: the ``tier`` / ``source`` label value of each kind of cache level
TIER_LABELS = {CacheTier.GPU_MEM: "gpu", CacheTier.HOST_MEM: "host", CacheTier.DISK: "disk", CacheTier.REMOTE: "remote"}

#: the load gauges (name after the prefix, help, ``ReplicaLoad`` attribute)
LOAD_GAUGES = (
    (
        "load_queued_prefill_tokens",
        "Prompt tokens queued for prefill (waiting or not computed yet)",
        "queued_prefill_tokens",
    ),
    ("load_running_requests", "Requests running", "running_requests"),
    ("load_kv_utilization", "KV utilisation (0..1) as the engine reports it for routing", "kv_utilization"),
)


def load_from_metrics(text: str, labels: Mapping[str, str] | None = None, prefix: str = "kvcm_") -> ReplicaLoad | None:
    """A replica's load read from a scrape's text (the ``load_*`` gauges of the source whose
    labels include ``labels``); None when the scrape has none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    want = dict(labels or {})
    found: dict[str, float] = {}
    names = {prefix + name: attr for name, _, attr in LOAD_GAUGES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = names.get(sample.name)
            if attr is not None and all(sample.labels.get(k) == v for k, v in want.items()):
                found[attr] = sample.value
    if len(found) != len(LOAD_GAUGES):
        return None
    return ReplicaLoad(
        int(found["queued_prefill_tokens"]), int(found["running_requests"]), min(1.0, max(0.0, found["kv_utilization"]))
    )


class EventPublisherCounters(Protocol):
    """What the collector reads of an event publisher (``kv_cache_manager_v2.events.ZmqEventPublisher``)."""

    @property
    def num_dropped_batches(self) -> int: ...

    @property
    def num_withheld_batches(self) -> int: ...


@dataclass(frozen=True)
class MetricsSource:
    """One manager to report (with its engine adapter and event publisher, if any) and its labels."""

    manager: KVCacheManager
    adapter: KVCacheResourceManager | None = None
    publisher: EventPublisherCounters | None = None
    labels: tuple[tuple[str, str], ...] = ()
    #: the replica's load now (given by the engine), reported as the ``load_*`` gauges
    load: Callable[[], ReplicaLoad] | None = None


def _check_labels(labels: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise TypeError(f"labels must be a mapping of label name to value, got {type(labels).__name__}")
    for k, v in labels.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"labels must map str to str, got {k!r}: {v!r}")
        if k in ("tier", "source", "result") or not k.isidentifier() or k.startswith("__"):
            raise ValueError(f"label name {k!r} is reserved or not a valid Prometheus label name")
    return tuple(sorted(labels.items()))


class _Families:
    """The metric families of one scrape, created on first use (in a fixed order)."""

    def __init__(self, label_names: Sequence[str]) -> None:
        self.label_names = list(label_names)
        self.families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(
        self,
        kind: str,
        name: str,
        doc: str,
        labels: Sequence[str],
        extra: Sequence[str],
        value: float,
        extra_names: Sequence[str] = (),
    ) -> None:
        fam = self.families.get(name)
        if fam is None:
            fam_new: CounterMetricFamily | GaugeMetricFamily
            names = [*self.label_names, *extra_names]
            if kind == "counter":
                fam_new = CounterMetricFamily(name, doc, labels=names)
            else:
                fam_new = GaugeMetricFamily(name, doc, labels=names)
            fam = self.families[name] = fam_new
        fam.add_metric([*labels, *extra], value)


class KVCacheMetricsCollector:
    """A Prometheus collector over one or more managers (e.g. data-parallel ranks told apart by labels).

    ``labels`` are constant labels of every sample of this source (e.g. ``{"model_name": ...,
    "engine": "0"}``); every source of one collector must use the same label names. Reading happens
    only in :meth:`collect`, on the scraping thread; the statistics read are plain counters, so a
    scrape never blocks the scheduler or changes any state.
    """

    def __init__(
        self,
        manager: KVCacheManager | None = None,
        *,
        adapter: KVCacheResourceManager | None = None,
        publisher: EventPublisherCounters | None = None,
        labels: Mapping[str, str] | None = None,
        load: Callable[[], ReplicaLoad] | None = None,
        vllm_prefix: str = "vllm:",
        prefix: str = "kvcm_",
    ) -> None:
        for name, value in (("vllm_prefix", vllm_prefix), ("prefix", prefix)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        self.vllm_prefix = vllm_prefix
        self.prefix = prefix
        self._sources: list[MetricsSource] = []
        self._lock = threading.Lock()
        if manager is not None or adapter is not None:
            self.add(manager, adapter=adapter, publisher=publisher, labels=labels, load=load)

    def add(
        self,
        manager: KVCacheManager | None = None,
        *,
        adapter: KVCacheResourceManager | None = None,
        publisher: EventPublisherCounters | None = None,
        labels: Mapping[str, str] | None = None,
        load: Callable[[], ReplicaLoad] | None = None,
    ) -> MetricsSource:
        """Report one more manager (``adapter.manager`` when only the adapter is given); ``load``:
        called at each scrape for the replica's load (the ``load_*`` gauges routers read)."""
        if load is not None and not callable(load):
            raise TypeError(f"load must be a callable returning a ReplicaLoad, got {type(load).__name__}")
        if adapter is not None:
            if not isinstance(adapter, KVCacheResourceManager):
                raise TypeError(f"adapter must be a KVCacheResourceManager, got {type(adapter).__name__}")
            if manager is None:
                manager = adapter.manager
            elif adapter.manager is not manager:
                raise ValueError("adapter wraps another manager than the one given")
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        if publisher is not None and not (
            hasattr(publisher, "num_dropped_batches") and hasattr(publisher, "num_withheld_batches")
        ):
            raise TypeError(f"publisher must be a ZmqEventPublisher, got {type(publisher).__name__}")
        source = MetricsSource(manager, adapter, publisher, _check_labels(labels), load)
        with self._lock:
            if self._sources and [k for k, _ in self._sources[0].labels] != [k for k, _ in source.labels]:
                raise ValueError(
                    f"every source must use the same label names: {[k for k, _ in self._sources[0].labels]}, "
                    f"got {[k for k, _ in source.labels]}"
                )
            if any(s.labels == source.labels for s in self._sources):
                raise ValueError(f"a source with labels {dict(source.labels)} is already reported: label each one")
            self._sources.append(source)
        return source

    def remove(self, source: MetricsSource) -> None:
        """Stop reporting ``source`` (e.g. before shutting its manager down for good)."""
        with self._lock:
            self._sources.remove(source)

    def describe(self) -> Iterable[Metric]:
        """No samples: lets a registry check names without reading any manager."""
        return []

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sources = list(self._sources)
        families = _Families([k for k, _ in sources[0].labels] if sources else [])
        for source in sources:
            self._collect_one(families, source)
        return list(families.families.values())

    def _collect_one(self, f: _Families, source: MetricsSource) -> None:
        m = source.manager
        lv = [v for _, v in source.labels]
        try:
            usage = m.gpu_utilization
        except LogicError:  # shut down: nothing left to report
            return
        self._collect_reuse(f, source, lv, usage)
        self._collect_tiers(f, m, lv)
        self._collect_remote(f, m, lv)
        self._collect_events(f, source, lv)
        if source.load is not None:
            ld = source.load()
            for name, doc, value in LOAD_GAUGES:
                f.add("gauge", self.prefix + name, doc, lv, [], float(getattr(ld, value)))

    def _collect_reuse(self, f: _Families, source: MetricsSource, lv: list[str], usage: float) -> None:
        """GPU usage, prefix-cache hits, the adapter's counters, pages, snapshots, open caches."""
        m = source.manager
        v = self.vllm_prefix
        p = self.prefix
        f.add(
            "gauge",
            v + "kv_cache_usage_perc",
            "KV-cache usage: fraction of GPU blocks in use (1 = 100%)",
            lv,
            [],
            usage,
        )
        r = m.reuse_statistics
        f.add(
            "counter", v + "prefix_cache_queries", "Prefix cache queries, in queried tokens", lv, [], r.queried_tokens
        )
        f.add("counter", v + "prefix_cache_hits", "Prefix cache hits, in cached tokens", lv, [], r.reused_tokens)
        self._collect_adapter(f, source, lv)
        for result, n in (("hit", r.reused_blocks), ("miss", r.missed_blocks)):
            f.add(
                "counter",
                p + "prefix_cache_blocks",
                "Input blocks of create_kv_cache found in the reuse cache (hit) or not (miss)",
                lv,
                [result],
                n,
                ("result",),
            )
        f.add("counter", p + "reused_pages", "Pages matches took from the reuse cache", lv, [], r.reused_pages)
        f.add("counter", p + "allocated_pages", "New pages allocated", lv, [], r.allocated_pages)
        if m.config.has_recurrent_layers:
            for what, n in (
                ("taken", r.snapshots_taken),
                ("skipped", r.snapshots_skipped),
                ("reused", r.snapshots_reused),
                ("evicted", r.snapshots_evicted),
                ("evicted_unused", r.snapshots_evicted_unused),
                ("taken_interval", r.snapshots_interval),
                ("taken_branch", r.snapshots_branch),
                ("taken_last", r.snapshots_last),
                ("taken_demand", r.snapshots_demand),
            ):
                f.add(
                    "counter",
                    p + "state_snapshots",
                    "Recurrent-state snapshots taken (in all, by kind), skipped for want of room, reused by a "
                    "match, evicted (of which never reused)",
                    lv,
                    [what],
                    n,
                    ("event",),
                )
            f.add(
                "counter",
                p + "attention_matched_tokens",
                "Input tokens of create_kv_cache the attention layers alone matched (bound of the hybrid match)",
                lv,
                [],
                r.attention_matched_tokens,
            )
        f.add(
            "gauge", p + "open_caches", "KVCache objects open (active or suspended requests)", lv, [], m.num_open_caches
        )
        self._collect_load_plan(f, m, lv)

    def _collect_load_plan(self, f: _Families, m: KVCacheManager, lv: list[str]) -> None:
        """load_policy: matched tokens taken and recomputed per tier, the estimated time saved."""
        p = self.prefix
        s = m.load_plan_statistics
        tiers = m.cache_tier_list
        for what, counts in (("taken", s.loaded_tokens), ("recomputed", s.recomputed_tokens)):
            for level, n in enumerate(counts):
                f.add(
                    "counter",
                    p + "load_plan_tokens",
                    "Matched tokens of create_kv_cache taken (loaded from that tier; gpu: already there) or "
                    "left to recompute by load_policy, by the tier their block was on",
                    lv,
                    [what, TIER_LABELS[tiers[level]]],
                    n,
                    ("plan", "source"),
                )
        for what, x in (("loads", s.saved_s), ("cuts", s.cut_saved_s)):
            f.add(
                "counter",
                p + "load_plan_saved_seconds",
                "Estimated seconds saved: by the loads taken (against recomputing them) and by load_policy's "
                "cuts (against loading every matched block)",
                lv,
                [what],
                x,
                ("by",),
            )

    def _collect_adapter(self, f: _Families, source: MetricsSource, lv: list[str]) -> None:
        """The engine adapter's counters: prompt tokens found cached per tier, preemptions."""
        v = self.vllm_prefix
        adapter = source.adapter
        tiers = source.manager.cache_tier_list
        if adapter is not None:
            for level, n in enumerate(adapter.reused_tokens_per_level):
                f.add(
                    "counter",
                    v + "prompt_tokens_cached",
                    "Prompt tokens of admitted requests found cached, by the tier they came from",
                    lv,
                    [TIER_LABELS[tiers[level]]],
                    n,
                    ("source",),
                )
            f.add("counter", v + "num_preemptions", "Cumulative number of preemptions", lv, [], adapter.num_preemptions)

    def _collect_tiers(self, f: _Families, m: KVCacheManager, lv: list[str]) -> None:
        """Per tier: bytes in use, quota, peak, traffic, I/O errors."""
        p = self.prefix
        for level, tier in enumerate(m.cache_tier_list):
            t = m.get_tier_statistics(CacheLevel(level))
            tl = [TIER_LABELS[tier]]
            tier_name = ("tier",)
            f.add(
                "gauge",
                p + "tier_used_bytes",
                "Bytes of the tier in use (pages held or cached)",
                lv,
                tl,
                t.used_bytes,
                tier_name,
            )
            f.add("gauge", p + "tier_total_bytes", "Bytes of the tier (its quota)", lv, tl, t.total_bytes, tier_name)
            f.add(
                "gauge", p + "tier_peak_used_bytes", "Highest bytes in use so far", lv, tl, t.peak_used_bytes, tier_name
            )
            if m.config.has_recurrent_layers:
                doc = "Bytes of the tier in use by recurrent states (live states and snapshots; hybrid models)"
                f.add("gauge", p + "tier_state_bytes", doc, lv, tl, t.state_bytes, tier_name)
            groups = m.get_storage_statistics(CacheLevel(level)) if tier is not CacheTier.REMOTE else []
            for what, held in (
                ("pinned", [g.pinned_bytes for g in groups]),
                ("retained", [g.retained_bytes for g in groups]),
            ):
                doc = f"Bytes of {what} pages in the tier (KVCacheManager.pin; retention with a duration or a hint)"
                f.add("gauge", f"{p}tier_{what}_bytes", doc, lv, tl, sum(held), tier_name)
            for what, pages, nbytes, doc in (
                ("offloaded", t.offloaded_pages, t.offloaded_bytes, "evicted into the tier from the one above"),
                ("onboarded", t.onboarded_pages, t.onboarded_bytes, "copied from the tier to a higher one"),
                ("dropped", t.dropped_pages, t.dropped_bytes, "dropped for good at the tier"),
                (
                    "declined",
                    t.declined_pages,
                    t.declined_bytes,
                    "dropped instead of written to the tier (its link's write backlog full)",
                ),
            ):
                f.add("counter", f"{p}tier_{what}_pages", f"Pages {doc}", lv, tl, pages, tier_name)
                f.add("counter", f"{p}tier_{what}_bytes", f"Bytes of pages {doc}", lv, tl, nbytes, tier_name)
            f.add(
                "counter",
                p + "tier_io_errors",
                "Pages a disk read or write failed for; remote: failed round trips and refused values",
                lv,
                tl,
                t.io_errors,
                tier_name,
            )

    def _collect_remote(self, f: _Families, m: KVCacheManager, lv: list[str]) -> None:
        """The remote tier's round trips, pages and queue (when there is one)."""
        p = self.prefix
        rs = m.remote_statistics
        if rs is not None:
            for name, value, doc in (
                ("lookups", rs.lookups, "Remote lookup round trips"),
                ("found_pages", rs.found_pages, "Pages looked up and found on the remote tier"),
                ("fetched_pages", rs.fetched_pages, "Pages fetched from the remote tier"),
                ("written_pages", rs.written_pages, "Pages written to the remote tier"),
                ("writes_dropped", rs.dropped_writes, "Remote writes given up (queue full, server down or refusing)"),
                ("errors", rs.errors, "Failed remote round trips"),
                ("corrupt_pages", rs.corrupt_pages, "Fetched remote values refused (truncated, foreign, bad checksum)"),
                ("skipped_lookups", rs.skipped_lookups, "Lookups skipped while the server counted as down"),
            ):
                f.add("counter", f"{p}remote_{name}", doc, lv, [], value)
            f.add(
                "gauge", p + "remote_pending_bytes", "Bytes waiting in the remote write queue", lv, [], rs.pending_bytes
            )
            f.add(
                "gauge",
                p + "remote_connected",
                "1 if the last remote round trip succeeded",
                lv,
                [],
                float(rs.connected),
            )

    def _collect_events(self, f: _Families, source: MetricsSource, lv: list[str]) -> None:
        """The event queue's and the event publisher's counters (when attached)."""
        p = self.prefix
        em = source.manager.event_manager
        if em is not None:
            f.add(
                "counter", p + "events_dropped", "KV-cache events dropped by a full event queue", lv, [], em.num_dropped
            )
            f.add("gauge", p + "events_pending", "KV-cache events waiting to be drained", lv, [], em.num_pending)
        pub = source.publisher
        if pub is not None:
            f.add(
                "counter",
                p + "event_batches_dropped",
                "Event batches the publisher dropped (hand-off queue full)",
                lv,
                [],
                pub.num_dropped_batches,
            )
            f.add(
                "counter",
                p + "event_batches_withheld",
                "Event batches sent only to the replay buffer (ZMQ held its byte bound)",
                lv,
                [],
                pub.num_withheld_batches,
            )


def register_metrics(
    manager: KVCacheManager | None = None,
    *,
    adapter: KVCacheResourceManager | None = None,
    publisher: EventPublisherCounters | None = None,
    labels: Mapping[str, str] | None = None,
    registry: CollectorRegistry = REGISTRY,
) -> KVCacheMetricsCollector:
    """A collector for ``manager`` (or ``adapter.manager``), registered in ``registry`` (unregister it
    with ``registry.unregister(collector)``; it keeps the manager referenced until then)."""
    collector = KVCacheMetricsCollector(manager, adapter=adapter, publisher=publisher, labels=labels)
    registry.register(collector)
    return collector


def serve_metrics(
    port: int,
    manager: KVCacheManager | None = None,
    *,
    addr: str = "127.0.0.1",
    adapter: KVCacheResourceManager | None = None,
    publisher: EventPublisherCounters | None = None,
    labels: Mapping[str, str] | None = None,
) -> tuple[WSGIServer, threading.Thread, KVCacheMetricsCollector]:
    """Serve ``/metrics`` for ``manager`` on ``addr:port`` (0: a free port, see ``server.server_port``)
    from a registry of its own, in a daemon thread. Stop it with ``server.shutdown(); server.server_close()``."""
    if type(port) is not int or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
    registry = CollectorRegistry()
    collector = register_metrics(manager, adapter=adapter, publisher=publisher, labels=labels, registry=registry)
    server, thread = start_http_server(port, addr, registry)
    return server, thread, collector
