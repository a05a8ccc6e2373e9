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
print(f"layout: {manager.num_layers} layers in {len(manager.layer_grouping)} layer group(s); "
      f"{group.num_slots} slots of {group.pools[0].slot_bytes} bytes")

system_prompt = list(range(1000, 1000 + 1024))
requests = []
for r in range(4):
    prompt = system_prompt + [r * 7919 + i for i in range(512)]
    print(f"request {r}: reusable prefix {manager.probe_reuse(None, prompt)} of {len(prompt)} tokens")
    kv = manager.create_kv_cache(input_tokens=prompt, id=r)
    assert kv.resume()
    assert kv.resize(len(prompt))  # prefill: pages for the whole prompt
    kv.commit(prompt)  # the engine computed the prompt's KV
    requests.append(kv)

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
print(f"decode: {steps} steps x {len(requests)} requests, "
      f"{elapsed / steps / len(requests) * 1e6:.2f} us per request per step (resize + indices + commit)")

kv = requests[0]
conv = manager.get_page_index_converter(kvm.LayerId(3), "value")
indices = conv(kv.get_base_page_indices(kvm.LayerGroupId(0)), kvm.PageIndexMode.PER_LAYER)
base = manager.get_mem_pool_base_address(kvm.LayerId(3), "value", kvm.PageIndexMode.PER_LAYER)
stride = manager.get_page_stride(kvm.LayerId(3), "value")
print(f"request 0, layer 3 values: block 0 at {hex(base + indices[0] * stride)}, {len(indices)} pages")

for kv in requests:
    kv.close()
stats = manager.get_storage_statistics()[0]
print(f"after close: {stats.free} of {stats.total} slots free")
manager.shutdown()
