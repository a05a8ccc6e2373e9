"""Chained SHA-256 keys of a run of blocks in one native call (see ``_blockhash.c``).

``available`` is False where the libcrypto that hashlib uses could not be found; callers then
hash with hashlib (same keys). ``same_block`` (no OpenSSL needed) compares a tree block's tokens
with a run of query tokens in place, so a match can follow a child without hashing; ``all_ids`` checks a list of token ids in one pass."""

from blockhash._blockhash import all_ids, available, chain, chain_tokens, same_block

__all__ = ["all_ids", "available", "chain", "chain_tokens", "same_block"]
