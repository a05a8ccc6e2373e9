"""``KVCacheManager.pin`` / ``unpin``: a cached prefix kept whatever the eviction policy (the
mechanism and its bound per tier: ``_storage/_pins.py``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .._common import DEFAULT_REUSE_SCOPE, ReuseScope, TokenIdExt
from .._page import Page
from .._retention import check_duration
from ._context import CacheContext
from ._matching import PrefixMatcher


def pin_key(reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt]) -> Hashable:
    return (reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE, tuple(tokens))


def pin_prefix(
    ctx: CacheContext,
    matcher: PrefixMatcher,
    reuse_scope: ReuseScope | None,
    tokens: Sequence[TokenIdExt],
    duration_s: float | None,
) -> int:
    """Pin the cached full blocks of ``tokens`` (every page of each); returns the tokens pinned."""
    duration = check_duration("duration_s", duration_s)
    if duration is not None:
        ctx.storage.expiries.read()  # a clock that fails raises here, before anything changes
    found = matcher.probe(ctx, "pin()", reuse_scope, tokens)  # validates the scope and tokens
    nodes = found[0] if found is not None else []
    pages: list[Page] = []
    for node in nodes:
        for ref in node.pages:
            page = ref() if ref is not None else None
            if page is not None:
                pages.append(page)
    ctx.enter("pin()")
    try:
        ctx.storage.pins.pin(pin_key(reuse_scope, tokens), pages, duration)
    finally:
        ctx.leave()
    return len(nodes) * ctx.tokens_per_block
