"""A short tour: a manager on the host-emulated backend serving a few requests.

Run with ``bash scripts/demo.sh`` (sets up .venv first) or ``python examples/demo.py``.
"""

from __future__ import annotations

import time

import kv_cache_manager_v2 as kvm

T = 32
layers = [
    kvm.AttentionLayerConfig(kvm.LayerId(i), [kvm.BufferConfig("key", 4096), kvm.BufferConfig("value", 4096)])
    for i in range(8)
]
config = kvm.KVCacheManagerConfig(
    tokens_per_block=T, cache_tiers=[kvm.GpuCacheTierConfig(256 << 20)], layers=layers, backend="host"
)
manager = kvm.KVCacheManager(config)
print(f"mode: {'compiled (mypyc)' if kvm.compiled else 'interpreted'}; backend: {manager.backend_name}")
(group,) = manager.pool_group_descs
print(
    f"layout: {manager.num_layers} layers in {len(manager.layer_grouping)} layer group(s); "
    f"{group.num_slots} slots of {group.pools[0].slot_bytes} bytes"
)

system_prompt = list(range(1000, 1000 + 1024))
requests = []
for r in range(4):
    prompt = system_prompt + [r * 7919 + i for i in range(512)]
    # the model must compute at least one token, so the last prompt token is not matched
    kv = manager.create_kv_cache(input_tokens=prompt[:-1], id=r)
    reused = kv.history_length
    assert kv.resume()  # SUSPENDED -> ACTIVE
    assert kv.resize(len(prompt))  # pages for the rest of the prompt
    kv.commit(prompt[reused:])  # the engine computed positions reused..len(prompt)
    print(f"request {r}: {len(prompt)} prompt tokens, {reused} reused from the cache, {len(prompt) - reused} computed")
    requests.append(kv)

s = manager.reuse_statistics
print(f"reuse: {s.reused_blocks} blocks reused, {s.missed_blocks} missed, hit rate {s.hit_rate:.2f}")
stats = manager.get_storage_statistics()[0]
print(f"after prefill: {stats.total - stats.free} of {stats.total} slots in use")

steps = 128
start = time.perf_counter()
for step in range(steps):
    for kv in requests:
        kv.resize(kv.capacity + 1)  # room for the next token
        kv.get_base_page_indices(kvm.LayerGroupId(0))  # what the kernel reads
        kv.commit([step])  # the generated token
elapsed = time.perf_counter() - start
print(
    f"decode: {steps} steps x {len(requests)} requests, "
    f"{elapsed / steps / len(requests) * 1e6:.2f} us per request per step (resize + indices + commit)"
)

kv = requests[0]
conv = manager.get_page_index_converter(kvm.LayerId(3), "value")
indices = conv(kv.get_base_page_indices(kvm.LayerGroupId(0)), kvm.PageIndexMode.PER_LAYER)
base = manager.get_mem_pool_base_address(kvm.LayerId(3), "value", kvm.PageIndexMode.PER_LAYER)
stride = manager.get_page_stride(kvm.LayerId(3), "value")
print(f"request 0, layer 3 values: block 0 at {hex(base + indices[0] * stride)}, {len(indices)} pages")

late = [1000 + i for i in range(1024)] + [0 * 7919 + i for i in range(512)] + list(range(64))
print(
    f"a new request continuing request 0's conversation: {manager.probe_reuse(None, late)} tokens reusable "
    "(blocks committed during decode are reusable at once)"
)
for kv in requests:
    kv.close()
stats = manager.get_storage_statistics()[0]
print(f"after close: {stats.free} free + {stats.evictable} reusable (evictable) of {stats.total} slots")
manager.clear_reusable_blocks()
print(f"after clear_reusable_blocks: {manager.get_storage_statistics()[0].free} free")
manager.shutdown()
