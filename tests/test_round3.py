"""Correctness round 3 (issue #24): the cascade through a tier smaller than one request, the
resume gate on every path, tier resize with beams, refused calls from a second thread, bools as
sizes, SWA scratch planning, engine adapter fields, window releases last block first."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
from conftest import REC, kv_layers
from fake_engine import FakeEngine
from test_beams import B, beam_step, start_beams
from tier_helpers import compute, seq

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BeamIndex,
    BufferConfig,
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LayerId,
    LogicError,
    PageStatus,
    Priority,
    ReuseScope,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

T = 16
SLOT = 2 * 2 * REC * T  # two layers, key + value: one slot holds one block
MakeManager = Callable[..., KVCacheManager]
GPU, HOST, DISK = CacheLevel(0), CacheLevel(1), CacheLevel(2)


def levels_of(kv: KVCache) -> list[int]:
    return [p.level for p in kv.block_table.pages[0] if p is not None]


def small_host(make_manager: MakeManager, tmp_path: object, host: int, **kw: object) -> KVCacheManager:
    """GPU 16 slots, a host tier of ``host`` slots, a disk tier of 64."""
    kw.setdefault("max_util_for_resume", 1.0)
    return make_manager(
        kv_layers(2, T), T, 16 * SLOT, host_quota=host * SLOT, disk_quota=64 * SLOT, disk_path=str(tmp_path), **kw
    )


# ---------------------------------------------------------------- 1. the cascade through a small host
def test_gpu_victims_push_the_small_host_tier_down_to_disk(make_manager: MakeManager, tmp_path: object) -> None:
    for host in (2, 4, 8):
        m = small_host(make_manager, tmp_path, host)
        engine = FakeEngine(m)
        toks = seq(1, 8 * T)
        a = m.create_kv_cache(input_tokens=toks)
        assert a.resume()
        compute(engine, a, toks, 8 * T)
        a.close()
        hog = m.create_kv_cache()
        assert hog.resume()
        compute(engine, hog, seq(2, 16 * T), 16 * T)  # the whole GPU
        assert m.probe_reuse(None, toks + [7]) == 8 * T  # nothing was dropped: the disk had room
        stats = [m.get_tier_statistics(level) for level in (GPU, HOST, DISK)]
        assert sum(s.dropped_pages for s in stats) == 0
        # the newest victims go to the host, the older rest straight on to disk
        assert stats[HOST].offloaded_pages == min(host, 8)
        assert stats[DISK].offloaded_pages == 8 - min(host, 8)
        assert stats[HOST].used_bytes == min(host, 8) * SLOT
        assert stats[DISK].used_bytes == (8 - min(host, 8)) * SLOT
        hog.close()
        b = m.create_kv_cache(input_tokens=toks + [7])
        assert b.history_length == 8 * T and b.resume()
        engine.check_all(b, toks, 8 * T)  # every record back intact, from host and disk
        b.close()
        m.shutdown()


def test_the_newest_victims_stay_in_the_small_host_tier(make_manager: MakeManager, tmp_path: object) -> None:
    m = small_host(make_manager, tmp_path, 2)
    engine = FakeEngine(m)
    toks = seq(1, 8 * T)
    a = m.create_kv_cache(input_tokens=toks)
    assert a.resume()
    compute(engine, a, toks, 8 * T)
    a.close()  # released last block first: block 7 is the oldest, block 0 the newest
    hog = m.create_kv_cache()
    assert hog.resume()
    compute(engine, hog, seq(2, 16 * T), 16 * T)
    b = m.create_kv_cache(input_tokens=toks + [7])
    assert levels_of(b) == [HOST, HOST] + [DISK] * 6
    b.close()
    hog.close()


def test_suspended_pages_spill_through_a_small_host_to_disk(make_manager: MakeManager, tmp_path: object) -> None:
    m = small_host(make_manager, tmp_path, 2)
    engine = FakeEngine(m)
    a_toks = seq(1, 8 * T)
    a = m.create_kv_cache()
    assert a.resume()
    compute(engine, a, a_toks, 8 * T - 3)
    a.suspend()
    hog = m.create_kv_cache()
    assert hog.resume()
    assert hog.resize(16 * T, 0)  # needs the whole GPU: a's 8 pages go down through the host
    assert sorted(levels_of(a)) == [HOST] * 2 + [DISK] * 6
    assert all(p.status is PageStatus.HELD for p in a.block_table.all_pages())
    engine.step(hog, seq(2, 16 * T), 0, 16 * T)
    hog.commit(seq(2, 16 * T))
    assert not a.resume()  # the GPU is locked by hog: nothing changes
    assert a.status is KVCacheStatus.SUSPENDED
    hog.close()
    assert a.resume()
    assert levels_of(a) == [GPU] * 8 and a.history_length == 8 * T - 3
    engine.check_all(a, a_toks, 8 * T - 3)
    assert sum(m.get_tier_statistics(level).dropped_pages for level in (GPU, HOST, DISK)) == 0
    a.close()


# ---------------------------------------------------------------- 2. the resume gate on every path
def test_resume_of_an_empty_cache_respects_max_util(make_manager: MakeManager, tmp_path: object) -> None:
    for tiers in (False, True):
        kw: dict[str, object] = {"max_util_for_resume": 0.5}
        if tiers:
            kw.update(host_quota=4 * SLOT, disk_quota=4 * SLOT, disk_path=str(tmp_path))
        m = make_manager(kv_layers(2, T), T, 10 * SLOT, **kw)
        a = m.create_kv_cache()
        assert a.resume() and a.resize(8 * T)  # 80 % of the slots locked
        b = m.create_kv_cache()
        assert not b.resume()  # nothing to place, but the GPU is above the limit
        assert b.status is KVCacheStatus.SUSPENDED
        assert a.resize(5 * T)  # 50 %: at the limit, not above it
        assert b.resume()
        assert m.gpu_utilization <= 0.5
        b.close()
        a.close()
        m.shutdown()


# ---------------------------------------------------------------- 3. tier resize with a suspended beam request
def _beam_pages(kv: KVCache) -> int:
    return len({id(p) for b in range(kv.beam_width) for p in kv._tables[b].all_pages()})


def _check_beams(engine: FakeEngine, kv: KVCache, seqs: list[list[int]]) -> None:
    assert kv.resume()
    for b in range(B):
        engine.check_all(kv, seqs[b], kv.history_length, beam=b)
        assert kv.get_committed_tokens(BeamIndex(b)) == seqs[b][: kv.history_length]


def _filler(m: KVCacheManager) -> KVCache:
    """A suspended request of 4 uncommitted blocks, listed for eviction before the beam request."""
    f = m.create_kv_cache()
    assert f.resume() and f.resize(4 * T)
    f.suspend()
    return f


def _fill_gpu(m: KVCacheManager) -> None:
    """A request taking the whole GPU (pushing every suspended page down), then closed."""
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(16 * T)
    hog.close()


def test_tier_resize_moves_every_beams_pages(make_manager: MakeManager, tmp_path: object) -> None:
    m = make_manager(
        kv_layers(2, T),
        T,
        16 * SLOT,
        host_quota=16 * SLOT,
        disk_quota=16 * SLOT,
        disk_path=str(tmp_path),
        max_util_for_resume=1.0,
    )
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(5)
    prompt = [rng.randrange(1 << 30) for _ in range(20)]
    f = _filler(m)
    kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=B)
    seqs = start_beams(engine, kv, prompt, rng)
    while kv.history_length < 2 * T - 2:
        assert kv.resize(kv.history_length + 1)
        seqs = beam_step(engine, kv, seqs, rng)
    n = _beam_pages(kv)
    assert n > len(kv.block_table.all_pages())  # some pages only other beams hold
    kv.suspend()
    f.close()  # the GPU's first slots are free, the beam request's pages lie above them
    assert m.resize(GPU, n * SLOT)
    _check_beams(engine, kv, seqs)
    assert m.get_storage_statistics(GPU)[0].total == n
    kv.suspend()
    assert m.resize(GPU, 16 * SLOT)
    assert kv.resume()
    f = _filler(m)
    kv.suspend()
    _fill_gpu(m)  # the filler goes to the host's first slots, the beam pages after it
    assert {p.level for p in kv._all_pages()} == {HOST}
    f.close()
    assert m.resize(HOST, n * SLOT)
    _check_beams(engine, kv, seqs)
    f = _filler(m)
    kv.suspend()
    _fill_gpu(m)
    assert m.resize(HOST, SLOT)  # all but the newest page the host held go to disk, the filler first
    assert m.resize(HOST, 16 * SLOT)
    assert sorted(p.level for p in {id(p): p for p in kv._all_pages()}.values()) == [HOST] + [DISK] * (n - 1)
    f.close()
    assert m.resize(DISK, (n - 1) * SLOT)
    _check_beams(engine, kv, seqs)
    kv.close()


# ---------------------------------------------------------------- 4. a refused call from another thread changes nothing
def _state(kv: KVCache) -> tuple[object, ...]:
    return (kv.num_committed_tokens, kv.get_committed_tokens(), kv.history_length, kv.capacity, kv.status)


def test_calls_refused_while_another_thread_is_inside_change_nothing(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), T, 64 * SLOT)
    inside = threading.Event()
    release = threading.Event()

    def slow(o: int, lc: int) -> Priority:
        inside.set()
        release.wait(5)
        return Priority(35)

    a = m.create_kv_cache()
    assert a.resume() and a.resize(2 * T)
    a.commit(seq(1, T - 1))  # the next token completes a block
    b = m.create_kv_cache(custom_priority_callback=slow)  # type: ignore[arg-type]
    assert b.resume()
    t = threading.Thread(target=lambda: b.resize(2 * T))
    t.start()
    assert inside.wait(5)
    try:
        before = _state(a)
        for call in (
            lambda: a.commit([5]),  # completes a block
            lambda: a.commit([5, 6]),
            lambda: a.resize(4 * T),
            lambda: a.suspend(),
            lambda: a.stop_committing(),
            lambda: m.create_kv_cache(),
        ):
            with pytest.raises(LogicError, match="another call"):
                call()
            assert _state(a) == before
    finally:
        release.set()
        t.join()
    assert b.capacity == 2 * T
    m.check_invariants()
    a.commit([5])
    assert a.num_committed_tokens == T
    a.close()
    b.close()


@pytest.mark.skipif(kvm.compiled, reason="patches a method of a compiled class")
def test_commit_refused_after_its_idle_check_takes_its_token_back(
    make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interpreted mode can switch threads between the decode commit's idle check and its entry;
    simulated here: another call starts right after the token went into the tail."""
    from kv_cache_manager_v2._core._kv_cache import KVCache

    m = make_manager(kv_layers(2, T), T, 64 * SLOT)
    a = m.create_kv_cache()
    assert a.resume() and a.resize(2 * T)
    a.commit(seq(1, T - 1))
    commit_token = KVCache._commit_token

    def then_another_thread_enters(self: KVCache, token: int) -> bool:
        done = commit_token(self, token)
        self._ctx.busy = True
        return done

    monkeypatch.setattr(KVCache, "_commit_token", then_another_thread_enters)
    before = _state(a)
    with pytest.raises(LogicError, match="another call"):
        a.commit([5])
    assert _state(a) == before
    monkeypatch.undo()
    m._ctx.busy = False  # the other call ends
    a.commit([5])
    assert a.get_committed_tokens() == seq(1, T - 1) + [5]
    m.check_invariants()
    a.close()


