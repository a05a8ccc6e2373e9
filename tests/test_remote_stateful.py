"""Stateful property test of the remote tier: the request layer group of one manager (GPU + host +
Redis, little memory) interleaved with a peer manager publishing into the same Redis, and with the
server dying, coming back empty, being flushed and having values corrupted or cut short. The fake
engine checks every record a resumed request reads (fetched ones included) and the invariant
checker runs after every rule."""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import NO_REDIS_REASON, REDIS_SERVER, kv_layers
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_stateful import PREFIXES, SESSIONS, ManagerMachine, T, hybrid_layers
from tier_helpers import land_some, loader

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    Prefetch,
    Priority,
    RemoteCacheTierConfig,
    ReuseScope,
)
from kv_cache_manager_v2._storage._remote._value import HEADER_BYTES
from kv_cache_manager_v2.redis_server import LocalRedisServer

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)

#: three layers (two full attention, one window-9 with sinks): slots of 512 and 256 bytes
LAYERS = kv_layers(3, T, window=9, swa_every=3, sink_tokens=2)
LAYERS = LAYERS[1:] + LAYERS[:1]
GROUP = 768  # bytes of one block over both pool groups


class RemoteMachine(ManagerMachine):
    """The base machine's rules on a manager with a remote tier, plus a peer and server trouble."""

    def make_manager(self) -> KVCacheManager:
        self.server = LocalRedisServer(REDIS_SERVER)
        self.server.start()
        self.alive = True
        self.tampered = False
        self.peer = KVCacheManager(self.config(write_through=True, gpu=24, host=None))
        self.peer_engine = FakeEngine(self.peer)
        return KVCacheManager(self.config(write_through=False, gpu=6, host=4))

    def __init__(self) -> None:
        super().__init__()
        # background lookups and fetches run when ``land`` says, in the order it picks
        loader(self.m).manual = True
        self.prefetches: list[tuple[Prefetch, list[int], ReuseScope]] = []
        self.loads_rng = random.Random(1)  # (its own: the base rules' token stream stays the same)

    @rule(prefix=st.integers(0, 2), shared=st.integers(1, 24), salt=st.sampled_from([None, 1]), cancel=st.booleans())
    def prefetch_tokens(self, prefix: int, shared: int, salt: int | None, cancel: bool) -> None:
        """A queued request's prefix is looked up and fetched in the background (or an earlier
        prefetch is cancelled: its round trips' results are discarded)."""
        if cancel and self.prefetches:
            self.prefetches.pop(0)[0].cancel()
            return
        tokens = PREFIXES[prefix][:shared] + [self.loads_rng.randrange(1 << 30)]
        scope = ReuseScope(salt=salt)
        self.prefetches.append((self.m.prefetch(tokens, reuse_scope=scope), tokens, scope))
        if len(self.prefetches) > 4:
            self.prefetches.pop(0)[0].cancel()

    @rule(k=st.integers(0, 99), count=st.integers(1, 3))
    def land(self, k: int, count: int) -> None:
        """``count`` background round trips finish (the ``k``-th queued first) and are installed."""
        land_some(self.m, k, count)

    @rule(k=st.integers(0, 3), priority=st.integers(0, 100))
    def create_prefetched(self, k: int, priority: int) -> None:
        """The request a finished prefetch was for is admitted: it reuses what the prefetch placed
        (or less, when pages went meanwhile; never wrong data: the engine checks every record)."""
        done = [entry for entry in self.prefetches if entry[0].done and not entry[0].cancelled]
        if not done or len(self.caches) >= 6:
            return
        handle, tokens, scope = done[k % len(done)]
        self.prefetches.remove((handle, tokens, scope))
        kv = self.m.create_kv_cache(scope, tokens, custom_priority_callback=lambda o, lc: Priority(priority))
        assert kv.history_length == kv.num_committed_tokens
        self.caches.append((kv, [*tokens, self.loads_rng.randrange(1 << 30)]))

    def config(self, write_through: bool, gpu: int, host: int | None) -> KVCacheManagerConfig:
        tiers: list[object] = [GpuCacheTierConfig(gpu * GROUP)]
        if host is not None:
            tiers.append(HostCacheTierConfig(host * GROUP))
        tiers.append(
            RemoteCacheTierConfig(
                self.server.url,
                "stateful",
                timeout_ms=3000,
                retry_interval_ms=0,
                write_through=write_through,
                max_pending_bytes=1 << 20,
            )
        )
        return KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=tiers,  # type: ignore[arg-type]
            layers=LAYERS,
            backend="host",
            max_util_for_resume=1.0,
            initial_pool_ratio=[0.6, 0.4],
        )

    @rule(
        prefix=st.integers(0, 2),
        shared=st.integers(0, 24),
        extra=st.integers(1, 30),
        salt=st.sampled_from([None, 1]),
        priority=st.integers(0, 100),
        session=st.sampled_from(SESSIONS),
    )
    def create(
        self, prefix: int, shared: int, extra: int, salt: int | None, priority: int, session: str | None = None
    ) -> None:
        """As the base rule, but create may reuse less than the probe said (a value that fails its
        checks, or no room to place what the remote tier has), never more."""
        if len(self.caches) >= 6:
            return
        seq = PREFIXES[prefix][:shared] + [self.rng.randrange(1 << 30) for _ in range(extra)]
        scope = ReuseScope(salt=salt)
        probed = self.m.probe_reuse(scope, seq[:-1])
        kv = self.m.create_kv_cache(
            scope, seq[:-1], custom_priority_callback=lambda o, lc: Priority(priority), session_id=session
        )
        assert kv.history_length <= probed or not self.alive
        assert kv.history_length == kv.num_committed_tokens
        self.caches.append((kv, seq))

    @rule(prefix=st.integers(0, 2), shared=st.integers(1, 24), salt=st.sampled_from([None, 1]))
    def peer_publishes(self, prefix: int, shared: int, salt: int | None) -> None:
        """The other replica computes a prefix (reusing what it can, from Redis too) and writes it through."""
        seq = PREFIXES[prefix][:shared]
        kv = self.peer.create_kv_cache(ReuseScope(salt=salt), seq[:-1])
        assert kv.resume()
        h = kv.history_length
        self.peer_engine.check_all(kv, seq, h)
        while h < len(seq):  # chunks cut at snapshot positions (hybrid models; else one chunk)
            end = min(len(seq), kv.next_snapshot_position(h) or len(seq))
            assert kv.resize(end)
            self.peer_engine.step(kv, seq, h, end)
            kv.commit(seq[h:end])
            h = end
        kv.close()
        assert self.peer.flush_remote_writes()
        self.peer.check_invariants()

    @precondition(lambda self: self.alive)
    @rule(restart=st.booleans())
    def server_dies(self, restart: bool) -> None:
        self.server.kill()
        self.alive = False
        if restart:
            self.server_returns()

    @precondition(lambda self: not self.alive)
    @rule()
    def server_returns(self) -> None:
        self.server.start()  # empty
        self.alive = True

    @precondition(lambda self: self.alive)
    @rule(index=st.integers(0, 1000), how=st.sampled_from(["flip", "truncate", "swap", "flush"]))
    def tamper(self, index: int, how: str) -> None:
        import redis

        client = redis.Redis.from_url(self.server.url)
        try:
            keys = sorted(client.keys("kvcm:*"))
            if how == "flush" or not keys:
                client.flushall()
                return
            key = keys[index % len(keys)]
            value = client.get(key) or b""
            if how == "flip" and len(value) > HEADER_BYTES:
                v = bytearray(value)
                v[HEADER_BYTES + index % (len(v) - HEADER_BYTES)] ^= 0x10
                client.set(key, bytes(v))
            elif how == "truncate" and value:
                client.set(key, value[: index % len(value)])
            else:
                client.set(key, client.get(keys[(index + 1) % len(keys)]) or b"")
            self.tampered = True
        finally:
            client.close()

    def teardown(self) -> None:
        try:
            super().teardown()
            self.peer.shutdown()
        finally:
            self.server.close()


