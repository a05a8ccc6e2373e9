"""Contiguous slots: the slot allocator's free runs against a model of the free set, a request's
blocks in consecutive slots, offload/onboard batches merged into few copies, and a long random
mix of requests (host tier) in which no allocation ever moves a page in use (fake engine data and
``check_invariants`` after every step)."""

from __future__ import annotations

import random

import pytest
from conftest import MakeManager, kv_layers
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, seq

from kv_cache_manager_v2 import CacheLevel, KVCache, KVCacheManager, LayerGroupId, LogicError
from kv_cache_manager_v2._common import SlotId
from kv_cache_manager_v2._page import Page
from kv_cache_manager_v2._storage._host_backend import HostMemoryPool
from kv_cache_manager_v2._storage._slot_allocator import SlotAllocator, pair_sorted

LG0 = LayerGroupId(0)
HOST = CacheLevel(1)


def allocator(num_slots: int) -> tuple[SlotAllocator, HostMemoryPool]:
    """An allocator of 1-byte slots over a real (lazily backed) pool: a compiled allocator takes
    only real pools."""
    pool = HostMemoryPool(num_slots)
    return SlotAllocator(num_slots, [pool], (1,)), pool


def check_runs(a: SlotAllocator, free: set[int]) -> None:
    """The allocator's runs hold exactly the free slots below its high-water mark (disjoint, the top
    one live), its maximal runs are those of ``free``, and its counts agree."""
    hw = a._high_water
    below = sorted(s for s in free if s < hw)
    listed = [s for f, n in zip(a._firsts, a._counts) for s in range(f, f + n)] + a._free
    assert sorted(listed) == below
    assert a._num_dead == sum(1 for n in a._counts if not n) and all(
        a._firsts[i] == -1 for i, n in enumerate(a._counts) if not n
    )
    assert not a._counts or a._counts[-1]
    assert a._in_runs == sum(a._counts)
    want: list[tuple[int, int]] = []
    for s in below:
        if want and want[-1][0] + want[-1][1] == s:
            want[-1] = (want[-1][0], want[-1][1] + 1)
        else:
            want.append((s, 1))
    assert a.free_runs() == want
    assert a.num_free == len(free) and a.num_used == a.num_slots - len(free)
    assert all(a.is_allocated(SlotId(s)) != (s in free) for s in range(a.num_slots))


def runs_of(slots: list[SlotId]) -> int:
    """Runs of consecutive ascending slots in ``slots``, in order."""
    return sum(1 for i, s in enumerate(slots) if i == 0 or s != slots[i - 1] + 1)