# ---------------------------------------------------------------- 5. bools are not sizes, in both modes
def test_bools_are_refused_as_sizes(make_manager: MakeManager, tmp_path: object) -> None:
    m = make_manager(kv_layers(2, T), T, 16 * SLOT)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    kv.commit(seq(1, 3))
    before = _state(kv)

    def set_capacity() -> None:
        kv.capacity = True  # type: ignore[assignment]

    def set_history() -> None:
        kv.history_length = True  # type: ignore[assignment]

    def set_stream() -> None:
        kv.cuda_stream = True  # type: ignore[assignment]

    for call in (
        lambda: kv.resize(True),
        lambda: kv.resize(False),
        lambda: kv.resize(8, True),
        lambda: kv.resize(None, True),
        set_capacity,
        set_history,
        set_stream,
    ):
        with pytest.raises(TypeError, match="int"):
            call()
        assert _state(kv) == before
    m.check_invariants()
    kv.close()
    buffers = [BufferConfig("key", REC * T), BufferConfig("value", REC * T)]
    for make in (
        lambda: AttentionLayerConfig(LayerId(True), buffers),
        lambda: AttentionLayerConfig(LayerId(0), buffers, sliding_window_size=True),
        lambda: AttentionLayerConfig(LayerId(0), buffers, sliding_window_size=4, num_sink_tokens=True),
        lambda: BufferConfig("key", True),
        lambda: BufferConfig("key", 64, tokens_per_block_override=True),
        lambda: GpuCacheTierConfig(True),
        lambda: HostCacheTierConfig(True),
        lambda: DiskCacheTierConfig(True, str(tmp_path)),
        lambda: KVCacheDesc(True, 0),
        lambda: KVCacheDesc(1, False),
        lambda: BatchDesc([KVCacheDesc(1, 0)], system_prompt_length=True),
        lambda: SwaScratchReuseConfig(True),
        lambda: KVCacheManagerConfig(True, [GpuCacheTierConfig(1 << 20)], kv_layers(1)),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="int"):
            make()


