"""One replica's cache as a router sees it: a radix tree of block hashes rebuilt from its events.

:class:`ReplicaIndex` applies a replica's wire events and answers ``match_length(tokens, scope)``
with the same rule as the replica's ``probe_reuse``: walk full blocks by hash, pick a partially
matching child by longest common token prefix among those holding a page of every attention layer
group, then shorten until every layer group holds the pages the match needs (full attention: every
block; sliding window: sinks and the window; recurrent: a snapshot at the last block). An event
with impossible values (a negative or unknown layer group, a window below one token, hashes outside
64 bits, a block size other than the replica's, a digest offset outside its block) is refused whole:
it changes nothing, not even what is learnt of the replica (block size, layer groups).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._common import DEFAULT_REUSE_SCOPE, ReuseScope, TokenIdExt
from .._events import LayerGroupSpec, block_hash
from .._layers._policy import LayerGroup
from .._life_cycle_registry import announced_layer_group
from .._reuse._keys import scope_key
from .._router_index import BlockTree, RNode
from .._router_index import prompt_block_hashes as _hashes
from .schema import AllBlocksCleared, AnyWireEvent, BlockMoved, BlockRemoved, BlockStored, KVEventBatch, block_tokens

#: block hashes are unsigned 64-bit ints
HASH_LIMIT = 1 << 64
#: layer group ids are small ints >= 0 (a replica numbers its groups densely from 0)
GROUP_LIMIT = 1 << 16


def prompt_block_hashes(
    tokens: Sequence[TokenIdExt], tokens_per_block: int, reuse_scope: ReuseScope | None = None
) -> list[int]:
    """The 64-bit hashes a replica reports for the blocks of ``tokens`` (the last may be partial)."""
    scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
    return _hashes(tokens, tokens_per_block, scope_key(scope))


class ReplicaIndex:
    """What one replica caches, rebuilt from its events.

    ``tokens_per_block`` and the layer groups are learnt from ``BlockStored`` events; pass them
    (e.g. ``event_manager.layer_groups``) to match exactly before every group has stored a block,
    and to refuse events for a group the replica does not have (learning, a store for a group that
    does not exist would make every match need it).
    """

    def __init__(
        self,
        tokens_per_block: int | None = None,
        groups: Sequence[LayerGroupSpec] = (),
        enable_partial_reuse: bool = True,
    ) -> None:
        self._given_tokens_per_block = tokens_per_block
        self._given_groups = tuple(groups)
        self.enable_partial_reuse = enable_partial_reuse
        self.tokens_per_block = tokens_per_block
        self.groups: dict[int, LayerGroup] = {}
        self._tree = BlockTree()
        self.reset()
        #: wire events applied so far
        self.num_events = 0

    # ------------------------------------------------------------------ applying events
    def apply_batch(self, batch: KVEventBatch) -> None:
        """:meth:`apply` the events of ``batch``."""
        self.apply(batch.events)

    def apply(self, events: Sequence[AnyWireEvent]) -> None:
        """Apply ``events`` in order; an impossible event raises ``ValueError`` (the events before it
        are applied, it and the ones after are not)."""
        for ev in events:
            self.apply_event(ev)

    def apply_event(self, ev: AnyWireEvent) -> None:
        """Apply one event; ``ValueError`` (and no change) when it holds impossible values."""
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._tree.remove(ev.block_hashes, self._check_target(ev.block_hashes, ev.group_idx))
        elif isinstance(ev, BlockMoved):
            self._tree.move(ev.block_hashes, self._check_target(ev.block_hashes, ev.group_idx), ev.medium)
        elif isinstance(ev, AllBlocksCleared):
            self.clear()
        self.num_events += 1

    def clear(self) -> None:
        """Forget every block (AllBlocksCleared)."""
        self._tree.clear()

    def __del__(self) -> None:
        tree = getattr(self, "_tree", None)
        if tree is not None:
            tree.clear()  # (its nodes are not collected as cycles)

    def reset(self) -> None:
        """Forget every block and what was learnt of the replica (block size, layer groups) beyond
        what the constructor was given: a restarted replica may use other ones."""
        self.clear()
        self.tokens_per_block = self._given_tokens_per_block
        self.groups = {}
        for spec in self._given_groups:
            self._learn_group(spec.group_idx, spec.kind, spec.window_size, spec.num_sink_blocks)

    def _learn_group(self, group: int, kind: str, window: int | None, sinks: int) -> None:
        if group not in self.groups:
            self.groups[group] = announced_layer_group(kind, window, sinks, self.tokens_per_block or 1)

    def _check_target(self, hashes: Sequence[int], group_idx: int | None) -> int:
        """The layer group an event names (None: 0), checked with its block hashes."""
        g = 0 if group_idx is None else group_idx
        if not 0 <= g < GROUP_LIMIT or (self._given_groups and g not in self.groups):
            allowed = sorted(self.groups) if self._given_groups else f"[0, {GROUP_LIMIT})"
            raise ValueError(f"group_idx {g} is not a layer group of the replica (allowed: {allowed})")
        if hashes and not (min(hashes) >= 0 and max(hashes) < HASH_LIMIT):
            raise ValueError(f"block hashes must be unsigned 64-bit ints, got {min(hashes)} .. {max(hashes)}")
        return g

    def _check_stored(
        self, event: BlockStored
    ) -> tuple[int, str, int | None, int, list[tuple[TokenIdExt, ...]] | None]:
        """``(group, kind, window, sinks, block tokens)`` of a ``BlockStored``, every value checked
        (nothing is learnt or changed before every check passed); block tokens only for blocks
        with digest tokens (None: the token ids, block by block)."""
        t = event.block_size
        n = len(event.block_hashes)
        if t < 1 or n == 0 or not (n - 1) * t < len(event.token_ids) <= n * t:
            raise ValueError(
                f"malformed BlockStored: {n} block hash(es), {len(event.token_ids)} token(s), block_size {t}"
            )
        if self.tokens_per_block is not None and t != self.tokens_per_block:
            raise ValueError(f"BlockStored with block_size {t}, the replica's is {self.tokens_per_block}")
        group = self._check_target(event.block_hashes, event.group_idx)
        for name, h in (("parent_block_hash", event.parent_block_hash), ("scope_hash", event.scope_hash)):
            if h is not None and not 0 <= h < HASH_LIMIT:
                raise ValueError(f"{name} must be an unsigned 64-bit int, got {h}")
        kind = event.kv_cache_spec_kind
        window = event.kv_cache_spec_sliding_window if kind == "sliding_window" else None
        sinks = event.num_sink_blocks or 0
        if kind == "sliding_window" and (window is None or window < 1):
            raise ValueError(f"a sliding-window group needs a window of at least 1 token, got {window}")
        if sinks < 0:
            raise ValueError(f"num_sink_blocks must be >= 0, got {sinks}")
        known = self.groups.get(group)
        if known is None:
            announced_layer_group(kind or "full_attention", window, sinks, t)  # an unknown kind raises
        elif kind is not None and (kind, window, sinks) != (known.kind, known.window_size, known.num_sink_blocks):
            raise ValueError(
                f"BlockStored announces group {group} as {kind} (window {window}, {sinks} sink blocks), "
                f"it was {known.kind} (window {known.window_size}, {known.num_sink_blocks} sink blocks)"
            )
        digests = event.extra_keys is not None and any(event.extra_keys)
        return group, kind or "full_attention", window, sinks, block_tokens(event) if digests else None

    def _stored(self, event: BlockStored) -> None:
        group, kind, window, sinks, tokens = self._check_stored(event)
        t = event.block_size
        if self.tokens_per_block is None:
            self.tokens_per_block = t
            self.groups = {
                g: announced_layer_group(lc.kind, lc.window_size, lc.num_sink_blocks, t)
                for g, lc in self.groups.items()
            }
        self._learn_group(group, kind, window, sinks)
        root = (event.scope_hash, event.lora_id)
        self._tree.store(
            root, event.parent_block_hash, event.block_hashes, event.token_ids, tokens, t, group, event.medium
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        """Blocks known (with a page in some group, or linking to such blocks)."""
        return len(self._tree.nodes)

    @property
    def _nodes(self) -> dict[int, RNode]:
        return self._tree.nodes

    def has_block(self, block_hash: int, group_idx: int | None = None) -> bool:
        node = self._tree.nodes.get(block_hash)
        if node is None:
            return False
        return bool(node.groups) if group_idx is None else group_idx in node.groups

    def medium_of(self, block_hash: int, group_idx: int = 0) -> str | None:
        node = self._tree.nodes.get(block_hash)
        return node.groups.get(group_idx) if node is not None else None

    def match_length(
        self,
        tokens: Sequence[TokenIdExt],
        reuse_scope: ReuseScope | None = None,
        hashes: Sequence[int] | None = None,
    ) -> int:
        """Tokens of ``tokens`` the replica would reuse (what its ``probe_reuse`` returns).

        ``hashes`` (from :func:`prompt_block_hashes`) saves hashing when several indexes are asked.
        """
        return self._match(tokens, reuse_scope, hashes)[0]

    def match_media(
        self,
        tokens: Sequence[TokenIdExt],
        reuse_scope: ReuseScope | None = None,
        hashes: Sequence[int] | None = None,
    ) -> dict[str | None, int]:
        """The tokens :meth:`match_length` reports, counted by the medium their block is on (a
        block with pages on several media counts at its lowest: the last in GPU, CPU, DISK,
        REMOTE order; another medium name counts as itself; a block needing no page, outside
        every window, as GPU)."""
        length, last, part = self._match(tokens, reuse_scope, hashes)
        t = self.tokens_per_block
        return {} if t is None else self._tree.media(length, last, part, t)

    def _match(
        self, tokens: Sequence[TokenIdExt], reuse_scope: ReuseScope | None, hashes: Sequence[int] | None
    ) -> tuple[int, RNode | None, RNode | None]:
        """The match's length, its last full block's node and its partial block's node (if any)."""
        t = self.tokens_per_block
        if t is None or len(tokens) == 0:
            return 0, None, None
        scope = reuse_scope if reuse_scope is not None else DEFAULT_REUSE_SCOPE
        key = (block_hash(scope_key(scope)), scope.lora_id)
        if key not in self._tree.roots:
            return 0, None, None
        if hashes is None:
            hashes = prompt_block_hashes(tokens, t, scope)
        h = hashes if type(hashes) is list else list(hashes)
        return self._tree.match(key, tokens, h, t, self.groups, self.enable_partial_reuse)