def test_allocator_matches_a_model_of_its_free_slots() -> None:
    """Random allocations (batches, one slot, after a previous slot or not, a request's or not),
    frees and resizes against a model of the free slots and the tails: the runs and counts agree,
    a batch lands in the fewest runs, never on the slot after a tail while a run that is not
    reserved holds it, and otherwise leaves that slot to the tail when it can."""
    rng = random.Random(5)
    a, pool = allocator(300)
    free = set(range(300))
    tails: set[int] = set()  # the last slot of each request's allocation: the slot after it is reserved
    used: list[int] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.45 and free:
            count = rng.randint(1, min(len(free), 40))
            after = rng.choice(used) if used and rng.random() < 0.5 else -1
            grows = rng.random() < 0.7
            fresh = count >= a._in_runs + len(a._free)  # every free slot is taken, then slots above the mark
            runs = [(f, n, f > 0 and f - 1 in tails) for f, n in maximal(free, a._high_water)]
            a.prepare(count)
            got = a.allocate(count, after, grows)
            assert len(set(got)) == count and all(s in free for s in got)
            continues = after >= 0 and after + 1 in free and after + 1 < a._high_water
            if not fresh and continues:
                assert got[0] == after + 1
            if not fresh and not continues:
                lengths = sorted((n for _, n, _ in runs), reverse=True)
                fewest = next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= count)
                assert runs_of(sorted(got)) <= fewest  # the fewest runs the free space allows
                if any(n >= count and not r for _, n, r in runs):  # one run, no reserved slot taken
                    assert runs_of(got) == 1 and got[0] - 1 not in tails
                elif any(n > count for _, n, _ in runs):  # from the middle of a reserved run
                    assert runs_of(got) == 1 and got[0] - 1 in free
            if grows:
                tails.discard(after)
                tails.add(got[-1])
        elif op < 0.6 and free:
            after = rng.choice(used) if used and rng.random() < 0.7 else -1
            nxt = after + 1 if after >= 0 and after + 1 in free and after + 1 < a._high_water else None
            got = [a.allocate_one(after)]
            assert got[0] in free and (nxt is None or got[0] == nxt)
            tails.discard(after)
            tails.add(got[0])
        elif op < 0.97 and used:
            got = []
            for _ in range(rng.randint(1, 30)):
                if not used:
                    break
                s = used.pop(rng.randrange(len(used)))
                a.free(SlotId(s))
                free.add(s)
                tails.discard(s)
        else:
            limit = rng.randint(200, 300)
            if all(s < limit for s in used):
                a.resize(limit)
                a.resize(300)
            else:
                with pytest.raises(LogicError):
                    a.resize(limit)
            got = []
        for s in got:
            free.discard(s)
            used.append(s)
        assert pool.mapped_bytes >= a._high_water
        if step % 7 == 0:
            check_runs(a, free)
            assert a._tail == [s in tails for s in range(300)]
    check_runs(a, free)
    with pytest.raises(LogicError):
        a.free(SlotId(used[0]))
        a.free(SlotId(used[0]))


