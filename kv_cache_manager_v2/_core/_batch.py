"""The decode step for a whole batch: ``resize_batch`` before the forward pass and
``commit_batch`` after it, each one call over the batch's caches.

Each call is a check pass over the batch (nothing changes until every cache and token passed)
and an update pass whose per-cache work, in 31 of 32 steps, is a few native attribute reads and
writes (capacity and history are one more; the token joins the tail). Only a cache whose step
crosses a block boundary (a new block, a completed block to publish), moves a sliding window,
takes a snapshot, copies a beam's tail on write or uses scratch blocks takes the per-request
path (``KVCache._resize`` / ``commit_tokens``): the same code, in the same order, as the
per-request calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .._common import MAX_CAPACITY, MAX_TOKEN_ID, KVCacheStatus, TokenIdExt
from .._exceptions import LogicError
from .._reuse._keys import check_token
from .._utils import as_list
from ._commit import commit_tokens
from ._context import CacheContext
from ._kv_cache import KVCache


def commit_batch(ctx: CacheContext, serial: int, caches: Sequence[KVCache], tokens: Sequence[TokenIdExt]) -> None:
    """``caches[i].commit([tokens[i]])`` for every i, every cache and token checked first."""
    items: list[object] = as_list(caches)
    token_list: list[object] = as_list(tokens)
    if len(items) != len(token_list):
        raise ValueError(f"commit_batch: {len(items)} caches but {len(token_list)} tokens (one token per cache)")
    active = KVCacheStatus.ACTIVE
    for i, (item, token) in enumerate(zip(items, token_list)):
        kv = _member(ctx, item, i)
        if kv._batch_serial == serial:
            raise ValueError(f"caches[{i}] is listed twice")
        kv._batch_serial = serial
        # one test per check on the common path; a failed one calls the checks that raise with the reason
        if (
            kv._status is not active
            or not kv._committing
            or kv._forked
            or type(token) is not int
            or not 0 <= token <= MAX_TOKEN_ID
            or len(kv._committed_blocks) * kv._tokens_per_block + len(kv._tail) >= kv._capacity
        ):
            try:
                kv._check_commit()
                check_token(token, "token")
                kv._check_room(1)
            except (LogicError, ValueError, TypeError) as e:
                raise type(e)(f"commit_batch: caches[{i}]: {e}") from None
    kvs = cast(list[KVCache], items)
    ctx.enter("commit_batch()")
    try:
        for kv, token in zip(kvs, token_list):
            if not kv._commit_token(cast(TokenIdExt, token)):
                commit_tokens(kv)  # a block completed or a window moved: publish, release what went stale
    finally:
        ctx.leave()


def resize_batch(ctx: CacheContext, caches: Sequence[KVCache], num_new_tokens: int) -> list[int]:
    """Capacity of each cache at least its committed length + ``num_new_tokens``; the positions
    of the caches that did not get it (each unchanged)."""
    items: list[object] = as_list(caches)
    active = KVCacheStatus.ACTIVE
    for i, item in enumerate(items):
        kv = _member(ctx, item, i)
        if kv._status is not active:
            raise LogicError(f"resize_batch: caches[{i}] is {kv._status.name}; only ACTIVE caches grow")
        tokens_per_block = kv._tokens_per_block
        capacity = len(kv._committed_blocks) * tokens_per_block + len(kv._tail) + num_new_tokens
        if capacity > kv._capacity:
            if capacity > MAX_CAPACITY:
                raise ValueError(f"resize_batch: caches[{i}]: capacity must be at most {MAX_CAPACITY} tokens")
            if capacity > kv._num_blocks * tokens_per_block:  # new blocks: the engine's index buffers hold them?
                try:
                    for table in kv._tables:
                        table.check_user_buf_room((capacity + tokens_per_block - 1) // tokens_per_block)
                except LogicError as e:
                    raise LogicError(f"resize_batch: caches[{i}]: {e}") from None
    kvs = cast(list[KVCache], items)
    failed: list[int] = []
    ctx.enter("resize_batch()")
    i = 0
    try:
        releasing = ctx.has_releasing_groups
        for i, kv in enumerate(kvs):
            tokens_per_block = kv._tokens_per_block
            capacity = len(kv._committed_blocks) * tokens_per_block + len(kv._tail) + num_new_tokens
            if capacity > kv._capacity:
                history_length = kv._history
                if (
                    capacity <= kv._num_blocks * tokens_per_block
                    and not kv._cow
                    and (
                        not releasing
                        or history_length < kv._window_next  # (_window_moves' first test, without the call)
                        or not kv._window_moves(capacity, history_length)
                    )
                ):
                    kv._capacity = capacity
                elif not kv._resize(capacity, history_length, (capacity + tokens_per_block - 1) // tokens_per_block):
                    failed.append(i)
    except BaseException as e:  # e.g. a custom_priority_callback raised: say what already happened
        e.add_note(
            f"resize_batch: raised at caches[{i}] (unchanged); caches before it got their room, except "
            f"positions {failed}"
        )
        raise
    finally:
        ctx.leave()
    return failed


def _member(ctx: CacheContext, item: object, i: int) -> KVCache:
    """``caches[i]`` checked: a KVCache of this manager."""
    if type(item) is not KVCache and not isinstance(item, KVCache):
        raise TypeError(f"caches[{i}] must be a KVCache, got {type(item).__name__}")
    kv = item
    if kv._ctx is not ctx:
        raise ValueError(f"caches[{i}] belongs to another KVCacheManager")
    return kv
