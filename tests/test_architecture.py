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


def test_storage_and_events_have_no_type_only_imports() -> None:
    """The forbidden contracts ignore ``TYPE_CHECKING`` imports while the core still has one type-only
    climb; storage and the event queue have none at all, so no type-only import can climb from them."""
    offenders = []
    for d, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if f.endswith(".py") and (rel.startswith(f"{PACKAGE}/_storage/") or rel == f"{PACKAGE}/_events.py"):
                with open(path) as fh:
                    if "TYPE_CHECKING" in fh.read():
                        offenders.append(rel)
    assert not offenders, f"type-only imports in {offenders}"
