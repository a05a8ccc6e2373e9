"""The import-layering contract (pyproject.toml, checked by lint-imports in CI) names every module."""

from __future__ import annotations

import os
import tomllib

import pytest

pytestmark = pytest.mark.mode_independent  # reads source files: the same in both modes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kv_cache_manager_v2"
#: what a class's docstring says to go past a guide: why its hierarchy is deeper, that it is one job
DEEPER_BECAUSE = "Deeper because:"
ONE_JOB = "One job:"


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


def test_the_package_has_no_type_only_imports() -> None:
    """The import contracts count ``TYPE_CHECKING`` imports too (``exclude_type_checking_imports =
    false``); none is left, so a type-only import that climbs cannot hide behind the flag."""
    offenders = []
    for d, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py"):
                with open(path) as fh:
                    if "TYPE_CHECKING" in fh.read():
                        offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, f"type-only imports in {offenders}"


def test_window_arithmetic_lives_in_the_layer_kinds() -> None:
    """The core, the reuse tree, storage and the adapter's capacity code ask a layer group's policy
    (``_layers/``); they never branch on a window themselves. Only the manager (and its
    queries) passes the announced window and sinks on (``LayerGroupInfo``, event specs)."""
    import re

    forbidden = re.compile(r"window_size is (not )?None|\bis_swa\b|swa_layer_groups|num_sink_blocks|\.window\b")
    checked = [os.path.join(ROOT, PACKAGE, "engine", "_capacity.py"), os.path.join(ROOT, PACKAGE, "_page.py")]
    for sub in ("_core", "_reuse", "_storage", "_storage/_tiers", "_storage/_remote"):
        folder = os.path.join(ROOT, PACKAGE, sub)
        checked += [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")]
    found = []
    for path in checked:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                announced = path.endswith(("_kv_cache_manager.py", "_manager_queries.py")) and re.search(
                    r"\bpolicy\.(window_size|num_sink_blocks)", line
                )
                if forbidden.search(line) and not announced and not line.lstrip().startswith("#"):
                    found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not found, "window arithmetic outside kv_cache_manager_v2/_layers:\n" + "\n".join(found)


def test_the_design_cards_modules_do_their_jobs() -> None:
    """The design card names four typed modules: ``_core`` and ``_storage`` (packages),
    ``_life_cycle_registry`` (layers -> layer groups and each group's policy) and ``_page`` (the page)."""
    import importlib

    for name in ("_core", "_storage"):
        assert os.path.isfile(os.path.join(ROOT, PACKAGE, name, "__init__.py"))
    registry = importlib.import_module(f"{PACKAGE}._life_cycle_registry")
    page = importlib.import_module(f"{PACKAGE}._page")
    assert registry.LayerGroupRegistry.__module__ == f"{PACKAGE}._life_cycle_registry"
    assert registry.LAYER_KINDS and registry.announced_layer_group
    assert page.Page.__module__ == f"{PACKAGE}._page"
    assert page.PoolGroupStorage.__module__ == f"{PACKAGE}._page"
    assert not os.path.exists(os.path.join(ROOT, PACKAGE, "_storage", "_page.py"))
    assert not os.path.exists(os.path.join(ROOT, PACKAGE, "_layers", "_registry.py"))


def test_no_room_past_its_size() -> None:
    """No module of the package or the benchmarks above 600 lines, no class above 500, no function
    above 120: past that, split by concern. The caps find rooms with two jobs: a class past 500
    lines that is one job says so (``One job:`` in its docstring, and what the job is)."""
    import ast

    found = []
    for top in (PACKAGE, "benchmarks"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                with open(path) as fh:
                    text = fh.read()
                rel = os.path.relpath(path, ROOT)
                if text.count("\n") > 600:
                    found.append(f"{rel}: {text.count(chr(10))} lines")
                for node in ast.walk(ast.parse(text)):
                    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        size = (node.end_lineno or node.lineno) - node.lineno + 1
                        limit = 500 if isinstance(node, ast.ClassDef) else 120
                        one_job = isinstance(node, ast.ClassDef) and ONE_JOB in (ast.get_docstring(node) or "")
                        if size > limit and not one_job:
                            found.append(f"{rel}: {node.name} {size} lines (limit {limit})")
    assert not found, "split these by concern:\n" + "\n".join(found)


@pytest.mark.parametrize("importer", ["_core/_pins.py", "_storage/_tiers/_base.py", "sim/_fleet.py"])
def test_the_backend_contract_refuses_a_backend_named_outside_the_remote_package(
    tmp_path: object, importer: str
) -> None:
    """lint-imports breaks the remote-backend contract when a module outside ``_storage/_remote/``
    imports a backend module (a contract whose source package contains its forbidden modules
    checks nothing: import-linter skips such pairs)."""
    import pathlib
    import shutil
    import subprocess
    import sys

    tmp = pathlib.Path(str(tmp_path))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp)
    shutil.copytree(
        os.path.join(ROOT, PACKAGE), tmp / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.json")
    )
    with open(tmp / PACKAGE / importer, "a") as f:
        f.write("\nimport kv_cache_manager_v2._storage._remote._redis  # noqa\n")
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run(
        [lint, "--no-cache"],
        cwd=tmp,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp), "COLUMNS": "1000"},
    )
    assert "the rest uses its interface BROKEN" in out.stdout, out.stdout[-2000:]


