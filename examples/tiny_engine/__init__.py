"""A tiny numpy transformer with paged attention, served through kv_cache_manager_v2.engine.

python examples/tiny_engine/run.py          # a few hundred requests, checked against a dense reference
"""