class HybridRemoteMachine(RemoteMachine):
    """The same with recurrent layers (snapshots every 2 blocks and at prompt ends): snapshots go to
    Redis with the blocks, an extension from it ends at a block whose snapshot is local or remote,
    and the fake engine checks every state a resumed request starts from (fetched ones included)."""

    def config(self, write_through: bool, gpu: int, host: int | None) -> KVCacheManagerConfig:
        base = super().config(write_through, gpu, host)
        tiers = [
            dataclasses.replace(t, quota=t.quota * 5 // 4) if not isinstance(t, RemoteCacheTierConfig) else t
            for t in base.cache_tiers
        ]
        return dataclasses.replace(
            base,
            cache_tiers=tiers,
            layers=hybrid_layers(LAYERS),
            initial_pool_ratio=[0.2, 0.48, 0.32],
            ssm_reuse_interval=2 * T,
        )


for machine in (RemoteMachine, HybridRemoteMachine):
    machine.TestCase.settings = settings(
        max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
    )
TestRemoteMachine = RemoteMachine.TestCase
TestHybridRemoteMachine = HybridRemoteMachine.TestCase


def loads_step(m: RemoteMachine, rng: random.Random) -> None:
    """Now and then a prefetch (or a cancel), round trips landing, a prefetched request admitted."""
    if rng.random() < 0.15:
        m.prefetch_tokens(rng.randrange(3), rng.randrange(1, 25), rng.choice([None, 1]), rng.random() < 0.2)
    if rng.random() < 0.4:
        m.land(rng.randrange(100), rng.randrange(1, 4))
    if rng.random() < 0.15:
        m.create_prefetched(rng.randrange(4), rng.randrange(101))


@pytest.mark.parametrize("machine", [RemoteMachine, HybridRemoteMachine])
@pytest.mark.parametrize("seed", range(3))
def test_remote_long_random_walk(seed: int, machine: type[RemoteMachine]) -> None:
    """The same rules 300 steps deep (seeded): pages go to Redis and come back, across managers,
    through outages and tampering; the fake engine and the invariant checker after every step."""
    rng = random.Random(seed)
    loads_rng = random.Random(seed + 1000)
    m = machine()
    try:
        for step in range(300):
            r = rng.randrange(12)
            if r == 0 or not m.caches:
                m.create(
                    rng.randrange(3),
                    rng.randrange(8, 25),
                    rng.randrange(1, 31),
                    rng.choice([None, 1]),
                    rng.randrange(101),
                )
            elif r <= 3:
                m.step(rng.randrange(6), rng.randrange(1, 13), rng.random() < 0.5)
            elif r == 4:
                m.suspend(rng.randrange(6))
            elif r == 5:
                m.close(rng.randrange(6), rng.random() < 0.5)
            elif r == 6:
                m.resume(rng.randrange(6))
            elif r <= 8:
                m.peer_publishes(rng.randrange(3), rng.randrange(1, 25), rng.choice([None, 1]))
            elif r == 9:
                if not m.alive:
                    m.server_returns()
                elif rng.random() < 0.1:
                    m.server_dies(rng.random() < 0.5)
            elif r == 10 and m.alive and rng.random() < 0.1:
                m.tamper(rng.randrange(1000), rng.choice(["flip", "truncate", "swap", "flush"]))
            if step >= 150:  # (the first half as without loads; then prefetches too, in their own stream)
                loads_step(m, loads_rng)
            m.invariants_hold()
        m.m.flush_remote_writes()
        st_ = m.m.remote_statistics
        # pages came back from Redis; pages were sent (written, or dropped when the server was down
        # at that moment: the writer's timing decides which, on a loaded machine)
        assert st_ is not None and st_.fetched_pages > 0 and st_.written_pages + st_.dropped_writes > 0
    finally:
        m.teardown()
