"""The persistent disk tier's records as pages come and go: the slots a previous manager left
(taken at start-up, adopted by the manager), and a record per reusable full block written there."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Sequence
from typing import cast

from .._common import PoolGroupIndex, SlotId
from .._page import Page, PoolGroupStorage
from .._typed import TypedList
from ._persist import PersistentDisk
from ._tiers._disk_tier import arm_sums, slot_sums


def take_persisted(persist: PersistentDisk, storages: TypedList[PoolGroupIndex, PoolGroupStorage]) -> None:
    """Mark the slots of the persistent disk tier's valid records used (their pages are made by
    ``_reuse._adopt.adopt_records``, which frees what it cannot place) and arm their checksums."""
    for g, found in enumerate(persist.records):
        storage = storages.items[g]
        storage.allocator.take([SlotId(r.slot) for r in found])
        arm_sums(storage.pools, [r.slot for r in found], [r.sums for r in found])


def persist_pages(
    persist: PersistentDisk,
    level: int,
    tokens_per_block: int,
    pages: list[Page],
    carried: Callable[[Page], tuple[int, int, float, float, int]],
) -> None:
    """Record the persistent disk tier's (at ``level``) reusable full-block pages among ``pages``
    (their bytes are in place; their retention as ``carried``, ``ExpiryQueue.carried``, says): a manager opening
    the directory after this one adopts them."""
    for page in pages:
        if page.level != level:
            continue  # a failed copy
        storage = page.storage
        node = page.node
        parent = node.parent if node is not None else None
        scope = node.scope if node is not None else None
        tokens: array[int] | None = None
        if node is not None and parent is not None and scope is not None and len(node.tokens) == tokens_per_block:
            raw = node.tokens
            if type(raw) is array:
                tokens = cast("array[int]", raw)
            else:
                with contextlib.suppress(TypeError, OverflowError):  # a block of digests (bytes tokens)
                    tokens = array("I", cast(Sequence[int], raw))
        if node is None or parent is None or scope is None or tokens is None:
            # a suspended request's private page, a partial tail, a block of digests: not
            # persisted, and the block this slot held before is gone
            persist.forget(int(storage.index), page.slot)
            continue
        sums = slot_sums(storage.pools, page.slot)
        c = carried(page)
        persist.write(
            int(storage.index),
            page.slot,
            page.layer_group,
            c[0],
            scope,
            parent.key,
            node.key,
            tokens,
            sums,
            (c[1], c[2], c[3], c[4]),
        )