def maximal(free: set[int], below: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in sorted(x for x in free if x < below):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def test_frees_rebuild_runs_and_a_batch_takes_the_shortest_run_that_holds_it() -> None:
    a, _ = allocator(64)
    slots = a.allocate(64)
    for s in [*range(19, 9, -1), *range(30, 34), *range(3, 5)]:  # runs of 10, 4 and 2
        a.free(slots[s])
    assert a._free == [*range(19, 9, -1), *range(30, 34), 3, 4] and not a._counts  # loose until there is a choice
    assert a.allocate(2) == [3, 4]  # folded into runs, the lowest on top: it holds 2
    assert list(zip(a._firsts, a._counts)) == [(30, 4), (10, 10)]
    assert a.allocate(4) == [10, 11, 12, 13]  # the top run holds it
    a.free(SlotId(12))
    a.free(SlotId(13))
    assert a.allocate(5) == [12, 13, 14, 15, 16]  # the top run (12, 13) cannot: merged, the shortest that can
    assert a.allocate(3) == [17, 18, 19]  # the top run holds it
    for s in [40, 42, 41, 43, 39, 44, 45, 1]:
        a.free(SlotId(s))
    assert a.allocate(3) == [30, 31, 32]  # the top run (1) cannot: the shortest run that holds 3
    assert a.free_runs() == [(1, 1), (33, 1), (39, 7)]
    assert a.allocate_one(SlotId(38)) == 39  # continues after the previous block: 39 is a tail now
    assert a.allocate(2, SlotId(50)) == [42, 43]  # 51 is in use; the run after the tail: from its middle
    assert a.allocate_one(SlotId(39)) == 40  # the tail grows in place
    assert a.allocate_one(SlotId(40)) == 41
    assert a.allocate_one(SlotId(41)) == 44  # 42 is taken: a run with room after it (43 is no tail)
    assert a.free_runs() == [(1, 1), (33, 1), (45, 1)]


def test_a_free_slot_after_a_tail_goes_last() -> None:
    """A request's tail (the last slot its allocation got) keeps the free slot after it: other
    allocations take any free run that is not reserved first, a reserved run from its middle."""
    a, _ = allocator(64)
    a.allocate(64)
    for s in (3, 20, 30):  # tails at 3, 20 and 30 (a request's blocks, one at a time)
        a.free(SlotId(s))
        assert a.allocate_one(SlotId(s - 1)) == s
    for s in [*range(4, 10), *range(12, 18), *range(21, 27), *range(31, 35), 40, 50, 51]:
        a.free(SlotId(s))
    # free runs: 4-9 (after the tail at 3), 12-17 (after 11: no tail), 21-26 (after 20), 31-34 (after 30),
    # 40 (after 39), 50-51 (after 49)
    assert a.allocate(5) == [12, 13, 14, 15, 16]  # the only run that holds it and is not reserved
    assert a.allocate(4) == [22, 23, 24, 25]  # only reserved runs hold it: the middle of the longest
    assert a.allocate(2, SlotId(60), True) == [50, 51]  # 61 is in use: the shortest that is not reserved
    # runs of one that are not reserved (17, 26, 40) go before any reserved slot
    assert {a.allocate_one(), a.allocate_one(), a.allocate_one()} == {17, 26, 40}
    middle = a.allocate_one()  # only reserved runs are left (4-9, 21, 31-34): from the middle of one
    assert middle in (6, 7, 33) and not a.is_allocated(SlotId(middle - 1))
    assert [a.allocate_one(SlotId(s)) for s in (3, 4, 20, 30)] == [4, 5, 21, 31]  # the tails grow in place


def test_a_closed_request_keeps_no_slot_for_its_next_block(make_manager: MakeManager) -> None:
    """A closed request grows no more: the free slot after its last block (its pages stay cached for
    reuse) goes to the next request like any other slot, from the front of its run."""
    m = make_manager(kv_layers(2, T), T, 10 * SLOT)
    engine = FakeEngine(m)
    gpu = m._storage.gpu.items[0].allocator
    a_toks, c_toks = seq(1, 3 * T), seq(3, 2 * T)
    a = m.create_kv_cache(None, a_toks)
    assert a.resume()
    compute(engine, a, a_toks, 3 * T)  # slots 0-2: its tail is 2, the slot after it kept for it
    b = m.create_kv_cache()
    assert b.resume() and b.resize(7 * T)  # slots 3-9; it commits nothing: closing frees them
    b.close()
    a.close()
    assert [gpu.is_allocated(SlotId(s)) for s in range(10)] == [True] * 3 + [False] * 7
    c = m.create_kv_cache(None, c_toks)
    assert c.resume()
    compute(engine, c, c_toks, 2 * T)
    assert [p.slot for p in c.block_table.pages[0] if p is not None] == [3, 4]  # (a open: 3-9's middle)
    engine.check_all(c, c_toks, 2 * T)
    c.close()
    m.check_invariants()


def test_closing_a_request_that_shares_another_s_last_block_keeps_that_one_s_tail(make_manager: MakeManager) -> None:
    """A request whose last block is another open request's (matched from the cache) ends no tail at
    close: the slot after that block stays kept for the request that grows into it."""
    m = make_manager(kv_layers(2, T), T, 10 * SLOT)
    engine = FakeEngine(m)
    toks = seq(1, 4 * T)
    a = m.create_kv_cache(None, toks[: 3 * T])
    assert a.resume()
    compute(engine, a, toks, 3 * T)  # slots 0-2, its tail at 2; it stays open
    tmp = m.create_kv_cache()
    assert tmp.resume() and tmp.resize(7 * T)
    tmp.close()  # slots 3-9 free again: one run, after a's tail
    b = m.create_kv_cache(None, toks)
    assert [p.slot for p in b.block_table.pages[0] if p is not None] == [0, 1, 2]  # a's blocks, matched
    b.close()
    c = m.create_kv_cache(None, seq(3, 2 * T))
    assert c.resume()
    compute(engine, c, seq(3, 2 * T), 2 * T)
    assert 3 not in [p.slot for p in c.block_table.pages[0] if p is not None]  # still kept for a
    compute(engine, a, toks, 4 * T)
    assert [p.slot for p in a.block_table.pages[0] if p is not None] == [0, 1, 2, 3]
    engine.check_all(a, toks, 4 * T)
    engine.check_all(c, seq(3, 2 * T), 2 * T)
    for kv in (a, c):
        kv.close()
    m.check_invariants()


def test_allocate_below_is_lowest_first_and_all_or_nothing() -> None:
    a, _ = allocator(20)
    a.allocate(10)
    for s in (7, 2, 3):
        a.free(SlotId(s))
    with pytest.raises(LogicError):
        a.allocate_below(12, 6)  # 3 free below the mark, 2 more under 12
    check_runs(a, {2, 3, 7, *range(10, 20)})
    assert a.allocate_below(12, 5) == [2, 3, 7, 10, 11]
    check_runs(a, set(range(12, 20)))


def test_pair_sorted_pairs_ascending_sources_with_ascending_targets() -> None:
    targets = [SlotId(s) for s in (41, 20, 21, 40, 22, 23)]
    assert pair_sorted([9, 8, 7, 6, 1, 0], targets) == [41, 40, 23, 22, 21, 20]
    assert pair_sorted([5, 1, 3, 2, 7, 8], targets) == [23, 20, 22, 21, 40, 41]


# ---------------------------------------------------------------------- through the manager
def fragment(m: KVCacheManager, rng: random.Random, rounds: int) -> list[KVCache]:
    """A long random mix of requests (varied lengths, growing, up to 8 open at once) that commit
    nothing: closing frees their slots, the open ones (returned) fragment the free space."""
    open_: list[KVCache] = []
    for _ in range(rounds):
        kv = m.create_kv_cache()
        if kv.resume() and kv.resize(rng.randint(1, 12) * T):
            open_.append(kv)
        else:
            kv.close()
        for kv in open_:
            if rng.random() < 0.5:
                kv.resize(kv.capacity + T)
        while len(open_) > 8 or (open_ and rng.random() < 0.2):
            open_.pop(rng.randrange(len(open_))).close()
    return open_


def free_run_lengths(m: KVCacheManager) -> list[int]:
    """Lengths of the GPU pool's free runs below its high-water mark, longest first."""
    a = m._storage.gpu.items[0].allocator
    free = [s for s in range(a._high_water) if not a.is_allocated(SlotId(s))]
    starts = [i for i, s in enumerate(free) if i == 0 or s != free[i - 1] + 1] + [len(free)]
    return sorted((starts[k + 1] - starts[k] for k in range(len(starts) - 1)), reverse=True)


def fewest_runs(m: KVCacheManager, count: int) -> int:
    """The fewest free runs below the GPU pool's high-water mark that hold ``count`` slots."""
    lengths = free_run_lengths(m)
    assert sum(lengths) >= count
    return next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= count)


