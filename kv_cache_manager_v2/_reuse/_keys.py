"""Reuse keys (SPEC 5.3): a SHA-256 chain rooted at the reuse scope; token validation and encoding."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Final, cast

from .._common import MAX_TOKEN_ID, ReuseScope, TokenIdExt

BlockKey = bytes
# Copying an initialised context is ~7% cheaper than constructing one per block.
_SHA256_INIT: Final = hashlib.sha256()


def _sha256_digest(data: bytes) -> bytes:
    h = _SHA256_INIT.copy()
    h.update(data)
    return h.digest()


#: Blocks validated and encoded together by ``BlockHasher``.
_CHUNK_BLOCKS: Final = 8

# Block encodings. Plain-id blocks: uint32 LE per token, so their length is a multiple of 4.
# Blocks holding digests: 0x01, then per token a tag (0x00 id + 4 bytes, 0x01 + uint32 length +
# raw bytes), zero-padded to a length of 1 mod 4. Both are prefix-free and their lengths differ
# mod 4, so no encoding of one block equals that of another: a digest never collides with ids.
_MIXED = b"\x01"


def scope_key(scope: ReuseScope) -> BlockKey:
    """Root of the key chain: SHA-256 of the encoded reuse scope."""
    parts = [b"kv_cache_manager_v2/scope"]
    for value in (scope.lora_id, scope.salt):
        parts.append(b"\x00" if value is None else b"\x01" + value.to_bytes(8, "little"))
    return _sha256_digest(b"".join(parts))


def encode_tokens(tokens: Sequence[TokenIdExt]) -> bytes:
    """Injective encoding of one block's tokens (plain-id blocks take the fast path)."""
    try:
        return array("I", cast(Sequence[int], tokens)).tobytes()
    except TypeError:
        pass
    parts = [_MIXED]
    for tok in tokens:
        if isinstance(tok, bytes):
            parts.append(b"\x01" + len(tok).to_bytes(4, "little") + tok)
        else:
            parts.append(b"\x00" + tok.to_bytes(4, "little"))
    out = b"".join(parts)
    return out + b"\x00" * ((1 - len(out)) % 4)


def check_token(tok: object) -> None:
    """A token is an int in ``[0, 2**32)`` or a non-empty ``bytes`` digest."""
    if isinstance(tok, int) and not isinstance(tok, bool):  # isinstance: a fast check compiled
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise ValueError(f"token id {tok} is outside [0, 2**32)")
    elif isinstance(tok, bytes):
        if len(tok) == 0:
            raise ValueError("a bytes token must not be empty")
    else:
        raise TypeError(f"tokens must be ints or bytes, got {type(tok).__name__} {tok!r}")


def validate_tokens(tokens: Sequence[TokenIdExt]) -> None:
    """Check every token (ints in ``[0, 2**32)`` or non-empty bytes); clear errors otherwise."""
    if len(tokens) > 8 and _encode_ids(tokens) is not None:
        return
    for tok in tokens:
        check_token(tok)


def _encode_ids(tokens: Sequence[TokenIdExt]) -> bytes | None:
    """uint32 LE encoding if every token is an id in range, else None (digests or bad input)."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens.tobytes()  # a memory copy: no per-token conversion
    try:
        if isinstance(tokens, list):
            encoded: array[int] = array("I")
            encoded.fromlist(tokens)  # about twice as fast as array("I", tokens) for lists
            return encoded.tobytes()
        return array("I", cast(Sequence[int], tokens)).tobytes()
    except (TypeError, OverflowError):
        return None


def block_key(parent: BlockKey, tokens: Sequence[TokenIdExt]) -> BlockKey:
    """Key of a block: SHA-256(parent key || encoded tokens)."""
    return _sha256_digest(parent + encode_tokens(tokens))


class BlockHasher:
    """Keys of the consecutive blocks of one token sequence.

    Tokens are validated and encoded lazily, a chunk of blocks at a time, so a match that
    stops early neither converts nor checks the rest of a long prompt; plain-id blocks hash a
    slice of the chunk's encoding. ``key(parent, o)`` equals
    ``block_key(parent, tokens[o*T:(o+1)*T])`` (the last block may be partial).
    Passing an ``array('I')`` makes encoding a memory copy.
    """

    def __init__(self, tokens: Sequence[TokenIdExt], tokens_per_block: int) -> None:
        self.tokens = tokens
        self.tokens_per_block = tokens_per_block
        self.num_blocks = (len(tokens) + tokens_per_block - 1) // tokens_per_block
        self._chunks: list[bytes | None] = []  # None: the chunk holds digests

    def key(self, parent: BlockKey, o: int) -> BlockKey:
        t = self.tokens_per_block
        c = o // _CHUNK_BLOCKS
        while len(self._chunks) <= c:
            self._encode_chunk()
        chunk = self._chunks[c]
        end = min((o + 1) * t, len(self.tokens))
        if chunk is None:
            return block_key(parent, self.tokens[o * t : end])
        base = c * _CHUNK_BLOCKS * t
        return _sha256_digest(parent + chunk[(o * t - base) * 4 : (end - base) * 4])

    def chain(self, parent: BlockKey) -> list[BlockKey]:
        """Keys of every block of the sequence, chained from ``parent``."""
        keys: list[BlockKey] = []
        for o in range(self.num_blocks):
            parent = self.key(parent, o)
            keys.append(parent)
        return keys

    def _encode_chunk(self) -> None:
        span = _CHUNK_BLOCKS * self.tokens_per_block
        beg = len(self._chunks) * span
        seg = self.tokens[beg : beg + span]
        encoded = _encode_ids(seg)
        if encoded is None:
            validate_tokens(seg)  # raises for bad tokens; otherwise the chunk holds digests
        self._chunks.append(encoded)
