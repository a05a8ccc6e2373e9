"""KVCacheResourceManager: the per-step resource-manager interface engines plug into their loop.

Seed 002 (a KV-cache manager as a *resource manager* of an executor): ``prepare_resources``
before the forward step, ``update_resources`` after it, ``free_resources`` when a request ends,
capacity queries for the scheduler, block tables and pool views for the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._common import (
    BAD_PAGE_INDEX,
    DEFAULT_PRIORITY,
    GPU_LEVEL,
    BeamIndex,
    BlockOrdinal,
    CacheLevel,
    KVCacheStatus,
    LayerGroupId,
    LayerId,
    PageIndexMode,
    PoolGroupIndex,
    Priority,
    TokenId,
    TokenIdExt,
)
from .._config import KVCacheManagerConfig
from .._core._kv_cache import KVCache
from .._core._kv_cache_manager import KVCacheManager
from .._core._request_state import default_priority
from .._exceptions import LogicError
from .._page_index import PageIndexConverter
from .._retention import Retention
from .._utils import check_type
from ._buffers import CudaBufferView, host_view, page_layout
from ._capacity import LayerGroupShape, StepPlan, admission_bound, peak_slots
from ._request import EngineRequest, RequestId, RequestState, check_field, check_priority, slices_as_is


class _FixedPriority:
    """Priority callback giving every page of a request the same eviction priority."""

    def __init__(self, priority: Priority) -> None:
        self.priority = priority

    def __call__(self, block_ordinal: BlockOrdinal, layer_group: LayerGroupId) -> Priority:
        return self.priority


class _Sequence:
    """The adapter's record of one request: its cache and what the current step computes."""

    def __init__(self, request: EngineRequest, kv: KVCache, padding: bool) -> None:
        self.request = request
        self.kv = kv
        self.padding = padding
        self.scheduled = 0  #: tokens the prepared step computes (0: none)
        self.serial = 0  #: the prepare_resources call that last saw this request
        # how to undo this step's prepare if a later request of the batch raises
        self.undo_capacity = -1  #: -1: admitted in this step (undo = close)
        self.undo_scheduled = 0
        self.undo_suspended = False
        self.undo_reused = 0
        self.undo_reused_per_level: list[int] = []
        #: pages per pool group the cache held when the adapter last suspended it (GPU-only
        #: managers: they stay in GPU memory, so they are not needed again)
        self.suspended_pages: list[int] = []


def _check_request(name: str, request: object) -> EngineRequest:
    if not isinstance(request, EngineRequest):
        raise TypeError(f"{name} must be an EngineRequest, got {type(request).__name__}")
    return request


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


