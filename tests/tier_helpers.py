"""What the tier tests share: a two-layer model whose slot holds one block, token sequences, and
computing and publishing blocks through the fake engine."""

from __future__ import annotations

from conftest import REC
from fake_engine import FakeEngine

from kv_cache_manager_v2 import KVCache, KVCacheManager, ReuseScope

T = 8
SLOT = 2 * 2 * REC * T  # two layers, key + value: one slot holds one block


def seq(r: int, n: int) -> list[int]:
    """``n`` tokens of sequence ``r`` (distinct sequences share no block)."""
    return [r * 10_000 + i for i in range(n)]


def compute(engine: FakeEngine, kv: KVCache, toks: list[int], upto: int) -> None:
    """Grow ``kv`` to ``upto`` tokens, write their KV through ``engine`` and commit them."""
    h = kv.history_length
    assert kv.resize(upto, h)
    engine.step(kv, toks, h, upto)
    kv.commit(toks[h:upto])


def publish(
    m: KVCacheManager,
    toks: list[int],
    scope: ReuseScope | None = None,
    engine: FakeEngine | None = None,
    match: bool = True,
) -> None:
    """Compute ``toks`` in a new request of ``scope`` and close it: its blocks become reusable
    (``match``: the request first reuses what the cache holds; else it computes everything)."""
    kv = m.create_kv_cache(scope, toks if match else None)
    assert kv.resume()
    compute(engine if engine is not None else FakeEngine(m), kv, toks, len(toks))
    kv.close()
