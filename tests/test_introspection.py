"""The invariant checker catches each kind of broken state (so the tests that run it can fail)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import kv_layers

from kv_cache_manager_v2 import KVCache, KVCacheManager, LayerGroupId, LifeCycleId, SlotId

T = 8
MakeManager = Callable[..., KVCacheManager]
LC0 = LifeCycleId(0)


def setup(make_manager: MakeManager) -> tuple[KVCacheManager, KVCache, KVCache]:
    m = make_manager(kv_layers(2, T))
    a = m.create_kv_cache()
    a.resume()
    assert a.resize(3 * T)
    a.commit(list(range(3 * T)))
    a.close()  # 3 reusable blocks
    b = m.create_kv_cache(input_tokens=list(range(2 * T)))
    b.resume()
    assert b.resize(4 * T)
    m.check_invariants()
    return m, a, b


def test_clean_state_passes(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    b.suspend()
    m.check_invariants()
    b.close()
    m.check_invariants()
    m.clear_reusable_blocks()
    m.check_invariants()


def test_wrong_owner_count_is_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    page = b.block_table.pages[LC0][0]
    assert page is not None
    page.num_locks += 1
    with pytest.raises(AssertionError, match="locks"):
        m.check_invariants()
    page.num_locks -= 1
    b.close()


def test_index_disagreeing_with_page_is_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    idx = b.get_base_page_indices(LayerGroupId(0))
    saved = idx[3]
    idx[3] = saved + 1
    with pytest.raises(AssertionError, match="index of block 3"):
        m.check_invariants()
    idx[3] = saved
    b.close()


def test_leaked_slot_is_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    slot = m._storage.gpu.items[0].allocator.allocate_one()
    with pytest.raises(AssertionError, match="used slots"):
        m.check_invariants()
    m._storage.gpu.items[0].allocator.free(SlotId(slot))
    b.close()


def test_slot_owned_twice_is_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    pages = b.block_table.pages[LC0]
    p2, p3 = pages[2], pages[3]
    assert p2 is not None and p3 is not None
    saved = p3.slot
    p3.slot = p2.slot
    with pytest.raises(AssertionError):
        m.check_invariants()
    p3.slot = saved
    b.close()


def test_evictor_out_of_sync_is_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    evictor = m._storage.gpu.items[0].evictor
    victim = evictor.pop_victim()  # unowned tree page no longer evictable
    with pytest.raises(AssertionError, match="not evictable"):
        m.check_invariants()
    evictor.add(victim)
    b.close()