def last_slot(kv: KVCache) -> int:
    return [p.slot for p in kv.block_table.pages[0] if p is not None][-1]


def test_requests_keep_growing_in_place_in_a_fragmented_pool(make_manager: MakeManager) -> None:
    """A prompt admitted into a fragmented pool among requests that keep decoding (a block each per
    step): it avoids the free slots right after their last blocks, and wherever the slot after a
    request's last block is free when a step begins, its next block lands there (but in rare cases:
    an allocation takes a reserved slot when the runs it looks at are all reserved). Nothing in use
    moves; the fake engine's data and the invariants are checked."""
    m = make_manager(kv_layers(2, T), T, 200 * SLOT, host_quota=400 * SLOT, max_util_for_resume=1.0)
    engine = FakeEngine(m)
    others = fragment(m, random.Random(3), 300)
    assert len(free_run_lengths(m)) >= 5  # fragmented
    gpu = m._storage.gpu.items[0].allocator
    toks = seq(9999, 24 * T)
    kv = m.create_kv_cache(None, toks)
    assert kv.resume()
    reserved = {last_slot(o) + 1 for o in others if not gpu.is_allocated(SlotId(last_slot(o) + 1))}
    compute(engine, kv, toks, 16 * T)
    assert reserved and not reserved & {p.slot for p in kv.block_table.pages[0] if p is not None}
    kept = lost = 0
    for upto in range(17 * T, 24 * T + 1, T):  # a block of decode each per step
        everyone = [kv, *others]
        free_next = [
            not gpu.is_allocated(SlotId(last_slot(r) + 1)) and last_slot(r) + 1 < gpu._high_water for r in everyone
        ]
        tails = [last_slot(r) for r in everyone]
        where = [[(p.storage, p.slot) for p in r.block_table.pages[0] if p is not None] for r in everyone]
        compute(engine, kv, toks, upto)
        for o in others:
            assert o.resize(o.capacity + T)
        for r, held in zip(everyone, where):  # nothing in use moved
            assert [(p.storage, p.slot) for p in r.block_table.pages[0] if p is not None][: len(held)] == held
        for r, tail, free in zip(everyone, tails, free_next):
            if free:
                kept += last_slot(r) == tail + 1
                lost += last_slot(r) != tail + 1
        m.check_invariants()
    assert kept >= 30 and lost * 10 <= kept
    engine.check_all(kv, toks, len(toks))
    for other in [*others, kv]:
        other.close()


