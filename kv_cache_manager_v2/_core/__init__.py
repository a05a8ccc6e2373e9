"""Per-request caches (KVCache) and the top-level KVCacheManager."""
