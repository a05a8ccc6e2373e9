"""The wire schema of KV-cache event batches: msgpack via msgspec, in vLLM's ``kv_events`` layout.

Every struct is *array-like*: encoded as a msgpack array of its fields in declaration order; an
event's first element is its tag (the class name). Field names and order follow vLLM
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``EventBatch(ts, events,
data_parallel_rank)``); fields marked *extension* come after vLLM's and are ignored by decoders
that declare fewer fields (msgspec's default). ``BlockMoved`` is an extension event, sent only by a
publisher built with ``moves="native"``; by default a move is sent as ``BlockRemoved`` (old medium)
followed by ``BlockStored`` (new medium), which every vLLM-compatible consumer understands.

Hashes are unsigned 64-bit ints (:func:`kv_cache_manager_v2.block_hash`). Tokens: ``token_ids``
holds one int per token; a ``bytes`` digest token (multimodal item, p-tuning extra id) appears as
a stand-in id (:func:`digest_stand_in`) and, exactly, in ``extra_keys``: one entry per block,
None for a block of plain ids, else a list of ``[offset_in_block, digest]`` pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import msgspec

from .._common import TokenId, TokenIdExt
from .._events import (
    AllBlocksClearedEvent,
    BlockMovedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    KVCacheEvent,
)

MovesAs = Literal["vllm", "native"]


class WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events on the wire (tagged by class name)."""


class BlockStored(WireEvent):
    """A run of consecutive blocks (each the parent of the next) gained pages of one layer group."""

    block_hashes: list[int]
    #: None for the first block of a sequence (its parent is the reuse scope's root)
    parent_block_hash: int | None
    #: every token of the run (a partial tail, if any, is the last block and shorter than block_size)
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    #: "GPU", "CPU" (host) or "DISK"
    medium: str | None
    lora_name: str | None = None
    #: per block: None (plain ids) or [[offset, digest bytes], ...] for its digest tokens
    extra_keys: list[list[tuple[int, bytes]] | None] | None = None
    #: layer group id
    group_idx: int | None = None
    #: "full_attention" or "sliding_window"
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: extension: eviction priority of the pages (0..100, lower goes first)
    priority: int | None = None
    #: extension: 64-bit hash of the reuse scope's root key (first blocks only; tells salts apart)
    scope_hash: int | None = None
    #: extension: sink blocks of a sliding-window group (needed with the window to match exactly)
    num_sink_blocks: int | None = None
    #: extension: the session of the request that published the blocks (None: none or not known)
    session_id: str | None = None


class BlockRemoved(WireEvent):
    """Blocks lost their pages of one layer group on ``medium``."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    #: extension: the session that published the blocks (None: none or not known)
    session_id: str | None = None


class AllBlocksCleared(WireEvent):
    """Every block of the replica was dropped."""


class BlockMoved(WireEvent):
    """Extension: blocks' pages of one layer group moved from ``source_medium`` to ``medium``."""

    block_hashes: list[int]
    source_medium: str | None
    medium: str | None
    group_idx: int | None = None


AnyWireEvent = BlockStored | BlockRemoved | AllBlocksCleared | BlockMoved


class LoadReport(msgspec.Struct, array_like=True, gc=False):
    """Extension: a replica's load when it published the batch (what routers weigh against cache)."""

    queued_prefill_tokens: int
    running_requests: int
    kv_utilization: float


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish: ``ts`` (seconds since the epoch), the events in order, the data-parallel rank."""

    ts: float
    events: list[AnyWireEvent]
    data_parallel_rank: int | None = None
    #: extension: random id of the publisher instance (a restarted replica's sequence numbers start again at 0)
    instance_id: int | None = None
    #: extension: the events were withheld from the PUB socket (its byte bound was reached): ``events`` is
    #: empty and the batch is in the replay buffer under the same sequence number
    withheld: bool = False
    #: extension: the replica's load (a batch may carry only this: no events)
    load: LoadReport | None = None


class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """A :class:`KVEventBatch` whose events stay encoded until :func:`decode_event` (a router decodes
    and applies a large batch in slices, and refuses a bad event alone)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
    instance_id: int | None = None
    withheld: bool = False
    load: LoadReport | None = None


def digest_stand_in(digest: bytes) -> int:
    """The token id a digest token shows in ``token_ids``: the first 4 bytes of SHA-256(digest),
    big-endian (different digests look different to consumers that hash token ids themselves)."""
    return int.from_bytes(hashlib.sha256(digest).digest()[:4], "big")


def _token_ids(tokens: Sequence[int | bytes]) -> tuple[list[int], list[tuple[int, bytes]] | None]:
    ids: list[int] = []
    extra: list[tuple[int, bytes]] | None = None
    for i, tok in enumerate(tokens):
        if isinstance(tok, bytes):
            ids.append(digest_stand_in(tok))
            if extra is None:
                extra = []
            extra.append((i, tok))
        else:
            ids.append(tok)
    return ids, extra


