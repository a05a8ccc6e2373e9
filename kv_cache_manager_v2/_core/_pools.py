"""What the manager reads off its pools: byte-contiguous runs of buffers (bulk transfer), every
live page (a tier resize moves them), and the pages per pool group a decode peaks at
(``clamp_max_seq_len_for_mem``)."""

from __future__ import annotations

from collections.abc import Iterator

from .._common import AggregatedPageDesc, BufferId, LayerGroupId, LayerId, MemAddress, PoolIndex
from .._life_cycle_registry import LayerGroupRegistry
from .._page import Page
from .._reuse._tree import ReuseTree
from .._storage._layout import StorageLayout
from .._storage._storage_manager import StorageManager
from ._request_state import RequestState


def aggregated_pages(
    layout: StorageLayout, storage: StorageManager, wanted: set[BufferId]
) -> Iterator[AggregatedPageDesc]:
    """Byte-contiguous runs of the ``wanted`` buffers, one or more per GPU pool."""
    for layer_group, coalesced_buffers in enumerate(layout.coalesced):
        pool_group = storage.gpu[layout.pool_group_of_layer_group[LayerGroupId(layer_group)]]
        for pool, coalesced in enumerate(coalesced_buffers):
            base = pool_group.memory_pool(pool).base_address
            run: list[BufferId] = []
            run_beg = 0
            for position, buffer_id in enumerate([*coalesced.buffer_ids, BufferId(LayerId(-1), "")]):
                if buffer_id in wanted:
                    if not run:
                        run_beg = position
                    run.append(buffer_id)
                elif run:
                    yield AggregatedPageDesc(
                        tuple(run),
                        LayerGroupId(layer_group),
                        pool_group.index,
                        PoolIndex(pool),
                        MemAddress(base + run_beg * coalesced.single_size),
                        len(run) * coalesced.single_size,
                        coalesced.slot_size,
                        pool_group.num_slots,
                    )
                    run = []


def live_pages(caches: list[RequestState], tree: ReuseTree, storage: StorageManager) -> list[Page]:
    """Every page that holds a slot: the requests', the reuse tree's, and garbage."""
    pages: dict[int, Page] = {}
    for cache in caches:
        for page in cache._all_pages():  # every beam's (a page only other beams hold moves too)
            pages[id(page)] = page
    for node in tree.nodes():
        for layer_group in range(len(node.pages)):
            tree_page = node.page(layer_group)
            if tree_page is not None:
                pages[id(tree_page)] = tree_page
    for level in storage.levels:
        for pool_group in level:
            for page in pool_group.evictor.pages():
                pages[id(page)] = page
    return list(pages.values())


def peak_pages_per_pool_group(
    registry: LayerGroupRegistry, layout: StorageLayout, length: int, beam_width: int = 1
) -> list[int]:
    """Most pages one request of ``beam_width`` beams holds per pool group while it decodes up to
    ``length`` tokens (a live state per beam; blocks once: beams share them until they fork)."""
    peak = [0] * len(layout.pool_groups)
    for i, policy in enumerate(registry.layer_groups):
        pages = policy.peak_pages(length) * (beam_width if policy.keeps_live_state else 1)
        peak[layout.pool_group_of_layer_group[LayerGroupId(i)]] += pages
    return peak


def longest_decode_that_fits(
    registry: LayerGroupRegistry,
    layout: StorageLayout,
    totals: list[int],
    batch_size: int,
    upper_bound: int,
    beam_width: int = 1,
) -> int:
    """Longest length (<= ``upper_bound``) that ``batch_size`` requests of ``beam_width`` beams can
    each decode to with ``totals`` slots per pool group: every length on the way must fit
    (``peak_pages``)."""

    def fits_up_to(length: int) -> bool:
        peak = peak_pages_per_pool_group(registry, layout, length, beam_width)
        return all(batch_size * pages <= total for pages, total in zip(peak, totals))

    lo, hi = 0, upper_bound
    while lo < hi:  # fits_up_to is monotone: the peak over lengths <= n never falls
        mid = (lo + hi + 1) // 2
        if fits_up_to(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
