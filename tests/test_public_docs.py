"""help(kv_cache_manager_v2) guides: it starts with the package's map and documents only public
names, and every public name (and each public method of the main classes) has a docstring."""

from __future__ import annotations

import inspect
import pydoc
import re
import typing

import pytest

import kv_cache_manager_v2 as kvm

COMPILED_DROPS_DOCS = "mypyc drops the docstrings of compiled classes and functions: fast mode checks them"


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
    if kvm.compiled:
        pytest.skip(COMPILED_DROPS_DOCS)
    for name in kvm.__all__:
        obj = getattr(kvm, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def test_public_methods_of_the_main_classes_have_docstrings() -> None:
    if kvm.compiled:
        pytest.skip(COMPILED_DROPS_DOCS)
    from kv_cache_manager_v2.engine import EngineRequest, KVCacheResourceManager

    missing = []
    for cls in (
        kvm.KVCacheManager,
        kvm.KVCache,
        kvm.KVCacheEventManager,
        kvm.PageIndexConverter,
        KVCacheResourceManager,
        EngineRequest,
    ):
        for name in dir(cls):
            owner = next(o for o in cls.__mro__ if name in vars(o))  # the definition users get
            member = vars(owner)[name]
            if name.startswith("_") or not owner.__module__.startswith("kv_cache_manager_v2"):
                continue  # private, or inherited from builtins / typing
            if (inspect.isfunction(member) or isinstance(member, property)) and not (member.__doc__ or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"public methods without a docstring: {sorted(set(missing))}"
