"""KVCacheResourceManager's records of its requests and the queries that only read them.

Construction, the per-request records, capacity queries for the scheduler, block tables and
pool views for the kernels. The step that changes the records (``prepare_resources`` and the
rest) is the subclass in ``_resource_manager.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._common import (
    BAD_PAGE_INDEX,
    BeamIndex,
    CacheTier,
    KVCacheStatus,
    LayerGroupId,
    LayerId,
    PageIndexMode,
    PoolGroupIndex,
)
from .._config import KVCacheManagerConfig
from .._core._kv_cache import KVCache
from .._core._kv_cache_manager import KVCacheManager
from .._core._prefetch import Prefetch
from .._exceptions import LogicError
from .._page_index import PageIndexConverter
from .._utils import check_int
from ._buffers import CudaBufferView, host_view, page_layout
from ._capacity import LayerGroupShape, StepPlan, admission_bound, peak_slots
from ._request import EngineRequest, RequestId, check_field


class RequestRecord:
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
        self.slot = -1  #: its index in the adapter's ``_records`` while the adapter holds it
        #: suspended: its pages on disk were prefetched in the background once since it last ran
        self.prefetched = False


def check_request(name: str, request: object) -> EngineRequest:
    """``request`` if it is an :class:`EngineRequest` (else TypeError naming the argument ``name``)."""
    if not isinstance(request, EngineRequest):
        raise TypeError(f"{name} must be an EngineRequest, got {type(request).__name__}")
    return request


class ResourceQueries:
    """The adapter's state (its manager and one record per request) and the queries that read it;
    :class:`KVCacheResourceManager` adds the step that changes it."""

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
        self._seqs: dict[int, RequestRecord] = {}
        #: the same records by slot (``EngineRequest._slot`` remembers it: found without hashing)
        self._records: list[RequestRecord | None] = []
        self._free_slots: list[int] = []
        self._serial = 0
        self._converters: dict[tuple[LayerId, str], PageIndexConverter] = {}
        self._is_shut_down = False
        #: preemptions so far: ``suspend_resources`` of a running request, ``free_resources`` of one not FINISHED
        self.num_preemptions = 0
        #: prompt tokens admitted requests reused so far, by the cache level they came from (see
        #: ``EngineRequest.num_reused_tokens_per_level``; the last level of a remote tier included)
        self.reused_tokens_per_level = [0] * self._num_levels
        #: new requests and suspended ones read from disk / the remote tier in the background
        #: (``KVCacheManager.prefetch``, ``KVCache.prefetch``) and wait, unscheduled, until it is in place
        self._background = m.config.load_workers > 0 and any(
            tier is CacheTier.DISK or tier is CacheTier.REMOTE for tier in m.cache_tier_list
        )
        #: new requests wait for their prefix (``prefetch_resources``): not under ``load_policy="never"``,
        #: whose creates take only what is in GPU memory (what a prefetch brings up would go unused)
        self._prefetch_new = self._background and m.config.load_policy != "never"
        #: the engine's step time the manager was told (``observe_step``; 0: none yet)
        self._step_s = 0.0
        #: new requests waiting for their prefetch (the loading state), by request id
        self._loading: dict[RequestId, tuple[EngineRequest, Prefetch]] = {}
        #: steps requests spent in the loading state, by what they waited for: "disk" (pages read
        #: from a disk tier, new or suspended requests), "remote" (a remote tier's lookup or fetch)
        self.loading_waits: dict[str, int] = {"disk": 0, "remote": 0}
        #: new requests that entered the loading state, by what they waited for first (as above)
        self.loading_requests: dict[str, int] = {"disk": 0, "remote": 0}
        #: what this ``prepare_resources`` call added to the loading state, undone if it raises: a
        #: counter and its key, and the request id of a new loading entry (its prefetch cancelled)
        self._loading_undo: list[tuple[dict[str, int], str, RequestId | None]] = []

    def __repr__(self) -> str:
        return f"KVCacheResourceManager(requests={len(self._seqs)}, free_blocks={self.get_num_free_blocks_per_pool_group()})"

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
        req = check_request("request", request)
        t = self.tokens_per_block
        final_cap = len(req.prompt_tokens) + check_field("max_new_tokens", req.max_new_tokens, 1) - 1
        chunk = check_field("context_chunk_size", req.context_chunk_size, 0)
        seq = self._record(req)
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
        layer_group_id: object = LayerGroupId(0),
        beam: object = BeamIndex(0),
    ) -> dict[RequestId, memoryview]:
        """Base page index (slot id, -1 for none) per block of each request, for one layer group.

        The views are the manager's live index views (no copy; see
        ``KVCache.get_base_page_indices``): fetch them again after the next prepare of that
        request; do not modify them.
        """
        layer_group = LayerGroupId(check_int("layer_group_id", layer_group_id))  # (each cache checks the range)
        beam_index = BeamIndex(check_int("beam", beam))
        out: dict[RequestId, memoryview] = {}
        for req in requests:
            out[req.request_id] = self._seq_of(req).kv.get_base_page_indices(layer_group, beam_index)
        return out

    def get_kernel_page_indices(
        self, request: EngineRequest, layer_id: object, role: str, index_mode: PageIndexMode = PageIndexMode.PER_LAYER
    ) -> list[int]:
        """The request's kernel page indices for one buffer (``expansion`` per block, -1 for none).

        Address of index ``x``: ``get_mem_pool_base_address(layer_id, role, index_mode) + x *
        get_page_stride(layer_id, role)``; ``get_buffers(layer_id, role)[x]`` is that page.
        """
        layer = LayerId(check_int("layer_id", layer_id))
        kv = self._seq_of(request).kv
        conv = self._converter(layer, role)
        lg = self.manager.get_layer_group_id(layer)
        scratch = kv.get_scratch_desc(lg)
        if scratch is not None and index_mode is not PageIndexMode.PER_LAYER:
            raise LogicError(
                f"request {request.request_id}: this step has SWA scratch blocks in layer group {lg}, which "
                f"only index_mode=PageIndexMode.PER_LAYER can address (got {index_mode})"
            )
        return conv(kv.get_base_page_indices(lg), index_mode, scratch)

    def get_buffers(
        self,
        layer_id: object,
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
        layer = LayerId(check_int("layer_id", layer_id))
        stride = m.get_page_stride(layer, role)  # validates the layer and role
        dt, shape = page_layout(stride, dtype, page_shape)
        num_pages = m.get_page_index_upper_bound(layer, role)
        if index_mode is PageIndexMode.SHARED:
            conv = self._converter(layer, role)
            num_pages -= conv.layer_offset * conv.expansion
        address = int(m.get_mem_pool_base_address(layer, role, index_mode))
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

    @property
    def num_loading(self) -> int:
        """New requests in the loading state (their prefix read from disk or the remote tier in
        the background; ``prepare_resources`` returns them unserved until it is in place)."""
        return sum(1 for _, handle in self._loading.values() if not handle.done)

    def is_loading(self, request: EngineRequest) -> bool:
        """Whether ``request`` waits in the loading state (new, or suspended with pages on disk):
        ``prepare_resources`` would return it unserved now, whatever the memory."""
        req = check_request("request", request)
        entry = self._loading.get(req.request_id)
        if entry is not None and entry[0] is req:
            return not entry[1].done
        seq = self._record(req)
        return seq is not None and seq.request is req and seq.kv.loading

    def has_resources(self, request: EngineRequest) -> bool:
        """Whether the adapter holds a cache for this request (prepared and not freed)."""
        seq = self._record(check_request("request", request))
        return seq is not None and seq.request is request

    def is_suspended(self, request: EngineRequest) -> bool:
        """Whether the request's cache is suspended (preempted: its pages may sit in lower tiers)."""
        return self._seq_of(request).kv.status is KVCacheStatus.SUSPENDED

    def get_kv_cache(self, request: EngineRequest) -> KVCache:
        """The request's :class:`KVCache` (for what the adapter does not cover; do not close it)."""
        return self._seq_of(request).kv

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

    def _record(self, req: EngineRequest) -> RequestRecord | None:
        """The record held under ``req``'s id (perhaps another request's), or None."""
        slot = req._slot
        records = self._records
        if 0 <= slot < len(records):
            seq = records[slot]
            if seq is not None and seq.request is req:
                return seq
        return self._seqs.get(req.request_id)

    def _item_record(self, item: object) -> tuple[EngineRequest, RequestRecord | None]:
        """A batch item, checked to be a request, and the record held under its id (``_record``)."""
        if not isinstance(item, EngineRequest):
            raise TypeError(f"batch items must be EngineRequest, got {type(item).__name__}")
        return item, self._record(item)

    def _hold(self, seq: RequestRecord) -> None:
        """Hold a new record (its request's id is not held)."""
        req = seq.request
        self._seqs[req.request_id] = seq
        records = self._records
        if self._free_slots:
            slot = self._free_slots.pop()
            records[slot] = seq
        else:
            slot = len(records)
            records.append(seq)
        seq.slot = slot
        req._slot = slot

    def _let_go(self, seq: RequestRecord) -> None:
        """Stop holding a record (``_hold`` took it)."""
        req = seq.request
        del self._seqs[req.request_id]
        self._records[seq.slot] = None
        self._free_slots.append(seq.slot)
        if req._slot == seq.slot:
            req._slot = -1
        seq.slot = -1

    def _seq_of(self, request: EngineRequest) -> RequestRecord:
        req = check_request("request", request)
        seq = self._record(req)
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
