"""The copy engine on the host backend: run merging, every pair of media, disk errors reported
per slot (never raised), nothing else touched."""

from __future__ import annotations

import os

import pytest

from kv_cache_manager_v2._storage._backend import MemoryPool
from kv_cache_manager_v2._storage._copy_engine import CopyEngine, coalesce
from kv_cache_manager_v2._storage._disk import DiskPool
from kv_cache_manager_v2._storage._host_backend import HostBackend

SIZE = 64
SLOTS = 16


def test_coalesce_merges_runs_consecutive_on_both_sides() -> None:
    pairs = [(5, 9), (3, 1), (4, 2), (6, 10), (7, 3), (0, 0)]
    runs = coalesce(pairs)
    assert [(s, d, n) for s, d, n, _ in runs] == [(0, 0, 1), (3, 1, 2), (5, 9, 2), (7, 3, 1)]
    assert [idx for *_, idx in runs] == [[5], [1, 2], [0, 3], [4]]
    assert coalesce([]) == []


def fill(pool: MemoryPool, tag: int) -> None:
    view = pool.host_view
    assert view is not None
    for s in range(SLOTS):
        view[s * SIZE : (s + 1) * SIZE] = bytes([tag ^ s]) * SIZE


def slot_bytes(pool: object, s: int) -> bytes:
    # type(), not isinstance(): compiled subclasses of an ABC share its isinstance cache (see CLAUDE.md)
    if type(pool) is DiskPool:
        return os.pread(pool.fd, SIZE, s * SIZE)
    view = pool.host_view  # type: ignore[attr-defined]
    assert view is not None
    return bytes(view[s * SIZE : (s + 1) * SIZE])


@pytest.fixture
def engine() -> CopyEngine:
    return CopyEngine(HostBackend())


def test_every_pair_of_media(engine: CopyEngine, tmp_path: object) -> None:
    backend = engine.backend
    gpu, host = backend.reserve_pool(SLOTS * SIZE), backend.reserve_host_pool(SLOTS * SIZE)
    disk, disk2 = DiskPool(str(tmp_path), SLOTS * SIZE, SIZE), DiskPool(str(tmp_path), SLOTS * SIZE, SIZE)
    for p in (gpu, host):
        p.ensure_mapped(SLOTS * SIZE)
    fill(gpu, 0x10)
    for d in (disk, disk2):  # a disk slot reads back only what was written through the pool (checksums)
        assert engine.copy([gpu], [d], [SIZE], [(s, s) for s in range(SLOTS)]) == set()
    fill(gpu, 0x20)
    pairs = [(1, 2), (2, 3), (3, 4), (9, 0)]
    for src, dst in ((gpu, host), (host, disk), (disk, disk2), (disk2, gpu), (gpu, gpu)):
        moves = pairs if src is not dst else [(2, 12), (3, 13)]
        want = {d: slot_bytes(src, s) for s, d in moves}
        before = {s: slot_bytes(dst, s) for s in range(SLOTS)}
        assert engine.copy([src], [dst], [SIZE], moves) == set()
        for s in range(SLOTS):  # the destinations hold the sources' bytes; nothing else changed
            assert slot_bytes(dst, s) == want.get(s, before[s])
    for p in (gpu, host, disk, disk2):
        p.release()


def test_disk_errors_are_reported_per_slot(engine: CopyEngine, tmp_path: object) -> None:
    backend = engine.backend
    host = backend.reserve_host_pool(SLOTS * SIZE)
    host.ensure_mapped(SLOTS * SIZE)
    fill(host, 0x20)
    disk = DiskPool(str(tmp_path), SLOTS * SIZE, SIZE)
    disk.error_hook = lambda op, off, n: op == "write" and off <= 5 * SIZE < off + n
    failed = engine.copy([host], [disk], [SIZE], [(0, 3), (1, 4), (2, 5), (3, 6)])
    assert failed == {2}  # one run failed; retried slot by slot, only slot 5 failed again
    assert disk.num_errors == 2
    for s, d in ((0, 3), (1, 4), (3, 6)):
        assert slot_bytes(disk, d) == bytes([0x20 ^ s]) * SIZE
    disk.error_hook = lambda op, off, n: op == "read"
    fill(host, 0x30)
    assert engine.copy([disk], [host], [SIZE], [(3, 0), (4, 1)]) == {0, 1}
    assert slot_bytes(host, 0) == bytes([0x30]) * SIZE  # an injected error fails before any byte moves
    disk.error_hook = None
    with pytest.raises(OSError, match="outside the file"):
        disk.read_into(memoryview(bytearray(SIZE)), SLOTS * SIZE)
    host.release()
    disk.release()
    disk.release()  # idempotent


