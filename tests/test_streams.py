"""Copies ordered against the engine's streams with events (``_storage/_streams.py``), on the CUDA
backend over the emulated driver: no device-wide (or any) synchronisation in steady state; every
copy after events recorded on the streams that used its pages, every stream in use after the
copies; the CPU touches host memory only once the copies using it are done.

The fake engine, given the driver, declares each record it reads or writes as a kernel on the
request's ``cuda_stream``; the driver fails on a copy and a kernel touching the same bytes without
being ordered, and defers copies until the CPU waits (so a missing wait reads stale bytes)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from conftest import attention_and_recurrent, kv_layers, make_config, requires_cuda
from fake_engine import FakeEngine
from tier_helpers import SLOT, T, compute, seq

from kv_cache_manager_v2 import KVCacheManager, SlotId
from kv_cache_manager_v2._storage._backend import D2H

pytest.importorskip("cuda.bindings")

COPIES = ("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync")
Log = list[tuple[str, int, int]]


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> Any:
    import cuda.bindings
    from fake_cuda_driver import FakeDriver

    driver = FakeDriver()
    monkeypatch.setattr(cuda.bindings, "driver", driver)
    return driver


def cuda_manager(gpu: int, host: int | None = None, disk: int | None = None, tmp: object = None) -> KVCacheManager:
    """A manager on the (emulated) CUDA backend with ``gpu`` / ``host`` / ``disk`` one-block slots."""
    return KVCacheManager(
        make_config(
            kv_layers(2, T),
            T,
            gpu * SLOT,
            host_quota=None if host is None else host * SLOT,
            disk_quota=None if disk is None else disk * SLOT,
            disk_path=None if disk is None else str(tmp),
            backend="cuda",
            max_util_for_resume=1.0,
        )
    )


def quiet(drv: Any, call: Callable[[], object]) -> Log:
    """Run a manager call (that must not return False); nothing synchronises in it. Returns its
    ordering calls and copies."""
    start = len(drv.log)
    assert call() is not False
    log: Log = drv.log[start:]
    assert not [entry for entry in log if "Synchronize" in entry[0]], log
    return log


def copy_stream(m: KVCacheManager) -> int:
    return int(m._storage.copier.backend.stream)  # type: ignore[attr-defined]


def check_ordered(log: Log, copy: int, streams: set[int]) -> None:
    """The copies of ``log`` come after a wait of the copy stream for an event recorded on each of
    ``streams`` (and no other stream), and each of them waits for an event recorded after them."""
    at = [i for i, entry in enumerate(log) if entry[0] in COPIES]
    assert at, log
    first, last = at[0], at[-1]
    recorded = {e: s for name, s, e in log[:first] if name == "cuEventRecord"}
    waited = {recorded[e] for name, s, e in log[:first] if name == "cuStreamWaitEvent" and s == copy and e in recorded}
    assert waited == streams, log
    done = [e for name, s, e in log[last:] if name == "cuEventRecord" and s == copy]
    assert done, log
    after = {s for name, s, e in log[last:] if name == "cuStreamWaitEvent" and e == done[0]}
    assert streams <= after, log


def test_offload_and_onboard_are_ordered_with_every_stream_in_use(drv: Any) -> None:
    """Requests on stream 7, on the legacy stream 0 and on 9: an offload waits for all three
    streams' kernels (never the device) and they wait for it; a request resumed on a new stream
    waits for the copies that brought its pages up. The fake engine's records on each stream are
    checked against every copy."""
    m = cuda_manager(gpu=4, host=8)
    engine = FakeEngine(m, driver=drv)
    copy = copy_stream(m)
    a = m.create_kv_cache()
    assert quiet(drv, lambda: a.resume(7)) == []  # nothing to copy, no copy yet to wait for
    compute(engine, a, seq(1, 2 * T), 2 * T)
    b = m.create_kv_cache()  # the legacy default stream
    assert b.resume() and b.cuda_stream == 0
    compute(engine, b, seq(2, T), T)
    a.suspend()
    hog = m.create_kv_cache()
    assert hog.resume(9)
    log = quiet(drv, lambda: hog.resize(3 * T))  # a's two pages go down to the host tier
    check_ordered(log, copy, {0, 7, 9})
    assert [p.level for p in a.block_table.all_pages()] == [1, 1]
    engine.step(hog, seq(3, 3 * T), 0, 3 * T)  # writes the slots just copied out: after the copy (checked)
    hog.close()
    log = quiet(drv, lambda: a.resume(11))  # onboarded, then on a new stream
    check_ordered(log, copy, {0, 7})  # 9 was let go of at hog's close: waited for once (below)
    last = max(i for i, entry in enumerate(log) if entry[0] in COPIES)
    done = next(e for name, s, e in log[last:] if name == "cuEventRecord" and s == copy)
    assert ("cuStreamWaitEvent", 11, done) in log[last:]  # the new stream starts after the copies
    assert ("cuEventRecord", 7, log[-1][2]) == log[-1]  # and 7, let go of, gets its event
    engine.check_all(a, seq(1, 2 * T), 2 * T)  # kernels on 11 read what the copies brought (checked)
    streams = m._storage.copier.streams
    assert streams.users == {0: 1, 11: 1} and len(streams.released) == 1  # 7 (9's was waited for)
    for kv in (a, b):
        kv.close()
    assert streams.users == {}
    m.clear_reusable_blocks()
    m.shutdown()
    assert not drv.events and not drv.live_streams and not drv.mapped and not drv.registered


def test_a_stream_let_go_of_is_still_waited_for(drv: Any) -> None:
    """A request closes (its stream may be destroyed next): an event recorded on its stream then
    orders the later eviction of its pages; that stream is never touched again."""
    m = cuda_manager(gpu=2, host=4)
    engine = FakeEngine(m, driver=drv)
    copy = copy_stream(m)
    a = m.create_kv_cache()
    assert a.resume(7)
    compute(engine, a, seq(1, 2 * T), 2 * T)
    log = quiet(drv, a.close)  # its blocks stay as reusable pages in GPU memory
    assert [(name, s) for name, s, _ in log] == [("cuEventRecord", 7)]
    event = log[0][2]
    hog = m.create_kv_cache()
    assert hog.resume(9)
    log = quiet(drv, lambda: hog.resize(2 * T))  # a's pages are evicted to the host tier
    first = min(i for i, entry in enumerate(log) if entry[0] in COPIES)
    assert ("cuStreamWaitEvent", copy, event) in log[:first]
    assert not [entry for entry in log if entry[1] == 7]
    engine.step(hog, seq(2, 2 * T), 0, 2 * T)
    hog.close()
    b = m.create_kv_cache(input_tokens=seq(1, 2 * T) + [5])
    assert b.history_length == 2 * T
    quiet(drv, lambda: b.resume(9))
    engine.check_all(b, seq(1, 2 * T), 2 * T)
    assert not [entry for entry in drv.log[drv.log.index(("cuEventRecord", 7, event)) + 1 :] if entry[1] == 7]
    b.close()
    m.shutdown()
    assert not drv.events


def test_suspend_resume_and_beam_forks_never_synchronise(drv: Any) -> None:
    """Beam search on stream 5 (copy-on-write of the shared partial block: a GPU-to-GPU copy),
    suspended, pushed down to the host tier and resumed: every manager call without a wait, every
    copy ordered with the beams' kernels (checked record by record)."""
    m = cuda_manager(gpu=12, host=12)
    engine = FakeEngine(m, driver=drv)
    engine.check_beam_field = False
    copy = copy_stream(m)
    rng = random.Random(3)
    beams = 2
    prompt = [rng.randrange(1 << 30) for _ in range(T + 3)]
    kv = m.create_kv_cache(input_tokens=prompt[:-1], beam_width=beams)
    quiet(drv, lambda: kv.resume(5))
    assert kv.resize(len(prompt), 0)
    engine.step(kv, prompt, 0, len(prompt))
    quiet(drv, lambda: kv.commit([prompt] * beams, [0] * beams))  # forks the beams
    seqs = [list(prompt) + [rng.randrange(1 << 30)] for _ in range(beams)]
    h = kv.history_length
    log = quiet(drv, lambda: kv.resize(h + 1))  # each beam writes the shared partial block: copied
    check_ordered(log, copy, {5})
    for b in range(beams):
        engine.step(kv, seqs[b], h, h + 1, beam=b)
        engine.check_all(kv, seqs[b], h + 1, beam=b)
    kv.commit([[seqs[b][h]] for b in range(beams)], list(range(beams)))
    quiet(drv, kv.suspend)
    hog = m.create_kv_cache()
    assert hog.resume(6)
    quiet(drv, lambda: hog.resize(12 * T))  # the suspended beams' pages go to the host tier
    assert all(p.level == 1 for p in kv.block_table.all_pages())
    engine.step(hog, seq(9, 12 * T), 0, 12 * T)
    hog.close()
    quiet(drv, lambda: kv.resume())
    for b in range(beams):
        engine.check_all(kv, seqs[b], h + 1, beam=b)
    kv.close()
    m.shutdown()
    assert not drv.events


