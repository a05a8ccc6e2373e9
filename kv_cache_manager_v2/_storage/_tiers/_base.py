"""What every tier module provides: a ``Tier`` (builds one level's pools, grows them), a
``MediumAccess`` per kind of pool it introduces (slot bytes to and from plain buffers, a slot read on
another thread: ``DetachedSlot``) and ``Route`` objects (batched slot copies between two kinds of pool).

The copy engine picks a route by the ``medium`` of the two pools (``Pool.medium``); a new medium is
one tier module with its access, its routes to the media before it, and a line in ``_registry.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ..._common import CacheTier
from .._backend import MemoryBackend, MemoryPool, Pool
from .._disk import DiskPool
from .._layout import PoolGroupLayout
from .._persist import PersistentDisk

#: A run: (first source slot, first destination slot, number of slots, pair indices in slot order).
Run = tuple[int, int, int, list[int]]
#: Copies gathered for the backend's batched calls, per direction: (destinations, sources, sizes).
Batches = dict[int, tuple[list[int], list[int], list[int]]]


def coalesce(pairs: Sequence[tuple[int, int]]) -> list[Run]:
    """Merge ``(src_slot, dst_slot)`` pairs into runs consecutive on both sides."""
    order = sorted(range(len(pairs)), key=lambda i: pairs[i])
    runs: list[Run] = []
    src0 = dst0 = count = -1
    indices: list[int] = []
    for i in order:
        src, dst = pairs[i]
        if count > 0 and src == src0 + count and dst == dst0 + count:
            count += 1
            indices.append(i)
            continue
        if count > 0:
            runs.append((src0, dst0, count, indices))
        src0, dst0, count, indices = src, dst, 1, [i]
    if count > 0:
        runs.append((src0, dst0, count, indices))
    return runs


def add_batch(batches: Batches, kind: int, dst: int, src: int, nbytes: int) -> None:
    """Queue one copy of direction ``kind`` for the backend's batched call."""
    batch = batches.get(kind)
    if batch is None:
        batch = batches[kind] = ([], [], [])
    batch[0].append(dst)
    batch[1].append(src)
    batch[2].append(nbytes)


class DetachedSlot(ABC):
    """A slot of one pool whose page let go of it, read on another thread (``MediumAccess.detach``)."""

    @abstractmethod
    def read(self) -> memoryview:
        """The slot's bytes; raises ``OSError`` where they cannot be read or do not verify."""

    def failed(self) -> None:
        """``read`` failed, so the bytes went nowhere (the medium counts it)."""


class MediumAccess(ABC):
    """How the CPU reaches the slot bytes of one kind of pool (``Pool.medium``)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend

    @abstractmethod
    def to_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], views: list[memoryview], failed: set[int]
    ) -> None:
        """Copy slot ``slots[i]`` (``size`` bytes) into ``views[i]``; add ``i`` to ``failed`` where it cannot be read."""

    @abstractmethod
    def from_buffers(
        self, pool: Pool, size: int, slots: Sequence[int], parts: list[memoryview], failed: set[int]
    ) -> None:
        """Copy ``parts[i]`` into slot ``slots[i]``; add ``i`` to ``failed`` where it cannot be written."""

    def can_detach(self) -> bool:
        """Whether another thread can read a slot as it is (``detach``)."""
        return False

    def detach(self, pool: Pool, slot: int, size: int) -> DetachedSlot:
        """Slot ``slot`` of ``pool`` for another thread to read (``can_detach`` media only)."""
        raise NotImplementedError

    def host_bytes(self, pool: Pool, slot: int, size: int) -> memoryview | None:
        """Slot ``slot`` of ``pool`` as a view of CPU memory; None where the medium has none."""
        return None

    def num_detached_errors(self, pool: Pool) -> int:
        """Detached slots of ``pool`` whose read failed (``DetachedSlot.failed``)."""
        return 0


class Route(ABC):
    """Batched copies of slot runs from one kind of pool to another (one pool of a group)."""

    @abstractmethod
    def copy(self, src: Pool, dst: Pool, size: int, runs: list[Run], failed: set[int], batches: Batches) -> None:
        """Copy ``runs`` of ``size``-byte slots; add the pair indices whose data could not be copied
        to ``failed``. Address copies may be queued in ``batches`` (issued by the caller, then synced)."""


class Tier(ABC):
    """One medium of the local cache levels: builds a level's pools and grows them."""

    def __init__(self, backend: MemoryBackend, tier: CacheTier) -> None:
        self.backend = backend
        #: the kind of memory
        self.tier = tier

    @abstractmethod
    def make_pool(self, group: PoolGroupLayout, pool: int, num_bytes: int, max_bytes: int) -> Pool:
        """Pool ``pool`` of ``group``, backing ``num_bytes`` now and able to grow in place to ``max_bytes``."""

    def make_pools(self, group: PoolGroupLayout, num_slots: int, max_slots: int) -> list[Pool]:
        """The pools of one group at this level (each releases what it made if a later one fails)."""
        pools: list[Pool] = []
        try:
            for pool, size in enumerate(group.slot_sizes):
                pools.append(self.make_pool(group, pool, num_slots * size, max_slots * size))
        except BaseException:
            for made in pools:
                made.release()
            raise
        return pools

    def persistent(self) -> PersistentDisk | None:
        """The files that keep this level's pages across restarts (a persistent disk tier), else None."""
        return None

    def grow(self, pools: list[Pool], slot_sizes: Sequence[int], num_slots: int) -> None:
        """Back ``num_slots`` slots of each pool before a resize hands them out (may raise, nothing changed)."""
        for pool, size in zip(pools, slot_sizes):
            pool.ensure_mapped(num_slots * size)


def memory(pool: Pool) -> MemoryPool:
    """``pool`` as the memory pool its medium says it is."""
    assert isinstance(pool, MemoryPool)
    return pool


def file(pool: Pool) -> DiskPool:
    """``pool`` as the file pool its medium says it is."""
    assert isinstance(pool, DiskPool)
    return pool
