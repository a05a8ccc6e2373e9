"""The import-layering contract (pyproject.toml, checked by lint-imports in CI) names every module."""

from __future__ import annotations

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kv_cache_manager_v2"


def package_modules() -> set[str]:
    out = set()
    for d, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                rel = os.path.relpath(os.path.join(d, f[:-3]), ROOT)
                out.add(rel.replace(os.sep, "."))
    return out


def test_every_module_has_a_layer() -> None:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    listed = {name.strip() for layer in layers for name in layer.split("|")}
    missing = {m for m in package_modules() if not any(m == x or m.startswith(x + ".") for x in listed)}
    assert not missing, f"add these modules to the layers contract in pyproject.toml: {sorted(missing)}"
