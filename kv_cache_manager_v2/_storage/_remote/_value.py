"""The remote tier's values, the same on every backend: a 96-byte header (magic, format version, layer
group, layout fingerprint, block key, payload length, CRC-32 of the payload, the block's retention:
``ExpiryQueue.carried``) then the page's bytes. A value that is missing, truncated, foreign or
corrupted is a miss, never bad KV; retention that is no retention of ours is none."""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Final

from ..._common import DEFAULT_PRIORITY, MAX_PRIORITY, Priority
from ..._config import AttentionLayerConfig, KVCacheManagerConfig

MAGIC: Final = b"KVC2"
#: bump when the value layout, the key layout or the slot layout (coalescing order) changes
FORMAT_VERSION: Final = 2
#: magic, version, layer group, layout fingerprint, block key, payload length, CRC-32, the retention
#: (base priority, priority, reserved, wall-clock expiry, duration, hint end), then reserved bytes
HEADER: Final = struct.Struct("<4sHH8s32sQIBBHddq")
HEADER_BYTES: Final = 96
#: a block's retention (``ExpiryQueue.carried``): base priority, priority, wall-clock expiry, duration, hint end
Carried = tuple[int, int, float, float, int]


def layout_fingerprint(config: KVCacheManagerConfig, dtype: str) -> bytes:
    """8 bytes naming everything that decides what a page's bytes mean: format version, tokens per
    block, ``dtype``, and every layer (id, window, sinks) with its buffers (role, size, override)."""
    parts = [f"kvcm-layout/{FORMAT_VERSION}/T={config.tokens_per_block}/dtype={dtype}"]
    for layer in config.layers:
        if isinstance(layer, AttentionLayerConfig):
            parts.append(f"L{layer.layer_id}/w={layer.sliding_window_size}/s={layer.num_sink_tokens}")
        else:
            parts.append(f"L{layer.layer_id}/recurrent")
        for b in layer.buffers:
            parts.append(f"B{b.role!r}/{b.size}/{b.tokens_per_block_override}")
    return hashlib.sha256("\n".join(parts).encode()).digest()[:8]


def encode_header(
    parts: list[memoryview], layer_group: int, fingerprint: bytes, block_key: bytes, retention: Carried
) -> bytes:
    """The header of a value whose payload is ``parts`` (concatenated), with its block's ``retention``."""
    crc = 0
    n = 0
    for part in parts:
        crc = zlib.crc32(part, crc)  # (releases the GIL for parts above 5 KiB)
        n += len(part)
    r = retention
    head = HEADER.pack(
        MAGIC, FORMAT_VERSION, layer_group, fingerprint, block_key, n, crc, r[0], r[1], 0, r[2], r[3], r[4]
    )
    return head + bytes(HEADER_BYTES - HEADER.size)


def value_retention(value: bytes | memoryview) -> Carried:
    """The retention in the header of ``value`` (a value ``decode_value`` accepted)."""
    fields = HEADER.unpack_from(value)
    return fields[7], fields[8], fields[10], fields[11], fields[12]


def carried_priority(retention: Carried) -> Priority:
    """The base priority ``retention`` kept, or the default one where it is out of range."""
    base = retention[0]
    return Priority(base) if 0 <= base <= MAX_PRIORITY else DEFAULT_PRIORITY


def decode_value(
    value: bytes | memoryview, layer_group: int, fingerprint: bytes, block_key: bytes, size: int
) -> memoryview | None:
    """The payload of ``value`` if it is a complete, intact page of ``size`` bytes for exactly this
    layer group, layout and block; None otherwise."""
    if len(value) != HEADER_BYTES + size:
        return None
    payload = memoryview(value)[HEADER_BYTES:]
    return payload if verify_parts(value, [payload], layer_group, fingerprint, block_key, size) else None


def verify_parts(
    header: bytes | memoryview,
    parts: list[memoryview],
    layer_group: int,
    fingerprint: bytes,
    block_key: bytes,
    size: int,
) -> bool:
    """Whether ``header`` and the payload read in ``parts`` (in order) are a complete, intact page of
    ``size`` bytes for exactly this layer group, layout and block."""
    fields = HEADER.unpack_from(header)
    if (
        fields[0] != MAGIC
        or fields[1] != FORMAT_VERSION
        or fields[2] != layer_group
        or fields[3] != fingerprint
        or fields[4] != block_key
        or fields[5] != size
    ):
        return False
    crc = 0
    n = 0
    for part in parts:
        crc = zlib.crc32(part, crc)  # (releases the GIL for parts above 5 KiB)
        n += len(part)
    return n == size and crc == fields[6]


def forget_frames(e: BaseException) -> None:
    """Drop the tracebacks of ``e`` and the exceptions it chains: their frames hold memory views of
    slots, which would keep the pools' memory exported (so it could not be released)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__context__ or x.__cause__
