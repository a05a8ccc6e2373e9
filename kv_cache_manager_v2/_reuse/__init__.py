"""Prefix reuse: reuse keys (hash chain) and the radix tree of committed blocks."""
