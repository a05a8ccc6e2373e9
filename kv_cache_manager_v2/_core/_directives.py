"""``KVCacheManager.directives``: what the engine says about a session's or a prefix's cached
blocks (retain, pin, unpin, prefetch, demote, end), each answered with a ``DirectiveOutcome``.
Built on the retention and pin mechanisms (``_storage/_expiry.py``, ``_storage/_pins.py``), the
background disk reads (``prefetch``: ``_storage/_page_reads.py``), the eviction cascade's moves
(``demote``) and the tree's removal (``end``); which blocks a session has: ``_sessions.py``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Final

from .._common import GPU_LEVEL, CacheLevel, Priority, ReuseScope, SessionId, TokenIdExt
from .._page import NO_HINT, Page
from .._retention import check_duration, check_retention_priority
from .._reuse._node import Node
from .._sessions import DirectiveOutcome, DirectiveStatus, check_session_id
from .._storage._page_reads import ReadGroup
from .._utils import check_int
from ._context import CacheContext
from ._matching import PrefixMatcher
from ._pins import pin_key
from ._request_state import RequestState
from ._retention import last_published
from ._sessions import is_private

#: a session's pin key is ``(_SESSION_PIN, session)`` (a prefix's: ``(scope, tokens)``)
_SESSION_PIN: Final = "session pin"

#: a session's ``end`` gives the private blocks still in use this priority (evicted first once released)
_ENDED_PRIORITY: Final = Priority(0)

#: a directive's target: a session id (str) or a prefix (a sequence of tokens)
Target = SessionId | Sequence[TokenIdExt]


def _pages(node: Node) -> list[Page]:
    out: list[Page] = []
    for ref in node.pages:
        page = ref() if ref is not None else None
        if page is not None:
            out.append(page)
    return out


def _in_use(node: Node, pages: list[Page]) -> bool:
    if node.num_extenders:
        return True
    return any(page.num_locks or page.num_holds for page in pages)


def _lowers(pages: list[Page], priority: Priority) -> bool:
    """Whether ``priority`` is below what some of ``pages`` has without retention."""
    return any(priority < (page.base_priority if page.retained else page.priority) for page in pages)


def _outcome(applied: int, deferred: int = 0, kept: int = 0) -> DirectiveOutcome:
    if applied == 0 and deferred == 0 and kept == 0:
        return DirectiveOutcome(DirectiveStatus.NOTHING_CACHED)
    status = DirectiveStatus.DEFERRED if deferred else DirectiveStatus.APPLIED
    return DirectiveOutcome(status, applied, deferred, kept)


class Directives:
    """Directives by session (a ``SessionId``: the blocks its requests reused or published, see
    ``create_kv_cache(session_id=...)``) or by prefix (tokens: the cached full blocks a request
    with those tokens would reuse, in ``reuse_scope``). Each returns a ``DirectiveOutcome``;
    bad input raises before anything changes (``TypeError``/``ValueError``)."""

    __slots__ = ("_check_alive", "_ctx", "_matcher")

    def __init__(self, ctx: CacheContext, matcher: PrefixMatcher, check_alive: Callable[[], None]) -> None:
        self._ctx = ctx
        self._matcher = matcher
        self._check_alive = check_alive

    # ------------------------------------------------------------------ targets
    def _target(
        self, what: str, target: object, reuse_scope: ReuseScope | None
    ) -> tuple[list[Node], SessionId | None, Hashable]:
        """The target's cached blocks (parents first), its session (None: a prefix) and pin key."""
        self._check_alive()
        if isinstance(target, str):
            session = check_session_id("session", target)
            assert session is not None
            if reuse_scope is not None:
                raise ValueError(f"{what}: reuse_scope applies to a prefix (tokens), not to a session")
            ctx = self._ctx
            for ref in ctx.open_caches:  # the session's open requests: what they published so far
                kv: object = ref()  # (an OpenCache: what the context knows of a cache)
                if isinstance(kv, RequestState) and kv._session == session:
                    ctx.sessions.record(session, last_published(kv))
            return ctx.sessions.nodes(session), session, (_SESSION_PIN, session)
        if not isinstance(target, Sequence) or isinstance(target, bytes):
            raise TypeError(
                f"{what}: the target must be a session id (str) or a prefix (a sequence of tokens), "
                f"got {type(target).__name__}"
            )
        key = pin_key(reuse_scope, target)  # (checks the scope and the tokens)
        found = self._matcher.probe(self._ctx, what, reuse_scope, target)
        nodes = [n for n in found[0] if n.parent is not None] if found is not None else []
        return nodes, None, key

    # ------------------------------------------------------------------ directives
    def retain(
        self, target: Target, priority: object, duration_s: float | None = None, reuse_scope: ReuseScope | None = None
    ) -> DirectiveOutcome:
        """Keep the target's cached blocks at ``priority`` (0..100, lower is evicted first) for
        ``duration_s`` seconds from their release (None: until evicted), then at the priority they
        had: like ``Retention`` at close, for blocks named later. A session's blocks that another
        session shares are only raised, never lowered (``num_kept``)."""
        p = Priority(check_retention_priority("priority", priority))
        duration = check_duration("duration_s", duration_s)
        nodes, session, _ = self._target("retain()", target, reuse_scope)
        ctx = self._ctx
        expiries = ctx.storage.expiries
        if duration is not None:
            expiries.read()  # a clock that fails raises here, before anything changes
        applied = kept = 0
        recorded: list[Page] = []  # pages on a persistent disk tier
        ctx.enter("retain()")
        try:
            expiries.expire()
            for node in nodes:
                pages = _pages(node)
                if not pages:
                    continue
                if session is not None and not is_private(node, session) and _lowers(pages, p):
                    kept += 1  # (another session shares it: only raised)
                    continue
                for page in pages:
                    expiries.retain(page, node.ordinal, p, duration, NO_HINT)
                    if page.level == ctx.storage.persist_level:
                        recorded.append(page)
                applied += 1
            if recorded and ctx.storage.persist is not None:  # their records keep the retention too
                ctx.storage.persist_pages(recorded)
        finally:
            ctx.leave()
        return _outcome(applied, 0, kept)

    def pin(
        self, target: Target, duration_s: float | None = None, reuse_scope: ReuseScope | None = None
    ) -> DirectiveOutcome:
        """Pin the target's cached blocks (never evicted while their tier holds the pin) until
        ``unpin`` (or for ``duration_s`` seconds); a pin of the same target before is replaced.
        Within each tier's ``max_pinned_share``: the blocks beyond it are left unpinned, with the
        blocks after them (``CLIPPED``, ``num_kept``); ``KVCacheManager.pin`` raises instead."""
        duration = check_duration("duration_s", duration_s)
        nodes, _, key = self._target("pin()", target, reuse_scope)
        ctx = self._ctx
        if duration is not None:
            ctx.storage.expiries.read()  # a clock that fails raises here, before anything changes
        room: dict[int, int] = {}  # per storage: pins it can still hold
        taken: set[int] = set()  # nodes pinned (a node is pinned only after its parent)
        pages: list[Page] = []
        applied = kept = 0
        for node in nodes:
            mine = _pages(node)
            parent = node.parent
            if parent is not None and parent.ordinal >= 0 and id(parent) not in taken:
                kept += 1 if mine else 0
                continue
            if not mine:
                taken.add(id(node))  # (nothing to pin here: its children may be)
                continue
            need: dict[int, int] = {}
            for page in mine:
                if page.num_pins == 0:
                    s = page.storage
                    if id(s) not in room:
                        room[id(s)] = s.pin_limit - s.num_pinned
                    need[id(s)] = need.get(id(s), 0) + 1
            if any(n > room[i] for i, n in need.items()):
                kept += 1
                continue
            for i, n in need.items():
                room[i] -= n
            taken.add(id(node))
            pages.extend(mine)
            applied += 1
        ctx.enter("pin()")
        try:
            ctx.storage.pins.pin(key, pages, duration)  # (no pages: no pin, an earlier one ends)
        finally:
            ctx.leave()
        if applied and kept:
            return DirectiveOutcome(DirectiveStatus.CLIPPED, applied, 0, kept)
        return _outcome(applied, 0, kept)

    def unpin(self, target: Target, reuse_scope: ReuseScope | None = None) -> DirectiveOutcome:
        """End the target's pin (``directives.pin``'s; a prefix's is ``KVCacheManager.pin``'s too):
        ``num_blocks`` it held (``NOTHING_CACHED``: there was none)."""
        _, _, key = self._target("unpin()", target, reuse_scope)
        ctx = self._ctx
        pins = ctx.storage.pins
        pin = pins.pins.get(key)
        if pin is None:
            return _outcome(0)
        blocks = len({id(page.node) for page in pin.pages if page.node is not None})
        ctx.enter("unpin()")
        try:
            pins.unpin(key)
        finally:
            ctx.leave()
        return _outcome(blocks)

    def prefetch(
        self, target: Target, to_level: object = GPU_LEVEL, reuse_scope: ReuseScope | None = None
    ) -> DirectiveOutcome:
        """Bring the target's cached blocks on a disk tier up to cache level ``to_level`` in the
        background (e.g. the user is typing again), as ``KVCacheManager.prefetch`` does for a
        request's tokens: into the first memory tier at or below ``to_level`` (the host tier when
        ``to_level`` is the GPU and a host tier exists: a request not admitted yet takes no GPU
        memory). ``num_blocks``: blocks there or above already; ``num_deferred``: blocks being
        read (``DEFERRED``; they land in ``poll_loads``, a read that fails is a miss); ``num_kept``:
        blocks left where they are (without ``load_workers`` nothing starts: the create reads
        what it takes). Takes no page; a prefix's blocks only in the remote tier: ``KVCacheManager.prefetch``."""
        level = check_int("to_level", to_level)
        ctx = self._ctx
        num_levels = ctx.storage.num_levels
        if level >= num_levels:
            raise ValueError(f"to_level must be a local cache level, in [0, {num_levels}), got {level}")
        nodes, _, _ = self._target("prefetch()", target, reuse_scope)
        reads = ctx.reads
        land = reads.background_target(CacheLevel(level)) if reads is not None else CacheLevel(level)
        group = ReadGroup()  # (placing one of its reads never evicts a page another installed)
        applied = deferred = kept = 0
        ctx.enter("prefetch()")
        try:
            ctx.poll_loads()
            for node in nodes:
                pages = _pages(node)
                if not pages:
                    continue
                if all(page.level <= land for page in pages):
                    applied += 1
                elif reads is not None and reads.read(pages, land, group):
                    deferred += 1
                else:
                    kept += 1
        finally:
            ctx.leave()
        return _outcome(applied, deferred, kept)

    def demote(self, target: Target, to_level: object, reuse_scope: ReuseScope | None = None) -> DirectiveOutcome:
        """Move the target's cached blocks down to cache level ``to_level`` (1 .. the last local
        tier) now, as eviction would (e.g. the user went idle): ``num_blocks`` are there or below
        afterwards. Blocks in use, pinned, or beyond the room below stay (``num_kept``); so do a
        session's blocks that another session shares."""
        level = check_int("to_level", to_level, 1)
        ctx = self._ctx
        num_levels = ctx.storage.num_levels
        if level >= num_levels:
            raise ValueError(f"to_level must be a local cache level below the GPU, in [1, {num_levels}), got {level}")
        nodes, session, _ = self._target("demote()", target, reuse_scope)
        chosen: list[Node] = []
        movers: list[Page] = []
        kept = 0
        for node in nodes:
            pages = _pages(node)
            if not pages:
                continue
            if session is not None and not is_private(node, session):
                kept += 1
                continue
            chosen.append(node)
            for page in pages:
                if page.level < level and page.num_locks == 0 and page.num_holds == 0 and page.in_evictor:
                    movers.append(page)
        ctx.enter("demote()")
        try:
            ctx.storage.demote(movers, CacheLevel(level))
        finally:
            ctx.leave()
        applied = sum(1 for node in chosen if all(page.level >= level for page in _pages(node)))
        return _outcome(applied, 0, kept + len(chosen) - applied)

    def end(
        self, session: object, keep: Sequence[TokenIdExt] | None = None, reuse_scope: ReuseScope | None = None
    ) -> DirectiveOutcome:
        """The session is over: its private blocks (published by it, used by no other session)
        leave the cache now (``num_blocks``); those a request still uses stay until released, at
        priority 0 (evicted first: ``DEFERRED``, ``num_deferred``); every block another session
        shares, that another pin holds (``KVCacheManager.pin``, a prefix's ``pin``), or that a
        block kept needs below it, stays as it was (``num_kept``), so those sessions reuse it as before. Its pin ends; the session is forgotten (the id may start again).
        ``keep``: tokens of a prefix whose cached blocks stay too (in ``reuse_scope``): a system
        prompt or template the engine knows later sessions will share, which this session may have
        been the first (and so far the only one) to publish."""
        if not isinstance(session, str):
            raise TypeError(f"end(): session must be a session id (str), got {type(session).__name__}")
        kept_nodes: set[int] = set()
        if keep is not None:
            kept_nodes = {id(n) for n in self._target("end()", keep, reuse_scope)[0]}
        elif reuse_scope is not None:
            raise ValueError("end(): reuse_scope applies to keep (tokens), which is None")
        nodes, sid, key = self._target("end()", session, None)
        assert sid is not None
        ctx = self._ctx
        dropped = deferred = kept = 0
        waiting: set[int] = set()  # private nodes kept for a request: their parents wait with them
        ctx.enter("end()")
        try:
            ctx.storage.pins.unpin(key)
            for node in reversed(nodes):  # children first: a node leaves once nothing below stays
                if node.parent is None:
                    continue  # left with a block removed before it (a pageless parent pruned)
                pages = _pages(node)
                if not is_private(node, sid) or id(node) in kept_nodes or any(page.num_pins for page in pages):
                    kept += 1 if pages else 0  # (shared, or pinned by another pin: ``KVCacheManager.pin``)
                    continue
                below = node.children()
                if _in_use(node, pages) or (below and all(id(c) in waiting for c in below)):
                    waiting.add(id(node))
                    for page in pages:
                        ctx.storage.expiries.retain(page, node.ordinal, _ENDED_PRIORITY, None, NO_HINT)
                    deferred += 1 if pages else 0
                elif below:
                    kept += 1 if pages else 0
                elif pages:
                    ctx.storage.discard(pages)  # (the tree forgets the block with its pages)
                    dropped += 1
            ctx.sessions.forget(sid)
        finally:
            ctx.leave()
        return _outcome(dropped, deferred, kept)
