"""A hold that is not a use (``_storage/_shelf.py``, ``Evictor.shelve``/``unshelve``), under every
registered eviction policy: a shelved page is not evicted, and when the hold ends it is back
exactly where it was in its policy's order, with the same state (use counts, values, segments,
the simulated LRU) and the same retention expiry. A prefetch's placing of its reads and fetched
values holds the pages the same prefetch brought or is bringing that way (once it locked and
released them: a use), never evicts them, and a request using a prefetched page later counts as
a use then. Every byte checked through the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REDIS_SERVER, Clock, MakeManager, kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, computed, loader, publish, seq, tiered, tree_pages

from kv_cache_manager_v2 import (
    EVICTION_POLICIES,
    CacheLevel,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kv_cache_manager_v2._common import BAD_PAGE_INDEX, DEFAULT_PRIORITY, Priority
from kv_cache_manager_v2._page import Evictor, Page
from kv_cache_manager_v2._storage._policies._frequency import FrequencyEvictor
from kv_cache_manager_v2._storage._policies._slru import SlruState
from kv_cache_manager_v2._storage._policies._use_history import FrequencyState
from kv_cache_manager_v2._storage._shelf import Shelf
from kv_cache_manager_v2.redis_server import LocalRedisServer

HOST = CacheLevel(1)
DISK = CacheLevel(2)


def evictor(m: KVCacheManager, level: int) -> Evictor:
    return m._storage.levels[level].items[0].evictor


def state(page: Page) -> object:
    """What the page's policy keeps of it (None: nothing), its priority and retention expiry."""
    st = page.policy_state
    kept: object = None
    if isinstance(st, FrequencyState):
        kept = (st.uses, st.first_use, st.use_serial, st.key, st.seq)
    elif isinstance(st, SlruState):
        kept = (st.hit, st.protected)
    return kept, page.priority, page.expires


def recent(ev: Evictor) -> list[bytes]:
    """The frequency policy's simulated LRU (empty for the others)."""
    return list(ev.history.recent) if isinstance(ev, FrequencyEvictor) else []


def snapshot(ev: Evictor) -> list[tuple[int, object]]:
    return [(id(p), state(p)) for p in ev.pages()]


