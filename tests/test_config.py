"""Configuration validation: every bad input gets a clear ValueError."""

from __future__ import annotations

import pytest
from conftest import kv_layers, make_config

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    CacheTier,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerId,
    ReuseScope,
    SwaScratchReuseConfig,
)


def cfg(**kw: object) -> KVCacheManagerConfig:
    base: dict[str, object] = dict(tokens_per_block=8, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=kv_layers(2))
    base.update(kw)
    return KVCacheManagerConfig(**base)  # type: ignore[arg-type]


def test_valid_config_and_tier_properties(tmp_path: object) -> None:
    c = cfg()
    assert c.backend == "auto" and c.max_util_for_resume == 0.97
    assert GpuCacheTierConfig(1).tier is CacheTier.GPU_MEM
    assert HostCacheTierConfig(1).tier is CacheTier.HOST_MEM
    assert DiskCacheTierConfig(1, str(tmp_path)).tier is CacheTier.DISK
    assert AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8)], 16).window_size == 16


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GpuCacheTierConfig(0), "quota"),
        (lambda: HostCacheTierConfig(-5), "quota"),
        (lambda: DiskCacheTierConfig(10, "/nonexistent/dir"), "existing directory"),
        (lambda: BufferConfig("", 8), "role"),
        (lambda: BufferConfig("k", 0), "size"),
        (lambda: BufferConfig("k", 8, 0), "override"),
        (lambda: AttentionLayerConfig(LayerId(0), []), "empty"),
        (lambda: AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8), BufferConfig("k", 8)]), "twice"),
        (lambda: AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8)], num_sink_tokens=4), "sliding_window"),
        (lambda: AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8)], sliding_window_size=0), "window"),
        (lambda: AttentionLayerConfig(LayerId(-1), [BufferConfig("k", 8)]), "layer_id"),
        (lambda: KVCacheDesc(4, 5), "exceed"),
        (lambda: KVCacheDesc(-1, 0), "capacity"),
        (lambda: SwaScratchReuseConfig(-1), "max_rewind_len"),
        (lambda: ReuseScope(salt=-1), "salt"),
        (lambda: cfg(tokens_per_block=12), "power of two"),
        (lambda: cfg(tokens_per_block=0), "power of two"),
        (lambda: cfg(cache_tiers=[]), "GpuCacheTierConfig"),
        (lambda: cfg(cache_tiers=[HostCacheTierConfig(10)]), "GpuCacheTierConfig"),
        (lambda: cfg(cache_tiers=[GpuCacheTierConfig(10), GpuCacheTierConfig(10)]), "at most once"),
        (lambda: cfg(layers=[]), "empty"),
        (lambda: cfg(layers=kv_layers(1) + kv_layers(1)), "twice"),
        (lambda: cfg(layers=[AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8, 3)])]), "divide"),
        (lambda: cfg(layers=[AttentionLayerConfig(LayerId(0), [BufferConfig("k", 8, 16)])]), "divide"),
        (lambda: cfg(max_util_for_resume=1.5), "max_util"),
        (lambda: cfg(backend="tpu"), "backend"),
        (lambda: cfg(initial_pool_ratio=[0.0]), "initial_pool_ratio"),
        (lambda: cfg(tokens_per_block=-8), ">= 0"),
    ],
)
def test_bad_config_is_a_clear_value_error(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_disk_tier_must_be_writable(tmp_path: object) -> None:
    import os

    d = os.path.join(str(tmp_path), "ro")
    os.mkdir(d)
    os.chmod(d, 0o500)
    if os.access(d, os.W_OK):  # running as root: permissions do not apply
        pytest.skip("directory permissions are not enforced for this user")
    with pytest.raises(ValueError, match="writable"):
        DiskCacheTierConfig(10, d)


@pytest.mark.parametrize(
    "make",
    [
        lambda: cfg(constraints=[5]),
        lambda: BatchDesc([5]),  # type: ignore[list-item]
        lambda: GpuCacheTierConfig(1.5),  # type: ignore[arg-type]
        lambda: BufferConfig(3, 8),  # type: ignore[arg-type]
        lambda: cfg(layers=[5]),
        lambda: ReuseScope(salt="a"),  # type: ignore[arg-type]
    ],
)
def test_wrong_types_are_type_errors(make: object) -> None:
    """Same exception type interpreted and compiled (mypyc checks annotated argument types itself)."""
    with pytest.raises(TypeError):
        make()  # type: ignore[operator]


def test_load_workers_is_validated() -> None:
    for bad, error in ((-1, ValueError), (65, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="load_workers"):
            make_config(kv_layers(1, 8), 8, 1 << 16, load_workers=bad)
    m = KVCacheManager(make_config(kv_layers(1, 8), 8, 1 << 16, backend="host"))
    assert m._ctx.loader is None  # GPU only: nothing to read in the background
    m.shutdown()