# ---------------------------------------------------------------- 8. blocks leaving a window together: last block first
def test_blocks_leaving_a_window_together_are_released_last_first(make_manager: MakeManager) -> None:
    t = 2
    slot = 2 * REC * t
    m = make_manager(kv_layers(1, t, window=4, swa_every=1), t, 11 * slot)
    engine = FakeEngine(m)
    toks = seq(1, 22)
    kv = m.create_kv_cache(input_tokens=toks)
    assert kv.resume() and kv.resize(22)
    engine.step(kv, toks, 0, 22)
    kv.commit(toks)  # blocks 0..8 leave the window in this one commit
    kv.close()
    other = m.create_kv_cache()
    assert other.resume() and other.resize(t)  # one slot of pressure: one page evicted
    other.close()
    assert m.probe_reuse(None, toks[:4]) == 4  # block 8 went, not block 0
    assert m.probe_reuse(None, toks[:18]) == 18 - 2  # block 8 is gone: the longest match ends before it
    b = m.create_kv_cache(input_tokens=toks[:4] + [7])
    assert b.history_length == 4 and b.resume()
    engine.check_all(b, toks, 4)
    b.close()


# ---------------------------------------------------------------- 7. engine adapter fields
def test_adapter_request_identity_is_fixed_and_step_fields_are_checked_where_used(backend: str) -> None:
    from conftest import make_config

    t = 4
    a = KVCacheResourceManager(make_config(kv_layers(1, t), t, 64 * 2 * REC * t, backend=backend))
    engine = FakeEngine(a.manager)
    prompt = seq(1, 12)
    req = EngineRequest(7, prompt, 4, context_chunk_size=8)
    assert a.prepare_resources([req]) == []
    engine.step(a.get_kv_cache(req), req.all_tokens(), 0, 8)
    a.update_resources([req])
    assert req.num_cached_tokens == 8
    kv = a.get_kv_cache(req)
    before = (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity)
    for name, value in (("request_id", 8), ("prompt_tokens", seq(2, 12)), ("reuse_scope", ReuseScope(salt=1))):
        with pytest.raises(AttributeError):
            setattr(req, name, value)
    assert req.request_id == 7 and list(req.prompt_tokens) == prompt and req.reuse_scope is None
    req.context_chunk_size = -3
    with pytest.raises(ValueError, match="context_chunk_size"):
        a.prepare_resources([req])
    with pytest.raises(ValueError, match="context_chunk_size"):
        a.get_needed_resource_to_completion(req)
    assert (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity) == before
    with pytest.raises(TypeError):  # refused at assignment (compiled) or where it is used
        req.context_chunk_size = "4"  # type: ignore[assignment]
        a.prepare_resources([req])
    req.context_chunk_size = 4
    req.max_new_tokens = 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        a.get_needed_resource_to_completion(req)
    req.max_new_tokens = 4
    other = EngineRequest(9, seq(3, 8), 2)
    other.priority = 500  # type: ignore[assignment]
    with pytest.raises(ValueError, match="priority"):
        a.prepare_resources([req, other])  # the batch is rolled back: req is as it was
    assert (req.num_cached_tokens, req.num_scheduled_tokens, kv.history_length, kv.capacity) == before
    assert a.manager.num_open_caches == 1
    assert a.prepare_resources([req]) == []
    assert req.num_scheduled_tokens == 4
    engine.step(a.get_kv_cache(req), req.all_tokens(), 8, 12)
    a.update_resources([req])
    assert a.get_kv_cache(req).history_length == 12
    a.free_resources(req)
    a.shutdown()