def still_there(before: list[tuple[int, object]], after: list[tuple[int, object]]) -> list[tuple[int, object]]:
    ids = {k for k, _ in after}
    return [x for x in before if x[0] in ids]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_shelved_page_is_not_evicted_and_goes_back_where_it_was(make_manager: MakeManager, policy: str) -> None:
    """Twelve published pages (some reused: frequency counts them, SLRU protects them; some retained
    for a while), five shelved (the first, the last, two adjacent ones, one whose priority changes
    meanwhile): a request's allocation evicts only others; restored, each is back in its place
    with the same state, and the order of the rest is the policy's as before."""
    clock = Clock()
    m = make_manager(kv_layers(2, T), T, 14 * SLOT, host_quota=32 * SLOT, eviction_policy=policy, clock=clock)
    engine = FakeEngine(m)
    docs = [seq(r, 2 * T) for r in range(6)]
    for toks in docs:
        publish(m, toks, engine=engine)
    for toks in docs[1:3]:  # reused: a use of their pages
        publish(m, toks, engine=engine)
    assert m.directives.retain(docs[4], int(DEFAULT_PRIORITY), 30.0).num_blocks == 2
    ev = evictor(m, 0)
    order = ev.pages()
    assert len(order) == 12
    before, lru = snapshot(ev), recent(ev)
    moved = order[6]
    shelved = [order[0], order[3], order[4], order[-1], moved]
    shelf = Shelf()
    shelf.put(shelved)
    shelf.put(shelved)  # (a page shelved already: not again)
    assert len(shelf) == 5 and ev.count == 7 and all(p not in ev.pages() for p in shelved)
    clock.now = 5.0
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(9 * T)  # 2 free slots, then 7 evicted (to the host): all but the shelved
    assert ev.count == 0 and all(p.level == 0 and p.slot >= 0 for p in shelved)
    moved.set_priority(Priority(60))  # (a page retained meanwhile goes where set_priority puts it)
    shelf.restore()
    assert len(shelf) == 0 and ev.count == 5 and ev.structure_error() is None
    after = snapshot(ev)
    assert after[-1][0] == id(moved)
    assert after[:-1] == [x for x in before if x[0] in {id(p) for p in shelved[:4]}]
    assert recent(ev) == lru
    assert ev.pages() == shelved and all(p.num_locks == 0 for p in shelved)
    links = [(p.lru_prev, p.lru_next) for p in shelved]
    if isinstance(ev, FrequencyEvictor):  # (used pages: in the heap, on no list)
        assert links == [(None, None)] * 5
    else:  # linked both ways in that order; the page retained meanwhile alone in its priority's list
        a, b, c, d, _ = shelved
        assert links == [(None, b), (a, c), (b, d), (c, None), (None, None)]
    kv.close()
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_pages_shelved_on_an_evicting_level_go_back_between_the_pages_that_stayed(
    make_manager: MakeManager, policy: str
) -> None:
    """The first blocks of two of four prompts shelved on the last level (frequency parks them:
    their blocks have children), their neighbours evicted meanwhile and new pages listed: back in
    the order of the pages that stayed, before the new ones (LRU, SLRU), with the same values
    (frequency: their children gone, they are candidates again)."""
    m = make_manager(kv_layers(2, T), T, 14 * SLOT, eviction_policy=policy)
    engine = FakeEngine(m)
    docs = [seq(r, 2 * T) for r in range(4)]
    for toks in docs:
        publish(m, toks, engine=engine)
    ev = evictor(m, 0)
    before = snapshot(ev)
    firsts = [tree_pages(m, docs[1])[0], tree_pages(m, docs[2])[0]]
    shelf = Shelf()
    shelf.put(firsts)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(10 * T)  # 6 free slots, then 4 evicted (dropped)
    assert ev.count == 2 and all(p.slot >= 0 for p in firsts)
    kv.close()
    engine.check_invariants = False  # (not while pages are shelved: they count a lock meanwhile)
    computed(m, engine, seq(9, 2 * T), 2 * T).close()  # 2 new pages listed
    new = [id(p) for p in ev.pages()][2:]
    shelf.restore()
    after = snapshot(ev)
    assert len(after) == 6 and ev.structure_error() is None
    olds = [x for x in after if x[0] not in new]
    mine = {id(p) for p in firsts}
    assert [x for x in after if x[0] in mine] == [x for x in before if x[0] in mine]  # same states
    if not isinstance(ev, FrequencyEvictor):  # same order (frequency: by value)
        assert olds == still_there(before, olds)
        assert [x[0] for x in olds] == [id(firsts[0]), id(firsts[1]), *[id(p) for p in tree_pages(m, docs[3])][::-1]]
        assert [x[0] for x in after[4:]] == new
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_shelved_page_whose_block_left_the_tree_is_freed_at_restore(make_manager: MakeManager, policy: str) -> None:
    """A prompt's second block shelved on a GPU of 4 slots (the last level); a request takes 3:
    the first block is evicted and its subtree leaves the tree, the shelved page with it (no
    longer reusable, but not freed while shelved). Restored, its slot is freed, as a last release
    frees it, and nothing lists it."""
    m = make_manager(kv_layers(2, T), T, 4 * SLOT, eviction_policy=policy)
    doc = seq(1, 2 * T)
    publish(m, doc, engine=FakeEngine(m))
    first, second = tree_pages(m, doc)
    shelf = Shelf()
    shelf.put([second])
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T)  # 2 free slots, and the first block's
    assert first.slot == BAD_PAGE_INDEX and second.node is None and second.slot != BAD_PAGE_INDEX
    gpu = m._storage.levels[0].items[0]
    assert gpu.num_used == 4
    shelf.restore()
    assert second.slot == BAD_PAGE_INDEX and not second.in_evictor and second.num_locks == 0
    assert gpu.num_used == 3 and evictor(m, 0).count == 0
    m.check_invariants()
    kv.close()
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_page_pinned_or_unpinned_while_shelved(make_manager: MakeManager, policy: str) -> None:
    """Pinned while shelved: restored, its pin holds it (in no evictor) until ``unpin`` lists it.
    Pinned when shelved (in no evictor then) and unpinned meanwhile: restored, it is listed."""
    m = make_manager(kv_layers(2, T), T, 8 * SLOT, eviction_policy=policy)
    doc = seq(1, 2 * T)
    publish(m, doc, engine=FakeEngine(m))
    pages = tree_pages(m, doc)
    ev = evictor(m, 0)
    shelf = Shelf()
    shelf.put(pages)
    assert m.directives.pin(doc).num_blocks == 2
    shelf.restore()
    assert all(p.pin_held and not p.in_evictor for p in pages) and ev.count == 0
    m.check_invariants()
    m.directives.unpin(doc)
    assert ev.count == 2 and all(p.in_evictor for p in pages)
    m.check_invariants()
    assert m.directives.pin(doc).num_blocks == 2 and ev.count == 0
    shelf.put(pages)
    m.directives.unpin(doc)
    assert ev.count == 0 and not any(p.pin_held for p in pages)  # (not listed while shelved)
    shelf.restore()
    assert ev.count == 2 and ev.structure_error() is None
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_placing_a_prefetchs_reads_is_no_use_of_its_pages(
    make_manager: MakeManager, tmp_path: object, policy: str
) -> None:
    """A prefetch of two blocks on disk, retained for 10 s, into a full host: its second read is
    placed while its first page is held there. The host's order of the pages that stayed, their
    policy's state, the simulated LRU and the retention expiry are as before (the hold once took
    and released the page: LRU listed it after the second, frequency gave it a new value and
    told its simulated LRU, SLRU listed it as its segment's newest). A request then using them is
    a use: counted, listed newest, its retention afresh from its release."""
    clock = Clock()
    m = tiered(make_manager, tmp_path, eviction_policy=policy, clock=clock)
    engine = FakeEngine(m)
    doc = seq(1, 2 * T + 1)
    computed(m, engine, doc[:-1], 2 * T).close()
    for r in (2, 3):  # 4 pages each: doc goes to the host, then to disk
        computed(m, engine, seq(r, 4 * T), 4 * T).close()
    pages = tree_pages(m, doc)
    assert [p.level for p in pages] == [DISK, DISK]
    assert m.directives.retain(doc[:-1], int(DEFAULT_PRIORITY), 10.0).num_blocks == 2
    assert [p.expires for p in pages] == [10.0, 10.0]
    handle = m.prefetch(doc[:-1], HOST)
    q = loader(m)
    q.run_queued(0)
    clock.now = 1.0
    m.poll_loads()  # the first page placed in the (full) host
    first = q.queued[0].page  # type: ignore[attr-defined]
    placed = [p for p in pages if p is not first]
    assert placed[0].level == HOST and first.level == DISK
    host = evictor(m, HOST)
    before, lru = snapshot(host), recent(host)
    q.run_queued(0)
    clock.now = 2.0
    m.poll_loads()  # the second: one more page of the host evicted, not the first one
    assert handle.done and handle.num_installed_pages == 2 and first.level == HOST
    after = snapshot(host)
    assert still_there(before, after) == [x for x in after if x[0] != id(first)]
    if policy != "frequency":  # the one placed is the newest (the page held stayed where it was)
        assert after[-1][0] == id(first)
    assert recent(host) == lru
    assert [p.expires for p in pages] == [10.0, 10.0]
    m.check_invariants()
    uses = [state(p) for p in pages]
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 2 * T and kv.resume()
    engine.check_all(kv, doc, 2 * T)
    clock.now = 3.0
    kv.close()
    assert [p.level for p in pages] == [0, 0]
    gpu = evictor(m, 0).pages()
    assert set(gpu[-2:]) == set(pages) or policy == "frequency"  # used: the newest
    for p, was in zip(pages, uses):
        st = p.policy_state
        if isinstance(st, FrequencyState):
            assert st.uses == was[0][0] + 1  # type: ignore[index]
        elif policy == "slru":
            assert isinstance(st, SlruState) and st.protected
    assert [p.expires for p in pages] == [13.0, 13.0]  # (from the release)
    m.check_invariants()


