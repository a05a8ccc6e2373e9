"""SWA prefill scratch slots (SPEC 5.7) through the fake engine: the reference case, chunked
prefill with suspend/resume and rewind, mixed models, reuse afterwards, index modes, misuse."""

from __future__ import annotations

import pytest
from conftest import REC, MakeManager, used_slots
from conftest import toks as tokens
from fake_engine import FakeEngine, KVMismatch
from tier_helpers import seq

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    CacheLevel,
    GpuCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    LogicError,
    PageIndexMode,
    SwaScratchReuseConfig,
)

T = 32
LG0 = LayerGroupId(0)


def swa_layers(n: int, window: int = 128, full_every: int = 0, sinks: int | None = None) -> list[AttentionLayerConfig]:
    """``n`` layers with K and V; every ``full_every``-th layer (from 1) is full attention."""
    out = []
    for i in range(n):
        full = full_every and i % full_every == 1
        out.append(
            AttentionLayerConfig(
                LayerId(i),
                [BufferConfig("key", REC * T), BufferConfig("value", REC * T)],
                None if full else window,
                None if full else sinks,
            )
        )
    return out


def prefill(engine: FakeEngine, kv: KVCache, toks: list[int], chunks: list[int], commit: bool = True) -> int:
    """Prefill in chunks; returns the peak number of used slots seen right after each resize."""
    peak = 0
    m = engine.mgr
    for c in chunks:
        h = kv.history_length
        assert kv.resize(h + c, h)
        peak = max(peak, used_slots(m))
        engine.step(kv, toks, h, h + c)
        if commit:
            kv.commit(toks[h : h + c])
        else:
            assert kv.resize(None, h + c)
    return peak


@pytest.mark.parametrize("scratch", [True, False])
def test_reference_case_five_slots_with_scratch_thirty_two_without(make_manager: MakeManager, scratch: bool) -> None:
    cfg = SwaScratchReuseConfig() if scratch else None
    m = make_manager(swa_layers(32), tokens_per_block=T, quota=64 * 32 * 2 * REC * T, swa_scratch_reuse=cfg)
    engine = FakeEngine(m)
    toks = tokens(1, 1024)
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(1024, 0)
    assert used_slots(m) == (5 if scratch else 32)
    if scratch:
        desc = kv.get_scratch_desc(LG0)
        assert desc is not None and (desc.range.beg, desc.range.end) == (0, 28) and len(desc.slot_ids) == 1
        assert list(kv.get_base_page_indices(LG0))[:28] == [-1] * 28
        assert kv.has_scratch_slots and not kv.supports_index_mode(PageIndexMode.SHARED)
    engine.step(kv, toks, 0, 1024)  # every layer writes and reads its 28 scratch blocks in one slot
    kv.commit(toks)
    assert not kv.has_scratch_slots or kv.history_length == 1024
    engine.check_all(kv, toks, 1024)
    assert kv.resize(1025)  # decode: no scratch, surplus scratch slot recycled
    assert not kv.has_scratch_slots and kv.supports_index_mode(PageIndexMode.SHARED)
    engine.step(kv, [*toks, 7], 1024, 1025)
    kv.close()


def test_converter_collisions_in_a_scratch_slot_are_caught(make_manager: MakeManager) -> None:
    """The fake engine checks each layer right after writing it: scratch blocks mapped onto the
    same sub-pages (here: a converter told each layer uses no sub-pages) are detected."""
    m = make_manager(
        swa_layers(4), tokens_per_block=T, quota=64 * 8 * REC * T, swa_scratch_reuse=SwaScratchReuseConfig()
    )
    engine = FakeEngine(m)
    for buf in engine.buffers:
        buf.converter.pages_per_layer = 0  # every scratch block of a layer on one sub-page
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(1024, 0)
    with pytest.raises(KVMismatch):
        engine.step(kv, tokens(2, 1024), 0, 1024)
    kv.close()


