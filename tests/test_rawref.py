"""rawref: lifetime, invalidation, hashing, no reference leaks, use from compiled code."""

from __future__ import annotations

import gc
import sys

import pytest

import rawref


class Target:
    def __init__(self) -> None:
        self._rawref: rawref.ref[Target] | None = None

    def __del__(self) -> None:
        if self._rawref is not None:
            self._rawref.invalidate()


class Slotted:
    __slots__ = ("x",)


def test_ref_returns_object_while_alive_and_none_after_del() -> None:
    t = Target()
    r = rawref.ref(t)
    assert r() is t and r.is_valid
    del t
    assert r() is None and not r.is_valid


def test_one_ref_per_object() -> None:
    t = Target()
    assert rawref.ref(t) is rawref.ref(t)
    assert rawref.ref(Target()) is not rawref.ref(t)


def test_invalidate_then_new_ref() -> None:
    t = Target()
    r = rawref.ref(t)
    r.invalidate()
    assert r() is None
    r2 = rawref.ref(t)
    assert r2 is not r and r2() is t


def test_hash_and_equality_by_identity() -> None:
    a, b = Target(), Target()
    ra, rb = rawref.ref(a), rawref.ref(b)
    s = {ra, rb, rawref.ref(a)}
    assert len(s) == 2 and ra in s
    assert ra != rb and ra == rawref.ref(a)
    assert hash(ra) == hash(rawref.ref(a))


def test_no_reference_leaks() -> None:
    t = Target()
    before = sys.getrefcount(t)
    r = rawref.ref(t)
    for _ in range(100):
        x = r()
        del x
        rawref.ref(t)
    assert sys.getrefcount(t) == before
    r_before = sys.getrefcount(r)
    for _ in range(100):
        rawref.ref(t)
    assert sys.getrefcount(r) == r_before


def test_null_constant() -> None:
    assert rawref.NULL() is None
    assert not rawref.NULL.is_valid
    assert "invalid" in repr(rawref.NULL)


def test_generic_alias_and_errors() -> None:
    assert rawref.ref[int] is not None  # usable in runtime annotations
    with pytest.raises(TypeError, match="_rawref"):
        rawref.ref(Slotted())
    with pytest.raises(TypeError):
        rawref.ref(Target())(1)  # type: ignore[call-arg]


def test_calls_other_than_the_usual_ones() -> None:
    # ref(obj) and r() take a fast path; the rest still parse their arguments
    t = Target()
    r = rawref.ref(t)
    assert rawref.ref(obj=t) is r
    assert r.__call__() is t
    with pytest.raises(TypeError, match="takes no arguments"):
        r(x=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes no arguments"):
        r.__call__(1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        rawref.ref()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        rawref.ref(t, t)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        rawref.ref(t, bad=1)  # type: ignore[call-arg]
    r.invalidate()
    assert r() is None and r.__call__() is None


def test_from_compiled_code_cache_closed_on_gc() -> None:
    """The manager (compiled in production mode) tracks open caches through rawrefs."""
    from conftest import kv_layers, make_config

    from kv_cache_manager_v2 import KVCacheManager

    m = KVCacheManager(make_config(kv_layers(2)))
    kv = m.create_kv_cache()
    r = rawref.ref(kv)
    assert r() is kv and m.num_open_caches == 1
    del kv
    gc.collect()
    assert r() is None and m.num_open_caches == 0
    m.shutdown()


def test_page_invalidates_its_ref_when_collected_without_free() -> None:
    from conftest import kv_layers, make_config

    from kv_cache_manager_v2 import KVCacheManager, LayerGroupId, Priority, SlotId
    from kv_cache_manager_v2._page import Page

    m = KVCacheManager(make_config(kv_layers(1)))
    storage = m._storage.gpu.items[0]
    page = Page(storage, SlotId(storage.allocator.allocate_one()), LayerGroupId(0), Priority(35), True)
    r = rawref.ref(page)
    del page
    gc.collect()
    assert r() is None and not r.is_valid  # no dangling pointer


def test_fresh_and_the_invalidate_function() -> None:
    """``fresh`` makes a ref stored nowhere (its owner keeps it); ``invalidate(r)`` is ``r.invalidate()``."""
    t = Target()
    r = rawref.fresh(t)
    assert r() is t and t._rawref is None  # stored nowhere: the owner stores it
    t._rawref = r
    assert rawref.ref(t) is r  # ... and then ref() finds it
    rawref.invalidate(r)
    assert r() is None and not r.is_valid
    with pytest.raises(TypeError, match=r"takes a rawref\.ref"):
        rawref.invalidate(t)  # type: ignore[arg-type]
    before = sys.getrefcount(t)
    for _ in range(100):
        rawref.fresh(t)
    assert sys.getrefcount(t) == before  # borrowed, like ref()


def test_a_page_keeps_one_ref_made_by_the_page_itself() -> None:
    from conftest import kv_layers, make_config

    from kv_cache_manager_v2 import KVCacheManager, LayerGroupId, Priority, SlotId
    from kv_cache_manager_v2._page import Page

    m = KVCacheManager(make_config(kv_layers(1)))
    storage = m._storage.gpu.items[0]
    page = Page(storage, SlotId(storage.allocator.allocate_one()), LayerGroupId(0), Priority(35), True)
    r = page.ref()
    assert page.ref() is r and rawref.ref(page) is r and r() is page
    page.free()
    assert r() is None and page.ref() is not r  # freed: a later ref is a new one
    m.shutdown()
