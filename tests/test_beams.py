"""Beam search through the fake engine: shared prompt pages, per-beam tails copied on write,
random parent choices, memory pressure, suspend/resume, tier resizing, publishing the final beam."""

from __future__ import annotations

import random

import pytest
from conftest import REC, MakeManager, kv_layers, used_slots
from fake_engine import FakeEngine

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    BeamIndex,
    CacheLevel,
    KVCache,
    KVCacheManager,
    LayerGroupId,
    LogicError,
)

T = 8
B = 4
LG0 = LayerGroupId(0)
GPU, HOST, DISK = CacheLevel(0), CacheLevel(1), CacheLevel(2)


def distinct_slots(kv: KVCache) -> int:
    """Slots the request's beams point at, each counted once (every layer group)."""
    out: set[tuple[int, int]] = set()
    for b in range(kv.beam_width):
        for lg in range(len(kv.block_table)):
            out.update((lg, s) for s in kv.get_base_page_indices(LayerGroupId(lg), BeamIndex(b)) if s != BAD_PAGE_INDEX)
    return len(out)


def start_beams(engine: FakeEngine, kv: KVCache, prompt: list[int], rng: random.Random) -> list[list[int]]:
    """Prefill the prompt once (shared pages), fork the beams with the commit of its last chunk."""
    assert kv.resume()
    n = len(prompt)
    assert kv.resize(n, kv.history_length)
    engine.step(kv, prompt, kv.history_length, n, beam=0)
    h = kv.num_committed_tokens
    kv.commit([prompt[h:]] * B, [0] * B)
    return [list(prompt) + [rng.randrange(1 << 30)] for _ in range(B)]  # each beam's next input token


def beam_step(engine: FakeEngine, kv: KVCache, seqs: list[list[int]], rng: random.Random) -> list[list[int]]:
    """One generation step: every beam checks its history and writes its input token, then the
    beams are rebuilt from random parents. ``seqs[b]`` is beam b's history plus its input token."""
    h = kv.history_length
    for b in range(B):
        engine.step(kv, seqs[b], h, h + 1, beam=b)
    parents = [rng.randrange(B) for _ in range(B)]
    kv.commit([[seqs[p][h]] for p in parents], parents)
    return [seqs[p][: h + 1] + [rng.randrange(1 << 30)] for p in parents]


@pytest.mark.parametrize("window", [None, 24])
def test_random_beam_search_keeps_every_beams_ancestry(make_manager: MakeManager, window: int | None) -> None:
    layers = kv_layers(2, T, window=window, swa_every=2 if window else 0)
    slots = 60
    # the hog fills the GPU past the default resume gate; this test is about beams, not admission
    m = make_manager(layers, quota=slots * 2 * 2 * REC * T, max_util_for_resume=1.0)
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(7)
    prompt = [rng.randrange(1 << 30) for _ in range(37)]
    kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=B)
    seqs = start_beams(engine, kv, prompt, rng)
    hog: KVCache | None = None
    refused = 0
    for step in range(200):
        h = kv.history_length
        if not kv.resize(h + 1):  # memory pressure: the hog goes, the step is retried
            refused += 1
            assert kv.capacity == h and hog is not None
            hog.close()
            hog = None
            assert kv.resize(h + 1)
        if step % 37 == 5 and hog is None:  # another request grabs most of what is free
            hog = m.create_kv_cache()
            hog.resume()
            free = m.get_storage_statistics()[0].free + m.get_storage_statistics()[0].evictable
            assert hog.resize(max(0, free - 2) // len(kv.block_table) * T)  # a page per layer group
        if step % 50 == 20:
            kv.suspend()
            assert kv.resume()
        for b in range(B):
            engine.check_all(kv, seqs[b], h, beam=b)
        seqs = beam_step(engine, kv, seqs, rng)
        for b in range(B):
            assert kv.get_committed_tokens(BeamIndex(b)) == seqs[b][: h + 1]
    assert refused > 0
    if hog is not None:
        hog.close()
    kv.close()


def test_shared_blocks_are_counted_once(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=200 * 2 * REC * T)
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(3)
    prompt = [rng.randrange(1 << 30) for _ in range(4 * T + 3)]  # 4 full blocks + a partial one
    kv = m.create_kv_cache(beam_width=B)
    seqs = start_beams(engine, kv, prompt, rng)
    assert used_slots(m) == distinct_slots(kv) == 5  # nothing copied yet: the tail is copied on write
    for _ in range(3 * T):
        h = kv.history_length
        assert kv.resize(h + 1)
        assert used_slots(m) == distinct_slots(kv)
        seqs = beam_step(engine, kv, seqs, rng)
    # distinct (block, content) pairs: the 4 prompt blocks once, then per block the distinct prefixes
    n = kv.num_committed_tokens
    contents = {(o, tuple(s[: min((o + 1) * T, n)])) for s in seqs for o in range(kv.num_blocks) if o * T < n}
    assert used_slots(m) == distinct_slots(kv) == len(contents)
    kv.close()


def test_only_the_final_beam_is_published(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T), quota=200 * 2 * REC * T)
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(5)
    prompt = [rng.randrange(1 << 30) for _ in range(2 * T + 1)]
    kv = m.create_kv_cache(beam_width=B)
    seqs = start_beams(engine, kv, prompt, rng)
    for _ in range(2 * T):
        assert kv.resize(kv.history_length + 1)
        seqs = beam_step(engine, kv, seqs, rng)
    final = [kv.get_committed_tokens(BeamIndex(b)) for b in range(B)]
    common = 0  # full blocks every beam holds alike are published as they complete, like a prompt
    while common + T <= len(final[0]) and all(f[: common + T] == final[0][: common + T] for f in final):
        common += T
    assert common >= 2 * T
    assert m.probe_reuse(input_tokens=[*final[2], 1]) == common
    kv.stop_committing(final_beam=BeamIndex(2))
    kv.close()
    assert m.probe_reuse(input_tokens=[*final[2], 1]) == len(final[2])
    other = next(b for b in range(B) if final[b][2 * T + 1 :] != final[2][2 * T + 1 :])
    assert m.probe_reuse(input_tokens=[*final[other], 1]) < len(final[other])
    reuse = m.create_kv_cache(input_tokens=[*final[2], 1])
    assert reuse.resume()
    engine.check_all(reuse, final[2], len(final[2]))
    reuse.close()


