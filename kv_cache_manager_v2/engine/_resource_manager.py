"""KVCacheResourceManager: the per-step resource-manager interface engines plug into their loop.

Seed 002 (a KV-cache manager as a *resource manager* of an executor): ``prepare_resources``
before the forward step, ``update_resources`` after it, ``free_resources`` when a request ends,
capacity queries for the scheduler, block tables and pool views for the kernels (those, and the
records they read, are the base class in ``_queries.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from .._common import (
    DEFAULT_PRIORITY,
    GPU_LEVEL,
    BlockOrdinal,
    CacheLevel,
    CacheTier,
    KVCacheStatus,
    LayerGroupId,
    Priority,
    TokenId,
    TokenIdExt,
)
from .._core._kv_cache import KVCache
from .._core._request_state import default_priority
from .._exceptions import LogicError
from .._retention import Retention, check_hints
from .._utils import as_list, check_int, check_number
from ._queries import RequestRecord, ResourceQueries, check_request
from ._request import EngineRequest, RequestState, check_field, check_priority, slices_as_is

#: the weight of one step in the adapter's prefill rate (``observe_step``)
PREFILL_RATE_WEIGHT: Final = 0.2


class _FixedPriority:
    """Priority callback giving every page of a request the same eviction priority."""

    def __init__(self, priority: Priority) -> None:
        self.priority = priority

    def __call__(self, block_ordinal: BlockOrdinal, layer_group: LayerGroupId) -> Priority:
        return self.priority


def step_tokens(kv: KVCache, begin: int, remaining: int, chunk: int) -> int:
    """Tokens of a request's next step from position ``begin`` with ``remaining`` uncomputed: at most
    ``chunk`` (0: no limit), and for a hybrid model cut at the next snapshot position
    (``KVCache.next_snapshot_position``), so that a step ends there and the manager can keep the
    recurrent state of that exact position for prefix reuse."""
    n = remaining
    if chunk and n > chunk:
        n = chunk
    if n > 1:
        cut = kv.next_snapshot_position(begin)
        if cut is not None and cut < begin + n:
            n = cut - begin
    return n


class KVCacheResourceManager(ResourceQueries):
    """Resource-manager adapter over one :class:`KVCacheManager` (built from ``config``).

    Per step: ``unserved = prepare_resources(batch)``; run the model on the served requests
    (inputs are positions ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)``);
    append sampled tokens; ``update_resources(batch)``; ``free_resources(r)`` for finished
    requests. Unserved requests were left exactly as they were: back off, or preempt with
    ``suspend_resources`` (keeps the KV) or ``free_resources`` (recompute later; committed
    blocks stay reusable, so re-admission mostly reuses them).

    "Blocks" in the capacity queries are slots: one slot holds one block of one layer group
    (all its layers and buffers). Scalars sum over pool groups; the ``*_per_pool_group``
    variants are exact per group (one pool group when every layer has the same buffer sizes).

    Built from a ``config`` (the adapter owns the manager it builds: ``shutdown`` releases it),
    or around an existing ``manager`` (e.g. one with an event manager; the caller keeps
    ownership: ``shutdown`` frees the adapter's requests and leaves the manager running).
    """

    # ------------------------------------------------------------------ the step
    def prepare_resources(self, batch: Sequence[EngineRequest]) -> list[EngineRequest]:
        """Give every request of ``batch`` KV memory for its next step; return those that got none.

        A request the adapter does not know yet is admitted: its cache reuses the longest
        cached prefix of its tokens but the last (at least one token is computed, for the
        logits), and is sized for its first chunk. A known request gets room for its next
        chunk or token (a suspended one is resumed first). Unserved requests are left exactly
        as they were. If anything raises, the whole batch is rolled back.

        With background loads (a disk or remote tier, ``load_workers``), a new request whose
        cached prefix lies on disk or the remote tier first waits in the loading state (not under
        ``load_policy="never"``: it takes only what is in GPU memory; see
        ``prefetch_resources``): it is returned unserved, ``is_loading`` true, while its reads run,
        and admitted once they are in place; so is a suspended request whose pages went to disk.
        """
        self._check_alive()
        self._serial += 1
        serial = self._serial
        if self._background:
            self.manager.poll_loads()  # loads that finished since the last step land now
            if self._loading_undo:
                self._loading_undo = []
        unserved: list[EngineRequest] = []
        done: list[RequestRecord] = []
        current: KVCache | None = None  # resumed by this call for the request being prepared
        try:
            items: list[object] = as_list(batch)  # (a list iterates natively)
            for item in items:
                req, seq = self._item_record(item)
                if seq is None:
                    if req.state is RequestState.FINISHED:
                        raise LogicError(f"request {req.request_id} is FINISHED; free_resources() it instead")
                    seq = self._admit(req, serial)
                    if seq is None:
                        unserved.append(req)
                    else:
                        done.append(seq)
                    continue
                if seq.request is not req:
                    raise ValueError(f"request_id {req.request_id} belongs to another EngineRequest the adapter holds")
                if seq.serial == serial:
                    raise ValueError(f"request {req.request_id} appears twice in the batch")
                seq.serial = serial
                if req.state is RequestState.FINISHED:
                    raise LogicError(f"request {req.request_id} is FINISHED; free_resources() it instead")
                c = req.context_chunk_size
                if type(c) is not int or c < 0:
                    c = check_field("context_chunk_size", c, 0)  # raises: before anything changes
                kv = seq.kv
                h = kv.history_length
                num_tokens = len(req.prompt_tokens) + len(req.generated_tokens)
                old_cap = kv.capacity
                if num_tokens == h + 1 and kv.status is KVCacheStatus.ACTIVE:
                    # the decode step: room for one more token (a new block at a block boundary)
                    if h >= old_cap and not kv.resize(h + 1):
                        unserved.append(req)
                        continue
                    seq.undo_capacity = old_cap
                    seq.undo_scheduled = seq.scheduled
                    seq.undo_suspended = False
                    done.append(seq)
                    seq.scheduled = 1
                    req.num_scheduled_tokens = 1
                    req.num_cached_tokens = h
                    continue
                if num_tokens <= h:
                    raise LogicError(
                        f"request {req.request_id} has no uncomputed token ({h} cached of {num_tokens}); "
                        "append the sampled token to generated_tokens before the next step"
                    )
                suspended = kv.status is KVCacheStatus.SUSPENDED
                if suspended and self._background and self._loads_pages(seq):
                    unserved.append(req)  # the loading state: scheduled once its pages are in memory
                    continue
                if suspended:
                    seq.prefetched = False
                    ok = kv.resume()
                    # a failed disk read (lower tiers) drops the blocks from the first lost one on,
                    # even when resume returns False: the engine recomputes them
                    h = kv.history_length
                    req.num_cached_tokens = h
                    if not ok:
                        unserved.append(req)
                        continue
                    current = kv
                n = step_tokens(kv, h, num_tokens - h, c)
                old_cap = kv.capacity
                if h + n > old_cap and not kv.resize(h + n):
                    if suspended:
                        self._suspend(seq)
                    current = None
                    unserved.append(req)
                    continue
                current = None
                seq.undo_capacity = old_cap
                seq.undo_scheduled = seq.scheduled
                seq.undo_suspended = suspended
                done.append(seq)
                seq.scheduled = n
                req.num_scheduled_tokens = n
                req.num_cached_tokens = h
        except BaseException:
            if current is not None and current.status is KVCacheStatus.ACTIVE:
                current.suspend()  # (its record was not updated yet: the suspended page counts stand)
            self._rollback(done)
            self._undo_loading()
            raise
        return unserved

    def _loads_pages(self, seq: RequestRecord) -> bool:
        """A suspended request whose pages lie on disk: read them in the background (once per
        suspension; a read that could not start or land leaves the rest to ``resume``), up to the
        GPU, else (the GPU has no room for them) to the first host tier that has. Whether it waits
        for them this step (counted in ``loading_waits``)."""
        kv = seq.kv
        if not kv.loading:
            if seq.prefetched or kv.ready:
                return False
            seq.prefetched = True
            started = kv.prefetch(GPU_LEVEL)
            tiers = self.manager.cache_tier_list
            level = 1
            while not started and level < len(tiers) and tiers[level] is CacheTier.HOST_MEM:
                started = kv.prefetch(CacheLevel(level))
                level += 1
            if not started or not kv.loading:
                return False
        self.loading_waits["disk"] += 1
        self._loading_undo.append((self.loading_waits, "disk", None))
        return True

    def _undo_loading(self) -> None:
        """Undo what a raising ``prepare_resources`` added to the loading state (new entries'
        prefetches cancelled, counters back)."""
        for counter, kind, rid in reversed(self._loading_undo):
            counter[kind] -= 1
            if rid is not None:
                entry = self._loading.pop(rid, None)
                if entry is not None:
                    entry[1].cancel()
        self._loading_undo = []

    def prefetch_resources(self, batch: Sequence[EngineRequest]) -> list[EngineRequest]:
        """Start the loading state of queued requests the adapter does not hold yet: the cached
        prefix of each is read up from disk and the remote tier in the background
        (``KVCacheManager.prefetch``) while the engine runs others; returns those still loading.
        Call it when requests arrive, then admit (``prepare_resources``) those ``is_loading``
        says are ready, within the engine's budget; ``prepare_resources`` starts it itself for a
        request not prefetched, and returns a loading one unserved. Without background loads
        (``load_workers=0``, or no disk or remote tier), and under ``load_policy="never"`` (a create
        takes only what is in GPU memory), it does nothing and returns ``[]``."""
        self._check_alive()
        out: list[EngineRequest] = []
        items: list[object] = as_list(batch)
        for item in items:
            req, seq = self._item_record(item)
            if seq is not None or not self._prefetch_new or req.state is RequestState.FINISHED:
                continue
            tokens: Sequence[TokenIdExt] = req.prompt_tokens if not req.generated_tokens else req.all_tokens()
            if len(tokens) > 1 and self._loading_prefetch(req, tokens[: len(tokens) - 1], False):
                out.append(req)
        return out

    def _loading_prefetch(self, req: EngineRequest, prefix: Sequence[TokenIdExt], count: bool = True) -> bool:
        """The loading state of a new request: its prefix is prefetched in the background
        (``KVCacheManager.prefetch``) the first time it is seen; whether it still waits for it
        (with ``count``, a step's wait counted in ``loading_waits``; the wait ends when the prefetch is done)."""
        rid = req.request_id
        entry = self._loading.get(rid)
        if entry is not None and entry[0] is not req:
            raise ValueError(f"request_id {rid} belongs to another EngineRequest the adapter holds")
        if entry is None:
            handle = self.manager.prefetch(prefix, GPU_LEVEL, req.reuse_scope)
            if handle.done:
                return False
            self._loading[rid] = (req, handle)
            kind = "remote" if handle.waits_for_remote else "disk"
            self.loading_requests[kind] += 1
            self._loading_undo.append((self.loading_requests, kind, rid))
        else:
            handle = entry[1]
            if handle.done:
                if count:  # (admitted now)
                    del self._loading[rid]
                return False
        if count:
            kind = "remote" if handle.waits_for_remote else "disk"
            self.loading_waits[kind] += 1
            self._loading_undo.append((self.loading_waits, kind, None))
        return True

    def _suspend(self, seq: RequestRecord) -> None:
        """Suspend an ACTIVE cache, remembering how many pages it holds per pool group."""
        kv = seq.kv
        if self._num_levels == 1:
            seq.suspended_pages = self._pages_per_pool_group(kv)
        kv.suspend()

    def _admit(self, req: EngineRequest, serial: int) -> RequestRecord | None:
        """A new cache for ``req`` (prefix reuse) sized for its first chunk; None if memory is short."""
        tokens: Sequence[TokenIdExt] = req.prompt_tokens if not req.generated_tokens else req.all_tokens()
        length = len(tokens)
        c = check_field("context_chunk_size", req.context_chunk_size, 0)
        priority = check_priority(req.priority)
        cb = default_priority if priority == DEFAULT_PRIORITY else _FixedPriority(priority)
        prefix = tokens[: length - 1] if length > 1 else None
        if self._prefetch_new and prefix is not None and self._loading_prefetch(req, prefix):
            return None
        m = self.manager
        levels = m.probe_reuse_levels(req.reuse_scope, prefix) if self._num_levels > 1 and prefix is not None else []
        # (hashed once: by the probe)
        kv = m.create_kv_cache(
            req.reuse_scope, prefix, req.request_id, cb, 1, req.retention, len(req.prompt_tokens), req.session_id
        )
        try:
            if req.output_is_history:  # hybrid models: keep the state the next turn starts with
                kv.plan_snapshot(len(req.prompt_tokens) + req.max_new_tokens - 1)
            if not kv.resume():
                kv.close()
                return None
            reused = kv.history_length  # after resume: a failed disk read shortens the reused prefix
            n = step_tokens(kv, reused, length - reused, c)
            if not kv.resize(reused + n):
                kv.close()
                return None
        except BaseException:
            kv.close()
            raise
        seq = RequestRecord(req, kv, False)
        seq.serial = serial
        seq.scheduled = n
        seq.undo_reused = req.num_reused_tokens
        seq.undo_reused_per_level = req.num_reused_tokens_per_level
        self._hold(seq)
        req.num_reused_tokens = reused
        per_level = self._tokens_per_level(reused, levels)
        req.num_reused_tokens_per_level = per_level
        total = self.reused_tokens_per_level
        for level, level_tokens in enumerate(per_level):
            total[level] += level_tokens
        req.num_cached_tokens = reused
        req.num_scheduled_tokens = n
        return seq

    def _tokens_per_level(self, reused: int, levels: list[CacheLevel]) -> list[int]:
        """``reused`` tokens split by the cache level their block came from (``levels``: one per block)."""
        out = [0] * self._num_levels
        t = self.tokens_per_block
        for o in range((reused + t - 1) // t):
            out[levels[o] if o < len(levels) else GPU_LEVEL] += min(t, reused - o * t)
        return out

    def _rollback(self, done: list[RequestRecord]) -> None:
        """Undo the prepares of this call (newest first); shrinking and suspending cannot fail."""
        for seq in reversed(done):
            req = seq.request
            kv = seq.kv
            if seq.undo_capacity < 0:
                kv.close()
                self._let_go(seq)
                total = self.reused_tokens_per_level
                for level, level_tokens in enumerate(req.num_reused_tokens_per_level):
                    total[level] -= level_tokens
                req.num_reused_tokens = seq.undo_reused
                req.num_reused_tokens_per_level = seq.undo_reused_per_level
                req.num_cached_tokens = 0
                req.num_scheduled_tokens = 0
                continue
            if kv.capacity > seq.undo_capacity:
                kv.resize(seq.undo_capacity)
            if seq.undo_suspended:
                self._suspend(seq)
            seq.scheduled = seq.undo_scheduled
            req.num_scheduled_tokens = seq.undo_scheduled

    def update_resources(self, batch: Sequence[EngineRequest]) -> None:
        """After the step: commit the tokens each served request computed and advance its history.

        Full blocks are published for reuse at once (also during generation). A request
        whose prompt is now cached moves from CONTEXT to GENERATION. Requests without a
        prepared step (unserved, suspended, already updated) are skipped, so calling it
        again is harmless: if a commit raises (a bad token), the requests before it are
        updated, it and the rest are not; fix the token and call again.
        """
        self._check_alive()
        one: list[TokenIdExt] = [TokenId(0)]  # one list per call (two threads misusing one adapter get their own)
        items: list[object] = as_list(batch)
        for item in items:
            req, seq = self._item_record(item)
            if seq is None or seq.request is not req:
                raise LogicError(f"update_resources: request {req.request_id} holds no resources (prepare it first)")
            n = seq.scheduled
            if n == 0:
                continue
            kv = seq.kv
            h = kv.history_length
            p = len(req.prompt_tokens)
            e = h + n
            if e > p + len(req.generated_tokens):
                raise LogicError(
                    f"request {req.request_id}: the step computed positions [{h}, {e}) but only "
                    f"{p + len(req.generated_tokens)} tokens remain; generated_tokens must only grow"
                )
            if seq.padding:
                kv.resize(None, e)
            elif n == 1:  # (commit keeps no reference to a one-token list: one list serves the batch)
                one[0] = req.generated_tokens[h - p] if h >= p else req.prompt_tokens[h]
                kv.commit(one)
            else:  # a prompt chunk is one slice of the prompt where commit takes it as it is
                kv.commit(req.prompt_tokens[h:e] if e <= p and slices_as_is(req.prompt_tokens) else req.tokens(h, e))
            seq.scheduled = 0
            req.num_scheduled_tokens = 0
            req.num_cached_tokens = e
            if req.state is RequestState.CONTEXT and e >= p:
                req.state = RequestState.GENERATION

    def observe_step(self, seconds: object, prefill_tokens: object) -> None:
        """An engine step took ``seconds`` and computed ``prefill_tokens`` prompt tokens: the
        manager's prefill rate (``load_policy="auto"``) follows, an exponentially weighted average
        (weight ``PREFILL_RATE_WEIGHT`` a step) of the steps that prefilled anything and took a
        measurable time; with background loads so does its step time (``set_prefill_rate``'s
        ``step_s``: a request loading from disk or the remote tier joins a later step), the same
        average of every step that took a measurable time."""
        self._check_alive()
        n = check_int("prefill_tokens", prefill_tokens)
        s = check_number("seconds", seconds, False, "the step's time")
        if s == 0.0 or 1.0 / s == math.inf or n / s == math.inf:  # (a step too short to time says nothing)
            return
        w = PREFILL_RATE_WEIGHT
        old: float | None = self.manager.load_plan_statistics.prefill_tokens_per_s
        rate = old
        if n > 0:
            sample = n / s
            rate = sample if old is None else (1.0 - w) * old + w * sample
        if self._background:
            self._step_s = s if self._step_s == 0.0 else (1.0 - w) * self._step_s + w * s
        if n > 0 or self._background:
            self.manager.set_prefill_rate(rate, self._step_s if self._step_s > 0.0 else None)

    def free_resources(self, request: EngineRequest, retain: Retention | Sequence[Retention] | None = None) -> None:
        """Release the request's KV (finished, or preempted to be recomputed). Unknown requests: no-op;
        one in the loading state: its loads are cancelled (their results discarded).

        Committed blocks, including a partial last block, stay reusable until evicted (``retain``: see ``KVCache.close``).
        """
        self._check_alive()
        req = check_request("request", request)
        if retain is not None:
            check_hints("retain", retain)
        seq = self._record(req)
        if seq is None:
            entry = self._loading.get(req.request_id)
            if entry is not None and entry[0] is req:  # freed while loading: its reads are discarded
                del self._loading[req.request_id]
                entry[1].cancel()
            return
        if seq.request is not req:
            raise ValueError(f"request_id {req.request_id} belongs to another EngineRequest the adapter holds")
        self._let_go(seq)
        kv = seq.kv
        if not seq.padding:
            kv.stop_committing()
            if req.state is not RequestState.FINISHED:
                self.num_preemptions += 1
        kv.close(retain if not seq.padding else None)
        req.num_scheduled_tokens = 0
        req.num_cached_tokens = 0

    def suspend_resources(self, request: EngineRequest) -> None:
        """Preempt without losing KV: the request keeps its pages (they may move to lower tiers).

        A step prepared but not run is dropped (its new blocks are released). The next
        ``prepare_resources`` that includes the request resumes it. Already suspended: no-op.
        """
        seq = self._seq_of(request)
        kv = seq.kv
        if kv.status is KVCacheStatus.SUSPENDED:
            return
        if kv.capacity > kv.history_length:
            kv.resize(kv.history_length)
        self._suspend(seq)
        self.num_preemptions += 1
        seq.scheduled = 0
        seq.request.num_scheduled_tokens = 0

    def add_padding_request(
        self, request_id: object, is_generation: object = True, token: object = 0
    ) -> EngineRequest | None:
        """A prepared warm-up request (e.g. for CUDA-graph capture); None if memory is short.

        Context-shaped: one prompt token, the step computes position 0. Generation-shaped
        (default): one prompt and one generated token, the step computes position 1 (position
        0 holds no meaningful KV). It is never published for reuse; ``free_resources`` it after.
        """
        self._check_alive()
        # (objects: compiled code would turn a bool into an int first)
        if type(request_id) is not int or type(is_generation) is not bool or type(token) is not int:
            raise TypeError("add_padding_request(request_id: int, is_generation: bool, token: int)")
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id} is already in use")
        tok = TokenId(token)
        req = EngineRequest(request_id, [tok], 1)
        kv = self.manager.create_kv_cache(None, None, req.request_id)
        try:
            kv.stop_committing()
            h = 1 if is_generation else 0
            if not kv.resume() or not kv.resize(h + 1, h):
                kv.close()
                return None
        except BaseException:
            kv.close()
            raise
        if is_generation:
            req.generated_tokens.append(tok)
            req.state = RequestState.GENERATION
        seq = RequestRecord(req, kv, True)
        seq.scheduled = 1
        self._hold(seq)
        req.num_cached_tokens = h
        req.num_scheduled_tokens = 1
        return req

    def shutdown(self) -> None:
        """Free every request's resources and release all memory (a manager given as ``manager=``
        stays running: its owner shuts it down). Idempotent."""
        if self._is_shut_down:
            return
        for _, handle in self._loading.values():
            handle.cancel()
        self._loading = {}
        for seq in list(self._seqs.values()):
            seq.kv.close()
            self._let_go(seq)
        if self._owns_manager:
            self.manager.shutdown()
        self._is_shut_down = True
