"""KVCache: the public object of one request's KV memory (README.md, "API in short").

Its state and the queries on it (lengths, tokens, tables, page indices) are its base's,
:class:`~._request_state.RequestState`; the concerns are functions over the state in their own
modules: residency (resume, suspend, prefetch, close, lost blocks), resize planning, commit and
publishing, beams. The decode step's fast paths stay here as methods: a resize that needs no new
block or one more block, and the commit of one token that completes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .._common import (
    MAX_CAPACITY,
    MAX_TOKEN_ID,
    BlockOrdinal,
    CacheLevel,
    KVCacheStatus,
    LayerGroupId,
    TokenIdExt,
)
from .._exceptions import LogicError, OutOfPagesError
from .._retention import Retention, check_hints
from .._reuse._keys import check_token, check_token_sequence, validate_tokens
from .._utils import check_int, check_type
from ._beams import commit_beams
from ._commit import commit_tokens, next_snapshot_position, publish_final
from ._planning import resize_blocks
from ._request_state import RequestState, checked_priority, default_priority
from ._residency import (
    cancel_loads,
    close_pages,
    drop_lost_blocks,
    loads_in_flight,
    needs_disk_reads,
    prefetch_pages,
    resume_pages,
    suspend_pages,
)
from ._snapshot_plan import add_snapshot_position


class KVCache(RequestState):
    """The KV memory of one request.

    Created SUSPENDED by :meth:`KVCacheManager.create_kv_cache`; ``resume()`` makes it ACTIVE,
    ``resize()`` grows or shrinks its pages, ``commit()`` records the tokens whose KV was
    computed, ``close()`` releases everything. Lengths keep
    ``num_committed_tokens <= history_length <= capacity``.
    """

    def __repr__(self) -> str:
        return (
            f"KVCache(id={self._id!r}, status={self._status.name}, capacity={self._capacity}, "
            f"history_length={self._history}, committed={self.num_committed_tokens}, blocks={self._num_blocks})"
        )

    # ------------------------------------------------------------------ properties
    @property
    def capacity(self) -> int:
        """Tokens the request has pages for (allocated or stale).

        Setting it is ``resize(value)`` that raises ``OutOfPagesError`` (changing nothing)
        where ``resize`` would return False.
        """
        return self._capacity

    @capacity.setter
    def capacity(self, value: object) -> None:  # object: compiled code would turn a bool into an int first
        if not self.resize(check_int("capacity", value)):
            raise OutOfPagesError(
                f"not enough GPU memory to grow this cache to capacity {value}; nothing changed "
                "(resize() returns False instead of raising)"
            )

    @property
    def history_length(self) -> int:
        """Tokens whose KV is already computed (the step's input starts here).

        Setting it is ``resize(None, value)``: capacity stays; history never shrinks.
        """
        return self._history

    @history_length.setter
    def history_length(self, value: object) -> None:
        if not self.resize(None, check_int("history_length", value)):
            raise OutOfPagesError(f"not enough GPU memory to raise history to {value}; nothing changed")

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether this request's prefill steps use scratch slots (docs/design.md, "SWA prefill scratch slots"; on by default when the
        manager has ``swa_scratch_reuse``). Settable while the current step has no scratch blocks."""
        return self._scratch_enabled

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, value: bool) -> None:
        check_type("enable_swa_scratch_reuse", value, bool)
        if value and self._ctx.max_rewind_len < 0:
            raise LogicError(
                "enable_swa_scratch_reuse needs a manager configured with swa_scratch_reuse=SwaScratchReuseConfig(...)"
            )
        table = self._table
        ctx = self._ctx
        done = True  # every scratch block is out of the window at the current history: the step is over
        for i, (beg, end) in enumerate(table.scratch):
            if beg < end and ctx.layer_groups[LayerGroupId(i)].stale_end(self._history) < end:
                done = False
        if not done:
            raise LogicError(
                "enable_swa_scratch_reuse cannot change while the current step has scratch blocks; "
                "commit the step (or resize to one without scratch blocks) first"
            )
        ctx.enter("enable_swa_scratch_reuse")
        try:
            self._clear_scratch()  # the committed step's scratch slots: nothing needs them now
        finally:
            ctx.leave()
        self._scratch_enabled = value and ctx.has_releasing_groups

    # ------------------------------------------------------------------ state machine
    def resume(self, cuda_stream: object = None) -> bool:
        """SUSPENDED -> ACTIVE: bring every page to GPU memory and lock it there.

        Pages in lower cache levels (matched there, or spilled while suspended) come up in one
        batch per (source level, pool group); a partially matched block gets its private copy.
        Returns False (staying SUSPENDED, nothing changed) when there is no room for them, or
        when GPU utilisation with them placed would exceed ``max_util_for_resume`` in a pool
        group above what the ``constraints`` guarantee. If a disk read fails, the blocks from the
        first lost one on are dropped: ``history_length`` (and capacity, committed tokens) shrink
        to what is still intact; read it again after resume.

        ``cuda_stream``: the stream the request's kernels run on from now on (sets the
        ``cuda_stream`` property; None keeps it). On CUDA the copies bringing the pages up are
        queued, not waited for: that stream's next kernels run after them.
        """
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(f"resume() needs a SUSPENDED cache; this one is {self._status.name}")
        # (an object: compiled, an int parameter would have turned a bool into an int already)
        stream = check_int("cuda_stream (a CUstream handle)", cuda_stream) if cuda_stream is not None else -1
        ctx = self._ctx
        ctx.enter("resume()")
        try:
            if not resume_pages(self):
                return False
        finally:
            ctx.leave()
        if not self._stream_counted:  # its kernels run from now on: our copies are ordered with them
            self._stream_counted = True
            if stream >= 0:
                self._cuda_stream = stream
            ctx.storage.copier.streams.acquire(self._cuda_stream)
        elif stream >= 0:
            self._set_stream(stream)
        return True

    def prefetch(self, target_level: object) -> bool:
        """Move this SUSPENDED cache's pages that sit below ``target_level`` up to it, ahead of
        ``resume`` (one batch per source level and pool group). Returns False, changing nothing,
        when ``target_level`` has no room for them. The pages stay HELD, so they may spill down
        again. A failed disk read drops the blocks from the first lost one on (as ``resume``).

        With ``load_workers`` (the default) the pages on disk are read in the background and this
        returns at once: ``loading`` is True until they are installed (into the host tier when
        ``target_level`` is the GPU and a host tier exists, else at ``target_level``), and
        ``ready`` tells when ``resume`` needs no disk read. A resume meanwhile reads what is still
        on disk itself (the background reads of this cache are then discarded); ``cancel_prefetch``
        stops them."""
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(f"prefetch() needs a SUSPENDED cache; this one is {self._status.name}")
        storage = self._ctx.storage
        level = check_int("target_level", target_level)
        if level >= storage.num_levels:
            raise ValueError(
                f"target_level must be in [0, {storage.num_levels}) ({storage.num_levels} tiers configured), "
                f"got {level}"
            )
        ctx = self._ctx
        ctx.enter("prefetch()")
        try:
            return prefetch_pages(self, CacheLevel(level))
        finally:
            ctx.leave()

    @property
    def loading(self) -> bool:
        """Whether background reads started by ``prefetch`` are still in flight (finished ones are
        installed first). False once they are in place, discarded or cancelled."""
        if not self._loads:
            return False
        ctx = self._ctx
        ctx.enter("KVCache.loading")
        try:
            return loads_in_flight(self)
        finally:
            ctx.leave()

    def cancel_prefetch(self) -> None:
        """Stop the background reads that ``prefetch`` started and that are not installed yet:
        they are discarded when they land (nothing was allocated for them) and the pages stay
        where they are; pages already installed stay too. Nothing else changes (``loading`` is
        False after). Idempotent; a no-op when nothing is loading."""
        if not self._loads:
            return
        ctx = self._ctx
        ctx.enter("cancel_prefetch()")
        try:
            cancel_loads(self)
        finally:
            ctx.leave()

    @property
    def ready(self) -> bool:
        """Whether ``resume`` can bring this cache's pages to GPU memory without a disk read:
        nothing of it is being read in the background and none of its pages lies on a disk tier
        (memory tiers are copied at resume either way). An ACTIVE (or CLOSED) cache is ready."""
        if self._status is not KVCacheStatus.SUSPENDED:
            return True
        return not self.loading and not needs_disk_reads(self)

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: locks become holds. The pages stay where they are, but with lower
        cache levels configured other requests may push them down (never drop them); the indices
        read ``BAD_PAGE_INDEX`` until ``resume``."""
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"suspend() needs an ACTIVE cache; this one is {self._status.name}")
        ctx = self._ctx
        ctx.enter("suspend()")
        try:
            suspend_pages(self)
        finally:
            ctx.leave()

    def close(self, retain: Retention | Sequence[Retention] | None = None) -> None:
        """Publish the partial last block (unless ``stop_committing()`` came first) and release
        every page; committed pages stay reusable (with a write-through remote tier, its published
        full blocks are handed to the writer now). Idempotent; also runs on garbage collection.

        ``retain``: "this conversation continues" (or, at a low priority, "it does not"): every
        page of the request's published full blocks keeps ``retain.priority`` for
        ``retain.duration_s`` seconds from its release (a request reusing the page pauses the
        duration, its release starts it again); a hint above a page's priority ends when a later
        request reuses the history to its end, one below when any request reuses the page (below a
        page's priority: only the blocks this request published itself; ``retain.start``: from
        that token on, ``retain.end``: before that token). A sequence of hints over ascending,
        non-overlapping token ranges gives each range its own (e.g. keep the conversation, drop
        its reasoning tokens: ``[Retention(90, 60.0, end=s), Retention(0, start=s)]``)."""
        hints = check_hints("retain", retain) if retain is not None else None  # (None: nothing more per close)
        if self._status is KVCacheStatus.CLOSED:
            return
        ctx = self._ctx
        ctx.enter("close()")
        try:
            self._close(hints)
        finally:
            ctx.leave()

    def _close(self, retain: Sequence[Retention] | None) -> None:
        close_pages(self, retain)
        if self._stream_counted:  # the next copy of its pages still waits for its kernels
            self._stream_counted = False
            self._ctx.storage.copier.streams.release(self._cuda_stream)
        self._ctx.storage.flush_write_through()  # its published blocks go to the remote writer now
        ref = self._rawref
        if ref is not None:
            self._ctx.cache_closed(ref)
            ref.invalidate()
            self._rawref = None

    def __del__(self) -> None:
        if self._status is not KVCacheStatus.CLOSED:
            ctx = self._ctx
            if ctx.busy:  # collected in the middle of a call: close when it ends
                ctx.deferred_closes.append(self)
            else:
                self.close()

    # ------------------------------------------------------------------ allocation
    def resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Set capacity (and raise history); allocate/release pages. All or nothing.

        Returns False, changing nothing, when GPU memory is short. Misuse raises.
        """
        if history_length is None and type(capacity) is int and self._status is KVCacheStatus.ACTIVE:
            # the decode step's common case, checked in one pass: a capacity within the blocks held
            cap: int = capacity  # (unboxed once)
            end = self._num_blocks * self._tokens_per_block
            if (
                self._history <= cap <= MAX_CAPACITY
                and end - self._tokens_per_block < cap <= end
                and not self._cow
                and (not self._ctx.has_releasing_groups or not self._window_moves(cap, self._history))
            ):
                self._capacity = cap
                return True
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(f"resize() needs an ACTIVE cache; this one is {self._status.name} (call resume() first)")
        # refuse bools while they are still objects (compiled, an int local would make them 0 / 1)
        if type(capacity) is bool:
            check_int("capacity", capacity)
        if type(history_length) is bool:
            check_int("history_length", history_length)
        new_capacity = self._capacity if capacity is None else capacity
        new_history = self._history if history_length is None else history_length
        if (
            type(new_capacity) is not int
            or type(new_history) is not int
            or new_capacity < 0
            or new_history < 0
            or new_capacity > MAX_CAPACITY
        ):
            check_int("capacity", new_capacity)  # raises with the reason
            check_int("history_length", new_history)
            if new_capacity > MAX_CAPACITY:
                raise ValueError(
                    f"capacity must be at most {MAX_CAPACITY} tokens (int32 positions), got {new_capacity}"
                )
        if new_history < self._history:
            raise LogicError(f"history_length never shrinks: {self._history} -> {new_history}")
        if new_capacity < new_history:
            raise LogicError(f"capacity {new_capacity} is below history_length {new_history}")
        tokens_per_block = self._tokens_per_block
        num_blocks = (new_capacity + tokens_per_block - 1) // tokens_per_block
        if (
            num_blocks == self._num_blocks
            and (not self._ctx.has_releasing_groups or not self._window_moves(new_capacity, new_history))
            and not self._cow
        ):
            self._capacity = new_capacity
            self._history = new_history
            return True
        ctx = self._ctx
        ctx.enter("resize()")
        try:
            return self._resize(new_capacity, new_history, num_blocks)
        finally:
            ctx.leave()

    def _resize(self, new_capacity: int, new_history: int, num_blocks: int) -> bool:
        """resize() past its checks and its no-op case (the caller entered the context)."""
        if (
            num_blocks == self._num_blocks + 1
            and len(self._tables) == 1
            and not self._cow
            and not self._scratch_enabled
            and (not self._ctx.has_releasing_groups or not self._window_moves(new_capacity, new_history))
        ):
            return self._grow_one_block(new_capacity, new_history)
        return resize_blocks(self, new_capacity, new_history, num_blocks)

    def _grow_one_block(self, new_capacity: int, new_history: int) -> bool:
        """The decode step's growth, which ``resize_blocks`` would plan the long way: one more
        block with a new page in every layer group, nothing released (one table, no scratch, no
        copy-on-write, no window movement; a block at the end is never out of window)."""
        ctx = self._ctx
        storage = ctx.storage
        table = self._table
        ordinal = self._num_blocks
        table.check_user_buf_room(ordinal + 1)
        need = ctx.pages_per_block
        if not storage.fits(need, ctx.no_gain):
            return False
        callback = self._priority_cb
        groups = ctx.block_layer_groups
        if callback is default_priority:
            priorities = ctx.default_priorities
        else:
            priorities = [checked_priority(callback(BlockOrdinal(ordinal), layer_group)) for layer_group in groups]
        storage.reserve(need)
        all_pages = table.pages.items
        for layer_group, priority in zip(groups, priorities):
            prev = all_pages[layer_group][ordinal - 1] if ordinal else None
            table.append(layer_group, storage.new_page(layer_group, priority, True, prev))
        for layer_group in ctx.state_layer_groups:  # live-state groups: the block has no page there
            table.extend(layer_group, ordinal + 1, [], [])
        if ctx.enable_stats:
            ctx.stats.allocated_pages += len(groups)
        self._capacity = new_capacity
        self._history = new_history
        self._num_blocks = ordinal + 1
        return True

    def _window_moves(self, new_capacity: int, new_history: int) -> bool:
        """Whether some layer group has blocks to release at history ``new_history``, or a different
        scratch range for the step ``new_history -> new_capacity``.

        Without scratch, the answer stays False until history reaches ``_window_next`` (kept
        from the last call), so a decode step usually costs one comparison."""
        if new_history < self._window_next:
            return False
        ctx = self._ctx
        table = self._table
        scratch = self._scratch_enabled
        next_move = MAX_CAPACITY + 1
        for layer_group in ctx.releasing_layer_groups:
            policy = ctx.layer_groups.items[layer_group]
            done = table.stale_end.items[layer_group]
            if policy.stale_end(new_history) > done:
                return True
            if (
                scratch
                and policy.scratch_range(new_capacity, new_history, ctx.max_rewind_len)
                != table.scratch.items[layer_group]
            ):
                return True
            next_move = min(next_move, policy.history_releasing_after(done))
        if not scratch:
            self._window_next = next_move
        return False

    # ------------------------------------------------------------------ tokens
    def commit(
        self,
        accepted_input_tokens: Sequence[TokenIdExt] | Sequence[Sequence[TokenIdExt]],
        beam_search_indices: Sequence[int] | None = None,
    ) -> None:
        """Append tokens whose KV has been computed; history rises to at least the committed length.

        Beam search (``beam_width > 1``): without ``beam_search_indices`` every beam commits the
        same tokens (the prompt; allowed until beams fork). With them, ``accepted_input_tokens[b]``
        are beam ``b``'s tokens (the same count for every beam) and ``beam_search_indices[b]`` the
        beam it continues: its history is that beam's, and so are its pages (full blocks shared,
        the partial last block copied on the next ``resize``). The first such commit forks the
        beams; commit the last prompt chunk that way (``[chunk] * B``, indices ``[0] * B``) so every
        beam has its own tail before the first generation step writes it.
        """
        if beam_search_indices is None and type(accepted_input_tokens) is list and len(accepted_input_tokens) == 1:
            token = cast("list[object]", accepted_input_tokens)[0]  # the decode step (engines pass a list)
        else:
            check_token_sequence(accepted_input_tokens, "accepted_input_tokens")
            if beam_search_indices is not None:
                self._check_committing()
                commit_beams(self, cast(Sequence[Sequence[TokenIdExt]], accepted_input_tokens), beam_search_indices)
                return
            if len(accepted_input_tokens) != 1:
                tokens = cast(Sequence[TokenIdExt], accepted_input_tokens)
                self._check_commit()
                validate_tokens(tokens, "accepted_input_tokens")
                self._check_room(len(tokens))
                ctx = self._ctx
                ctx.enter("commit()")
                try:
                    commit_tokens(self, tokens)
                finally:
                    ctx.leave()
                return
            token = cast(Sequence[object], accepted_input_tokens)[0]
        # one token (read as an object: compiled code would type-check it first); each check below
        # that fails calls the function that raises, in the order of the full checks
        if self._status is not KVCacheStatus.ACTIVE or not self._committing or self._forked:
            self._check_commit()
        if type(token) is not int or token < 0 or token > MAX_TOKEN_ID:
            check_token(token, "accepted_input_tokens")
        if len(self._committed_blocks) * self._tokens_per_block + len(self._tail) >= self._capacity:
            self._check_room(1)
        ctx = self._ctx
        if ctx.busy:
            ctx.check_idle("commit()")  # before the token goes in: all or nothing
        if not self._commit_token(cast(TokenIdExt, token)):
            try:
                ctx.enter("commit()")
            except LogicError:
                # another thread entered since check_idle: take the token out again (only
                # the tail changed: _commit_token returns False before touching history)
                self._tail.pop()
                raise
            try:
                commit_tokens(self)
            finally:
                ctx.leave()

    def _commit_token(self, token: TokenIdExt) -> bool:
        """Append one checked token: the decode step. False when it completed a block or moved
        a sliding window: then ``commit_tokens`` must follow (in the entered context)."""
        tail = self._tail
        tail.append(token)
        tokens_per_block = self._tokens_per_block
        committed = len(self._committed_blocks) * tokens_per_block + len(tail)
        if len(tail) == tokens_per_block:
            return False
        if committed > self._history:
            if (
                committed >= self._window_next
                and self._ctx.has_releasing_groups
                and self._window_moves(committed, committed)
            ):
                return False
            self._history = committed
        return True

    def stop_committing(self, final_beam: object = None) -> None:
        """No more commits for this request (its further output must not be reused); publishes
        what was committed, the partial last block included. With beams, that is the sequence of
        ``final_beam`` (a ``BeamIndex``; default: the one ``close`` would publish, beam 0)."""
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError("stop_committing() on a CLOSED cache")
        final = self._check_beam(final_beam) if final_beam is not None else None
        ctx = self._ctx
        ctx.enter("stop_committing()")
        try:
            if self._status is KVCacheStatus.SUSPENDED and ctx.storage.any_lost():
                drop_lost_blocks(self, False, -1)
            if final is not None:
                self._final_beam = final
            publish_final(self)
            self._committing = False
            self._extend_from(None)
        finally:
            ctx.leave()

    def plan_snapshot(self, position: object) -> None:
        """Hybrid models: also keep the recurrent state at the last full block at or before
        ``position`` tokens as a snapshot when a commit ends history exactly there, e.g. the end of
        prompt + output that a conversation's next turn starts with (the adapter does this for an
        ``EngineRequest`` with ``output_is_history``). Ignored under ``ssm_snapshot_policy=
        "interval"``, without recurrent layers, and for a block history has already reached."""
        end = check_int("position", position)
        end -= end % self._tokens_per_block
        if self._ctx.plans_branches and self._ctx.state_layer_groups and end > self._history:
            add_snapshot_position(self, end)

    def next_snapshot_position(self, position: object) -> int | None:
        """The least position after ``position`` where the manager keeps a snapshot of the
        recurrent state (per ``ssm_snapshot_policy``: multiples of the snapshot interval, the
        prompt's last full block, where the prompt leaves a cached path, ...; ``MAX_CAPACITY + 1``
        when none is ahead); None without recurrent layers. A commit that ends history exactly
        there takes the snapshot: cut prefill chunks at these positions."""
        after = check_int("position", position)
        if not self._ctx.state_layer_groups:
            return None
        return next_snapshot_position(self, after)