def _beam_pages(kv: KVCache) -> int:
    return len({id(p) for b in range(kv.beam_width) for p in kv._tables[b].all_pages()})


def _check_beams(engine: FakeEngine, kv: KVCache, seqs: list[list[int]]) -> None:
    assert kv.resume()
    for b in range(B):
        engine.check_all(kv, seqs[b], kv.history_length, beam=b)
        assert kv.get_committed_tokens(BeamIndex(b)) == seqs[b][: kv.history_length]


def _filler(m: KVCacheManager) -> KVCache:
    """A suspended request of 4 uncommitted blocks, listed for eviction before the beam request."""
    f = m.create_kv_cache()
    assert f.resume() and f.resize(4 * m.tokens_per_block)
    f.suspend()
    return f


def _fill_gpu(m: KVCacheManager) -> None:
    """A request taking the whole GPU (pushing every suspended page down), then closed."""
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(16 * m.tokens_per_block)
    hog.close()


def test_tier_resize_moves_every_beams_pages(make_manager: MakeManager, tmp_path: object) -> None:
    t = 16
    slot = 2 * 2 * REC * t  # two layers, key + value: one slot holds one block
    m = make_manager(
        kv_layers(2, t),
        t,
        16 * slot,
        host_quota=16 * slot,
        disk_quota=16 * slot,
        disk_path=str(tmp_path),
        max_util_for_resume=1.0,
    )
    engine = FakeEngine(m)
    engine.check_beam_field = False
    rng = random.Random(5)
    prompt = [rng.randrange(1 << 30) for _ in range(20)]
    f = _filler(m)
    kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=B)
    seqs = start_beams(engine, kv, prompt, rng)
    while kv.history_length < 2 * t - 2:
        assert kv.resize(kv.history_length + 1)
        seqs = beam_step(engine, kv, seqs, rng)
    n = _beam_pages(kv)
    assert n > len(kv.block_table.all_pages())  # some pages only other beams hold
    kv.suspend()
    f.close()  # the GPU's first slots are free, the beam request's pages lie above them
    assert m.resize(GPU, n * slot)
    _check_beams(engine, kv, seqs)
    assert m.get_storage_statistics(GPU)[0].total == n
    kv.suspend()
    assert m.resize(GPU, 16 * slot)
    assert kv.resume()
    f = _filler(m)
    kv.suspend()
    _fill_gpu(m)  # the filler goes to the host's first slots, the beam pages after it
    assert {p.level for p in kv._all_pages()} == {HOST}
    f.close()
    assert m.resize(HOST, n * slot)
    _check_beams(engine, kv, seqs)
    f = _filler(m)
    kv.suspend()
    _fill_gpu(m)
    assert m.resize(HOST, slot)  # all but the newest page the host held go to disk, the filler first
    assert m.resize(HOST, 16 * slot)
    assert sorted(p.level for p in {id(p): p for p in kv._all_pages()}.values()) == [HOST] + [DISK] * (n - 1)
    f.close()
    assert m.resize(DISK, (n - 1) * slot)
    _check_beams(engine, kv, seqs)
    kv.close()


def test_beam_misuse_is_refused(make_manager: MakeManager) -> None:
    m = make_manager(kv_layers(1, T))
    with pytest.raises(ValueError, match="beam_width"):
        m.create_kv_cache(beam_width=0)
    kv = m.create_kv_cache(beam_width=2)
    kv.resume()
    assert kv.resize(10)
    with pytest.raises(ValueError, match="one entry per beam"):
        kv.commit([[1]], [0])
    with pytest.raises(ValueError, match="beam_search_indices\\[1\\]"):
        kv.commit([[1], [2]], [0, 2])
    with pytest.raises(ValueError, match="same number"):
        kv.commit([[1], [2, 3]], [0, 1])
    with pytest.raises(ValueError, match="beam index"):
        kv.get_base_page_indices(LG0, BeamIndex(2))
    kv.commit([[1], [2]], [0, 0])
    with pytest.raises(LogicError, match="forked"):
        kv.commit([3])
    single = m.create_kv_cache()
    single.resume()
    assert single.resize(4)
    with pytest.raises(ValueError, match="beam_width 1"):
        single.commit([[1]], [0])
    kv.close()
    single.close()