def test_offload_and_onboard_merge_their_copies(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(2, T), T, 160 * SLOT, host_quota=400 * SLOT, max_util_for_resume=1.0)
    engine = FakeEngine(m)
    others = fragment(m, random.Random(4), 300)
    assert len(free_run_lengths(m)) >= 3
    toks = seq(7777, 32 * T)
    kv = m.create_kv_cache(None, toks)
    assert kv.resume()
    fewest = fewest_runs(m, 32)
    compute(engine, kv, toks, len(toks))
    pages = [p for p in kv.block_table.pages[0] if p is not None]
    assert runs_of(sorted(p.slot for p in pages)) == fewest
    copier = m._storage.copier
    before = copier.num_runs
    kv.suspend()
    gpu_pool = m._storage.gpu.items[0]
    filler = m.create_kv_cache()
    assert filler.resume()
    assert filler.resize((gpu_pool.allocator.num_free + len(pages)) * T)  # pushes the suspended pages down
    assert all(p.level == HOST for p in pages)
    assert runs_of(sorted(p.slot for p in pages)) == 1
    pools = len(gpu_pool.pools)
    assert copier.num_runs - before == fewest * pools  # one copy per source run
    filler.close()
    before = copier.num_runs
    assert kv.resume()
    assert copier.num_runs - before <= fewest * pools
    assert runs_of(sorted(p.slot for p in pages)) <= fewest
    engine.check_all(kv, toks, len(toks))
    runs_now = runs_of(sorted(p.slot for p in pages))
    kv.close()  # reusable now, listed for eviction last block first
    before = copier.num_runs
    filler = m.create_kv_cache()
    assert filler.resume()
    assert filler.resize((gpu_pool.allocator.num_free + len(pages)) * T)
    assert all(p.level == HOST for p in pages)
    assert copier.num_runs - before == runs_now * pools
    filler.close()
    kv = m.create_kv_cache(None, toks)
    assert kv.resume() and kv.history_length == len(toks)  # onboarded from the host
    engine.check_all(kv, toks, len(toks))
    for other in [*others, kv]:
        other.close()