def package_classes() -> dict[tuple[str, str], tuple[list[tuple[str, str]], str]]:
    """Every class of the package: (module, name) -> (its bases as (module, name), resolved through
    the imports of its module; its docstring). Bases from outside the package are left out."""
    import ast

    imports: dict[str, dict[str, tuple[str, str]]] = {}
    defined: dict[tuple[str, str], tuple[list[ast.expr], str]] = {}
    for d, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            package = parts[:-1]  # what a relative import starts from
            module = ".".join(package if f == "__init__.py" else parts)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            names = imports.setdefault(module, {})
            for node in tree.body:
                if isinstance(node, ast.ImportFrom):
                    base = package[: len(package) - node.level + 1] if node.level else []
                    source = ".".join(base + ([node.module] if node.module else []))
                    for alias in node.names:
                        names[alias.asname or alias.name] = (source, alias.name)
                elif isinstance(node, ast.ClassDef):
                    defined[(module, node.name)] = (node.bases, ast.get_docstring(node) or "")

    def resolve(module: str, name: str) -> tuple[str, str] | None:
        for _ in range(10):  # through re-exports
            if (module, name) in defined:
                return module, name
            found = imports.get(module, {}).get(name)
            if found is None or not found[0].startswith(PACKAGE):
                return None
            module, name = found
        return None

    out: dict[tuple[str, str], tuple[list[tuple[str, str]], str]] = {}
    for (module, name), (bases, doc) in defined.items():
        resolved = [resolve(module, b.id) for b in bases if isinstance(b, ast.Name)]
        out[(module, name)] = ([r for r in resolved if r is not None], doc)
    return out


def test_class_hierarchies_are_at_most_two_deep() -> None:
    """A class of the package, its base, and no grandparent from the package: a chain of bases
    cut only to fit the size guide is one class (or parts it holds) instead. A class whose
    docstring says ``Deeper because:`` (and why) may go deeper."""
    classes = package_classes()

    def depth(key: tuple[str, str]) -> int:
        bases = classes[key][0]
        return 1 + max((depth(b) for b in bases), default=0)

    found = [
        f"{module}.{name}: {depth((module, name))} levels"
        for (module, name), (_, doc) in sorted(classes.items())
        if depth((module, name)) > 2 and DEEPER_BECAUSE not in doc
    ]
    assert not found, "hierarchies deeper than a class and its base (compose, or say why):\n" + "\n".join(found)