def test_disk_reads_verify_every_slot_checksum(engine: CopyEngine, tmp_path: object) -> None:
    """A slot whose file bytes changed behind the pool (zeroed, overwritten, truncated away, never
    written) fails its read like an I/O error, alone; the other slots of the run still copy."""
    backend = engine.backend
    host = backend.reserve_host_pool(SLOTS * SIZE)
    host.ensure_mapped(SLOTS * SIZE)
    fill(host, 0x60)
    disk = DiskPool(str(tmp_path), SLOTS * SIZE, SIZE)
    assert engine.copy([host], [disk], [SIZE], [(s, s) for s in range(8)]) == set()
    os.pwrite(disk.fd, bytes(SIZE), 2 * SIZE)  # zeroed
    os.pwrite(disk.fd, b"\x01", 4 * SIZE + 7)  # one byte changed
    os.pwrite(disk.fd, slot_bytes(disk, 6), 5 * SIZE)  # another slot's (valid) bytes
    fill(host, 0x70)
    pairs = [(s, 8 + s) for s in range(9)]  # slot 8 was never written
    assert engine.copy([disk], [host], [SIZE], pairs) == {2, 4, 5, 8}
    for s in (0, 1, 3, 6, 7):
        assert slot_bytes(host, 8 + s) == bytes([0x60 ^ s]) * SIZE
    assert disk.num_corrupt == 4 + 1  # the run, then each bad slot alone
    os.ftruncate(disk.fd, 3 * SIZE)  # truncated: later slots read short, or as zeros once it grows again
    os.ftruncate(disk.fd, SLOTS * SIZE)
    assert engine.copy([disk], [host], [SIZE], [(0, 0), (1, 1), (3, 3), (7, 7)]) == {2, 3}
    bufs = [memoryview(bytearray(SIZE)) for _ in range(2)]
    assert engine.read_slots([disk], [SIZE], [1, 7], bufs, 0) == {1}
    assert bytes(bufs[0]) == bytes([0x60 ^ 1]) * SIZE
    host.release()
    disk.release()


def test_slots_to_buffers_and_back_on_every_medium(engine: CopyEngine, tmp_path: object) -> None:
    """read_slots / write_slots (the remote tier's values): a slot's bytes of every pool, in pool order,
    after ``offset`` bytes of room; disk failures reported per slot."""
    backend = engine.backend
    gpu = [backend.reserve_pool(SLOTS * SIZE) for _ in range(2)]
    host = [backend.reserve_host_pool(SLOTS * SIZE) for _ in range(2)]
    for p in gpu + host:
        p.ensure_mapped(SLOTS * SIZE)
    disk = [DiskPool(str(tmp_path), SLOTS * SIZE, SIZE) for _ in range(2)]
    fill(gpu[0], 0x40)
    fill(gpu[1], 0x50)
    bufs = [bytearray(8 + 2 * SIZE) for _ in range(2)]
    assert engine.read_slots(gpu, [SIZE, SIZE], [3, 7], [memoryview(b) for b in bufs], 8) == set()
    assert [bytes(b) for b in bufs] == [b"\0" * 8 + bytes([0x40 ^ s]) * SIZE + bytes([0x50 ^ s]) * SIZE for s in (3, 7)]
    views = [memoryview(b)[8:] for b in bufs]
    for dst in (host, disk):
        assert engine.write_slots(dst, [SIZE, SIZE], [1, 9], views) == set()
        for p, tag in zip(dst, (0x40, 0x50)):
            assert slot_bytes(p, 1) == bytes([tag ^ 3]) * SIZE and slot_bytes(p, 9) == bytes([tag ^ 7]) * SIZE
        again = [bytearray(2 * SIZE) for _ in range(2)]
        assert engine.read_slots(dst, [SIZE, SIZE], [9, 1], [memoryview(b) for b in again], 0) == set()
        assert [bytes(b) for b in again] == [bytes(views[1]), bytes(views[0])]
    disk[1].error_hook = lambda op, off, n: off == 9 * SIZE
    assert engine.read_slots(disk, [SIZE, SIZE], [1, 9], [memoryview(bytearray(2 * SIZE)) for _ in range(2)], 0) == {1}
    assert engine.write_slots(disk, [SIZE, SIZE], [9, 1], views) == {0}
    for p in gpu + host + disk:
        p.release()