def test_no_allocation_moves_a_page_in_use(make_manager: MakeManager) -> None:
    """A long random mix with decode steps, suspensions and a host tier: every page a running
    request holds keeps its slot until the request lets it go or is suspended."""
    rng = random.Random(11)
    m = make_manager(kv_layers(2, T), T, 96 * SLOT, host_quota=200 * SLOT, max_util_for_resume=1.0)
    engine = FakeEngine(m)
    running: list[tuple[KVCache, list[int]]] = []
    suspended: list[tuple[KVCache, list[int]]] = []
    for r in range(260):
        where: dict[int, tuple[object, int]] = {
            id(p): (p.storage, p.slot) for kv, _ in running for p in kv.block_table.pages[0] if p is not None
        }
        held: list[Page] = [p for kv, _ in running for p in kv.block_table.pages[0] if p is not None]
        op = rng.random()
        if op < 0.35:
            toks = seq(r % 40, rng.randint(1, 10) * T + rng.randint(0, T - 1)) + seq(1000 + r, rng.randint(0, 2 * T))
            kv = m.create_kv_cache(None, toks)
            if kv.resume() and kv.resize(len(toks), kv.history_length):
                engine.step(kv, toks, kv.history_length, len(toks))
                kv.commit(toks[kv.history_length :])
                running.append((kv, toks))
            else:
                kv.close()
        elif op < 0.7 and running:
            kv, toks = rng.choice(running)
            grow = rng.randint(1, 2 * T)
            toks.extend(seq(5000 + r, grow))
            h = kv.history_length
            if kv.resize(len(toks), h):
                engine.step(kv, toks, h, len(toks))
                kv.commit(toks[h:])
            else:
                del toks[h:]
        elif op < 0.8 and running:
            kv, toks = running.pop(rng.randrange(len(running)))
            kv.suspend()
            suspended.append((kv, toks))
        elif op < 0.9 and suspended:
            i = rng.randrange(len(suspended))
            kv, toks = suspended[i]
            if kv.resume():
                suspended.pop(i)
                engine.check_all(kv, toks, kv.history_length)
                running.append((kv, toks))
        elif running:
            kv, _ = running.pop(rng.randrange(len(running)))
            kv.close()
        still = {id(p) for kv, _ in running for p in kv.block_table.pages[0] if p is not None}
        for p in held:
            if id(p) in still:
                assert (p.storage, p.slot) == where[id(p)], "a page in use moved"
        for kv, toks in running:
            engine.check_all(kv, toks, kv.history_length)
        m.check_invariants()
    for kv, _ in running + suspended:
        kv.close()


def test_the_allocator_s_per_slot_lists_are_invisible_to_the_gc() -> None:
    """One entry per slot (millions on a disk tier): a full collection must not visit them."""
    import gc

    a, _ = allocator(64)
    assert not gc.is_tracked(a._is_free) and not gc.is_tracked(a._tail)
    a.resize(128)
    a.allocate(100)
    a.resize(100)
    assert not gc.is_tracked(a._is_free) and not gc.is_tracked(a._tail)


def test_allocate_below_takes_free_slots_below_the_limit_whatever_the_stack_looks_like() -> None:
    """``allocate_below`` (a tier's compaction before a shrink) takes several runs in one call; taking
    one may compact the run stack, which moved the others under indices taken beforehand (an
    ``IndexError`` half-way, or slots at or above the limit)."""
    for seed in range(400):
        rng = random.Random(seed)
        n = rng.randint(50, 400)
        a, _ = allocator(n)
        used = set(a.allocate(n))
        for s in rng.sample(sorted(used), rng.randint(1, n - 1)):
            a.free(SlotId(s))
            used.discard(s)
        for _ in range(rng.randint(0, 30)):
            if a.num_free > 1 and rng.random() < 0.5:
                used |= set(a.allocate(rng.randint(1, min(4, a.num_free - 1)), -1, rng.random() < 0.5))
            elif used:
                s = rng.choice(sorted(used))
                a.free(SlotId(s))
                used.discard(s)
        limit = rng.randint(1, n)
        below_free = sum(1 for s in range(limit) if s not in used)
        if not below_free:
            continue
        count = rng.randint(1, below_free)
        out = a.allocate_below(limit, count)
        assert len(set(out)) == len(out) == count and not set(out) & used and all(s < limit for s in out), seed
        used |= set(out)
        check_runs(a, {s for s in range(n) if s not in used})