def test_snapshot_copies_are_ordered(drv: Any) -> None:
    """A hybrid model: the commit's snapshots of the live state and the matched snapshot copied into
    the next request's live state are GPU-to-GPU copies, ordered like the others (the state record
    read on the new stream is checked against them)."""
    m = KVCacheManager(make_config(attention_and_recurrent(T), T, 8 << 20, backend="cuda", ssm_reuse_interval=2 * T))
    engine = FakeEngine(m, driver=drv)
    copy = copy_stream(m)
    prompt = seq(4, 4 * T + 3)
    a = m.create_kv_cache(input_tokens=prompt)
    quiet(drv, lambda: a.resume(5))
    for lo, hi in ((0, 2 * T), (2 * T, 4 * T), (4 * T, len(prompt))):
        assert a.resize(hi)
        engine.step(a, prompt, lo, hi)
        chunk = prompt[lo:hi]
        log = quiet(drv, lambda c=chunk: a.commit(c))
        if hi % (2 * T) == 0:  # a snapshot of the live state
            check_ordered(log, copy, {5})
    event = quiet(drv, a.close)[-1][2]
    b = m.create_kv_cache(input_tokens=prompt + [1])
    assert b.history_length == 4 * T
    log = quiet(drv, lambda: b.resume(6))  # the snapshot copied into b's live state
    first = min(i for i, entry in enumerate(log) if entry[0] in COPIES)
    assert ("cuStreamWaitEvent", copy, event) in log[:first]  # after a's kernels on 5 (let go of)
    done = next(e for name, s, e in log[first:] if name == "cuEventRecord" and s == copy)
    assert ("cuStreamWaitEvent", 6, done) in log[first:]
    engine.check_all(b, prompt, 4 * T)
    b.close()
    m.shutdown()
    assert not drv.events


