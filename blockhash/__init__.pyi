available: bool

def chain(parent: bytes, data: bytes | bytearray | memoryview, block_bytes: int, /) -> list[bytes]:
    """``key[i] = SHA-256(key[i-1] || data[i*block_bytes:(i+1)*block_bytes])``, ``key[-1] = parent``;
    the last block may be shorter."""