# ---------------------------------------------------------------- 6. SWA scratch planning
def _swa(
    n: int, window: int, t: int, full: int = 0, full_bytes: int = 0, swa_bytes: int = 0
) -> list[AttentionLayerConfig]:
    """``n`` windowed layers then ``full`` full-attention ones (K and V of the given bytes per token)."""
    out = []
    for i in range(n + full):
        b = (swa_bytes if i < n else full_bytes) or REC
        out.append(
            AttentionLayerConfig(
                LayerId(i),
                [BufferConfig("key", b * t), BufferConfig("value", b * t)],
                window if i < n else None,
            )
        )
    return out


def test_scratch_reuse_can_be_switched_off_once_the_step_is_committed(make_manager: MakeManager) -> None:
    t = 32
    m = make_manager(_swa(8, 32, t), t, 64 * 8 * 2 * REC * t, swa_scratch_reuse=SwaScratchReuseConfig())
    engine = FakeEngine(m)
    toks = seq(1, 512)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(256)
    assert kv.has_scratch_slots
    with pytest.raises(LogicError, match="commit the step"):
        kv.enable_swa_scratch_reuse = False  # the step is not computed yet
    engine.step(kv, toks, 0, 256)
    kv.commit(toks[:256])
    kv.enable_swa_scratch_reuse = False
    assert not kv.enable_swa_scratch_reuse and not kv.has_scratch_slots
    m.check_invariants()
    assert kv.resize(512)  # the next chunk gets pages for every block, no scratch
    assert not kv.has_scratch_slots
    engine.step(kv, toks, 256, 512)
    kv.commit(toks[256:512])
    engine.check_all(kv, toks, 512)
    kv.enable_swa_scratch_reuse = True
    kv.close()