@pytest.mark.parametrize(
    "layers, rewind",
    [
        (swa_layers(4), 0),
        (swa_layers(4), 40),
        (swa_layers(6, full_every=2), 0),  # alternating window-128 and full layers
        (swa_layers(4, window=96, sinks=40), 0),  # sinks (2 blocks) are never scratch
        (swa_layers(6, window=64, full_every=3, sinks=10), 33),
    ],
)
def test_chunked_prefill_with_suspend_resume_then_decode_and_reuse(
    make_manager: MakeManager, layers: list[AttentionLayerConfig], rewind: int
) -> None:
    m = make_manager(
        layers,
        tokens_per_block=T,
        quota=200 * 6 * 2 * REC * T,
        swa_scratch_reuse=SwaScratchReuseConfig(rewind),
        typical_step=BatchDesc([KVCacheDesc(2200, 0)]),  # every block: pool groups sized alike
    )
    engine = FakeEngine(m)
    toks = tokens(3, 2200)
    kv = m.create_kv_cache()
    kv.resume()
    for chunk in (500, 700, 1):
        prefill(engine, kv, toks, [chunk])
        kv.suspend()  # scratch slots go back; the pages stay
        assert not kv.has_scratch_slots
        assert kv.resume()
        engine.check_all(kv, toks, kv.history_length)
    h = kv.history_length
    assert kv.resize(h + 600, h)  # a step suspended before it runs gets its scratch slots back on resume
    had_scratch = kv.has_scratch_slots
    kv.suspend()
    assert kv.resume() and kv.has_scratch_slots == had_scratch
    engine.step(kv, toks, h, h + 600)
    kv.commit(toks[h : h + 600])
    for pos in range(kv.history_length, kv.history_length + 40):  # decode
        assert kv.resize(pos + 1)
        engine.step(kv, toks, pos, pos + 1)
        kv.commit([toks[pos]])
    n = kv.history_length
    kv.close()
    # a prefix computed with scratch is reusable where the window kept its pages
    assert m.probe_reuse(input_tokens=toks[: n + 1]) == n
    b = m.create_kv_cache(input_tokens=toks[: n + 1])
    assert b.resume()
    engine.check_all(b, toks, n)
    prefill(engine, b, toks, [50])
    b.close()


def test_a_second_resize_of_the_same_step_moves_blocks_between_pages_and_scratch(make_manager: MakeManager) -> None:
    m = make_manager(
        swa_layers(2), tokens_per_block=T, quota=64 * 2 * 2 * REC * T, swa_scratch_reuse=SwaScratchReuseConfig()
    )
    engine = FakeEngine(m)
    toks = tokens(4, 1024)
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(100, 0) and not kv.has_scratch_slots  # 4 blocks with pages
    assert kv.resize(1024, 0)  # the same step grows: blocks 0..27 become scratch, their pages go back
    assert used_slots(m) == 14 + 4  # 2 layers: a slot holds 2 scratch blocks of one layer
    assert kv.resize(600, 0)  # shrinks: blocks 14..18 are in the window again and get pages
    desc = kv.get_scratch_desc(LG0)
    assert desc is not None and (desc.range.beg, desc.range.end) == (0, 14)
    engine.step(kv, toks, 0, 600)
    kv.commit(toks[:600])
    engine.check_all(kv, toks, 600)
    kv.close()


def test_a_decode_step_at_full_memory_reuses_the_block_leaving_the_window(make_manager: MakeManager) -> None:
    layers = swa_layers(1, window=64)
    m = make_manager(layers, tokens_per_block=T, quota=3 * 2 * REC * T)  # 3 slots: the window's peak
    engine = FakeEngine(m)
    toks = tokens(5, 400)
    kv = m.create_kv_cache()
    kv.resume()
    for pos in range(400):
        assert kv.resize(pos + 1), pos  # at a block boundary the block leaving the window pays for the new one
        engine.step(kv, toks, pos, pos + 1)
        kv.commit([toks[pos]])
    assert m.get_storage_statistics()[0].free == 0
    kv.close()


