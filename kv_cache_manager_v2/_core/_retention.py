"""Retention a request asks for (``_retention.py`` values, ``_storage/_expiry.py`` mechanism):
its ranges' and decode blocks' priorities, given to the pages it publishes, and the close-time
hint over its whole published history, which a later request reusing that history ends (a
duration counts from a page's release and pauses while a request holds it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .._common import Priority
from .._page import NO_HINT, Page
from .._retention import Retention
from .._reuse._node import Node
from ._request_state import RequestState


def retain_new_pages(state: RequestState, ordinal: int, pages: Sequence[Page | None]) -> None:
    """Give block ``ordinal``'s own pages (not yet in the tree) the request's retention for it (a
    duration runs from their release)."""
    retention = state._retention
    assert retention is not None
    r = retention.at(ordinal * state._tokens_per_block, state._prompt_length)
    if r is None:
        return
    expiries = state._ctx.storage.expiries
    for page in pages:
        if page is not None and page.node is None:
            expiries.retain(page, ordinal, Priority(r[0]), r[1], NO_HINT)


def retain_history(state: RequestState, retain: Retention) -> None:
    """The close-time hint: every page of the request's published full blocks keeps
    ``retain.priority`` for ``retain.duration_s`` (from its release). A hint raising a page ends when a later request
    reuses the whole history (the conversation continued) and replaces an older hint; a hint below
    a page's base priority applies only to the blocks this request published itself (a prefix it
    reused may serve others), and ends when any request reuses the page (the guess that nobody
    would was wrong). Blocks that end at or before ``retain.start``, or start at or after
    ``retain.end``, are left as they are."""
    expiries = state._ctx.storage.expiries
    expiries.expire()
    priority = Priority(retain.priority)
    first_own = state._num_matched_blocks
    node = last_published(state)
    if node is None:
        return
    last = node.ordinal
    tokens_per_block = state._tokens_per_block
    first = retain.start // tokens_per_block  # the first block holding a token at or after start
    stop = last + 1 if retain.end is None else (retain.end + tokens_per_block - 1) // tokens_per_block
    while node is not None and node.ordinal >= stop:  # (blocks after the range)
        node = node.parent
    while node is not None and node.ordinal >= first:
        own = node.ordinal >= first_own
        for ref in node.pages:
            page = ref() if ref is not None else None
            if page is None:
                continue
            # compared with the priority the page has without retention: the latest hint replaces an
            # older one (of this conversation or another sharing the prefix)
            base = page.base_priority if page.retained else page.priority
            if own or priority >= base:
                end = last if priority >= base else node.ordinal
                expiries.retain(page, node.ordinal, priority, retain.duration_s, end)
        node = node.parent


def last_published(state: RequestState) -> Node | None:
    """The tree node of the request's last published full block (also after ``stop_committing``,
    which lets go of ``_last_node``), or None."""
    node = state._last_node
    n = state._num_published
    if node is not None or n == 0:
        return node
    for page in state._tables[state._final_beam].block_pages(n - 1):
        if page is not None and page.node is not None:
            return cast(Node, page.node)
    return None


def end_hint(page: Page, state: RequestState, match_end: int) -> None:
    """A request whose match ends at block ``match_end`` reuses ``page``: a close-time hint on it
    has done its work when the match reaches the end of the hinted history (the conversation
    continued; another request sharing only a prefix leaves it)."""
    if match_end >= page.hint_end:
        state._ctx.storage.expiries.end(page)
