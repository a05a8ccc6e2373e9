"""What reading a page from a tier below the GPU costs: per cache level, seconds per byte and a
latency per transfer (a batch of copies from one level), for ``load_policy="auto"``.

The configured figures (the tier configs' ``read_bytes_per_s`` and ``read_latency_s``) are the
prior; with ``refine`` every timed read refines them, each an exponentially weighted average
(weight ``REFINE_WEIGHT`` per batch): a batch whose bytes take longer than its latency at the
current estimate refines the time per byte (its time less the latency, over its bytes), a smaller
one the latency (its time less its bytes' time). Only reads the CPU waits for are timed: a disk
tier's (``StorageManager.move_up``; a background read on its worker, ``PageRead``) and the remote
tier's fetches (``RemoteFill``; a prefetch's on its worker, ``RemoteReads``); a host tier's
copies are queued on the copy stream (their CPU time says nothing about the link), so its figures
stay as configured. The GPU (level 0) costs nothing.

A read also waits behind what is queued on its link (``wait_s``: e.g. writes of evicted pages to a
slow disk), counted once per level a read uses, like the latency. The manager knows its own
writes: each batch of evicted pages written to a level (``note_write``) queues on that level's
link at the tier's ``write_bytes_per_s`` (queued writes stream: no latency each), from when the
link is free or now, whichever is later (``busy_until``, on the manager's clock); whoever knows more of the link's
backlog (an engine, a simulator) sets it per level (``KVCacheManager.set_tier_wait``: the link is
busy that long from now, our writes queue after it). The wait is what is left of it now.

**Write admission** (``KVCacheManagerConfig.max_write_backlog_s``): a link whose backlog would
exceed that bound with one more page cannot absorb it; an evicted reusable page that would be
written there is dropped instead (``admitted``: the eviction cascade asks per batch; the level
counts it, ``TierStatistics.declined_pages``). A link that keeps up never reaches the bound, so
nothing changes there; a slow one stops queueing writes that would stall the reads behind them.
Pages requests still own (suspended requests) are always written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Final

from .._config import (
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)

#: the weight of one timed batch in the running estimates
REFINE_WEIGHT: Final = 0.2
#: ``busy_until`` of a link nothing was queued on yet
IDLE: Final = -math.inf


class TierCosts:
    """Per cache level (the configured tiers' order, the GPU first): the estimated read cost."""

    def __init__(
        self,
        tiers: Sequence[CacheTierConfig],
        refine: bool,
        max_backlog_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: seconds per byte read into the GPU, and seconds per transfer (0 for the GPU)
        self.seconds_per_byte: list[float] = []
        self.latency_s: list[float] = []
        for tier in tiers:
            if isinstance(tier, GpuCacheTierConfig):
                self.seconds_per_byte.append(0.0)
                self.latency_s.append(0.0)
            else:
                self.seconds_per_byte.append(1.0 / float(tier.read_bytes_per_s))
                self.latency_s.append(float(tier.read_latency_s))
        self.refine = refine
        #: per level: whether its timed reads refine it (the CPU waits for them: not GPU, not host)
        self.timed = [not isinstance(tier, (GpuCacheTierConfig, HostCacheTierConfig)) for tier in tiers]
        #: per level: whether a request reading from it waits apart from the engine's steps (disk,
        #: remote: background workers read while it waits in the loading state; the GPU and host
        #: tiers: copies ordered within the step)
        self.apart = [isinstance(tier, (DiskCacheTierConfig, RemoteCacheTierConfig)) for tier in tiers]
        #: per level: seconds per byte written to it and the bound of its link's write backlog
        #: (0 and infinite where the manager writes nothing itself: the GPU, the remote tier,
        #: whose writer has its own bound)
        self.seconds_per_written_byte = [
            1.0 / float(tier.write_bytes_per_s) if isinstance(tier, (HostCacheTierConfig, DiskCacheTierConfig)) else 0.0
            for tier in tiers
        ]
        self.max_backlog_s = float(max_backlog_s) if max_backlog_s is not None else math.inf
        #: the manager's clock (seconds; a reading that fails reads as the last good one)
        self.clock = clock
        #: per level: when its link is done with what is queued on it (the clock's seconds)
        self.busy_until: list[float] = [IDLE] * len(tiers)
        #: per level: evicted pages dropped instead of written there (``TierStatistics.declined_*``)
        self.declined_pages = [0] * len(tiers)
        self.declined_bytes = [0] * len(tiers)
        #: timed batches per level that refined the estimates
        self.samples: list[int] = [0] * len(tiers)
        #: the remote tier's level (the last, after the local ones; -1 without one): the level
        #: its fetches refine, synchronous (``RemoteFill``) or a prefetch's (``RemoteReads``)
        self.remote_level = len(tiers) - 1 if tiers and isinstance(tiers[-1], RemoteCacheTierConfig) else -1

    @classmethod
    def of(cls, config: KVCacheManagerConfig, clock: Callable[[], float]) -> TierCosts:
        """The costs of ``config``'s tiers, its refinement and write backlog bound, on ``clock``."""
        return cls(config.cache_tiers, config.refine_tier_costs, config.max_write_backlog_s, clock)

    def observe(self, level: int, nbytes: int, seconds: float) -> None:
        """A batch of ``nbytes`` bytes read from ``level`` took ``seconds`` (refines the estimate)."""
        if not self.refine or not 0 < level < len(self.samples) or not self.timed[level]:
            return
        if nbytes <= 0 or not seconds >= 0.0:
            return
        per_byte = self.seconds_per_byte[level]
        latency = self.latency_s[level]
        w = REFINE_WEIGHT
        if nbytes * per_byte >= latency:  # mostly bytes: what is left after the latency
            sample = (seconds - latency) / nbytes
            self.seconds_per_byte[level] = (1.0 - w) * per_byte + w * (sample if sample > 0.0 else 0.0)
        else:  # mostly latency
            sample = seconds - nbytes * per_byte
            self.latency_s[level] = (1.0 - w) * latency + w * (sample if sample > 0.0 else 0.0)
        self.samples[level] += 1

    def wait_s(self, level: int) -> float:
        """Seconds a read from ``level`` queued now waits behind its link's backlog."""
        busy = self.busy_until[level]
        if busy == IDLE:
            return 0.0
        left = busy - self.clock()
        return left if left > 0.0 else 0.0

    def set_wait(self, level: int, seconds: float) -> None:
        """``level``'s link is busy ``seconds`` from now (what an engine or a simulator knows)."""
        self.busy_until[level] = self.clock() + seconds

    def write_s(self, level: int, nbytes: int) -> float:
        """Estimated seconds ``nbytes`` bytes written to ``level`` occupy its link (queued writes
        stream: their latencies overlap what is queued before them)."""
        return nbytes * self.seconds_per_written_byte[level]

    def note_write(self, level: int, nbytes: int) -> None:
        """``nbytes`` bytes were written (queued) to ``level`` in one transfer: its link is busy
        that much longer, from now if it was idle."""
        if not 0 < level < len(self.busy_until) or self.seconds_per_written_byte[level] <= 0.0:
            return
        now = self.clock()
        busy = self.busy_until[level]
        self.busy_until[level] = (busy if busy > now else now) + self.write_s(level, nbytes)

    def admitted(self, level: int, page_bytes: int, count: int) -> int:
        """How many of ``count`` pages of ``page_bytes`` bytes, written to ``level`` in one transfer,
        its link absorbs without its backlog exceeding ``max_backlog_s`` (all of them without a
        bound)."""
        bound = self.max_backlog_s
        if bound == math.inf or not 0 < level < len(self.busy_until) or count <= 0:
            return count
        per_page = page_bytes * self.seconds_per_written_byte[level]
        room = bound - self.wait_s(level)
        if per_page <= 0.0:
            return count if room >= 0.0 else 0
        if room < per_page:
            return 0
        n = int(room / per_page)
        return n if n < count else count

    def read_s(self, level: int, nbytes: int) -> float:
        """Estimated seconds to read ``nbytes`` bytes from ``level`` in one transfer (its link's wait
        included)."""
        if level <= 0:
            return 0.0
        return self.wait_s(level) + self.latency_s[level] + nbytes * self.seconds_per_byte[level]