def _stored(ev: BlockStoredEvent) -> BlockStored:
    ids, extra = _token_ids(ev.tokens)
    g = ev.group
    return BlockStored(
        block_hashes=[ev.block_hash],
        parent_block_hash=ev.parent_block_hash,
        token_ids=ids,
        block_size=ev.block_size,
        lora_id=ev.lora_id,
        medium=ev.medium,
        extra_keys=[extra],
        group_idx=g.group_idx,
        kv_cache_spec_kind=g.kind,
        kv_cache_spec_sliding_window=g.window_size,
        priority=ev.priority,
        scope_hash=ev.scope_hash if ev.parent_is_root else None,
        num_sink_blocks=g.num_sink_blocks if g.window_size is not None else None,
        session_id=ev.session,
    )


def _extends(run: BlockStored, nxt: BlockStored) -> bool:
    """Whether ``nxt`` (one block) continues ``run``: same group, medium, scope, priority and session, child of
    its last block."""
    return (
        nxt.parent_block_hash is not None
        and nxt.parent_block_hash == run.block_hashes[-1]
        and len(run.token_ids) == len(run.block_hashes) * run.block_size  # no partial tail in the run
        and nxt.group_idx == run.group_idx
        and nxt.medium == run.medium
        and nxt.lora_id == run.lora_id
        and nxt.priority == run.priority
        and nxt.session_id == run.session_id
    )


def to_wire(events: Sequence[KVCacheEvent], moves: MovesAs = "vllm") -> list[AnyWireEvent]:
    """Wire events for drained manager events, in order.

    Consecutive stores of a chain of blocks in one layer group become one ``BlockStored`` (stores of
    other groups may sit between them; any other event ends every run), consecutive removals of
    one group, medium and session one ``BlockRemoved``. A block's session (``session_id``, where
    known) travels in an extension field, the last one.
    """
    if moves not in ("vllm", "native"):
        raise ValueError(f"moves must be 'vllm' or 'native', got {moves!r}")
    out: list[AnyWireEvent] = []
    runs: dict[int | None, BlockStored] = {}  # open store run per layer group
    for ev in events:
        if isinstance(ev, BlockMovedEvent):
            runs.clear()
            if moves == "native":
                out.append(BlockMoved([ev.block_hash], ev.source_medium, ev.medium, ev.group_idx))
            else:
                out.append(BlockRemoved([ev.block_hash], ev.source_medium, ev.group_idx, ev.session))
                out.append(_stored(ev))
        elif isinstance(ev, BlockStoredEvent):
            w = _stored(ev)
            run = runs.get(w.group_idx)
            if run is not None and _extends(run, w):
                run.block_hashes.append(w.block_hashes[0])
                run.token_ids.extend(w.token_ids)
                assert run.extra_keys is not None and w.extra_keys is not None
                run.extra_keys.append(w.extra_keys[0])
            else:
                runs[w.group_idx] = w
                out.append(w)
        elif isinstance(ev, BlockRemovedEvent):
            runs.clear()
            last = out[-1] if out else None
            if (
                isinstance(last, BlockRemoved)
                and last.group_idx == ev.group_idx
                and last.medium == ev.medium
                and last.session_id == ev.session
            ):
                last.block_hashes.append(ev.block_hash)
            else:
                out.append(BlockRemoved([ev.block_hash], ev.medium, ev.group_idx, ev.session))
        elif isinstance(ev, AllBlocksClearedEvent):
            runs.clear()
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"events must be KV-cache events from get_latest_events(), got {type(ev).__name__}")
    for x in out:  # a run of plain-id blocks carries no extra keys at all
        if isinstance(x, BlockStored) and x.extra_keys is not None and all(k is None for k in x.extra_keys):
            x.extra_keys = None
    return out


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_RAW_DECODER = msgspec.msgpack.Decoder(RawEventBatch)
_EVENT_DECODER: msgspec.msgpack.Decoder[AnyWireEvent] = msgspec.msgpack.Decoder(AnyWireEvent)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one batch (raises ``msgspec.DecodeError`` / ``ValidationError`` on a malformed payload)."""
    return _DECODER.decode(payload)


def decode_raw_batch(payload: bytes) -> RawEventBatch:
    """Decode one batch, its events left encoded (raises like :func:`decode_batch`)."""
    return _RAW_DECODER.decode(payload)


def decode_event(raw: msgspec.Raw) -> AnyWireEvent:
    """Decode one event of a :class:`RawEventBatch` (raises like :func:`decode_batch`)."""
    return _EVENT_DECODER.decode(raw)


def block_tokens(ev: BlockStored) -> list[tuple[TokenIdExt, ...]]:
    """The tokens of each block of a ``BlockStored``, digests restored from ``extra_keys``
    (``ValueError`` for a digest offset outside its block)."""
    t = ev.block_size
    n = len(ev.block_hashes)
    out: list[tuple[TokenIdExt, ...]] = []
    for i in range(n):
        toks: list[TokenIdExt] = [TokenId(x) for x in ev.token_ids[i * t : (i + 1) * t]]
        extra = ev.extra_keys[i] if ev.extra_keys is not None and i < len(ev.extra_keys) else None
        if extra:
            for off, digest in extra:
                if not 0 <= off < len(toks):
                    raise ValueError(f"extra_keys offset {off} of block {i} is outside its {len(toks)} token(s)")
                toks[off] = bytes(digest)
        out.append(tuple(toks))
    return out