def test_device_memory_routes_through_a_small_staging_buffer(tmp_path: object) -> None:
    """GPU memory the CPU cannot address (the host backend playing a real device): device <-> device
    and host by address, device <-> disk and <-> byte buffers through a staging buffer of three slots,
    so runs are cut and batched; disk errors still reported per slot."""
    backend = HostBackend(addressable=False)
    engine = CopyEngine(backend, staging_bytes=3 * SIZE)
    dev, dev2 = backend.reserve_pool(SLOTS * SIZE), backend.reserve_pool(SLOTS * SIZE)
    host = backend.reserve_host_pool(SLOTS * SIZE)
    disk = DiskPool(str(tmp_path), SLOTS * SIZE, SIZE)
    assert dev.host_view is None and dev.medium != host.medium
    for p in (dev, dev2, host):
        p.ensure_mapped(SLOTS * SIZE)

    def read(pool: object, s: int) -> bytes:
        if pool is dev or pool is dev2:
            return backend.read(pool.base_address + s * SIZE, SIZE)  # type: ignore[attr-defined]
        return slot_bytes(pool, s)

    for s in range(SLOTS):
        backend.write(dev.base_address + s * SIZE, bytes([0x80 ^ s]) * SIZE)
    pairs = [(s, s) for s in range(SLOTS)]
    assert engine.copy([dev], [disk], [SIZE], pairs) == set()  # 16 slots in batches of 3
    pairs = [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (9, 0), (11, 3)]
    for src, dst in ((dev, host), (host, dev2), (dev2, disk), (disk, dev), (dev, dev2)):
        want = {d: read(src, s) for s, d in pairs}
        before = {s: read(dst, s) for s in range(SLOTS)}
        assert engine.copy([src], [dst], [SIZE], pairs) == set()
        for s in range(SLOTS):
            assert read(dst, s) == want.get(s, before[s])
    disk.error_hook = lambda op, off, n: op == "read" and off <= 12 * SIZE < off + n
    assert engine.copy([disk], [dev], [SIZE], [(10, 0), (11, 1), (12, 2), (13, 3)]) == {2}  # slot 2: garbage
    disk.error_hook = None
    assert read(dev, 0) == read(disk, 10) and read(dev, 1) == read(disk, 11) and read(dev, 3) == read(disk, 13)
    disk.error_hook = lambda op, off, n: op == "write" and off <= 4 * SIZE < off + n
    assert engine.copy([dev], [disk], [SIZE], [(0, 3), (1, 4), (2, 5)]) == {1}
    disk.error_hook = None
    bufs = [memoryview(bytearray(4 + SIZE)) for _ in range(5)]
    slots = [15, 0, 7, 3, 9]
    assert engine.read_slots([dev], [SIZE], slots, bufs, 4) == set()
    assert [bytes(b[4:]) for b in bufs] == [read(dev, s) for s in slots]
    assert engine.write_slots([dev2], [SIZE], [1, 2, 3, 4, 5], [b[4:] for b in bufs]) == set()
    assert [read(dev2, s) for s in (1, 2, 3, 4, 5)] == [read(dev, s) for s in slots]
    for p in (dev, dev2, host, disk):
        p.release()
    backend.shutdown()
