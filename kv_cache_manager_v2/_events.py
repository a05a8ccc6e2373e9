"""KV-cache events (docs/design.md, "KV-cache events"): what enters and leaves the reuse tree, queued for the engine.

The reuse tree reports every page it gains, loses or sees moved between tiers (one event per block
and layer group) in plain values (keys, tokens, layer group, cache level): this module knows
neither the tree nor pages, it turns those values into small event objects in a bounded queue
that the engine drains each step (``KVCacheEventManager.get_latest_events``). Events keep
references to the tree's keys: hashes are computed when a consumer asks.

Wire format, publisher and router index: ``kv_cache_manager_v2.events`` (optional extra).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol

from ._common import CacheTier, Priority, SessionId, TokenIdExt
from ._utils import check_int, check_type

#: The ``medium`` string of each tier (vLLM's names for GPU and CPU).
#: The remote tier reports no events (it is shared by every replica, not a replica's cache): pages
#: fetched from it enter the local tree and are reported at the local medium they land in.
MEDIUM_OF_TIER: Final = {
    CacheTier.GPU_MEM: "GPU",
    CacheTier.HOST_MEM: "CPU",
    CacheTier.DISK: "DISK",
    CacheTier.REMOTE: "REMOTE",
}


def block_hash(key: bytes) -> int:
    """The stable 64-bit block hash routers see: the last 8 bytes of the SHA-256 reuse key, read
    big-endian as an unsigned int. Equal prefixes in equal scopes give equal hashes on every replica."""
    return int.from_bytes(key[-8:], "big")


#: ``source_level`` of a block that did not move (``KVCacheEventManager.block_stored``)
NOT_MOVED: Final = -1


class LayerGroupSpec:
    """The shape of one layer group, as events describe it: its layer kind (the policy's name,
    vLLM's ``kv_cache_spec_kind``), window and sink blocks."""

    __slots__ = ("group_idx", "kind", "num_sink_blocks", "window_size")

    def __init__(self, group_idx: int, window_size: int | None, num_sink_blocks: int, kind: str = "") -> None:
        self.group_idx = group_idx
        #: sliding window in tokens; None for full attention
        self.window_size = window_size
        self.num_sink_blocks = num_sink_blocks
        #: ``"full_attention"``, ``"sliding_window"``, ... (default: told by the window)
        self.kind = kind or ("full_attention" if window_size is None else "sliding_window")

    def __repr__(self) -> str:
        return (
            f"LayerGroupSpec(group_idx={self.group_idx}, window_size={self.window_size}, "
            f"num_sink_blocks={self.num_sink_blocks}, kind={self.kind!r})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, LayerGroupSpec)
            and self.group_idx == other.group_idx
            and self.window_size == other.window_size
            and self.num_sink_blocks == other.num_sink_blocks
            and self.kind == other.kind
        )

    def __hash__(self) -> int:
        return hash((self.group_idx, self.window_size, self.num_sink_blocks, self.kind))


class KVCacheEvent:
    """Base of the events :class:`KVCacheEventManager` queues."""

    __slots__ = ()


class BlockStoredEvent(KVCacheEvent):
    """A block gained a page of one layer group: it is reusable there (subject to the match rule).

    ``tokens`` holds ids and ``bytes`` digests exactly as committed; a partial tail has fewer than
    ``block_size`` tokens. ``parent_key`` is the scope root's key for the first block of a sequence
    (``parent_is_root``). ``session``: the session of the request that published the block (None:
    none, or not known, e.g. a block adopted from a persistent disk or fetched from the remote tier).
    """

    __slots__ = (
        "block_size",
        "group",
        "key",
        "lora_id",
        "medium",
        "parent_is_root",
        "parent_key",
        "priority",
        "session",
        "tokens",
    )

    def __init__(
        self,
        key: bytes,
        parent_key: bytes,
        parent_is_root: bool,
        tokens: tuple[TokenIdExt, ...],
        block_size: int,
        lora_id: int | None,
        group: LayerGroupSpec,
        priority: Priority,
        medium: str,
        session: SessionId | None = None,
    ) -> None:
        self.key = key
        self.parent_key = parent_key
        self.parent_is_root = parent_is_root
        self.tokens = tokens
        self.block_size = block_size
        self.lora_id = lora_id
        self.group = group
        self.priority = priority
        self.medium = medium
        self.session = session

    @property
    def block_hash(self) -> int:
        """The block's 64-bit hash (see :func:`block_hash`)."""
        return block_hash(self.key)

    @property
    def parent_block_hash(self) -> int | None:
        """None for the first block of a sequence (vLLM's convention); see ``scope_hash``."""
        return None if self.parent_is_root else block_hash(self.parent_key)

    @property
    def scope_hash(self) -> int:
        """Hash of the reuse scope's root key (only meaningful for a first block, where it is the parent)."""
        return block_hash(self.parent_key)

    @property
    def group_idx(self) -> int:
        """The layer group's index (as in ``LayerGroupSpec.group_idx``)."""
        return self.group.group_idx

    @property
    def is_partial(self) -> bool:
        """Whether the block holds fewer tokens than a full block (a request's last one)."""
        return len(self.tokens) < self.block_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_hash={self.block_hash:#x}, parent_block_hash={self.parent_block_hash}, "
            f"tokens={len(self.tokens)}, group_idx={self.group_idx}, medium={self.medium!r}, priority={self.priority})"
        )


class BlockMovedEvent(BlockStoredEvent):
    """A block's page of one layer group moved between tiers (``source_medium`` -> ``medium``).
    Made by the event manager: a stored event's fields, then ``source_medium``.

    Deeper because: a move is a store at the new medium (plus where it came from), so it is a
    ``BlockStoredEvent``: the vLLM wire form sends it as a removal and a store."""

    __slots__ = ("source_medium",)

    #: the medium the page left
    source_medium: str


class BlockRemovedEvent(KVCacheEvent):
    """A block lost its page of one layer group (evicted, or its subtree was removed); ``session``:
    the session that published it (None: none, or not known)."""

    __slots__ = ("group", "key", "medium", "session")

    def __init__(self, key: bytes, group: LayerGroupSpec, medium: str, session: SessionId | None = None) -> None:
        self.key = key
        self.group = group
        self.medium = medium
        self.session = session

    @property
    def block_hash(self) -> int:
        """The block's 64-bit hash (see :func:`block_hash`)."""
        return block_hash(self.key)

    @property
    def group_idx(self) -> int:
        """The layer group's index (as in ``LayerGroupSpec.group_idx``)."""
        return self.group.group_idx

    def __repr__(self) -> str:
        return f"BlockRemovedEvent(block_hash={self.block_hash:#x}, group_idx={self.group_idx}, medium={self.medium!r})"


class AllBlocksClearedEvent(KVCacheEvent):
    """Every reusable block was dropped (``clear_reusable_blocks``, ``shutdown``, or a resync)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "AllBlocksClearedEvent()"


class BlockSource(Protocol):
    """What the event manager reads for a resynchronisation (the reuse tree)."""

    def stored_block_events(self, events: KVCacheEventManager) -> list[BlockStoredEvent]:
        """A ``BlockStoredEvent`` (``events.stored_event``) per page, parents first."""
        ...


class KVCacheEventManager:
    """Bounded queue of KV-cache events, filled by one :class:`KVCacheManager` and drained by the engine.

    Pass it as ``KVCacheManager(config, event_manager=...)``; call :meth:`get_latest_events` once per
    step (or hand the result to ``kv_cache_manager_v2.events.ZmqEventPublisher``). Nothing blocks: when
    ``max_events`` are pending, the oldest is dropped and counted (``num_dropped``). A subscriber that
    missed events would keep a wrong view for good, so after an overflow (``resync_on_overflow``) the
    next drain returns a resynchronisation instead of the surviving events: an
    :class:`AllBlocksClearedEvent`, then one :class:`BlockStoredEvent` per page in the reuse tree.
    A manager without an event manager pays one ``is not None`` test where blocks enter or leave the tree.
    """

    def __init__(self, max_events: object = 100_000, resync_on_overflow: bool = True) -> None:
        self._max = check_int("max_events", max_events, 1)  # (an object: compiled, a bool would be an int)
        check_type("resync_on_overflow", resync_on_overflow, bool)
        self._resync_on_overflow = resync_on_overflow
        self._queue: deque[KVCacheEvent] = deque()
        #: events dropped because the queue was full (cumulative)
        self.num_dropped = 0
        self._overflowed = False
        self._source: BlockSource | None = None
        self._groups: list[LayerGroupSpec] = []
        self._media: list[str] = []
        self._tokens_per_block = 0

    def __repr__(self) -> str:
        return (
            f"KVCacheEventManager(pending={len(self._queue)}, max_events={self._max}, dropped={self.num_dropped}, "
            f"attached={self._source is not None})"
        )

    # ------------------------------------------------------------------ engine side
    @property
    def is_attached(self) -> bool:
        """Whether a :class:`KVCacheManager` records into this queue (one manager per queue)."""
        return self._source is not None

    @property
    def max_events(self) -> int:
        """How many events the queue holds before it drops the oldest."""
        return self._max

    @property
    def num_pending(self) -> int:
        """Events recorded and not yet taken."""
        return len(self._queue)

    @property
    def layer_groups(self) -> list[LayerGroupSpec]:
        """One spec per layer group of the attached manager (empty before it is attached)."""
        return list(self._groups)

    @property
    def tokens_per_block(self) -> int:
        """Block size of the attached manager (0 before it is attached)."""
        return self._tokens_per_block

    def get_latest_events(self) -> list[KVCacheEvent]:
        """Every event queued since the last call, oldest first (a resync after an overflow)."""
        if self._overflowed and self._resync_on_overflow:
            self._overflowed = False
            self._queue.clear()
            return self.snapshot()
        self._overflowed = False
        out = list(self._queue)
        self._queue.clear()
        return out

    def snapshot(self) -> list[KVCacheEvent]:
        """The reuse tree as events: AllBlocksCleared, then every page's BlockStored, parents first.

        A subscriber that applies it ends with the same view as one that saw every event so far.
        The pending queue is left alone.
        """
        out: list[KVCacheEvent] = [AllBlocksClearedEvent()]
        source = self._source
        if source is not None:
            out.extend(source.stored_block_events(self))
        return out

    # ------------------------------------------------------------------ manager side
    def _attach(
        self, source: BlockSource, tokens_per_block: int, groups: list[LayerGroupSpec], media: list[str]
    ) -> None:
        if self._source is not None:
            raise ValueError("event_manager is already attached to a KVCacheManager; use one per manager")
        self._source = source
        self._tokens_per_block = tokens_per_block
        self._groups = groups
        self._media = media

    def _push(self, event: KVCacheEvent) -> None:
        q = self._queue
        if len(q) >= self._max:
            q.popleft()
            self.num_dropped += 1
            self._overflowed = True
        q.append(event)

    def stored_event(
        self,
        key: bytes,
        parent_key: bytes,
        parent_is_root: bool,
        tokens: Sequence[TokenIdExt],
        lora_id: int | None,
        layer_group: int,
        priority: Priority,
        level: int,
        source_level: int = NOT_MOVED,
        session: SessionId | None = None,
    ) -> BlockStoredEvent:
        """The event of a block's page of ``layer_group`` now at cache ``level`` (a ``BlockMovedEvent``
        when it came from ``source_level``), published by ``session``."""
        group, medium = self._groups[layer_group], self._media[level]
        block_size, copied = self._tokens_per_block, tuple(tokens)
        if source_level == NOT_MOVED:
            return BlockStoredEvent(
                key, parent_key, parent_is_root, copied, block_size, lora_id, group, priority, medium, session
            )
        moved = BlockMovedEvent(
            key, parent_key, parent_is_root, copied, block_size, lora_id, group, priority, medium, session
        )
        moved.source_medium = self._media[source_level]
        return moved

    def block_stored(self, event: BlockStoredEvent) -> None:
        """Queue ``event`` (made by ``stored_event``): a block gained a page, or its page moved."""
        self._push(event)

    def block_removed(self, key: bytes, layer_group: int, level: int, session: SessionId | None = None) -> None:
        """The block ``key`` (published by ``session``) no longer has a page of ``layer_group`` (it
        was at cache ``level``)."""
        self._push(BlockRemovedEvent(key, self._groups[layer_group], self._media[level], session))

    def all_cleared(self) -> None:
        """Every block left the tree at once."""
        self._queue.clear()  # nothing before it matters to a subscriber any more
        self._overflowed = False
        self._push(AllBlocksClearedEvent())
