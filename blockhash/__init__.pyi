from typing import Any

available: bool

def chain(parent: bytes, data: bytes | bytearray | memoryview, block_bytes: int, /) -> list[bytes]:
    """``key[i] = SHA-256(key[i-1] || data[i*block_bytes:(i+1)*block_bytes])``, ``key[-1] = parent``;
    the last block may be shorter."""

def chain_tokens(parent: bytes, tokens: list[Any] | tuple[Any, ...], block_tokens: int, /) -> list[bytes] | None:
    """``chain`` of the tokens' uint32 LE encoding (``block_tokens`` per block), encoded natively;
    None when a token is not an int; ValueError for an int outside ``[0, 2**32)``."""

def same_block(block: object, tokens: object, beg: int, per_block: int, /) -> bool | None:
    """Whether ``block`` (a tuple of valid tokens: ints in ``[0, 2**32)``, non-empty bytes; or an ``array('I')``) holds exactly
    ``tokens[beg:beg+per_block]`` (``tokens``: a list, tuple or ``array('I')``); None when it cannot tell
    cheaply (another type, or a query token that is not exactly a valid int or bytes)."""

def all_ids(tokens: object, /) -> bool:
    """Whether ``tokens`` is a list or tuple of exact ints in ``[0, 2**32)`` only (False for anything else)."""
