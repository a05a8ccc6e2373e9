"""Memory backends: host emulation contract, selection, CUDA (skipped without a GPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import CUDA_REASON, kv_layers, make_config, requires_cuda

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    CuError,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerId,
    MemAddress,
    OutOfMemoryError,
    SlotId,
)
from kv_cache_manager_v2._config import BACKEND_ENV_VAR
from kv_cache_manager_v2._storage._host_backend import HostBackend
from kv_cache_manager_v2._storage._select import select_backend


def test_a_disk_tier_larger_than_the_disk_is_out_of_memory(tmp_path: Path) -> None:
    """The disk file cannot be allocated: OutOfMemoryError naming the directory (not ENOSPC), no file left."""
    config = make_config(kv_layers(2), disk_quota=1 << 60, disk_path=str(tmp_path))  # 1 EiB
    with pytest.raises(OutOfMemoryError, match=f"disk tier could not allocate .* in {tmp_path}"):
        KVCacheManager(config)
    assert list(tmp_path.iterdir()) == []


def test_host_pool_read_write_copy_and_stable_base() -> None:
    b = HostBackend()
    pool = b.reserve_pool(1 << 20)
    base = pool.base_address
    pool.ensure_mapped(4096)
    b.write(MemAddress(base + 100), b"hello")
    b.copy(MemAddress(base + 5000), MemAddress(base + 100), 5, 0)
    pool.ensure_mapped(1 << 20)
    assert pool.base_address == base and pool.mapped_bytes == 1 << 20
    assert b.read(MemAddress(base + 5000), 5) == b"hello"
    with pytest.raises(ValueError, match="reserved"):
        pool.ensure_mapped(2 << 20)
    pool.release()
    pool.release()


def test_host_backend_reserves_a_realistic_pool_lazily_and_refuses_an_impossible_one() -> None:
    layers = [
        AttentionLayerConfig(
            LayerId(i), [BufferConfig("key", 8 * 128 * 2 * 32), BufferConfig("value", 8 * 128 * 2 * 32)]
        )
        for i in range(32)
    ]
    m = KVCacheManager(KVCacheManagerConfig(32, [GpuCacheTierConfig(40 << 30)], layers, backend="host"))
    assert m.get_storage_statistics()[0].total == 10240  # 40 GiB of 4 MiB slots, reserved not committed
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(32 * 4)
    kv.close()
    m.shutdown()
    with pytest.raises(OutOfMemoryError, match="quota"):
        KVCacheManager(KVCacheManagerConfig(32, [GpuCacheTierConfig(1 << 52)], layers, backend="host"))


def test_env_var_overrides_auto(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(BACKEND_ENV_VAR, "host")
    with caplog.at_level(logging.INFO, logger="kv_cache_manager_v2"):
        assert select_backend("auto").name == "host"
    assert "using the host memory backend" in caplog.text
    monkeypatch.setenv(BACKEND_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=BACKEND_ENV_VAR):
        select_backend("auto")


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here: auto does not fall back")
def test_auto_falling_back_to_the_host_device_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning (visible without any logging set up) naming the reason; an explicit "host" is quiet."""
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    with caplog.at_level(logging.INFO, logger="kv_cache_manager_v2"):
        assert select_backend("auto").name == "host"
        fallbacks = [r for r in caplog.records if "falls back to the host-emulated device" in r.getMessage()]
        assert [r.levelno for r in fallbacks] == [logging.WARNING]
        assert str(CUDA_REASON) in fallbacks[0].getMessage()
        caplog.clear()
        assert select_backend("host").name == "host"
        monkeypatch.setenv(BACKEND_ENV_VAR, "host")
        assert select_backend("auto").name == "host"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_picks_cuda_only_when_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    m = KVCacheManager(make_config(kv_layers(1), backend="auto"))
    assert m.backend_name == ("cuda" if CUDA_REASON is None else "host")
    m.shutdown()


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here")
def test_cuda_requested_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not usable"):
        KVCacheManager(make_config(kv_layers(1), backend="cuda"))


