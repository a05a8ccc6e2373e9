"""``python -m kv_cache_manager_v2.sim``: the ``kv-cache-sim`` console script."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
