"""The invariant checker catches each kind of broken state (so the tests that run it can fail)."""

from __future__ import annotations

import pytest
from conftest import MakeManager, kv_layers

from kv_cache_manager_v2 import CacheLevel, KVCache, KVCacheManager, LayerGroupId, SlotId
from kv_cache_manager_v2._page import Page
from kv_cache_manager_v2._storage._policies._frequency import FrequencyEvictor
from kv_cache_manager_v2._storage._policies._use_history import state_of

T = 8
LC0 = LayerGroupId(0)


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


def spilled(make_manager: MakeManager, tmp_path: object) -> tuple[KVCacheManager, KVCache, KVCache]:
    """GPU + host + disk; ``a`` suspended with its 2 pages spilled to host, ``hog`` active on the GPU."""
    slot = 2 * 2 * 32 * T
    m = make_manager(kv_layers(2, T), T, 2 * slot, host_quota=2 * slot, disk_quota=4 * slot, disk_path=str(tmp_path))
    a = m.create_kv_cache()
    a.resume()
    assert a.resize(2 * T)
    a.suspend()
    hog = m.create_kv_cache()
    hog.resume()
    assert hog.resize(2 * T)
    assert [p.level for p in a.block_table.all_pages()] == [1, 1]
    m.check_invariants()
    return m, a, hog


def test_held_page_missing_from_its_evictor_is_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    page = a.block_table.all_pages()[0]
    page.storage.evictor.remove(page)
    with pytest.raises(AssertionError, match=r"HELD page .* not evictable"):
        m.check_invariants()
    page.storage.evictor.add(page)
    a.close()
    hog.close()


def test_page_level_disagreeing_with_its_storage_is_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    page = a.block_table.all_pages()[0]
    page.level = CacheLevel(2)
    with pytest.raises(AssertionError, match="says level 2"):
        m.check_invariants()
    page.level = CacheLevel(1)
    a.close()
    hog.close()


def test_active_cache_with_a_page_below_the_gpu_is_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    page = hog.block_table.all_pages()[0]
    host = m._storage.levels[CacheLevel(1)].items[0]
    gpu = page.storage
    page.storage, page.level = host, CacheLevel(1)  # pretend it lives on the host
    with pytest.raises(AssertionError):
        m.check_invariants()
    page.storage, page.level = gpu, CacheLevel(0)
    a.close()
    hog.close()


def test_live_indices_of_a_suspended_cache_are_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    a.block_table.live = True
    with pytest.raises(AssertionError, match="indices are live"):
        m.check_invariants()
    a.block_table.live = False
    a.close()
    hog.close()


def test_two_pages_in_one_slot_of_a_lower_level_is_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    p0, p1 = a.block_table.all_pages()
    saved = p1.slot
    p1.slot = p0.slot
    with pytest.raises(AssertionError, match="owned twice"):
        m.check_invariants()
    p1.slot = saved
    a.close()
    hog.close()


def test_lost_page_count_out_of_sync_is_caught(make_manager: MakeManager, tmp_path: object) -> None:
    m, a, hog = spilled(make_manager, tmp_path)
    m._storage.levels[CacheLevel(1)].items[0].num_lost += 1
    with pytest.raises(AssertionError, match="lost pages"):
        m.check_invariants()
    m._storage.levels[CacheLevel(1)].items[0].num_lost -= 1
    a.close()
    hog.close()


def test_pins_beyond_the_share_are_caught(make_manager: MakeManager) -> None:
    m, _, b = setup(make_manager)
    b.close()
    assert m.pin(list(range(3 * T))) == 3 * T
    group = m._storage.gpu[0]
    share = group.pinned_share
    group.pinned_share = 2.5 / group.num_slots  # (a tier shrunk under its pins)
    with pytest.raises(AssertionError, match=r"holds 3 pinned pages, beyond max_pinned_share .* \(2\)"):
        m.check_invariants()
    group.pinned_share = share
    m.check_invariants()


def frequency_heap(make_manager: MakeManager) -> tuple[KVCacheManager, list[Page], list[Page], Page]:
    """A manager with the frequency policy: 4 reusable one-block leaves that two requests used
    (rate > 0: its heap), a one-off 2-block sequence whose leaf has rate 0 (its FIFO) and whose
    parent is parked. Returns the manager, the heap's pages, the FIFO's and the parked one."""
    m = make_manager(kv_layers(2, T), eviction_policy="frequency")
    for r in range(4):
        tokens = [r * 1000 + i for i in range(T)]
        for _ in range(2):
            kv = m.create_kv_cache(input_tokens=tokens)
            kv.resume()
            assert kv.resize(T)
            kv.commit(tokens[kv.history_length :])
            kv.close()
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(2 * T)
    kv.commit(list(range(50_000, 50_000 + 2 * T)))
    kv.close()
    m.check_invariants()
    evictor = m._storage.gpu.items[0].evictor
    assert type(evictor) is FrequencyEvictor
    pages = evictor.pages()
    parked = pages[-1]  # the parked parent comes last
    assert evictor.is_parked(parked)
    heap = [p for p in pages[:-1] if state_of(p).pos >= 0]
    fifo = [p for p in pages[:-1] if state_of(p).pos < 0]
    assert (
        len(heap) == 4 and len(fifo) == 1 and all(state_of(p).uses == 2 for p in heap) and state_of(fifo[0]).uses == 1
    )
    return m, heap, fifo, parked


@pytest.mark.parametrize("damage", ["order", "position", "fifo", "count", "parked", "mask"])
def test_broken_frequency_evictor_is_caught(make_manager: MakeManager, damage: str) -> None:
    m, heap, fifo, parked = frequency_heap(make_manager)
    evictor = m._storage.gpu.items[0].evictor
    assert type(evictor) is FrequencyEvictor
    saved = (state_of(heap[0]).key, state_of(heap[1]).pos, state_of(fifo[0]).pos, evictor.count, evictor._nonempty)
    if damage == "order":
        state_of(heap[0]).key = state_of(heap[-1]).key + 1.0
        says = "heap order broken"
    elif damage == "position":
        state_of(heap[1]).pos += 1
        says = "records position"
    elif damage == "fifo":
        state_of(fifo[0]).pos = 0
        says = "FIFO list broken"
    elif damage == "count":
        evictor.count += 1
        says = "counts 7 pages but holds 6"
    elif damage == "parked":
        parked.anchor = False
        says = "a parked page that should be a candidate"
    else:
        evictor._nonempty = 0
        says = "non-empty bit out of date"
    with pytest.raises(AssertionError, match=says):
        m.check_invariants()
    state_of(heap[0]).key, state_of(heap[1]).pos, state_of(fifo[0]).pos, evictor.count, evictor._nonempty = saved
    parked.anchor = True
    m.check_invariants()  # repaired: the manager shuts down cleanly