@pytest.mark.parametrize("driver", ["emulated", pytest.param("cuda", marks=requires_cuda)])
def test_a_stream_destroyed_after_close_and_kv_round_trips(driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request on a stream of the engine's own: its pages go to the host tier and back; after it
    closes the engine destroys the stream, and the eviction of its pages still waits for it (the
    emulated driver fails on any use of a destroyed stream). On a GPU, with real events."""
    import cuda.bindings

    drv: Any = None
    if driver == "emulated":
        from fake_cuda_driver import FakeDriver

        drv = FakeDriver()
        monkeypatch.setattr(cuda.bindings, "driver", drv)
    cu = cuda.bindings.driver
    m = cuda_manager(gpu=4, host=8)
    engine = FakeEngine(m, driver=drv)
    status, handle = cu.cuStreamCreate(0)
    assert status == cu.CUresult.CUDA_SUCCESS
    stream = int(handle)
    a = m.create_kv_cache()
    assert a.resume(stream)
    compute(engine, a, seq(1, 2 * T), 2 * T)
    a.suspend()
    hog = m.create_kv_cache()
    assert hog.resume(stream) and hog.resize(4 * T)  # a's pages go to the host tier
    engine.step(hog, seq(2, 4 * T), 0, 4 * T)
    hog.close()
    assert a.resume()  # and come back
    engine.check_all(a, seq(1, 2 * T), 2 * T)
    a.close()
    assert cu.cuStreamDestroy(handle)[0] == cu.CUresult.CUDA_SUCCESS
    hog = m.create_kv_cache()
    assert hog.resume() and hog.resize(4 * T)  # on stream 0: a's blocks are evicted to the host tier
    engine.step(hog, seq(3, 4 * T), 0, 4 * T)
    hog.close()
    b = m.create_kv_cache(input_tokens=seq(1, 2 * T) + [1])
    assert b.history_length == 2 * T and b.resume()
    engine.check_all(b, seq(1, 2 * T), 2 * T)
    b.close()
    m.shutdown()
    assert drv is None or not drv.events


def test_the_cpu_waits_for_the_copies_using_host_bytes(drv: Any, tmp_path: object) -> None:
    """Copies are deferred until the CPU waits: host bytes a pending copy writes are waited for
    before a disk write or a read-out takes them, host bytes a pending copy reads before they are
    overwritten, and the staging buffer before it is filled again."""
    m = cuda_manager(gpu=4, host=4, disk=8, tmp=tmp_path)
    storage = m._storage
    backend = storage.copier.backend
    gpu, host, disk = (storage.levels[level][0] for level in range(3))
    for group in (gpu, host, disk):
        group.allocator.allocate(4)
    sizes = gpu.layout.slot_sizes

    def fill(slot: int, value: int) -> None:
        for p, size in enumerate(sizes):
            backend.write(gpu.slot_address(p, SlotId(slot)), bytes([value]) * size)

    def on_gpu(slot: int) -> bytes:
        return b"".join(backend.read(gpu.slot_address(p, SlotId(slot)), size) for p, size in enumerate(sizes))

    def read_out(group: Any, slot: int) -> bytes:
        buf = memoryview(bytearray(sum(sizes)))
        assert not storage.copier.read_slots(group.pools, sizes, [slot], [buf], 0)
        return bytes(buf)

    for slot in range(4):
        fill(slot, slot + 1)
    copier = storage.copier
    assert not copier.copy(gpu.pools, host.pools, sizes, [(0, 0), (1, 1)])  # D2H, pending
    assert drv.pending
    assert read_out(host, 0) == bytes([1]) * sum(sizes)  # a read-out (the remote tier's) waits
    assert not copier.copy(gpu.pools, host.pools, sizes, [(2, 2)])
    assert not copier.copy(host.pools, disk.pools, sizes, [(2, 0)])  # pwrite of the host slot waits
    assert read_out(disk, 0) == bytes([3]) * sum(sizes)
    assert not copier.copy(host.pools, gpu.pools, sizes, [(1, 3)])  # H2D reads host slot 1, pending
    new = [memoryview(bytes([9]) * sum(sizes))]
    assert not copier.write_slots(host.pools, sizes, [1], new)  # overwriting it waits
    assert on_gpu(3) == bytes([2]) * sum(sizes) and read_out(host, 1) == bytes(new[0])
    for slot, value in ((1, 21), (2, 22)):
        assert not copier.write_slots(disk.pools, sizes, [slot], [memoryview(bytes([value]) * sum(sizes))])
    assert not copier.copy(disk.pools, gpu.pools, sizes, [(1, 0)])  # disk -> staging -> GPU, pending
    assert not copier.copy(disk.pools, gpu.pools, sizes, [(2, 2)])  # refilling the staging buffer waits
    assert on_gpu(0) == bytes([21]) * sum(sizes) and on_gpu(2) == bytes([22]) * sum(sizes)
    m.shutdown()
    assert not drv.pending and not drv.events


def test_pages_handed_to_the_remote_writer_wait_for_their_copy(drv: Any, redis_server: Any) -> None:
    """Reusable pages offloaded to the host tier (the copy still queued) and then dropped to the
    remote tier: the writer thread reads their host slots only after the copy (another manager
    reads back exactly what the first one computed)."""
    from test_remote import remote_config

    a = KVCacheManager(remote_config(redis_server.url, gpu=2, host=2, backend="cuda"))
    engine = FakeEngine(a, driver=drv)
    toks = seq(5, 2 * T)
    kv = a.create_kv_cache(input_tokens=toks)
    assert kv.resume(7)
    compute(engine, kv, toks, 2 * T)
    kv.close()  # two reusable pages in GPU memory
    first = a.create_kv_cache()
    assert first.resume(7) and first.resize(2 * T)  # they go to the host tier: copies queued
    assert drv.pending
    first.suspend()
    second = a.create_kv_cache()
    assert second.resume(7) and second.resize(2 * T)  # first's pages go down, pushing them out
    assert a.flush_remote_writes()
    b = KVCacheManager(remote_config(redis_server.url, gpu=4))
    kv = b.create_kv_cache(input_tokens=toks + [1])
    assert kv.history_length == 2 * T and kv.resume()
    FakeEngine(b).check_all(kv, toks, 2 * T)
    kv.close()
    for kv in (first, second):
        kv.close()
    for m in (a, b):
        m.shutdown()


def test_the_emulated_driver_catches_unordered_copies(drv: Any) -> None:
    """The checks above can fail: a copy issued without waiting for the kernel that wrote its
    source, and a wait for an event never recorded."""
    m = cuda_manager(gpu=2, host=2)
    storage = m._storage
    backend = storage.copier.backend
    gpu, host = storage.levels[0][0], storage.levels[1][0]
    gpu.allocator.allocate(1)
    host.allocator.allocate(1)
    src = gpu.slot_address(0, SlotId(0))
    size = gpu.layout.slot_sizes[0]
    drv.kernel(7, writes=[(src, size)])
    with pytest.raises(AssertionError, match="not ordered after the write"):
        backend.copy_batch(D2H, [host.slot_address(0, SlotId(0))], [src], [size])
    event = backend.create_event()
    with pytest.raises(AssertionError, match="never recorded"):
        backend.wait_event(7, event)
    backend.destroy_event(event)
    drv.pending.clear()
    m.shutdown()


def test_the_host_backend_orders_nothing() -> None:
    """Synchronous copies: the host-emulated backend records no stream and makes no event."""
    m = KVCacheManager(make_config(kv_layers(2, T), T, 4 * SLOT, host_quota=4 * SLOT, max_util_for_resume=1.0))
    kv = m.create_kv_cache()
    assert kv.resume(7) and kv.resize(2 * T)
    streams = m._storage.copier.streams
    assert not streams.active and streams.users == {} and streams.done is None
    kv.cuda_stream = 8
    assert kv.cuda_stream == 8 and streams.users == {}
    kv.close()
    m.shutdown()
