"""Chained SHA-256 keys of a run of blocks in one native call (see ``_blockhash.c``).

``available`` is False where the libcrypto that hashlib uses could not be found; callers then
hash with hashlib (same keys)."""

from blockhash._blockhash import available, chain, chain_tokens

__all__ = ["available", "chain", "chain_tokens"]
