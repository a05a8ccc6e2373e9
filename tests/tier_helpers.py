"""What the tier tests share, and requests driven through the fake engine for any test: a two-layer
model whose slot holds one block, token sequences, computing, serving and publishing blocks, the
tree's pages of a prompt, and worker scripts run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from conftest import REC, MakeManager, kv_layers
from fake_engine import FakeEngine

from kv_cache_manager_v2 import KVCache, KVCacheManager, Retention, ReuseScope, TokenIdExt
from kv_cache_manager_v2._common import DEFAULT_REUSE_SCOPE
from kv_cache_manager_v2._page import Page
from kv_cache_manager_v2._reuse._keys import BlockHasher, scope_key
from kv_cache_manager_v2._storage._loader import BackgroundLoader

T = 8
SLOT = 2 * 2 * REC * T  # two layers, key + value: one slot holds one block


def seq(r: int, n: int) -> list[int]:
    """``n`` tokens of sequence ``r`` (distinct sequences share no block)."""
    return [r * 10_000 + i for i in range(n)]


def wait_loaded(poll: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll (``KVCache.loading``, ``not Prefetch.done``) until the background loads are in place."""
    deadline = time.monotonic() + timeout_s
    while poll():
        assert time.monotonic() < deadline, "background loads did not finish"
        time.sleep(0.001)


def loader(m: KVCacheManager) -> BackgroundLoader:
    """``m``'s background loader (``load_workers`` > 0)."""
    out = m._ctx.loader
    assert out is not None
    return out


def tiered(
    make_manager: MakeManager,
    tmp_path: object,
    manual: bool = True,
    gpu_slots: int = 4,
    disk_slots: int = 32,
    **kw: object,
) -> KVCacheManager:
    """A manager of GPU ``gpu_slots``, host 4, disk ``disk_slots`` slots (``kw``: more of its
    config); with ``manual`` its background loads run when the test says
    (``BackgroundLoader.run_queued``)."""
    m = make_manager(
        kv_layers(2, T),
        T,
        gpu_slots * SLOT,
        host_quota=4 * SLOT,
        disk_quota=disk_slots * SLOT,
        disk_path=str(tmp_path),
        max_util_for_resume=1.0,
        **kw,
    )
    if manual:
        loader(m).manual = True
    return m


def land_some(m: KVCacheManager, k: int, count: int) -> None:
    """Up to ``count`` queued background loads finish, the ``k``-th queued first each time (any
    order), then ``m`` installs them."""
    q = loader(m)
    for _ in range(count):
        if not q.queued:
            break
        q.run_queued(k % len(q.queued))
    m.poll_loads()


def compute(engine: FakeEngine, kv: KVCache, toks: list[int], upto: int) -> None:
    """Grow ``kv`` to ``upto`` tokens, write their KV through ``engine`` and commit them."""
    h = kv.history_length
    assert kv.resize(upto, h)
    engine.step(kv, toks, h, upto)
    kv.commit(toks[h:upto])


def computed(m: KVCacheManager, engine: FakeEngine, toks: list[int], upto: int) -> KVCache:
    """A new request (matching nothing), resumed, that computed and committed ``toks[:upto]``."""
    kv = m.create_kv_cache()
    assert kv.resume()
    compute(engine, kv, toks, upto)
    return kv


def serve(engine: FakeEngine, kv: KVCache, tokens: Sequence[TokenIdExt], decode: int = 0) -> None:
    """Resume ``kv``, check the reused prefix, prefill the rest of ``tokens`` but the last ``decode``,
    then decode those one at a time (committing all)."""
    assert kv.resume()
    h = kv.history_length
    engine.check_all(kv, tokens, h)
    n = len(tokens) - decode
    assert kv.resize(n)
    engine.step(kv, tokens, h, n)
    kv.commit(tokens[h:n])
    for pos in range(n, len(tokens)):
        assert kv.resize(pos + 1)
        engine.step(kv, tokens, pos, pos + 1)
        kv.commit([tokens[pos]])


def run(
    m: KVCacheManager,
    engine: FakeEngine,
    tokens: list[int],
    retain: Retention | Sequence[Retention] | None = None,
    **kw: object,
) -> KVCache:
    """Create (matching ``tokens``; ``kw`` to ``create_kv_cache``), compute and commit all of ``tokens``,
    close (with ``retain``)."""
    kv = m.create_kv_cache(input_tokens=tokens, **kw)  # type: ignore[arg-type]
    assert kv.resume()
    h = kv.history_length
    assert kv.resize(len(tokens))
    engine.step(kv, tokens, h, len(tokens))
    kv.commit(tokens[h:])
    kv.close(retain=retain)
    return kv


def publish(
    m: KVCacheManager,
    toks: Sequence[TokenIdExt],
    scope: ReuseScope | None = None,
    engine: FakeEngine | None = None,
    match: bool = True,
) -> None:
    """Compute ``toks`` in a new request of ``scope`` and close it: its blocks become reusable
    (``match``: the request first reuses what the cache holds, checked; else it computes everything)."""
    kv = m.create_kv_cache(scope, toks if match else None)
    serve(engine if engine is not None else FakeEngine(m), kv, toks)
    kv.close()


def tree_pages(m: KVCacheManager, toks: list[int]) -> list[Page]:
    """The reusable page of each matched block of ``toks`` (layer group 0), in order."""
    root = m._tree.root(DEFAULT_REUSE_SCOPE, False)
    assert root is not None
    nodes, _, _ = m._tree.match(root, BlockHasher(toks, m.tokens_per_block, "tokens"), False)
    out = []
    for n in nodes:
        p = n.page(0)
        assert p is not None
        out.append(p)
    return out


def page_keys(m: KVCacheManager, toks: list[int]) -> list[bytes]:
    """The remote keys of the full blocks of ``toks`` (one layer group, ``T`` tokens a block)."""
    remote = m._remote
    assert remote is not None
    hasher = BlockHasher(toks, T, "toks", None, 0)
    parent = scope_key(DEFAULT_REUSE_SCOPE)
    out = []
    for o in range(len(toks) // T):
        parent = hasher.key(parent, o)
        out.append(remote.page_key(parent, 0))
    return out


def run_worker(script: str, spec: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """Run ``tests/<script>`` with ``spec`` (JSON) in a child process on this process's path; the
    JSON of its last stdout line."""
    out = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