class KVCacheResourceManager:
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

    def __init__(self, config: KVCacheManagerConfig | None = None, *, manager: KVCacheManager | None = None) -> None:
        if (config is None) == (manager is None):
            raise ValueError("KVCacheResourceManager needs exactly one of config or manager=")
        if manager is not None:
            if not isinstance(manager, KVCacheManager):
                raise TypeError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
            manager.get_storage_statistics()  # raises LogicError if it was shut down
            self.manager = manager
            self._owns_manager = False
        else:
            if not isinstance(config, KVCacheManagerConfig):
                raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
            self.manager = KVCacheManager(config)
            self._owns_manager = True
        m = self.manager
        t = m.tokens_per_block
        self.tokens_per_block = t
        self._shapes: list[LayerGroupShape] = []
        for lg in range(len(m.layer_grouping)):
            info = m.get_layer_group_info(LayerGroupId(lg))
            self._shapes.append(LayerGroupShape(m._layer_group_policy(LayerGroupId(lg)), info.pool_group_index))
        self._num_pool_groups = len(m.pool_group_descs)
        #: cache levels (tiers); with more than one, admission asks where the reused blocks are
        self._num_levels = len(m.cache_tier_list)
        self._releases_blocks = any(s.policy.releases_blocks for s in self._shapes)
        self._seqs: dict[int, _Sequence] = {}
        self._serial = 0
        self._converters: dict[tuple[LayerId, str], PageIndexConverter] = {}
        self._is_shut_down = False
        #: preemptions so far: ``suspend_resources`` of a running request, ``free_resources`` of one not FINISHED
        self.num_preemptions = 0
        #: prompt tokens admitted requests reused so far, by the cache level they came from (see
        #: ``EngineRequest.num_reused_tokens_per_level``; the last level of a remote tier included)
        self.reused_tokens_per_level = [0] * self._num_levels

    def __repr__(self) -> str:
        return f"KVCacheResourceManager(requests={len(self._seqs)}, free_blocks={self.get_num_free_blocks_per_pool_group()})"

    # ------------------------------------------------------------------ the step
    def prepare_resources(self, batch: Sequence[EngineRequest]) -> list[EngineRequest]:
        """Give every request of ``batch`` KV memory for its next step; return those that got none.

        A request the adapter does not know yet is admitted: its cache reuses the longest
        cached prefix of its tokens but the last (at least one token is computed, for the
        logits), and is sized for its first chunk. A known request gets room for its next
        chunk or token (a suspended one is resumed first). Unserved requests are left exactly
        as they were. If anything raises, the whole batch is rolled back.
        """
        self._check_alive()
        self._serial += 1
        serial = self._serial
        unserved: list[EngineRequest] = []
        done: list[_Sequence] = []
        current: KVCache | None = None  # resumed by this call for the request being prepared
        try:
            for req in batch:
                if not isinstance(req, EngineRequest):
                    raise TypeError(f"batch items must be EngineRequest, got {type(req).__name__}")
                seq = self._seqs.get(req.request_id)
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
                c = check_field("context_chunk_size", req.context_chunk_size, 0)  # before anything changes
                kv = seq.kv
                h = kv.history_length
                num_tokens = len(req.prompt_tokens) + len(req.generated_tokens)
                if num_tokens <= h:
                    raise LogicError(
                        f"request {req.request_id} has no uncomputed token ({h} cached of {num_tokens}); "
                        "append the sampled token to generated_tokens before the next step"
                    )
                suspended = kv.status is KVCacheStatus.SUSPENDED
                if suspended:
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
            raise
        return unserved

    def _suspend(self, seq: _Sequence) -> None:
        """Suspend an ACTIVE cache, remembering how many pages it holds per pool group."""
        kv = seq.kv
        if self._num_levels == 1:
            seq.suspended_pages = self._pages_per_pool_group(kv)
        kv.suspend()

    def _pages_per_pool_group(self, kv: KVCache) -> list[int]:
        """Slots held per pool group by an ACTIVE cache (its indices are live): blocks with a page,
        and the live state of each group that keeps one (resume took it; one: the adapter creates
        no beams), as ``peak_slots`` counts them."""
        out = [0] * self._num_pool_groups
        for lg, shape in enumerate(self._shapes):
            if shape.policy.keeps_live_state:
                out[shape.pool_group] += 1  # (its blocks have no page)
                continue
            indices = kv.get_base_page_indices(LayerGroupId(lg))
            out[shape.pool_group] += len(indices) - indices.tolist().count(BAD_PAGE_INDEX)
        return out

    def _admit(self, req: EngineRequest, serial: int) -> _Sequence | None:
        """A new cache for ``req`` (prefix reuse) sized for its first chunk; None if memory is short."""
        tokens: Sequence[TokenIdExt] = req.prompt_tokens if not req.generated_tokens else req.all_tokens()
        length = len(tokens)
        c = check_field("context_chunk_size", req.context_chunk_size, 0)
        priority = check_priority(req.priority)
        cb = default_priority if priority == DEFAULT_PRIORITY else _FixedPriority(priority)
        prefix = tokens[: length - 1] if length > 1 else None
        m = self.manager
        levels = m.probe_reuse_levels(req.reuse_scope, prefix) if self._num_levels > 1 and prefix is not None else []
        # (hashed once: by the probe)
        kv = m.create_kv_cache(req.reuse_scope, prefix, req.request_id, cb, 1, req.retention, len(req.prompt_tokens))
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
        seq = _Sequence(req, kv, False)
        seq.serial = serial
        seq.scheduled = n
        seq.undo_reused = req.num_reused_tokens
        seq.undo_reused_per_level = req.num_reused_tokens_per_level
        self._seqs[req.request_id] = seq
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

    def _rollback(self, done: list[_Sequence]) -> None:
        """Undo the prepares of this call (newest first); shrinking and suspending cannot fail."""
        for seq in reversed(done):
            req = seq.request
            kv = seq.kv
            if seq.undo_capacity < 0:
                kv.close()
                del self._seqs[req.request_id]
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
        for req in batch:
            if not isinstance(req, EngineRequest):
                raise TypeError(f"batch items must be EngineRequest, got {type(req).__name__}")
            seq = self._seqs.get(req.request_id)
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
            elif n == 1:
                kv.commit([req.generated_tokens[h - p]] if h >= p else [req.prompt_tokens[h]])
            else:  # a prompt chunk is one slice of the prompt where commit takes it as it is
                kv.commit(req.prompt_tokens[h:e] if e <= p and slices_as_is(req.prompt_tokens) else req.tokens(h, e))
            seq.scheduled = 0
            req.num_scheduled_tokens = 0
            req.num_cached_tokens = e
            if req.state is RequestState.CONTEXT and e >= p:
                req.state = RequestState.GENERATION

    def free_resources(self, request: EngineRequest, retain: Retention | None = None) -> None:
        """Release the request's KV (finished, or preempted to be recomputed). Unknown requests: no-op.

        Committed blocks, including a partial last block, stay reusable until evicted (``retain``: see ``KVCache.close``).
        """
        self._check_alive()
        req = _check_request("request", request)
        check_type("retain", retain, (Retention, type(None)))
        seq = self._seqs.get(req.request_id)
        if seq is None:
            return
        if seq.request is not req:
            raise ValueError(f"request_id {req.request_id} belongs to another EngineRequest the adapter holds")
        del self._seqs[req.request_id]
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

    def add_padding_request(self, request_id: int, is_generation: bool = True, token: int = 0) -> EngineRequest | None:
        """A prepared warm-up request (e.g. for CUDA-graph capture); None if memory is short.

        Context-shaped: one prompt token, the step computes position 0. Generation-shaped
        (default): one prompt and one generated token, the step computes position 1 (position
        0 holds no meaningful KV). It is never published for reuse; ``free_resources`` it after.
        """
        self._check_alive()
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
        seq = _Sequence(req, kv, True)
        seq.scheduled = 1
        self._seqs[req.request_id] = seq
        req.num_cached_tokens = h
        req.num_scheduled_tokens = 1
        return req

    # ------------------------------------------------------------------ capacity
    def get_max_resource_count(self) -> int:
        """Slots of all pool groups (see the class doc for what a block is)."""
        return sum(self.get_max_resource_count_per_pool_group())

    def get_max_resource_count_per_pool_group(self) -> list[int]:
        """Slots of each pool group at the GPU level."""
        return [s.total for s in self.manager.get_storage_statistics()]

    def get_num_free_blocks(self) -> int:
        """Slots that can be allocated now (free + evictable reusable), summed over pool groups."""
        return sum(self.get_num_free_blocks_per_pool_group())

    def get_num_free_blocks_per_pool_group(self) -> list[int]:
        """Slots each pool group can allocate now (free + evictable reusable)."""
        return [s.available for s in self.manager.get_storage_statistics()]

    def get_needed_resource_to_completion(self, request: EngineRequest) -> int:
        """More slots the request needs to finish (summed over pool groups); see the per-group variant."""
        return sum(self.get_needed_resource_to_completion_per_pool_group(request))

    def get_needed_resource_to_completion_per_pool_group(self, request: EngineRequest) -> list[int]:
        """Slots per pool group the request still needs beyond those it holds, at the peak of its remaining steps.

        Assumes it generates ``max_new_tokens`` with its ``context_chunk_size``. Exact for an
        admitted request running alone (pages another request shares count as its own, and
        blocks leaving a window are released). For a request not admitted yet: an upper
        bound that assumes no prefix reuse. With SWA scratch reuse an upper bound: a prefill
        step's out-of-window blocks are counted as pages, where they share a few scratch slots.

        A suspended request counts the pages it holds in GPU memory only with a GPU-only manager;
        with lower tiers its pages may spill (they count as free blocks as far as the tiers below
        can take them), so it needs its whole peak again.
        """
        req = _check_request("request", request)
        t = self.tokens_per_block
        final_cap = len(req.prompt_tokens) + check_field("max_new_tokens", req.max_new_tokens, 1) - 1
        chunk = check_field("context_chunk_size", req.context_chunk_size, 0)
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.request is not req:
            return admission_bound(self._shapes, self._num_pool_groups, final_cap, chunk)
        kv = seq.kv
        plan = StepPlan(kv.history_length, kv.capacity, min(req.num_tokens, final_cap), final_cap, chunk)
        peak = peak_slots(self._shapes, self._num_pool_groups, t, plan, self._releases_blocks)
        if kv.status is KVCacheStatus.ACTIVE:
            held = self._pages_per_pool_group(kv)
        elif self._num_levels == 1 and seq.suspended_pages:
            held = seq.suspended_pages
        else:
            held = [0] * self._num_pool_groups
        return [max(0, n - k) for n, k in zip(peak, held)]

    # ------------------------------------------------------------------ kernels
    def get_batch_cache_indices(
        self,
        requests: Sequence[EngineRequest],
        layer_group_id: LayerGroupId = LayerGroupId(0),
        beam: BeamIndex = BeamIndex(0),
    ) -> dict[RequestId, memoryview]:
        """Base page index (slot id, -1 for none) per block of each request, for one layer group.

        The views are the manager's live index views (no copy; see
        ``KVCache.get_base_page_indices``): fetch them again after the next prepare of that
        request; do not modify them.
        """
        out: dict[RequestId, memoryview] = {}
        for req in requests:
            out[req.request_id] = self._seq_of(req).kv.get_base_page_indices(layer_group_id, beam)
        return out

    def get_kernel_page_indices(
        self, request: EngineRequest, layer_id: LayerId, role: str, index_mode: PageIndexMode = PageIndexMode.PER_LAYER
    ) -> list[int]:
        """The request's kernel page indices for one buffer (``expansion`` per block, -1 for none).

        Address of index ``x``: ``get_mem_pool_base_address(layer_id, role, index_mode) + x *
        get_page_stride(layer_id, role)``; ``get_buffers(layer_id, role)[x]`` is that page.
        """
        kv = self._seq_of(request).kv
        conv = self._converter(layer_id, role)
        lg = self.manager.get_layer_group_id(layer_id)
        scratch = kv.get_scratch_desc(lg)
        if scratch is not None and index_mode is not PageIndexMode.PER_LAYER:
            raise LogicError(
                f"request {request.request_id}: this step has SWA scratch blocks in layer group {lg}, which "
                f"only index_mode=PageIndexMode.PER_LAYER can address (got {index_mode})"
            )
        return conv(kv.get_base_page_indices(lg), index_mode, scratch)

    def get_buffers(
        self,
        layer_id: LayerId,
        role: str,
        dtype: Any = None,
        page_shape: tuple[int, ...] | None = None,
        index_mode: PageIndexMode = PageIndexMode.PER_LAYER,
    ) -> Any:
        """Zero-copy view of the pool holding this buffer, indexed by kernel page index.

        Shape ``(num_pages, *page_shape)`` of ``dtype`` (default: ``(num_pages, page_bytes)``
        of uint8): numpy on the host backend; on CUDA a :class:`CudaBufferView` exposing
        ``__cuda_array_interface__``. Page ``x`` is this buffer's page for kernel index ``x``
        in ``index_mode`` (other indices hold other layers' pages of the same pool). Valid
        until the manager shuts down.
        """
        self._check_alive()
        m = self.manager
        if not isinstance(index_mode, PageIndexMode):
            raise TypeError(f"index_mode must be a PageIndexMode, got {type(index_mode).__name__}")
        stride = m.get_page_stride(layer_id, role)  # validates layer_id and role
        dt, shape = page_layout(stride, dtype, page_shape)
        num_pages = m.get_page_index_upper_bound(layer_id, role)
        if index_mode is PageIndexMode.SHARED:
            conv = self._converter(layer_id, role)
            num_pages -= conv.layer_offset * conv.expansion
        address = int(m.get_mem_pool_base_address(layer_id, role, index_mode))
        full_shape = (num_pages,) + shape
        if m.backend_name == "cuda":
            return CudaBufferView(address, full_shape, dt)
        return host_view(address, full_shape, dt)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def layer_group_pool_groups(self) -> list[PoolGroupIndex]:
        """The pool group holding each layer group's slots (indexed by ``LayerGroupId``)."""
        return [s.pool_group for s in self._shapes]

    @property
    def num_requests(self) -> int:
        """Requests holding resources (active or suspended)."""
        return len(self._seqs)

    def has_resources(self, request: EngineRequest) -> bool:
        """Whether the adapter holds a cache for this request (prepared and not freed)."""
        seq = self._seqs.get(_check_request("request", request).request_id)
        return seq is not None and seq.request is request

    def is_suspended(self, request: EngineRequest) -> bool:
        """Whether the request's cache is suspended (preempted: its pages may sit in lower tiers)."""
        return self._seq_of(request).kv.status is KVCacheStatus.SUSPENDED

    def get_kv_cache(self, request: EngineRequest) -> KVCache:
        """The request's :class:`KVCache` (for what the adapter does not cover; do not close it)."""
        return self._seq_of(request).kv

    def shutdown(self) -> None:
        """Free every request's resources and release all memory (a manager given as ``manager=``
        stays running: its owner shuts it down). Idempotent."""
        if self._is_shut_down:
            return
        for seq in list(self._seqs.values()):
            seq.kv.close()
        self._seqs.clear()
        if self._owns_manager:
            self.manager.shutdown()
        self._is_shut_down = True

    def _seq_of(self, request: EngineRequest) -> _Sequence:
        req = _check_request("request", request)
        seq = self._seqs.get(req.request_id)
        if seq is None or seq.request is not req:
            raise LogicError(f"request {req.request_id} holds no resources in this adapter (prepare_resources first)")
        return seq

    def _converter(self, layer_id: LayerId, role: str) -> PageIndexConverter:
        key = (layer_id, role)
        conv = self._converters.get(key)
        if conv is None:
            conv = self.manager.get_page_index_converter(layer_id, role)
            self._converters[key] = conv
        return conv

    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise LogicError("the resource manager was shut down")
