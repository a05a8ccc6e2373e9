"""``KVCacheManager.pin`` / ``unpin``: a cached prefix kept whatever the eviction policy (the
mechanism and its bound per tier: ``_storage/_pins.py``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .._common import DEFAULT_REUSE_SCOPE, ReuseScope, TokenIdExt
from .._page import Page
from .._retention import check_duration
from .._reuse._keys import check_token_sequence, validate_tokens
from .._utils import check_type
from ._context import CacheContext
from ._matching import PrefixMatcher


def pin_key(reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt]) -> Hashable:
    """A pin's key: its scope and its tokens as a tuple (checked like ``pin`` checks them, so every
    sequence type ``pin`` takes gives the same key)."""
    if reuse_scope is not None:
        check_type("reuse_scope", reuse_scope, ReuseScope)
    if tokens is None:
        raise TypeError("tokens must be a sequence of token ids (int) or digests (bytes), got None")
    check_token_sequence(tokens, "tokens")
    validate_tokens(tokens, "tokens")
    return (reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE, tuple(tokens))


def pin_prefix(
    ctx: CacheContext,
    matcher: PrefixMatcher,
    reuse_scope: ReuseScope | None,
    tokens: Sequence[TokenIdExt],
    duration_s: float | None,
) -> int:
    """Pin the cached full blocks of ``tokens`` (every page of each); returns the tokens pinned
    (0: nothing cached, no pin, and an earlier pin of the same tokens ends)."""
    duration = check_duration("duration_s", duration_s)
    key = pin_key(reuse_scope, tokens)
    if duration is not None:
        ctx.storage.expiries.read()  # a clock that fails raises here, before anything changes
    found = matcher.probe(ctx, "pin()", reuse_scope, tokens)
    nodes = found[0] if found is not None else []
    pages: list[Page] = []
    for node in nodes:
        for ref in node.pages:
            page = ref() if ref is not None else None
            if page is not None:
                pages.append(page)
    ctx.enter("pin()")
    try:
        ctx.storage.pins.pin(key, pages, duration)
    finally:
        ctx.leave()
    return len(nodes) * ctx.tokens_per_block if pages else 0


def unpin_prefix(ctx: CacheContext, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt]) -> bool:
    """End the pin of ``tokens`` (False: none)."""
    key = pin_key(reuse_scope, tokens)
    ctx.enter("unpin()")
    try:
        return ctx.storage.pins.unpin(key)
    finally:
        ctx.leave()