def test_cuda_module_imports_cleanly_and_errors_carry_driver_text() -> None:
    import kv_cache_manager_v2._storage._cuda_backend as cb

    assert hasattr(cb, "CudaBackend")
    e = CuError(2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "cuMemCreate")
    assert e.status == 2 and "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory" in str(e)


@requires_cuda
def test_cuda_pool_grows_in_place_and_round_trips() -> None:
    from kv_cache_manager_v2._storage._cuda_backend import CudaBackend

    b = CudaBackend()
    pool = b.reserve_pool(64 << 20)
    base = pool.base_address
    pool.ensure_mapped(1)
    assert pool.mapped_bytes >= b.granularity
    b.write(MemAddress(base + 8), b"kvkvkvkv")
    pool.ensure_mapped(32 << 20)
    assert pool.base_address == base
    b.copy(MemAddress(base + (16 << 20)), MemAddress(base + 8), 8, 0)
    b.synchronize()
    assert b.read(MemAddress(base + (16 << 20)), 8) == b"kvkvkvkv"
    pool.release()
    b.shutdown()


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> object:
    """Replaces cuda.bindings.driver (looked up at call time, so compiled code sees it too)."""
    import cuda.bindings
    from fake_cuda_driver import FakeDriver

    drv = FakeDriver()
    monkeypatch.setattr(cuda.bindings, "driver", drv)
    return drv


def test_cuda_backend_logic_on_an_emulated_driver(fake_driver: object) -> None:
    from fake_cuda_driver import GRANULARITY, FakeDriver
    from fake_engine import FakeEngine

    from kv_cache_manager_v2 import LayerGroupId

    drv = fake_driver
    assert isinstance(drv, FakeDriver)
    m = KVCacheManager(make_config(kv_layers(2), quota=8 << 20, backend="cuda"))
    assert m.backend_name == "cuda"
    assert not drv.mapped  # nothing mapped until slots are used
    engine = FakeEngine(m, driver=drv)  # its records: kernels on the request's stream (0)
    toks = list(range(1000, 1100))
    kv = m.create_kv_cache(input_tokens=toks)
    assert kv.resume() and kv.resize(60)
    engine.step(kv, toks, 0, 60)
    kv.commit(toks[:60])
    assert sum(drv.mapped.values()) == GRANULARITY  # grown by one chunk, at the reserved base
    kv.close()
    since = len(drv.log)
    b = m.create_kv_cache(input_tokens=toks[:52] + [1, 2, 3])  # partial match: device-to-device copy
    assert b.history_length == 52 and b.resume()
    assert "cuMemcpyAsync" in drv.calls  # ordered after the writer's kernels on stream 0 (the fake checks)
    assert not [c for c, _, _ in drv.log[since:] if "Synchronize" in c]  # nothing waited for
    engine.check_all(b, toks, 52)
    assert b.get_base_page_indices(LayerGroupId(0))[6] != BAD
    b.close()
    m.clear_reusable_blocks()
    m.shutdown()
    assert not drv.mapped and not drv.handles and not drv.reservations  # everything given back
    assert not drv.events and not drv.live_streams


BAD = -1


def test_cuda_driver_errors_become_cu_errors(fake_driver: object) -> None:
    from fake_cuda_driver import FakeDriver

    drv = fake_driver
    assert isinstance(drv, FakeDriver)
    m = KVCacheManager(make_config(kv_layers(1), quota=8 << 20, backend="cuda"))
    kv = m.create_kv_cache()
    kv.resume()
    drv.fail_next["cuMemCreate"] = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    stats = m.get_storage_statistics()
    with pytest.raises(CuError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as info:
        kv.resize(8)
    assert info.value.status == 2 and info.value.message == "emulated failure"
    assert kv.capacity == 0 and len(kv.get_base_page_indices(0)) == 0  # nothing changed
    assert m.get_storage_statistics() == stats
    drv.fail_next["cuMemMap"] = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CuError, match="cuMemMap"):
        kv.resize(8)
    assert not drv.handles  # the physical chunk of the failed map was released
    assert kv.resize(8)  # the next attempt maps normally
    kv.close()
    m.shutdown()


