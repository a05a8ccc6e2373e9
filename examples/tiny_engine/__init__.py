"""A tiny numpy model with paged attention, served through kv_cache_manager_v2.engine.

python examples/tiny_engine/run.py          # a few hundred requests, checked against a dense reference

Layer kinds: attention (full, sliding window with sinks), recurrent (Mamba2-like) and parallel
(both in one layer); hybrid models run through ``hybrid.py`` with explicit per-sequence state.
"""
