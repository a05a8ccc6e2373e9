"""The decode step for a whole batch: ``resize_batch`` before the forward pass and
``commit_batch`` after it, each one call over the batch's caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .._common import MAX_CAPACITY, MAX_TOKEN_ID, KVCacheStatus, TokenIdExt
from .._exceptions import LogicError
from .._reuse._keys import check_token
from .._utils import as_list, check_int
from ._commit import commit_tokens
from ._context import CacheContext
from ._kv_cache import KVCache


def commit_batch(ctx: CacheContext, serial: int, caches: Sequence[KVCache], tokens: Sequence[TokenIdExt]) -> None:
    """``caches[i].commit([tokens[i]])`` for every i, every cache and token checked first."""
    kvs = _batch_members(ctx, serial, caches)
    token_list: list[object] = as_list(tokens)
    if len(kvs) != len(token_list):
        raise ValueError(f"commit_batch: {len(kvs)} caches but {len(token_list)} tokens (one token per cache)")
    for i in range(len(kvs)):
        kv = kvs[i]
        token = token_list[i]
        try:
            kv._check_commit()
            if type(token) is int:
                if not 0 <= token <= MAX_TOKEN_ID:
                    check_token(token, "token")  # raises with the reason
            else:
                check_token(token, "token")
            kv._check_room(1)
        except (LogicError, ValueError, TypeError) as e:
            raise type(e)(f"commit_batch: caches[{i}]: {e}") from None
    ctx.enter("commit_batch()")
    try:
        for i in range(len(kvs)):
            kv = kvs[i]
            if not kv._commit_token(cast(TokenIdExt, token_list[i])):
                commit_tokens(kv)
    finally:
        ctx.leave()


def resize_batch(ctx: CacheContext, caches: Sequence[KVCache], num_new_tokens: int) -> list[int]:
    """Capacity of each cache at least its committed length + ``num_new_tokens``; the positions
    of the caches that did not get it (each unchanged)."""
    check_int("num_new_tokens", num_new_tokens)
    kvs = _batch_members(ctx, 0, caches)
    capacities: list[int] = []  # each cache's capacity to reach
    for i in range(len(kvs)):
        kv = kvs[i]
        if kv._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"resize_batch: caches[{i}] is {kv._status.name}; only ACTIVE caches grow")
        capacity = kv.num_committed_tokens + num_new_tokens
        capacities.append(capacity)
        if capacity > MAX_CAPACITY:
            raise ValueError(f"resize_batch: caches[{i}]: capacity must be at most {MAX_CAPACITY} tokens")
        num_blocks = (capacity + kv._tokens_per_block - 1) // kv._tokens_per_block
        if num_blocks > kv._num_blocks:
            try:
                for table in kv._tables:
                    table.check_user_buf_room(num_blocks)
            except LogicError as e:
                raise LogicError(f"resize_batch: caches[{i}]: {e}") from None
    failed: list[int] = []
    ctx.enter("resize_batch()")
    i = 0
    try:
        for i in range(len(kvs)):
            kv = kvs[i]
            capacity = capacities[i]
            if capacity <= kv._capacity:
                continue
            tokens_per_block = kv._tokens_per_block
            num_blocks = (capacity + tokens_per_block - 1) // tokens_per_block
            history_length = kv._history
            if (
                num_blocks == kv._num_blocks
                and not kv._cow
                and (not ctx.has_releasing_groups or not kv._window_moves(capacity, history_length))
            ):
                kv._capacity = capacity
            elif not kv._resize(capacity, history_length, num_blocks):
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


def _batch_members(ctx: CacheContext, serial: int, caches: Sequence[KVCache]) -> list[KVCache]:
    """``caches`` checked: KVCaches of this manager, each listed once (when ``serial`` is nonzero)."""
    items: list[object] = as_list(caches)
    for i in range(len(items)):
        kv = items[i]
        if not isinstance(kv, KVCache):
            raise TypeError(f"caches[{i}] must be a KVCache, got {type(kv).__name__}")
        if kv._ctx is not ctx:
            raise ValueError(f"caches[{i}] belongs to another KVCacheManager")
        if serial:
            if kv._batch_serial == serial:
                raise ValueError(f"caches[{i}] is listed twice")
            kv._batch_serial = serial
    return cast(list[KVCache], items)