@pytest.mark.parametrize("cancel", [False, True])
@pytest.mark.parametrize("by", ["tokens", "cache"])
def test_a_cancelled_prefetch_holds_nothing(make_manager: MakeManager, tmp_path: object, by: str, cancel: bool) -> None:
    """A prefetch (by tokens, or a suspended cache's) placed the first of its three pages (the
    oldest on a full host by then); a prefetch by tokens of the same blocks shares the other reads.
    While the first wants them, placing them keeps its page; once it is cancelled
    (``Prefetch.cancel``, ``KVCache.cancel_prefetch``), its page is no longer held: the first
    evicted (moved down)."""
    m = tiered(make_manager, tmp_path, clock=Clock())
    engine = FakeEngine(m)
    doc = seq(1, 3 * T + 1)
    owner = computed(m, engine, doc[:-1], 3 * T)
    if by == "cache":
        owner.suspend()
    else:
        owner.close()
    for r in (2, 3):
        computed(m, engine, seq(r, 4 * T), 4 * T).close()
    pages = tree_pages(m, doc)
    assert [p.level for p in pages] == [DISK] * 3
    first = m.prefetch(doc[:-1], HOST) if by == "tokens" else None
    assert first is not None or owner.prefetch(HOST)
    q = loader(m)
    q.run_queued(0)
    m.poll_loads()
    mine = next(p for p in pages if p.level == HOST)
    computed(m, engine, seq(4, 3 * T), 3 * T).close()  # 3 GPU pages pushed to the host: `mine` is its oldest
    assert evictor(m, HOST).pages()[0] is mine
    second = m.prefetch(doc[:-1], HOST)
    assert second.num_disk_pages == 2
    if cancel:
        if first is not None:
            first.cancel()
        else:
            owner.cancel_prefetch()
    q.run_queued(0)
    m.poll_loads()
    assert (mine.level == HOST) != cancel
    assert all(p.num_locks == 0 for p in pages)
    q.run_queued(0)
    m.poll_loads()
    assert second.done
    m.check_invariants()
    if by == "cache":
        assert owner.resume()
        engine.check_all(owner, doc, 3 * T)
        owner.close()
    kv = m.create_kv_cache(None, doc[:-1])
    assert kv.history_length == 3 * T and kv.resume()
    engine.check_all(kv, doc, 3 * T)
    kv.close()
    m.check_invariants()


