"""help(kv_cache_manager_v2) guides: it starts with the package's map and documents only public
names, and every public name (and each public method of the main classes) has a docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pydoc
import re
import typing
from pathlib import Path

import pytest

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

MAIN_CLASSES = (
    kvm.KVCacheManager,
    kvm.KVCache,
    kvm.KVCacheEventManager,
    kvm.PageIndexConverter,
    KVCacheResourceManager,
    EngineRequest,
)


def _help_text() -> str:
    return pydoc.render_doc(kvm, renderer=pydoc.plaintext)


def _section(text: str, title: str) -> str:
    match = re.search(rf"^{title}\n(.*?)(?=^[A-Z][A-Z ]+\n|\Z)", text, re.M | re.S)
    return match.group(1) if match else ""


def test_help_starts_with_the_map() -> None:
    text = _help_text()
    name = _section(text, "NAME").strip()
    assert (
        name == "kv_cache_manager_v2 - Engine-agnostic paged KV-cache manager for LLM inference: a map of the package."
    )
    assert text.index("NAME") < text.index("DESCRIPTION") < text.index("PACKAGE CONTENTS")
    description = _section(text, "DESCRIPTION")
    assert description.strip().startswith("Main objects")
    for part in ("Main objects", "The step cycle of a request", "Engine adapter", "Simulator", "README.md", "docs/"):
        assert part in description, f"the package docstring (help's map) has no {part!r}"


def test_help_documents_only_public_names() -> None:
    text = _help_text()
    public = set(kvm.__all__)
    for title in ("CLASSES", "FUNCTIONS", "DATA"):
        body = _section(text, title)
        assert body, f"help() has no {title} section"
        if title == "CLASSES":  # after the class tree, one "class Name(...)" block per class
            names = re.findall(r"^    class (\w+)", body, re.M)
        else:
            names = re.findall(r"^    (\w+)(?: = |\()", body, re.M)
        documented = {name for name in names if not (name.startswith("__") and name.endswith("__"))}
        assert documented, title
        assert documented <= public, f"{title} documents names outside __all__: {sorted(documented - public)}"
    # each id type says where users import it from, never its private module
    assert not re.search(r"= kv_cache_manager_v2\._", _section(text, "DATA"))


def _typing_object(obj: object) -> bool:
    return isinstance(obj, typing.NewType) or type(obj).__module__ == "typing"


def test_public_types_and_constants_are_documented() -> None:
    """Id types and aliases carry their own docstrings; constants (ints, tuples, bools cannot) are
    explained in the package docstring."""
    for name in kvm.__all__:
        obj = getattr(kvm, name)
        if _typing_object(obj):
            doc = obj.__doc__
            assert doc and doc != type(obj).__doc__, f"{name} has no docstring of its own"
        elif not (inspect.isclass(obj) or callable(obj)):
            assert re.search(rf"\b{name}\b", kvm.__doc__ or ""), f"constant {name} is not described in the package map"


def test_every_public_class_and_function_has_a_docstring() -> None:
    for name in kvm.__all__:
        obj = getattr(kvm, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def test_public_methods_of_the_main_classes_have_docstrings() -> None:
    missing = []
    for cls in MAIN_CLASSES:
        for name in dir(cls):
            owner = next(o for o in cls.__mro__ if name in vars(o))  # the definition users get
            member = vars(owner)[name]
            if name.startswith("_") or not owner.__module__.startswith("kv_cache_manager_v2"):
                continue  # private, or inherited from builtins / typing
            if (inspect.isfunction(member) or isinstance(member, property)) and not (member.__doc__ or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"public methods without a docstring: {sorted(set(missing))}"


def _source_docs(cls: type) -> dict[str, str | None]:
    """The docstrings of ``cls`` and of the functions in its body, as written in its module's source."""
    path = Path(kvm.__file__).parent.parent.joinpath(*cls.__module__.split("."))  # the source, compiled too
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs = {"": ast.get_docstring(node)}
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name not in docs:  # a property's getter comes first
            docs[item.name] = ast.get_docstring(item)
    return docs


def test_help_shows_the_source_docstrings_in_both_modes() -> None:
    """Compiled too (mypyc keeps only signatures, and gives the classes it makes non-native a filler
    docstring and ``type`` annotations: the build puts the sources' back)."""
    text = _help_text()
    assert "mypyc filler docstring" not in text
    assert not re.search(r": type\b", text), "an annotation shows as `type`"
    public_classes = [getattr(kvm, n) for n in kvm.__all__ if inspect.isclass(getattr(kvm, n))]
    checked = 0
    for cls in dict.fromkeys([*public_classes, *MAIN_CLASSES]):
        if not cls.__module__.startswith("kv_cache_manager_v2") or cls.__module__.startswith(
            "kv_cache_manager_v2.events"
        ):
            continue
        for name, doc in _source_docs(cls).items():
            if doc is None or (name.startswith("_") and name != "__init__"):
                continue
            shown = inspect.getdoc(vars(cls)[name]) if name else cls.__doc__
            if name == "__init__" and not inspect.isfunction(vars(cls)[name]):
                continue  # a native class's __init__: its docstring and signature are the class's
            assert shown is not None and inspect.cleandoc(shown) == doc, f"{cls.__name__}.{name or '__doc__'}"
            checked += 1
    assert checked > 100, checked


def test_signatures_and_config_fields_are_the_sources_in_both_modes() -> None:
    signature = inspect.signature(EngineRequest)
    assert list(signature.parameters)[:3] == ["request_id", "prompt_tokens", "max_new_tokens"]
    assert signature.parameters["priority"].default == kvm.DEFAULT_PRIORITY
    assert list(inspect.signature(kvm.KVCache.resize).parameters)[:2] == ["self", "capacity"]
    for cls in (kvm.KVCacheManagerConfig, kvm.BufferConfig, kvm.DiskCacheTierConfig, kvm.RetentionRange):
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        assert all(isinstance(t, str) for t in types.values()), (cls.__name__, types)
        assert inspect.signature(cls).parameters.keys() >= {f.name for f in dataclasses.fields(cls) if f.init}
    assert dataclasses.fields(kvm.KVCacheManagerConfig)[0].type == "int"  # as written (a future import)


@pytest.mark.mode_independent
def test_shipped_text_stands_alone_without_the_internal_specification() -> None:
    """Users have the package, README.md, docs/ and examples/, not the specification they were
    written from: no docstring, comment or page sends them to its sections."""
    root = Path(__file__).resolve().parent.parent
    shipped = [root / "README.md", *root.glob("docs/**/*.md")]
    shipped += [*root.glob("kv_cache_manager_v2/**/*.py"), *root.glob("examples/**/*.py")]
    found = []
    for path in shipped:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bSPEC\b\s*§?\s*\d|§\s*\d|SPEC\.md|\.\./shared", line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