def test_scratch_can_be_switched_per_request(make_manager: MakeManager) -> None:
    m = make_manager(
        swa_layers(4), tokens_per_block=T, quota=64 * 4 * 2 * REC * T, swa_scratch_reuse=SwaScratchReuseConfig()
    )
    assert m.supports_index_mode(PageIndexMode.SHARED) is None  # ask each request
    engine = FakeEngine(m)
    off = m.create_kv_cache()
    assert off.enable_swa_scratch_reuse
    off.enable_swa_scratch_reuse = False
    off.resume()
    assert off.resize(1024, 0) and not off.has_scratch_slots and used_slots(m) == 32
    on = m.create_kv_cache()
    on.resume()
    assert on.resize(1024, 0) and on.has_scratch_slots
    with pytest.raises(LogicError, match="scratch blocks"):
        on.enable_swa_scratch_reuse = False
    with pytest.raises(TypeError):  # compiled: mypyc checks the annotation itself
        on.enable_swa_scratch_reuse = 1  # type: ignore[assignment]
    shared = FakeEngine(m, PageIndexMode.SHARED)
    with pytest.raises(KVMismatch, match="SHARED"):
        shared.step(on, tokens(6, 1024), 0, 1024)
    for kv, seed in ((off, 7), (on, 8)):
        toks = tokens(seed, 1024)
        engine.step(kv, toks, 0, 1024)
        kv.commit(toks)
        engine.check_all(kv, toks, 1024)
        kv.close()


def test_scratch_needs_the_manager_option(make_manager: MakeManager) -> None:
    m = make_manager(swa_layers(2), tokens_per_block=T)
    assert m.supports_index_mode(PageIndexMode.SHARED) is True
    kv = m.create_kv_cache()
    assert not kv.enable_swa_scratch_reuse
    with pytest.raises(LogicError, match="swa_scratch_reuse"):
        kv.enable_swa_scratch_reuse = True
    kv.close()


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


def test_scratch_resize_failure_is_all_or_nothing(make_manager: MakeManager) -> None:
    slot = 8 * 2 * REC * T  # 8 layers: a slot holds 8 scratch blocks of one layer
    m = make_manager(swa_layers(8), tokens_per_block=T, quota=9 * slot, swa_scratch_reuse=SwaScratchReuseConfig())
    hog = m.create_kv_cache()
    hog.resume()
    assert hog.resize(2 * T)  # 2 of 9 slots
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(2 * T, 0)
    before = (list(kv.get_base_page_indices(LG0)), kv.capacity, used_slots(m))
    assert not kv.resize(1024, 0)  # needs 4 scratch + 4 window slots; 7 available counting its own 2
    assert (list(kv.get_base_page_indices(LG0)), kv.capacity, used_slots(m)) == before
    assert not kv.has_scratch_slots
    hog.close()
    assert kv.resize(1024, 0) and used_slots(m) == 8
    kv.close()


def test_scratch_with_a_host_tier_survives_spilling(make_manager: MakeManager) -> None:
    """A request suspended between the resize and the run of a scratch step spills to host while
    another request takes the GPU; resume brings its pages up and its scratch slots back."""
    slot = 8 * 2 * REC * T
    m = make_manager(
        swa_layers(8),
        tokens_per_block=T,
        quota=12 * slot,
        host_quota=12 * slot,
        swa_scratch_reuse=SwaScratchReuseConfig(),
        max_util_for_resume=1.0,
    )
    engine = FakeEngine(m)
    toks = tokens(9, 2048)
    kv = m.create_kv_cache()
    kv.resume()
    prefill(engine, kv, toks, [512])
    assert kv.resize(1536, 512) and kv.has_scratch_slots  # the next step's scratch is placed...
    kv.suspend()  # ...and the request is preempted before it runs
    hog = m.create_kv_cache()
    hog.enable_swa_scratch_reuse = False
    hog.resume()
    assert hog.resize(12 * T)  # the whole GPU: the suspended request's pages go to host
    assert m.get_tier_statistics(CacheLevel(1)).offloaded_pages == 8
    hog.close()
    assert kv.resume() and kv.has_scratch_slots
    engine.check_all(kv, toks, 512)
    engine.step(kv, toks, 512, 1536)
    kv.commit(toks[512:1536])
    engine.check_all(kv, toks, 1536)
    kv.close()
