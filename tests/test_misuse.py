"""The misuse catalogue (issue #9): each wrong call raises the documented exception type with a
message naming the argument (or the state), leaves the manager exactly as it was (statistics,
free slots, every cache's indices and lengths, invariants), and the manager then still serves a
new request correctly through the fake engine.

In production mode, arguments whose annotation mypyc checks itself (``int``, ``memoryview``,
our native classes...) are refused by mypyc's own ``TypeError``, which does not name the
argument (``mypyc=True`` below): both modes raise the same type, only fast mode names it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import REC, MakeManager, cache_state, kv_layers, make_config
from fake_engine import FakeEngine
from tier_helpers import seq

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    BufferId,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerGroupId,
    LayerId,
    LogicError,
    OutOfPagesError,
    Priority,
    RemoteCacheTierConfig,
    RequestRetention,
    Retention,
    RetentionRange,
    ReuseScope,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

T = 8


@dataclass
class World:
    m: KVCacheManager
    active: KVCache  # with committed, reusable tokens
    suspended: KVCache
    closed: KVCache
    fresh: KVCache  # ACTIVE, nothing allocated
    toks: list[int]


def make_world() -> World:
    m = KVCacheManager(make_config(kv_layers(2, T, window=16, swa_every=2), quota=2 * 2 * REC * T * 40))
    engine = FakeEngine(m)
    toks = list(range(500, 560))
    active = m.create_kv_cache()
    active.resume()
    assert active.resize(40)
    engine.step(active, toks, 0, 40)
    active.commit(toks[:40])
    suspended = m.create_kv_cache()
    suspended.resume()
    assert suspended.resize(20)
    suspended.suspend()
    closed = m.create_kv_cache()
    closed.close()
    fresh = m.create_kv_cache()
    fresh.resume()
    return World(m, active, suspended, closed, fresh, toks)


def snapshot(w: World) -> object:
    w.m.check_invariants()
    caches = [w.active, w.suspended, w.closed, w.fresh]
    return (
        w.m.get_storage_statistics(),
        w.m.reuse_statistics,
        w.m.num_open_caches,
        [(kv.status, kv.capacity, kv.history_length, kv.num_committed_tokens) for kv in caches],
        [
            kv.get_base_page_indices(LayerGroupId(lg)).tolist()
            for kv in caches
            if kv.status.name != "CLOSED"
            for lg in (0, 1)
        ],
    )


def still_serves(w: World) -> None:
    engine = FakeEngine(w.m)
    seq = [*w.toks[:40], 1, 2, 3, 4, 5, 6, 7, 8, 9]
    kv = w.m.create_kv_cache(input_tokens=seq)
    assert kv.history_length == 40
    assert kv.resume()
    engine.check_all(kv, seq, 40)
    assert kv.resize(len(seq))
    engine.step(kv, seq, 40, len(seq))
    kv.commit(seq[40:])
    kv.close()


def cfg(**kw: Any) -> KVCacheManagerConfig:
    base: dict[str, Any] = dict(
        tokens_per_block=T, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=kv_layers(2, T), backend="host"
    )
    base.update(kw)
    return KVCacheManagerConfig(**base)


def layer(**kw: Any) -> AttentionLayerConfig:
    base: dict[str, Any] = dict(layer_id=LayerId(0), buffers=[BufferConfig("key", 64)])
    base.update(kw)
    return AttentionLayerConfig(**base)


def bad_priority(o: int, lc: int) -> Priority:
    return Priority(101)


def raising_priority(o: int, lc: int) -> Priority:
    raise RuntimeError("callback failed")


def resize_with_callback(w: World, cb: Callable[[int, int], Priority]) -> None:
    kv = w.m.create_kv_cache(custom_priority_callback=cb)  # type: ignore[arg-type]
    kv.resume()
    try:
        kv.resize(3 * T)
    finally:
        kv.close()


Case = tuple[str, Callable[[World], object], type[BaseException], str, bool]

CASES: list[Case] = [
    # ---- configuration
    ("tpb zero", lambda w: cfg(tokens_per_block=0), ValueError, "tokens_per_block", False),
    ("tpb not a power of two", lambda w: cfg(tokens_per_block=12), ValueError, "tokens_per_block", False),
    ("tpb str", lambda w: cfg(tokens_per_block="8"), TypeError, "tokens_per_block", True),
    ("no tiers", lambda w: cfg(cache_tiers=[]), ValueError, "cache_tiers", False),
    ("host tier first", lambda w: cfg(cache_tiers=[HostCacheTierConfig(1 << 20)]), ValueError, "cache_tiers", False),
    ("gpu quota zero", lambda w: GpuCacheTierConfig(0), ValueError, "quota", False),
    ("gpu quota float", lambda w: GpuCacheTierConfig(1.5), TypeError, "quota", True),  # type: ignore[arg-type]
    ("disk path missing", lambda w: DiskCacheTierConfig(1 << 20, "/nonexistent/dir"), ValueError, "path", False),
    ("no layers", lambda w: cfg(layers=[]), ValueError, "layers", False),
    ("duplicate layer", lambda w: cfg(layers=[layer(), layer()]), ValueError, "layer_id", False),
    ("empty role", lambda w: BufferConfig("", 64), ValueError, "role", False),
    ("zero size", lambda w: BufferConfig("key", 0), ValueError, "size", False),
    (
        "override not dividing",
        lambda w: cfg(layers=[layer(buffers=[BufferConfig("key", 64, 3)])]),
        ValueError,
        "tokens_per_block_override",
        False,
    ),
    (
        "duplicate role",
        lambda w: layer(buffers=[BufferConfig("key", 64), BufferConfig("key", 64)]),
        ValueError,
        "role",
        False,
    ),
    ("sinks without window", lambda w: layer(num_sink_tokens=4), ValueError, "num_sink_tokens", False),
    ("window zero", lambda w: layer(sliding_window_size=0), ValueError, "sliding_window_size", False),
    ("max util zero", lambda w: cfg(max_util_for_resume=0.0), ValueError, "max_util_for_resume", False),
    ("max util above one", lambda w: cfg(max_util_for_resume=1.5), ValueError, "max_util_for_resume", False),
    (
        "ratio length",
        lambda w: KVCacheManager(
            cfg(
                layers=[
                    layer(),
                    layer(layer_id=LayerId(1), buffers=[BufferConfig("key", 128)], sliding_window_size=16),
                ],
                initial_pool_ratio=[1.0],
            )
        ),
        ValueError,
        "initial_pool_ratio",
        False,
    ),
    ("ratio sum", lambda w: cfg(initial_pool_ratio=[0.9]), ValueError, "initial_pool_ratio", False),
    ("ratio nan", lambda w: cfg(initial_pool_ratio=[float("nan")]), ValueError, "initial_pool_ratio", False),
    ("backend name", lambda w: cfg(backend="gpu"), ValueError, "backend", False),
    (
        "quota too small",
        lambda w: KVCacheManager(cfg(cache_tiers=[GpuCacheTierConfig(100)])),
        ValueError,
        "quota",
        False,
    ),
    ("config type", lambda w: KVCacheManager("cfg"), TypeError, "config", True),  # type: ignore[arg-type]
    ("constraint type", lambda w: cfg(constraints=[1]), TypeError, "constraints", True),
    ("typical step type", lambda w: cfg(typical_step=KVCacheDesc(8, 0)), TypeError, "typical_step", True),
    ("desc history above capacity", lambda w: KVCacheDesc(5, 6), ValueError, "history_length", False),
    ("batch desc type", lambda w: BatchDesc([5]), TypeError, "kv_caches", True),  # type: ignore[list-item]
    ("rewind negative", lambda w: SwaScratchReuseConfig(-1), ValueError, "max_rewind_len", False),
    ("salt negative", lambda w: ReuseScope(salt=-1), ValueError, "salt", False),
    ("lora id str", lambda w: ReuseScope(lora_id="a"), TypeError, "lora_id", True),  # type: ignore[arg-type]
    # ---- manager calls
    ("create scope type", lambda w: w.m.create_kv_cache(reuse_scope="s"), TypeError, "reuse_scope", True),  # type: ignore[arg-type]
    (
        "create callback",
        lambda w: w.m.create_kv_cache(custom_priority_callback=5),
        TypeError,
        "custom_priority_callback",
        False,
    ),  # type: ignore[arg-type]
    ("create negative token", lambda w: w.m.create_kv_cache(input_tokens=[1, -1]), ValueError, "input_tokens", False),
    ("create float token", lambda w: w.m.create_kv_cache(input_tokens=[1.5]), TypeError, "input_tokens", False),  # type: ignore[list-item]
    ("create bool token", lambda w: w.m.create_kv_cache(input_tokens=[True, 3]), TypeError, "input_tokens", False),
    ("probe huge token", lambda w: w.m.probe_reuse(input_tokens=[2**32]), ValueError, "input_tokens", False),
    ("probe scope type", lambda w: w.m.probe_reuse(reuse_scope=3), TypeError, "reuse_scope", True),  # type: ignore[arg-type]
    ("unknown layer", lambda w: w.m.get_layer_group_id(LayerId(99)), ValueError, "layer_id", False),
    ("unknown role", lambda w: w.m.get_mem_pool_base_address(LayerId(0), "nope"), ValueError, "role", False),
    (
        "index mode type",
        lambda w: w.m.get_mem_pool_base_address(LayerId(0), "key", "PER_LAYER"),  # type: ignore[arg-type]
        TypeError,
        "index_mode",
        True,
    ),
    ("stride unknown layer", lambda w: w.m.get_page_stride(LayerId(77), "key"), ValueError, "layer_id", False),
    ("converter unknown role", lambda w: w.m.get_page_index_converter(LayerId(0), "x"), ValueError, "role", False),
    ("upper bound unknown role", lambda w: w.m.get_page_index_upper_bound(LayerId(1), "q"), ValueError, "role", False),
    ("manager index mode type", lambda w: w.m.supports_index_mode(1), TypeError, "mode", True),  # type: ignore[arg-type]
    ("statistics level", lambda w: w.m.get_storage_statistics(5), ValueError, "level", False),  # type: ignore[arg-type]
    ("quota level", lambda w: w.m.get_quota(-1), ValueError, "level", False),  # type: ignore[arg-type]
    ("clamp batch zero", lambda w: w.m.clamp_max_seq_len_for_mem(0, 10), ValueError, "batch_size", False),
    (
        "clamp bound negative",
        lambda w: w.m.clamp_max_seq_len_for_mem(1, -1),
        ValueError,
        "token_num_upper_bound",
        False,
    ),
    ("clear while open", lambda w: w.m.clear_reusable_blocks(), LogicError, "close", False),
    ("shutdown while open", lambda w: w.m.shutdown(), LogicError, "close", False),
    (
        "aggregated unknown role",
        lambda w: list(w.m.get_aggregated_pages([(LayerId(0), "zz")])),
        ValueError,
        "role",
        False,
    ),  # type: ignore[list-item]
    # ---- per request
    ("resize negative", lambda w: w.active.resize(-1), ValueError, "capacity", False),
    ("resize str", lambda w: w.active.resize("5"), TypeError, "capacity", True),  # type: ignore[arg-type]
    ("history negative", lambda w: w.active.resize(50, -3), ValueError, "history_length", False),
    ("history shrinks", lambda w: w.active.resize(50, 10), LogicError, "history_length", False),
    ("capacity below history", lambda w: w.active.resize(20), LogicError, "capacity", False),
    ("capacity above the limit", lambda w: w.active.resize(2**40), ValueError, "capacity", False),
    ("resize suspended", lambda w: w.suspended.resize(30), LogicError, "ACTIVE", False),
    ("resize closed", lambda w: w.closed.resize(30), LogicError, "ACTIVE", False),
    ("commit beyond capacity", lambda w: w.active.commit(list(range(10))), LogicError, "capacity", False),
    ("commit negative", lambda w: w.fresh.commit([-1]), ValueError, "accepted_input_tokens", False),
    ("commit str", lambda w: w.fresh.commit(["x"]), TypeError, "accepted_input_tokens", False),  # type: ignore[list-item]
    ("commit beams", lambda w: w.active.commit([1], beam_search_indices=[0]), ValueError, "beam_search_indices", False),
    ("commit suspended", lambda w: w.suspended.commit([1]), LogicError, "ACTIVE", False),
    ("resume active", lambda w: w.active.resume(), LogicError, "SUSPENDED", False),
    ("resume bad stream", lambda w: w.suspended.resume(cuda_stream=-1), ValueError, "cuda_stream", False),
    ("suspend suspended", lambda w: w.suspended.suspend(), LogicError, "ACTIVE", False),
    ("stop closed", lambda w: w.closed.stop_committing(), LogicError, "CLOSED", False),
    ("indices group", lambda w: w.active.get_base_page_indices(LayerGroupId(5)), ValueError, "layer_group_id", False),
    ("indices beam", lambda w: w.active.get_base_page_indices(LayerGroupId(0), 1), ValueError, "beam", False),  # type: ignore[arg-type]
    ("indices group str", lambda w: w.active.get_base_page_indices("0"), TypeError, "layer_group_id", True),  # type: ignore[arg-type]
    (
        "buf format",
        lambda w: w.active.set_base_page_index_buf(0, LayerGroupId(0), memoryview(bytearray(64))),  # type: ignore[arg-type]
        ValueError,
        "buf",
        False,
    ),
    ("buf type", lambda w: w.active.set_base_page_index_buf(0, LayerGroupId(0), b"xx"), TypeError, "buf", True),  # type: ignore[arg-type]
    (
        "buf too short",
        lambda w: w.active.set_base_page_index_buf(0, LayerGroupId(0), memoryview(array("i", [0]))),  # type: ignore[arg-type]
        ValueError,
        "buf",
        False,
    ),
    ("buf closed", lambda w: w.closed.set_base_page_index_buf(0, LayerGroupId(0), None), LogicError, "CLOSED", False),  # type: ignore[arg-type]
    ("scratch group", lambda w: w.active.get_scratch_desc(LayerGroupId(9)), ValueError, "layer_group_id", False),
    ("cache index mode type", lambda w: w.active.supports_index_mode("x"), TypeError, "mode", True),  # type: ignore[arg-type]
    ("stream negative", lambda w: setattr(w.active, "cuda_stream", -1), ValueError, "cuda_stream", False),
    (
        "capacity setter short of memory",
        lambda w: setattr(w.active, "capacity", 10**6),
        OutOfPagesError,
        "capacity",
        False,
    ),
    ("history setter shrinks", lambda w: setattr(w.active, "history_length", 0), LogicError, "history_length", False),
    (
        "scratch without config",
        lambda w: setattr(w.fresh, "enable_swa_scratch_reuse", True),
        LogicError,
        "swa_scratch_reuse",
        False,
    ),
    (
        "callback out of range",
        lambda w: resize_with_callback(w, bad_priority),
        ValueError,
        "custom_priority_callback",
        False,
    ),
    ("callback raises", lambda w: resize_with_callback(w, raising_priority), RuntimeError, "callback failed", False),
]


def test_the_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


def test_bools_are_refused_as_sizes(make_manager: MakeManager, tmp_path: object) -> None:
    m = make_manager(kv_layers(2, T), T, 16 * 2 * 2 * REC * T)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    kv.commit(seq(1, 3))
    before = cache_state(kv)

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
        assert cache_state(kv) == before
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


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_misuse_is_refused_cleanly(case: Case) -> None:
    _, call, exc, names, mypyc_checked = case
    w = make_world()
    before = snapshot(w)
    with pytest.raises(exc) as info:
        call(w)
    if not (mypyc_checked and kvm.compiled):
        assert names.lower() in str(info.value).lower(), f"the message does not name {names!r}: {info.value}"
    assert snapshot(w) == before
    still_serves(w)
    for kv in (w.active, w.suspended, w.fresh):
        kv.close()
    w.m.shutdown()


# ---------------------------------------------------------------------- bools are not ints, in both modes
def with_beams(w: World, call: Callable[[KVCache], object]) -> None:
    """``call`` on a new ACTIVE cache of two beams (no pages), closed after."""
    kv = w.m.create_kv_cache(beam_width=2)
    kv.resume()
    try:
        call(kv)
    finally:
        kv.close()


def adapter(w: World) -> KVCacheResourceManager:
    return KVCacheResourceManager(manager=w.m)


#: every public int argument (and int field of a config or value type), given a bool: (name, call)
BOOL_CASES: list[tuple[str, Callable[[World], object]]] = [
    # ---- KVCache
    ("get_committed_tokens beam", lambda w: w.active.get_committed_tokens(True)),
    ("get_scratch_desc layer_group_id", lambda w: w.active.get_scratch_desc(True)),
    ("get_base_page_indices layer_group_id", lambda w: w.active.get_base_page_indices(True)),
    ("get_base_page_indices beam_id", lambda w: w.active.get_base_page_indices(0, False)),
    ("set_base_page_index_buf beam", lambda w: w.active.set_base_page_index_buf(False, 0, None)),
    ("set_base_page_index_buf layer_group_id", lambda w: w.active.set_base_page_index_buf(0, True, None)),
    ("get_ssm_state_index layer_group_id", lambda w: w.active.get_ssm_state_index(True)),
    ("get_ssm_state_index beam", lambda w: w.active.get_ssm_state_index(0, True)),
    ("get_aggregated_page_indices layer_group_id", lambda w: list(w.active.get_aggregated_page_indices(True))),
    ("get_aggregated_page_indices beam_id", lambda w: list(w.active.get_aggregated_page_indices(0, False))),
    ("next_snapshot_position position", lambda w: w.active.next_snapshot_position(True)),
    ("plan_snapshot position", lambda w: w.active.plan_snapshot(True)),
    ("resume cuda_stream", lambda w: w.suspended.resume(True)),
    ("prefetch target_level", lambda w: w.suspended.prefetch(False)),
    ("resize capacity", lambda w: w.active.resize(True)),
    ("resize history_length", lambda w: w.active.resize(40, True)),
    ("stop_committing final_beam", lambda w: w.active.stop_committing(False)),
    ("commit beam_search_indices", lambda w: with_beams(w, lambda kv: kv.commit([[1], [2]], [True, 0]))),
    ("capacity setter", lambda w: setattr(w.active, "capacity", True)),
    ("history_length setter", lambda w: setattr(w.active, "history_length", True)),
    ("cuda_stream setter", lambda w: setattr(w.active, "cuda_stream", True)),
    # ---- KVCacheManager
    ("create_kv_cache beam_width", lambda w: w.m.create_kv_cache(beam_width=True)),
    ("create_kv_cache prompt_length", lambda w: w.m.create_kv_cache(prompt_length=True)),
    ("get_layer_group_id layer_id", lambda w: w.m.get_layer_group_id(True)),
    ("get_layer_group_info layer_group_id", lambda w: w.m.get_layer_group_info(True)),
    ("get_mem_pool_base_address layer_id", lambda w: w.m.get_mem_pool_base_address(True, "key")),
    ("get_page_stride layer_id", lambda w: w.m.get_page_stride(True, "key")),
    ("get_page_index_upper_bound layer_id", lambda w: w.m.get_page_index_upper_bound(True, "key")),
    ("get_page_index_converter layer_id", lambda w: w.m.get_page_index_converter(True, "key")),
    ("get_aggregated_pages layer_id", lambda w: list(w.m.get_aggregated_pages([BufferId(True, "key")]))),
    ("get_storage_statistics level", lambda w: w.m.get_storage_statistics(False)),
    ("get_tier_statistics level", lambda w: w.m.get_tier_statistics(False)),
    ("get_quota level", lambda w: w.m.get_quota(False)),
    ("resize cache_level", lambda w: w.m.resize(False, 1 << 20)),
    ("resize quota", lambda w: w.m.resize(0, True)),
    ("resize_batch num_new_tokens", lambda w: w.m.resize_batch([w.active], True)),
    ("clamp batch_size", lambda w: w.m.clamp_max_seq_len_for_mem(True, 64)),
    ("clamp token_num_upper_bound", lambda w: w.m.clamp_max_seq_len_for_mem(1, True)),
    ("clamp beam_width", lambda w: w.m.clamp_max_seq_len_for_mem(1, 64, True)),
    ("event manager max_events", lambda w: KVCacheEventManager(True)),
    # ---- the engine adapter
    ("EngineRequest request_id", lambda w: EngineRequest(True, [1], 1)),
    ("EngineRequest max_new_tokens", lambda w: EngineRequest(1, [1], True)),
    ("EngineRequest context_chunk_size", lambda w: EngineRequest(1, [1], 1, True)),
    ("EngineRequest priority", lambda w: EngineRequest(1, [1], 1, priority=True)),
    ("EngineRequest.tokens begin", lambda w: EngineRequest(1, [1, 2], 1).tokens(True, 2)),
    ("EngineRequest.tokens end", lambda w: EngineRequest(1, [1, 2], 1).tokens(0, True)),
    ("add_padding_request request_id", lambda w: adapter(w).add_padding_request(True)),
    ("add_padding_request token", lambda w: adapter(w).add_padding_request(1, token=True)),
    ("get_batch_cache_indices layer_group_id", lambda w: adapter(w).get_batch_cache_indices([], True)),
    ("get_batch_cache_indices beam", lambda w: adapter(w).get_batch_cache_indices([], 0, False)),
    (
        "get_kernel_page_indices layer_id",
        lambda w: adapter(w).get_kernel_page_indices(EngineRequest(1, [1], 1), True, "key"),
    ),
    ("get_buffers layer_id", lambda w: adapter(w).get_buffers(True, "key")),
    # ---- configuration and value types
    ("tokens_per_block", lambda w: cfg(tokens_per_block=True)),
    ("ssm_reuse_interval", lambda w: cfg(ssm_reuse_interval=True)),
    ("ssm_lower_tier_interval", lambda w: cfg(ssm_lower_tier_interval=True)),
    ("ssm_snapshots_from_start", lambda w: cfg(ssm_snapshots_from_start=[True])),
    ("gpu quota", lambda w: GpuCacheTierConfig(True)),
    ("remote timeout_ms", lambda w: RemoteCacheTierConfig("redis://127.0.0.1:1", "m", timeout_ms=True)),
    ("buffer size", lambda w: BufferConfig("key", True)),
    ("layer_id", lambda w: layer(layer_id=True)),
    ("sliding_window_size", lambda w: layer(sliding_window_size=True)),
    ("KVCacheDesc beam_width", lambda w: KVCacheDesc(8, 0, True)),
    ("BatchDesc system_prompt_length", lambda w: BatchDesc([KVCacheDesc(8, 0)], system_prompt_length=True)),
    ("max_rewind_len", lambda w: SwaScratchReuseConfig(True)),
    ("Retention priority", lambda w: Retention(True, 1.0)),
    ("Retention start", lambda w: Retention(50, 1.0, start=True)),
    ("RetentionRange start", lambda w: RetentionRange(True, 8, 50)),
    ("RetentionRange end", lambda w: RetentionRange(0, True, 50)),
    ("RetentionRange priority", lambda w: RetentionRange(0, 8, True)),
    ("RequestRetention decode_priority", lambda w: RequestRetention(decode_priority=True)),
    ("ReuseScope lora_id", lambda w: ReuseScope(lora_id=True)),
    ("ReuseScope salt", lambda w: ReuseScope(salt=False)),
]


@pytest.mark.parametrize("case", BOOL_CASES, ids=[c[0] for c in BOOL_CASES])
def test_a_bool_is_refused_where_an_int_is_expected(case: tuple[str, Callable[[World], object]]) -> None:
    """``True`` / ``False`` are ints to Python (and, compiled, to an ``int`` parameter): every public
    int argument refuses them with a ``TypeError`` (both modes), changing nothing."""
    _, call = case
    w = make_world()
    before = snapshot(w)
    with pytest.raises(TypeError, match="int"):
        call(w)
    assert snapshot(w) == before
    still_serves(w)
    for kv in (w.active, w.suspended, w.fresh):
        kv.close()
    w.m.shutdown()