def test_cuda_copies_are_cut_where_a_host_registration_ends(
    fake_driver: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real driver refuses a copy whose page-locked host range spans two registrations (adjacent
    ones too: CUDA_ERROR_INVALID_VALUE, seen on an H200); the host tier registers in chunks as it
    grows, so a merged run of slots can cross a chunk's end: the backend cuts the copy there. The
    emulated driver asserts every async copy lies within one registration."""
    import mmap

    from kv_cache_manager_v2._storage import _cuda_backend

    monkeypatch.setattr(_cuda_backend, "_HOST_CHUNK", 3 * mmap.PAGESIZE)  # registrations end mid-run
    m = KVCacheManager(make_config(kv_layers(2), quota=4 << 20, host_quota=4 << 20, backend="cuda"))
    storage = m._storage
    gpu, host = storage.levels[0][0], storage.levels[1][0]
    n = 40
    gpu.allocator.allocate(n)
    host.allocator.allocate(n // 2)  # the host pools grow twice: more registration ends
    host.allocator.allocate(n // 2)
    sizes = gpu.layout.slot_sizes
    assert n * sizes[0] > 2 * 3 * mmap.PAGESIZE  # a run of n slots crosses chunk ends
    backend = storage.copier.backend
    for p, size in enumerate(sizes):
        for slot in range(n):
            backend.write(gpu.slot_address(p, SlotId(slot)), bytes([slot + 1]) * size)
    pairs = [(i, i) for i in range(n)]  # one run of n slots per pool
    assert not storage.copier.copy(gpu.pools, host.pools, sizes, pairs)  # offload
    backend.wait_copies()  # the CPU reads host memory the copies wrote (the fake defers them)
    for p, size in enumerate(sizes):
        view = host.memory_pool(p).host_view
        assert view is not None
        assert all(view[slot * size : (slot + 1) * size] == bytes([slot + 1]) * size for slot in range(n))
    back = [(i, n - 1 - i) for i in range(n)]  # onboard into other GPU slots (reversed: no merging)
    gpu.allocator.allocate(n)
    assert not storage.copier.copy(host.pools, gpu.pools, sizes, [(h, g + n) for h, g in back])
    assert not storage.copier.copy(host.pools, gpu.pools, sizes, pairs)  # and merged, back in place
    for p, size in enumerate(sizes):
        for slot in range(n):
            assert backend.read(gpu.slot_address(p, SlotId(slot)), size) == bytes([slot + 1]) * size
            assert backend.read(gpu.slot_address(p, SlotId(2 * n - 1 - slot)), size) == bytes([slot + 1]) * size
    m.shutdown()


def test_host_registrations_cut_copies_at_each_range_end_and_forget_removed_ranges() -> None:
    from kv_cache_manager_v2._storage._cuda_backend import HostRegistrations

    r = HostRegistrations()
    r.add(1000, 100)
    r.add(1100, 50)  # adjacent: still two registrations
    r.add(5000, 10)
    dsts, srcs, sizes = [1050, 7000], [90, 91], [120, 5]  # D2H: the host side is the destination
    r.cut(True, dsts, srcs, sizes)
    assert (dsts, srcs, sizes) == ([1050, 1100, 1150, 7000], [90, 140, 190, 91], [50, 50, 20, 5])
    srcs2, dsts2, sizes2 = [1000], [0], [150]  # H2D over both: the host side is the source
    r.cut(False, dsts2, srcs2, sizes2)
    assert (srcs2, dsts2, sizes2) == ([1000, 1100], [0, 100], [100, 50])
    r.remove(1100)  # only that one
    assert r.ranges == [(1000, 1100), (5000, 5010)]
    d, s, n = [1050], [0], [100]
    r.cut(True, d, s, n)
    assert n == [50, 50]  # up to the end of the first; the rest is in no registration: left whole
