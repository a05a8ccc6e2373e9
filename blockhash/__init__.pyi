from typing import Any

available: bool

def chain(parent: bytes, data: bytes | bytearray | memoryview, block_bytes: int, /) -> list[bytes]:
    """``key[i] = SHA-256(key[i-1] || data[i*block_bytes:(i+1)*block_bytes])``, ``key[-1] = parent``;
    the last block may be shorter."""

def chain_tokens(parent: bytes, tokens: list[Any] | tuple[Any, ...], block_tokens: int, /) -> list[bytes] | None:
    """``chain`` of the tokens' uint32 LE encoding (``block_tokens`` per block), encoded natively;
    None when a token is not an int; ValueError for an int outside ``[0, 2**32)``."""
