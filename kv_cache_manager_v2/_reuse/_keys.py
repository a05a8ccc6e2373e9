"""Reuse keys: a SHA-256 chain rooted at the reuse scope; token validation and encoding."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Final, cast

import blockhash

from .._common import MAX_TOKEN_ID, ReuseScope, TokenIdExt
from .._utils import as_list

BlockKey = bytes
# Copying an initialised context is ~7% cheaper than constructing one per block.
_SHA256_INIT: Final = hashlib.sha256()


#: chained keys of a run of blocks in one native call (OpenSSL through blockhash); else hashlib
NATIVE_CHAIN: Final = blockhash.available
#: bound once: mypyc looks a module's attribute up at every call
_all_ids: Final = blockhash.all_ids


def _sha256_digest(data: bytes) -> bytes:
    h = _SHA256_INIT.copy()
    h.update(data)
    return h.digest()


def chain_keys(parent: BlockKey, encoded: bytes, block_bytes: int) -> list[BlockKey]:
    """Keys of the consecutive blocks encoded in ``encoded`` (``block_bytes`` each, the last may be
    shorter), chained from ``parent``: ``block_key`` of each, in one call."""
    if NATIVE_CHAIN:
        return blockhash.chain(parent, encoded, block_bytes)
    return chain_keys_hashlib(parent, encoded, block_bytes)


def chain_token_keys(parent: BlockKey, tokens: Sequence[TokenIdExt], tokens_per_block: int) -> list[BlockKey] | None:
    """``chain_keys`` of validated ``tokens`` (a list, tuple or ``array``; blocks of
    ``tokens_per_block``, the last may be shorter), encoded on the way; None when they include
    digests (hash those with ``block_key``)."""
    if isinstance(tokens, array):
        return chain_keys(parent, _encode_array(tokens, "tokens"), tokens_per_block * 4)
    items = tokens if isinstance(tokens, tuple) else as_list(tokens)
    if NATIVE_CHAIN:
        return blockhash.chain_tokens(parent, items, tokens_per_block)
    encoded = encode_validated(list(items))
    return None if encoded is None else chain_keys_hashlib(parent, encoded, tokens_per_block * 4)


def chain_keys_hashlib(parent: BlockKey, encoded: bytes, block_bytes: int) -> list[BlockKey]:
    """``chain_keys`` through hashlib, a block at a time (where blockhash is not available)."""
    keys: list[BlockKey] = []
    for beg in range(0, len(encoded), block_bytes):
        parent = _sha256_digest(parent + encoded[beg : beg + block_bytes])
        keys.append(parent)
    return keys


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


def check_token(tok: object, name: str = "token") -> None:
    """A token is an ``int`` (not a bool; numpy integers are not ints) in ``[0, 2**32)`` or
    non-empty ``bytes``."""
    if isinstance(tok, int) and not isinstance(tok, bool):
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise ValueError(f"{name}: token id {tok} is outside [0, 2**32)")
    elif isinstance(tok, bytes):
        if len(tok) == 0:
            raise ValueError(f"{name}: a bytes token must not be empty")
    else:
        raise TypeError(
            f"{name}: tokens must be int or bytes, got {type(tok).__name__} {tok!r} "
            "(convert numpy arrays with .tolist(); bools are not token ids)"
        )


def check_token_sequence(tokens: object, name: str) -> None:
    """Refuse a bytes or str object where a sequence of tokens is expected (it would read as ids)."""
    if isinstance(tokens, (bytes, bytearray, str)):
        raise TypeError(
            f"{name} must be a sequence of tokens, got {type(tokens).__name__}; pass a digest token in a list: [digest]"
        )


def validate_tokens(tokens: Sequence[TokenIdExt], name: str = "tokens") -> None:
    """Check every token (ints in ``[0, 2**32)`` or non-empty bytes); clear errors otherwise.

    A list or tuple of ids is checked natively in one pass (``blockhash.all_ids``); otherwise one
    pass of type and range checks (no encoding), which names the first bad token.
    """
    if isinstance(tokens, array):
        _encode_array(tokens, name)
        return
    if _all_ids(tokens):  # ids only, checked natively in one pass (else the loop below names the bad token)
        return
    items = as_list(cast(Sequence[object], tokens))
    for tok in items:
        if isinstance(tok, int) and not isinstance(tok, bool):  # exact type flags: fast compiled
            if tok < 0 or tok > MAX_TOKEN_ID:
                check_token(tok, name)  # raises with the reason
        elif not isinstance(tok, bytes) or not tok:
            check_token(tok, name)


def encode_ids(tokens: Sequence[TokenIdExt], name: str) -> bytes | None:
    """Validate ``tokens`` and return their uint32 LE encoding, or None when they include digests.

    The same rule in both build modes: elements must be exactly ``int`` or ``bytes`` (a loop over
    their types, then the range checked by ``array.fromlist``); an ``array`` of integers is
    checked as a whole.
    """
    if isinstance(tokens, array):
        return _encode_array(tokens, name)
    if isinstance(tokens, list):
        items = cast(list[object], tokens)
    else:
        items = list(cast(Sequence[object], tokens))
    ids_only = True
    for tok in items:
        if not isinstance(tok, int) or isinstance(tok, bool):  # exact type flags: fast compiled
            if not isinstance(tok, bytes):
                check_token(tok, name)  # raises with the reason
            ids_only = False
    if not ids_only:
        for tok in items:
            check_token(tok, name)
        return None
    encoded: array[int] = array("I")
    try:
        encoded.fromlist(cast(list[int], items))  # about twice as fast as array("I", tokens) for lists
    except OverflowError:
        for tok in items:
            check_token(tok, name)  # names the token outside [0, 2**32)
        raise
    return encoded.tobytes()


def encode_validated(tokens: list[TokenIdExt]) -> bytes | None:
    """uint32 LE encoding of tokens already validated; None when they include digests."""
    encoded: array[int] = array("I")
    try:
        encoded.fromlist(cast(list[int], tokens))
    except TypeError:
        return None
    return encoded.tobytes()


def _encode_array(tokens: array[int], name: str) -> bytes:
    if tokens.typecode == "I":
        return tokens.tobytes()  # a memory copy: no per-token conversion
    if tokens.typecode in "fdu" or (len(tokens) and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID)):
        raise ValueError(
            f"{name}: an array of tokens must hold integers in [0, 2**32), got typecode {tokens.typecode!r}"
        )
    return array("I", tokens).tobytes()


def block_key(parent: BlockKey, tokens: Sequence[TokenIdExt]) -> BlockKey:
    """Key of a block: SHA-256(parent key || encoded tokens)."""
    return _sha256_digest(parent + encode_tokens(tokens))


class BlockHasher:
    """Keys of the consecutive blocks of one token sequence.

    Tokens are validated and encoded lazily, a chunk of blocks at a time, so a match that
    stops early does not hash the rest of a long prompt (``validate_rest`` checks it without
    hashing); plain-id blocks hash a slice of the chunk's encoding. ``keys[ordinal]`` is
    ``block_key(parent, tokens[ordinal*T:(ordinal+1)*T])`` chained from the scope root; ``keys`` may start
    with keys computed earlier for the same tokens (``probe_reuse`` -> ``create_kv_cache``).
    Passing an ``array('I')`` makes encoding a memory copy.
    """

    def __init__(
        self,
        tokens: Sequence[TokenIdExt],
        tokens_per_block: int,
        name: str,
        keys: list[BlockKey] | None = None,
        validated: int = 0,
    ) -> None:
        self.tokens = tokens
        self.tokens_per_block = tokens_per_block
        self.name = name
        self.num_blocks = (len(tokens) + tokens_per_block - 1) // tokens_per_block
        self.keys: list[BlockKey] = keys if keys is not None else []
        #: tokens known valid from the start (checked earlier, e.g. by ``probe_reuse``)
        self.validated = validated
        self._chunks: list[bytes | None] = []  # None: the chunk holds digests
        #: full blocks of a list or tuple are checked, encoded and hashed in one native call a chunk
        #: at a time (False once a chunk held a digest or a bad token: encoded in Python from then on)
        self._native = NATIVE_CHAIN and (type(tokens) is list or type(tokens) is tuple)

    def key(self, parent: BlockKey, ordinal: int) -> BlockKey:
        """Block ``ordinal``'s key given its parent's (computed once, then kept in ``keys``)."""
        if ordinal < len(self.keys):
            return self.keys[ordinal]
        t = self.tokens_per_block
        c = ordinal // _CHUNK_BLOCKS
        if self._native and ordinal == len(self.keys):
            end = min((c + 1) * _CHUNK_BLOCKS, len(self.tokens) // t) * t
            if ordinal * t < end and self._native_keys(parent, ordinal * t, end):
                return self.keys[ordinal]
        while len(self._chunks) <= c:
            self._encode_chunk()
        chunk = self._chunks[c]
        if chunk is None:
            key = block_key(parent, self.tokens[ordinal * t : min((ordinal + 1) * t, len(self.tokens))])
            if ordinal == len(self.keys):
                self.keys.append(key)
            return key
        beg = (ordinal - c * _CHUNK_BLOCKS) * t * 4
        full_end = len(chunk) - len(chunk) % (t * 4)
        if ordinal != len(self.keys) or beg >= full_end:  # out of sequence, or the partial last block: alone
            key = _sha256_digest(parent + chunk[beg : beg + t * 4])
            if ordinal == len(self.keys):
                self.keys.append(key)
            return key
        # the chunk's remaining full blocks in one call (a match usually goes on to the next block)
        self.keys += chain_keys(parent, chunk[beg:full_end], t * 4)
        return self.keys[ordinal]

    def key_alone(self, parent: BlockKey, ordinal: int) -> BlockKey:
        """``key``, hashing block ``ordinal`` alone when it is the next full block of a list or tuple
        (a match that follows children by their tokens hashes only at a branch, where it may stop)."""
        t = self.tokens_per_block
        beg = ordinal * t
        if (
            self._native
            and ordinal == len(self.keys)
            and beg + t <= len(self.tokens)
            and self._native_keys(parent, beg, beg + t)
        ):
            return self.keys[ordinal]
        return self.key(parent, ordinal)

    def matched(self, ordinal: int, key: BlockKey) -> None:
        """Block ``ordinal`` (the next one without a key) equals, token for token, a tree block of
        key ``key`` under its parent: that is its key, and its tokens are valid."""
        if ordinal == len(self.keys):
            self.keys.append(key)
            t = self.tokens_per_block
            if ordinal * t <= self.validated:
                self.validated = (ordinal + 1) * t

    def _native_keys(self, parent: BlockKey, beg: int, end: int) -> bool:
        """Keys of the full blocks in tokens ``[beg, end)`` through ``blockhash.chain_tokens`` (which
        checks them as ``encode_ids`` does); False, switching to the Python encoding, when a token is
        not exactly an int or is out of range (that path raises with the token's name)."""
        try:
            keys = blockhash.chain_tokens(
                parent, cast("list[object] | tuple[object, ...]", self.tokens[beg:end]), self.tokens_per_block
            )
        except ValueError:
            keys = None
        if keys is None:
            self._native = False
            return False
        self.keys += keys
        if beg <= max(self.validated, len(self._chunks) * _CHUNK_BLOCKS * self.tokens_per_block):
            self.validated = max(self.validated, end)
        return True

    def chain(self, parent: BlockKey) -> list[BlockKey]:
        """Keys of every block of the sequence, chained from ``parent``."""
        for ordinal in range(self.num_blocks):
            parent = self.key(parent, ordinal)
        return self.keys

    def validate_rest(self) -> None:
        """Check the tokens neither a chunk encoding nor an earlier call has checked."""
        done = max(self.validated, len(self._chunks) * _CHUNK_BLOCKS * self.tokens_per_block)
        if done < len(self.tokens):
            validate_tokens(self.tokens[done:], self.name)
        self.validated = len(self.tokens)

    def _encode_chunk(self) -> None:
        span = _CHUNK_BLOCKS * self.tokens_per_block
        beg = len(self._chunks) * span
        self._chunks.append(encode_ids(self.tokens[beg : beg + span], self.name))
