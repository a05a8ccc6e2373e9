"""Stateful property test: random interleavings of the request life cycle with shared
prefixes, checked by the fake engine and by slot-ownership invariants."""

from __future__ import annotations

import random

from conftest import kv_layers, make_config
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    KVCache,
    KVCacheManager,
    KVCacheStatus,
    LayerId,
    Priority,
    ReuseScope,
    SwaScratchReuseConfig,
)

T = 4
PREFIXES = [[(p * 1000 + i) for i in range(24)] for p in range(3)]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = self.make_manager()
        self.engine = FakeEngine(self.m)
        self.caches: list[tuple[KVCache, list[int]]] = []
        self.rng = random.Random(0)
        self.computed: dict[int, int] = {}  # id(kv) -> tokens computed but not yet committed

    def make_manager(self) -> KVCacheManager:
        # full attention first, then SWA with sinks: both life cycles share one pool group
        layers = kv_layers(3, T, window=9, swa_every=3, sink_tokens=2)
        layers = layers[1:] + layers[:1]
        return KVCacheManager(make_config(layers, tokens_per_block=T, quota=3 * 2 * 32 * T * 40))

    @rule(
        prefix=st.integers(0, 2),
        shared=st.integers(0, 24),
        extra=st.integers(1, 30),
        salt=st.sampled_from([None, 1]),
        priority=st.integers(0, 100),
    )
    def create(self, prefix: int, shared: int, extra: int, salt: int | None, priority: int) -> None:
        if len(self.caches) >= 6:
            return
        seq = PREFIXES[prefix][:shared] + [self.rng.randrange(1 << 30) for _ in range(extra)]
        scope = ReuseScope(salt=salt)
        probed = self.m.probe_reuse(scope, seq[:-1])
        kv = self.m.create_kv_cache(scope, seq[:-1], custom_priority_callback=lambda o, lc: Priority(priority))
        assert kv.history_length == probed == kv.num_committed_tokens
        if kv.enable_swa_scratch_reuse:
            kv.enable_swa_scratch_reuse = priority % 2 == 0  # scratch on for some requests only
        self.caches.append((kv, seq))

    def dropped(self) -> list[int]:
        return [g.num_dropped for g in self.m._storage.gpu]

    def check_eviction_was_exact(self, dropped_before: list[int]) -> None:
        """An allocation that had to evict in a pool group evicted exactly enough: nothing is left free."""
        for g, before, stats in zip(self.m._storage.gpu, dropped_before, self.m.get_storage_statistics()):
            if g.num_dropped > before:
                assert stats.free == 0, f"pool group {stats.pool_group_index} evicted more than needed"

    def with_status(self, status: KVCacheStatus) -> list[tuple[KVCache, list[int]]]:
        return [(kv, seq) for kv, seq in self.caches if kv.status is status]

    @precondition(lambda self: any(kv.status is KVCacheStatus.SUSPENDED for kv, _ in self.caches))
    @rule(i=st.integers(0, 5))
    def resume(self, i: int) -> None:
        suspended = self.with_status(KVCacheStatus.SUSPENDED)
        kv, seq = suspended[i % len(suspended)]
        dropped = self.dropped()
        if kv.resume():
            self.check_eviction_was_exact(dropped)
            self.engine.check_all(kv, seq, kv.history_length)

    @precondition(lambda self: any(kv.status is KVCacheStatus.ACTIVE for kv, _ in self.caches))
    @rule(i=st.integers(0, 5), chunk=st.integers(1, 12), lazy=st.booleans())
    def step(self, i: int, chunk: int, lazy: bool) -> None:
        """One engine step. With ``lazy``, the tokens are committed only at the next step, whose
        ``resize(capacity, history)`` raises history first (SWA blocks leave the window there)."""
        active = self.with_status(KVCacheStatus.ACTIVE)
        self.advance(*active[i % len(active)], chunk, lazy)

    @precondition(lambda self: any(kv.status is KVCacheStatus.ACTIVE for kv, _ in self.caches))
    @rule(chunk=st.integers(1, 12), lazy=st.booleans())
    def step_all(self, chunk: int, lazy: bool) -> None:
        """An engine iteration: every active request advances (its own chunk size)."""
        for n, (kv, seq) in enumerate(self.with_status(KVCacheStatus.ACTIVE)):
            self.advance(kv, seq, 1 + (chunk + 5 * n) % 12, lazy)

    def advance(self, kv: KVCache, seq: list[int], chunk: int, lazy: bool) -> None:
        h = max(kv.history_length, self.computed.get(id(kv), 0))
        end = min(len(seq), h + chunk)
        if end == h:
            return
        before = (kv.capacity, kv.history_length, list(kv.get_base_page_indices(0)))
        dropped = self.dropped()
        if not kv.resize(end, h):
            assert (kv.capacity, kv.history_length, list(kv.get_base_page_indices(0))) == before
            return
        self.check_eviction_was_exact(dropped)
        kv.commit(seq[kv.num_committed_tokens : h])  # what the previous (lazy) step computed
        self.engine.step(kv, seq, h, end)
        if lazy:
            self.computed[id(kv)] = end
        else:
            kv.commit(seq[h:end])
            self.computed.pop(id(kv), None)

    @precondition(lambda self: any(kv.status is KVCacheStatus.ACTIVE for kv, _ in self.caches))
    @rule(i=st.integers(0, 5))
    def suspend(self, i: int) -> None:
        active = self.with_status(KVCacheStatus.ACTIVE)
        kv, seq = active[i % len(active)]
        kv.commit(seq[kv.num_committed_tokens : self.computed.pop(id(kv), 0)])
        kv.suspend()

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, 5), stop=st.booleans())
    def close(self, i: int, stop: bool) -> None:
        kv, _ = self.caches.pop(i % len(self.caches))
        self.computed.pop(id(kv), None)
        if stop:
            kv.stop_committing()
        kv.close()

    @invariant()
    def invariants_hold(self) -> None:
        self.m.check_invariants()

    def teardown(self) -> None:
        for kv, _ in self.caches:
            kv.close()
        self.m.clear_reusable_blocks()
        assert all(s.free == s.total for s in self.m.get_storage_statistics())
        self.m.shutdown()


