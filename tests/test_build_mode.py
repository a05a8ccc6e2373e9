"""The package knows whether it runs compiled (production) or interpreted (fast)."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

import kv_cache_manager_v2


def _module_files() -> dict[str, str]:
    out = {}
    for info in pkgutil.walk_packages(kv_cache_manager_v2.__path__, "kv_cache_manager_v2."):
        mod = importlib.import_module(info.name)
        out[info.name] = str(getattr(mod, "__file__", ""))
    out["kv_cache_manager_v2.__init__"] = str(kv_cache_manager_v2.__file__)
    return out


def test_compiled_flag_matches_module_kinds() -> None:
    files = _module_files()
    assert len(files) >= 10
    from setup_mypyc import NOT_COMPILED  # the documented exclusions stay interpreted in both modes

    excluded = tuple(p.rstrip("/").removesuffix(".py").replace("/", ".") for p in NOT_COMPILED)
    assert any(name.startswith(excluded) for name in files), "an excluded module should exist"
    files = {name: f for name, f in files.items() if not name.startswith(excluded)}
    kinds = {name: not f.endswith(".py") for name, f in files.items()}
    assert all(v == kv_cache_manager_v2.compiled for v in kinds.values()), kinds


def test_expected_mode() -> None:
    expected = os.environ.get("KVCM_EXPECT_COMPILED")
    if expected is None:
        pytest.skip("KVCM_EXPECT_COMPILED not set (scripts/test.sh sets it)")
    assert kv_cache_manager_v2.compiled is (expected == "1")