def test_initial_gpu_split_and_constraints_count_scratch_slots() -> None:
    t = 32
    layers = _swa(16, 128, t, full=16, swa_bytes=12, full_bytes=20)  # slots: 12288 (windowed) and 20480 bytes
    step = BatchDesc([KVCacheDesc(16384, 0)] * 8)
    quota = 256 * 12288 + 256 * 20480

    def slots(scratch: SwaScratchReuseConfig | None, **kw: object) -> list[int]:
        """GPU slots per pool group, windowed group first."""
        cfg = KVCacheManagerConfig(
            t,
            [GpuCacheTierConfig(quota)],
            layers,
            swa_scratch_reuse=scratch,
            backend="host",
            **kw,  # type: ignore[arg-type]
        )
        m = KVCacheManager(cfg)
        stats = sorted(m.get_storage_statistics(), key=lambda x: sum(x.slot_sizes))
        m.shutdown()
        assert [sum(x.slot_sizes) for x in stats] == [12288, 20480]
        return [x.total for x in stats]

    swa_g, full_g = 0, 1
    plain = slots(None, typical_step=step)
    with_scratch = slots(SwaScratchReuseConfig(), typical_step=step)
    # without scratch each request holds all 512 blocks in both groups; with it the windowed
    # group holds its window, the chunk's last blocks and one scratch slot per request
    assert plain[swa_g] * 12288 / (plain[full_g] * 20480) == pytest.approx(12288 / 20480, rel=0.02)
    assert with_scratch[swa_g] < plain[swa_g] / 5  # ~5 pages + 32 scratch slots a request instead of 512
    assert with_scratch[full_g] > plain[full_g]
    # constraints: 4 x (512, 0) need 24 + 64 slots with scratch, 64 + 64 without
    quota = 24 * 12288 + 64 * 20480
    tight = BatchDesc([KVCacheDesc(512, 0)] * 4)
    cfg = KVCacheManagerConfig(
        t,
        [GpuCacheTierConfig(quota)],
        layers,
        swa_scratch_reuse=SwaScratchReuseConfig(),
        constraints=[tight],
        backend="host",
    )
    m = KVCacheManager(cfg)
    kvs = [m.create_kv_cache() for _ in range(4)]
    for kv in kvs:  # the constrained batch really fits
        assert kv.resume() and kv.resize(512, 0)
    for kv in kvs:
        kv.close()
    m.shutdown()
    with pytest.raises(ValueError, match="slots needed"):
        slots(None, constraints=[tight])
