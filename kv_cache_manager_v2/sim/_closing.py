"""What the replay does once a request has finished and closed: its shared prefix pinned
(``--pin-system-prompts``), the engine's close hook told (``--retention-hints`` with
``--sessions``: ``SessionReturns``), its session ended when it was the session's last request
(``--session-end``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from .._common import TokenIdExt
from .._core._kv_cache_manager import KVCacheManager
from ._live import Live
from ._replay_types import ReplayResult
from ._workload import SimRequest


class Closing:
    """The replay's close-time actions (see the module doc), and what they pinned so far."""

    def __init__(self, tokens_per_block: int) -> None:
        self.t = tokens_per_block
        #: per request index, the shared prefix (id, tokens) to pin once it finished (--pin-system-prompts)
        self.pins: Sequence[tuple[int, int] | None] | None = None
        self.pinned: dict[int, int] = {}  #: prefix id -> tokens pinned (-1: refused beyond max_pinned_share)
        #: seconds a pin lasts after each use (--pin-duration; None: until the end)
        self.pin_duration_s: float | None = None
        self.on_close: Callable[[int], None] | None = None  #: called with a request's index once it closed

    def wanted(self, sim: SimRequest) -> bool:
        """Whether closing ``sim`` does anything (most replays: nothing to call)."""
        return self.pins is not None or sim.ends_session or self.on_close is not None

    def closed(self, manager: KVCacheManager, result: ReplayResult, live: Live) -> None:
        """A request finished: its shared prefix pinned, ``on_close`` told, its session ended
        when it was its session's last request (``directives.end``, keeping the shared template;
        what it did counted in ``ReplayResult.sessions_ended``)."""
        if self.pins is not None:
            self._pin_shared(manager, result, live)
        sim = live.sim
        if self.on_close is not None:
            self.on_close(sim.index)
        if sim.ends_session and sim.session is not None:
            keep = sim.prompt_tokens()[: sim.session_keep] if sim.session_keep else None
            out = manager.directives.end(sim.session, cast("Sequence[TokenIdExt] | None", keep))
            ended = result.sessions_ended
            ended[0] += out.num_blocks
            ended[1] += out.num_deferred
            ended[2] += out.num_kept

    def _pin_shared(self, manager: KVCacheManager, result: ReplayResult, live: Live) -> None:
        """Pin the finished request's shared prefix (its full blocks, now cached) through the
        public ``KVCacheManager.pin``, unless pinned whole already or refused; with
        ``pin_duration_s``, pinned again by every request using it, for that long."""
        target = self.pins[live.sim.index] if self.pins is not None else None
        if target is None:
            return
        key, length = target
        done = self.pinned.get(key, 0)
        ttl = self.pin_duration_s
        if ttl is None and (done < 0 or done >= length // self.t * self.t):
            return
        try:
            pinned = manager.pin(live.req.prompt_tokens[:length], duration_s=ttl)
        except ValueError:  # beyond max_pinned_share: the prefix stays unpinned
            result.pins_refused += 1
            if ttl is None:
                self.pinned[key] = -1
            return
        if pinned > 0 and done <= 0:
            result.pinned_prefixes += 1
        if pinned > done:
            result.pinned_tokens += pinned - max(done, 0)
            self.pinned[key] = pinned
