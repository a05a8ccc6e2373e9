"""Replays the repository's Mooncake-format trace (metadata only) and checks prefix matching against an
independent model: a set of block-aligned prefix ids."""

from __future__ import annotations

import json

from conftest import TRACE, make_config

from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, KVCacheManager, LayerId

T = 32


def load(n: int) -> list[dict[str, object]]:
    out = []
    with open(TRACE) as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


def prompt_of(req: dict[str, object]) -> list[int]:
    ids = req["hash_ids"]
    assert isinstance(ids, list)
    n = req["input_length"]
    assert isinstance(n, int)
    return [h * 512 + i for h in ids for i in range(512)][:n]


def manager(slots: int) -> KVCacheManager:
    layers = [AttentionLayerConfig(LayerId(0), [BufferConfig("key", 64), BufferConfig("value", 64)])]
    return KVCacheManager(make_config(layers, tokens_per_block=T, quota=slots * 128, enable_partial_reuse=False))


def test_matches_agree_with_a_prefix_set_model() -> None:
    reqs = load(120)
    m = manager(200_000)  # holds everything: no eviction
    seen: set[int] = set()
    total_hits = 0
    for req in reqs:
        prompt = prompt_of(req)
        query = prompt[:-1]
        expected = 0
        pid = 0
        for o in range(len(query) // T):
            pid = hash((pid, tuple(query[o * T : (o + 1) * T])))
            if pid not in seen:
                break
            expected += T
        assert m.probe_reuse(None, query) == expected
        kv = m.create_kv_cache(input_tokens=query)
        assert kv.history_length == expected
        assert kv.resume() and kv.resize(len(prompt))
        kv.commit(prompt[expected:])
        kv.close()
        pid = 0
        for o in range(len(prompt) // T):
            pid = hash((pid, tuple(prompt[o * T : (o + 1) * T])))
            seen.add(pid)
        total_hits += expected
    assert total_hits > 0  # the trace shares prefixes
    st = m.reuse_statistics
    assert st.reused_blocks * T == total_hits


def test_small_cache_evicts_and_stays_consistent() -> None:
    reqs = load(80)
    m = manager(3_000)  # ~96k tokens: far less than the trace's working set
    resized = 0
    for req in reqs:
        prompt = prompt_of(req)
        kv = m.create_kv_cache(input_tokens=prompt[:-1])
        if kv.resume() and kv.resize(len(prompt)):
            kv.commit(prompt[kv.history_length :])
            resized += 1
        kv.close()
        st = m.get_storage_statistics()[0]
        assert st.available == st.total  # nothing open: everything is free or reusable
    assert resized == len(reqs) and m.reuse_statistics.reused_blocks > 0
    m.clear_reusable_blocks()
    assert m.get_storage_statistics()[0].free == 3_000