class TightMultiGroupMachine(ManagerMachine):
    """Two pool groups (different buffer sizes), no partial reuse, little memory: eviction and
    failed resizes all the time."""

    def make_manager(self) -> KVCacheManager:
        layers = [
            AttentionLayerConfig(LayerId(0), [BufferConfig("key", 32 * T), BufferConfig("value", 32 * T)]),
            AttentionLayerConfig(LayerId(1), [BufferConfig("key", 64 * T)], sliding_window_size=6),
            AttentionLayerConfig(LayerId(2), [BufferConfig("key", 32 * T), BufferConfig("value", 32 * T)]),
        ]
        return KVCacheManager(
            make_config(
                layers,
                tokens_per_block=T,
                quota=(128 + 64) * T * 14,
                enable_partial_reuse=False,
                initial_pool_ratio=[0.7, 0.3],
            )
        )


class ScratchMachine(ManagerMachine):
    """SWA scratch reuse on for half the requests (rewind 1): three SWA layers with sinks share
    scratch slots next to full-attention layers, in little memory."""

    def make_manager(self) -> KVCacheManager:
        layers = kv_layers(5, T, window=5, swa_every=2, sink_tokens=2)  # layers 0, 2, 4: SWA
        return KVCacheManager(
            make_config(
                layers,
                tokens_per_block=T,
                quota=5 * 2 * 32 * T * 20,
                swa_scratch_reuse=SwaScratchReuseConfig(1),
                initial_pool_ratio=[0.5, 0.5],
            )
        )


for machine in (ManagerMachine, TightMultiGroupMachine, ScratchMachine):
    machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
    )
TestManagerMachine = ManagerMachine.TestCase
TestTightMultiGroupMachine = TightMultiGroupMachine.TestCase
TestScratchMachine = ScratchMachine.TestCase
