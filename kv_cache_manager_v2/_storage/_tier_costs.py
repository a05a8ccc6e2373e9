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
slow disk); whoever knows the link's backlog (an engine, a simulator) sets it per level
(``KVCacheManager.set_tier_wait``), and it counts once per level a read uses, like the latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .._config import CacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig

#: the weight of one timed batch in the running estimates
REFINE_WEIGHT: Final = 0.2


class TierCosts:
    """Per cache level (the configured tiers' order, the GPU first): the estimated read cost."""

    def __init__(self, tiers: Sequence[CacheTierConfig], refine: bool) -> None:
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
        #: per level: the expected seconds a read waits behind its link's queue before it starts
        self.wait_s: list[float] = [0.0] * len(tiers)
        #: timed batches per level that refined the estimates
        self.samples: list[int] = [0] * len(tiers)

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

    def read_s(self, level: int, nbytes: int) -> float:
        """Estimated seconds to read ``nbytes`` bytes from ``level`` in one transfer (its link's wait
        included)."""
        if level <= 0:
            return 0.0
        return self.wait_s[level] + self.latency_s[level] + nbytes * self.seconds_per_byte[level]