@pytest.fixture
def redis() -> Iterator[LocalRedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server")
    with LocalRedisServer(REDIS_SERVER) as server:
        yield server


def remote_config(url: str, path: Path, write_through: bool, host_slots: int) -> KVCacheManagerConfig:
    path.mkdir()
    return KVCacheManagerConfig(
        tokens_per_block=T,
        cache_tiers=[
            GpuCacheTierConfig(4 * SLOT),
            HostCacheTierConfig(host_slots * SLOT),
            DiskCacheTierConfig(32 * SLOT, str(path)),
            RemoteCacheTierConfig(url, "shelf", timeout_ms=5000, write_through=write_through),
        ],
        layers=kv_layers(2, T),
        backend="host",
        max_util_for_resume=1.0,
    )


@pytest.mark.parametrize("disk_first", [True, False])
def test_a_prefetch_never_evicts_what_it_brought_from_disk_or_the_remote_tier(
    redis: LocalRedisServer, tmp_path: Path, disk_first: bool
) -> None:
    """A 4-block prompt: its first 2 blocks on the local disk, the other 2 on the remote tier only,
    prefetched into a host of 3 slots. Disk reads first: the fetch does not push their pages back
    down (it fetches what fits beside them: one block). The fetch first: placing the disk reads
    does not push the fetched pages down (one read placed, the other discarded: the create's
    resume reads it). Every byte exact."""
    doc = seq(7, 4 * T + 1)
    peer = KVCacheManager(remote_config(redis.url, tmp_path / "peer", True, 3))
    try:
        computed(peer, FakeEngine(peer), doc[:-1], 4 * T).close()
        assert peer.flush_remote_writes()
    finally:
        peer.shutdown()
    m = KVCacheManager(remote_config(redis.url, tmp_path / "m", False, 3))
    try:
        loader(m).manual = True
        engine = FakeEngine(m)
        computed(m, engine, doc[: 2 * T], 2 * T).close()
        for r in (2, 3):  # 4 pages each: the 2 blocks go to the host, then to disk
            computed(m, engine, seq(r, 4 * T), 4 * T).close()
        local = tree_pages(m, doc)
        assert [p.level for p in local] == [DISK, DISK]
        handle = m.prefetch(doc[:-1], HOST)
        assert handle.num_disk_pages == 2 and handle.waits_for_remote
        q = loader(m)
        if disk_first:
            while any(hasattr(j, "page") for j in q.queued):
                q.run_queued(next(k for k, j in enumerate(q.queued) if hasattr(j, "page")))
            m.poll_loads()
            assert [p.level for p in local] == [HOST, HOST]
        while handle.waits_for_remote:  # the lookup, then the fetch
            q.run_queued(next(k for k, j in enumerate(q.queued) if not hasattr(j, "page")))
            m.poll_loads()
        fetched = tree_pages(m, doc)[2:]
        if disk_first:
            assert [p.level for p in local] == [HOST, HOST] and [p.level for p in fetched] == [HOST]
        else:
            assert [p.level for p in fetched] == [HOST, HOST] and [p.level for p in local] == [DISK, DISK]
            while q.queued:
                q.run_queued(0)
            m.poll_loads()
            assert [p.level for p in fetched] == [HOST, HOST] and handle.num_installed_pages == 1
            assert sorted(p.level for p in local) == [HOST, DISK]
        assert handle.done
        m.check_invariants()
        kv = m.create_kv_cache(None, doc[:-1])
        reused = 3 * T if disk_first else 4 * T  # (disk first: no room for the last block beside the match)
        assert kv.history_length == reused and kv.resume()
        engine.check_all(kv, doc, reused)
        kv.close()
        m.check_invariants()
    finally:
        m.shutdown()


def test_a_fetch_parks_the_chain_page_it_extends_as_the_newest(redis: LocalRedisServer) -> None:
    """Frequency, a GPU-only cache (it parks anchors) with a remote tier: a prompt's first block is
    local, a leaf (a candidate), its second only on the remote tier; two other prompts' first
    blocks are parked. A prefetch fetches the second block under the first (shelved meanwhile): its
    node has a child now, so it is parked, as the newest parked page (as a release parks it), not
    ahead of those parked before."""

    def config(write_through: bool) -> KVCacheManagerConfig:
        return KVCacheManagerConfig(
            tokens_per_block=T,
            cache_tiers=[
                GpuCacheTierConfig(12 * SLOT),
                RemoteCacheTierConfig(redis.url, "park", timeout_ms=5000, write_through=write_through),
            ],
            layers=kv_layers(2, T),
            backend="host",
            eviction_policy="frequency",
        )

    doc = seq(7, 2 * T + 1)
    peer = KVCacheManager(config(True))
    try:
        computed(peer, FakeEngine(peer), doc[:-1], 2 * T).close()
        assert peer.flush_remote_writes()
    finally:
        peer.shutdown()
    m = KVCacheManager(config(False))
    try:
        loader(m).manual = True
        engine = FakeEngine(m)
        computed(m, engine, doc[:T], T).close()
        for r in (2, 3):
            computed(m, engine, seq(r, 2 * T), 2 * T).close()
        ev = evictor(m, 0)
        assert isinstance(ev, FrequencyEvictor)
        first = tree_pages(m, doc[:T])[0]
        assert not ev.is_parked(first) and sum(ev.is_parked(p) for p in ev.pages()) == 2
        handle = m.prefetch(doc[:-1], 0)
        q = loader(m)
        while handle.waits_for_remote:  # the lookup, then the fetch
            q.run_queued(0)
            m.poll_loads()
        assert handle.done and len(tree_pages(m, doc)) == 2
        pages = ev.pages()
        assert [ev.is_parked(p) for p in pages] == [False] * 3 + [True] * 3 and pages[-1] is first
        m.check_invariants()
        kv = m.create_kv_cache(None, doc[:-1])
        assert kv.history_length == 2 * T and kv.resume()
        engine.check_all(kv, doc, 2 * T)
        kv.close()
        m.check_invariants()
    finally:
        m.shutdown()
