"""Storage statistics: per level usage, traffic counters (offloaded, onboarded and dropped pages
and bytes, I/O errors, declined writes) since creation or since the previous iteration, the remote
tier's last."""

from __future__ import annotations

from typing import Final

from .._common import GPU_LEVEL, CacheLevel, CacheTier, StorageStatistics, TierStatistics
from ._cascade import EvictionCascade
from ._tier_costs import TierCosts
from ._tiers._remote_tier import RemoteTier

#: traffic counters of a level: offloaded, onboarded, dropped pages, the same in bytes, I/O errors,
#: declined writes' pages and bytes (write admission; the remote tier's writer counts its own as dropped)
NUM_COUNTERS: Final = 9


class TrafficStatistics:
    """Statistics of the levels of ``storage`` (``tiers``: the medium of each; and of its remote
    tier, once attached)."""

    def __init__(self, storage: EvictionCascade, tiers: list[CacheTier]) -> None:
        self.storage = storage
        self.tiers = tiers
        self.num_levels = len(tiers)
        self.remote: RemoteTier | None = None
        #: the levels' write admission counts (declined writes), once the manager sets them
        self.costs: TierCosts | None = None
        #: cumulative counters at the last ``take_iteration_stats``, per level (the remote tier last)
        self._iteration_base: list[list[int]] = [[0] * NUM_COUNTERS for _ in range(len(tiers) + 1)]

    def statistics(self, level: CacheLevel) -> list[StorageStatistics]:
        storage = self.storage
        out: list[StorageStatistics] = []
        for group in storage.levels[level]:
            free = group.allocator.num_free
            available = storage.available(level, group.index)
            out.append(
                StorageStatistics(
                    group.index,
                    group.layout.slot_sizes,
                    group.num_slots,
                    free,
                    available - free,
                    group.num_pinned,
                    group.num_retained,
                )
            )
        return out

    def utilization(self) -> float:
        """Max over GPU pool groups of unavailable / total slots."""
        storage = self.storage
        return max(1.0 - storage.available(0, group.index) / group.num_slots for group in storage.levels[GPU_LEVEL])

    def _counters(self, level: int) -> list[int]:
        """Cumulative (offloaded, onboarded, dropped) pages then bytes, and io errors, of ``level``."""
        if level == self.num_levels:
            assert self.remote is not None
            return self.remote.remote.counters() + [0, 0]
        out = [0] * NUM_COUNTERS
        for group in self.storage.levels.items[level]:
            slot_bytes = group.layout.slot_bytes
            for i, count in enumerate((group.num_offloaded, group.num_onboarded, group.num_dropped)):
                out[i] += count
                out[3 + i] += count * slot_bytes
            out[6] += group.num_io_errors
            for access, pool in zip(group.media, group.pools):  # handed-off slots the remote writer found damaged
                out[6] += access.num_detached_errors(pool)
        if self.costs is not None:
            out[7] = self.costs.declined_pages[level]
            out[8] = self.costs.declined_bytes[level]
        persist = self.storage.persist
        if persist is not None and level == self.storage.persist_level:
            out[6] += persist.num_write_errors  # slot records that could not be written
        return out

    def tier_statistics(self, level: CacheLevel) -> TierStatistics:
        """Usage and traffic of ``level`` since the manager was created."""
        if level == self.num_levels:
            return self._remote_stats(level, [0] * NUM_COUNTERS)
        peaks = [group.allocator.peak_used - group.set_aside for group in self.storage.levels[level]]
        return self._tier_stats(level, [0] * NUM_COUNTERS, peaks, self._counters(level))

    def _remote_stats(self, level: CacheLevel, base: list[int]) -> TierStatistics:
        """The remote level: written (offloaded), fetched (onboarded), dropped writes, errors; usage
        is the server's business (it is shared), so it reads 0."""
        remote = self.remote
        assert remote is not None
        quota = remote.remote.cfg.quota
        counters = remote.remote.counters() + [0, 0]
        return _statistics(level, CacheTier.REMOTE, quota if quota is not None else 0, 0, 0, 0, counters, base)

    def take_iteration_stats(self) -> list[TierStatistics]:
        """Per level, the traffic since the previous call (peaks: highest usage since then); resets."""
        out: list[TierStatistics] = []
        remote = self.remote
        if remote is not None:
            remote.flush_write_through()
        storage = self.storage
        for level in range(self.num_levels):
            groups = storage.levels.items[level]
            peaks = [group.allocator.iteration_peak - group.set_aside for group in groups]
            now = self._counters(level)
            out.append(self._tier_stats(CacheLevel(level), self._iteration_base[level], peaks, now))
            self._iteration_base[level] = now
            for group in groups:
                group.allocator.iteration_peak = group.allocator.num_used
        if remote is not None:
            level = self.num_levels
            out.append(self._remote_stats(CacheLevel(level), self._iteration_base[level]))
            self._iteration_base[level] = remote.remote.counters() + [0, 0]
        return out

    def _tier_stats(self, level: CacheLevel, base: list[int], peaks: list[int], now: list[int]) -> TierStatistics:
        """``level``'s usage in bytes (``peaks``: slots per pool group) and its traffic, the counters
        ``now`` minus ``base``."""
        total = used = peak = state = 0
        for group, group_peak in zip(self.storage.levels[level], peaks):
            slot_bytes = group.layout.slot_bytes
            total += group.num_slots * slot_bytes
            in_use = group.num_used * slot_bytes
            used += in_use
            peak += group_peak * slot_bytes
            if group.layout.holds_states:
                state += in_use
        return _statistics(level, self.tiers[level], total, used, peak, state, now, base)


def _statistics(
    level: CacheLevel, tier: CacheTier, total: int, used: int, peak: int, state: int, now: list[int], base: list[int]
) -> TierStatistics:
    """A level's statistics (``state``: the bytes of recurrent states in use); traffic is the
    counters ``now`` minus ``base`` (offloaded, onboarded and dropped pages, the same in bytes, I/O
    errors, declined pages and bytes)."""
    d = [now[i] - base[i] for i in range(NUM_COUNTERS)]
    return TierStatistics(
        level=level,
        tier=tier,
        total_bytes=total,
        used_bytes=used,
        peak_used_bytes=peak,
        offloaded_pages=d[0],
        onboarded_pages=d[1],
        dropped_pages=d[2],
        offloaded_bytes=d[3],
        onboarded_bytes=d[4],
        dropped_bytes=d[5],
        io_errors=d[6],
        state_bytes=state,
        declined_pages=d[7],
        declined_bytes=d[8],
    )
