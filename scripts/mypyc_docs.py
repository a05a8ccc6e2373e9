"""Build time: the compiled package shows the same docstrings and signatures in help() as the sources.

mypyc (mypy 2.4.1) writes a compiled function's or native class's C docstring as its text signature
only (none where a default is not a literal, e.g. ``priority=DEFAULT_PRIORITY``; keyword-only
parameters shown positional), gives properties and methods of non-native classes no docstring,
sets a non-native class's ``__doc__`` to "mypyc filler docstring" and gives dataclass fields
runtime types as annotations (``type`` for a ``Literal``, a union or a ``Callable``). It has no
option to keep them, and compiled descriptors' docstrings cannot be set at run time.

setup_mypyc.py compiles copies of mypyc's C files (``with_docs``) whose method, getset and type
tables carry the sources' docstrings and signatures (read with ``ast``: defaults as written, no
annotations, which CPython's text signatures cannot hold): only C string literals change, no code.
Class docstrings mypyc cannot put in C and dataclass annotations as written go to a JSON file
(``class_docs``) that ``kv_cache_manager_v2/__init__.py`` applies at import (compiled only, ~0.3 ms).
tests/test_public_docs.py compares help() with the sources in both modes.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

#: (module, class or None, function)
FunctionKey = tuple[str, "str | None", str]


class SourceDocs:
    """Docstrings, text signatures and annotations of the modules in ``sources``, as written."""

    def __init__(self, sources: list[str]) -> None:
        self.functions: dict[FunctionKey, str] = {}
        self.signatures: dict[FunctionKey, str] = {}
        self.classes: dict[tuple[str, str], str] = {}
        #: (module, class) -> {field: annotation as written}: how the interpreter keeps them (the future import)
        self.class_annotations: dict[tuple[str, str], dict[str, str]] = {}
        for path in sources:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            self._read(module_name(path), text, ast.parse(text))

    def _read(self, module: str, text: str, tree: ast.Module) -> None:
        future = any(
            isinstance(node, ast.ImportFrom)
            and node.module == "__future__"
            and any(a.name == "annotations" for a in node.names)
            for node in tree.body
        )
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(module, None, node, text)
            elif isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc:
                    self.classes[module, node.name] = doc
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self._function(module, node.name, item, text)
                    elif future and isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        fields = self.class_annotations.setdefault((module, node.name), {})
                        fields[item.target.id] = ast.get_source_segment(text, item.annotation) or ""

    def _function(self, module: str, cls: str | None, node: ast.FunctionDef | ast.AsyncFunctionDef, text: str) -> None:
        decorators = {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in node.decorator_list}
        if decorators & {"setter", "deleter"}:
            return  # a property's docstring is its getter's
        doc = ast.get_docstring(node)
        if doc:
            self.functions[module, cls, node.name] = doc
        signature = _text_signature(node, text, bound=cls is not None and "staticmethod" not in decorators)
        if signature is not None:
            self.signatures[module, cls, node.name] = signature


def module_name(path: str) -> str:
    parts = os.path.splitext(os.path.normpath(path))[0].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _text_signature(node: ast.FunctionDef | ast.AsyncFunctionDef, text: str, bound: bool) -> str | None:
    """The parameters as CPython's ``__text_signature__`` writes them: no annotations, defaults as
    written (inspect finds a name in the function's module), ``$self`` for the bound one; None where a
    default is not a constant or a name (mypyc's signature then, if it has one)."""
    args = node.args

    def param(arg: ast.arg, default: ast.expr | None, prefix: str = "") -> str:
        if default is None:
            return prefix + arg.arg
        if not isinstance(default, _SIMPLE_DEFAULTS):
            raise ValueError(arg.arg)
        return f"{prefix}{arg.arg}={ast.get_source_segment(text, default)}"

    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    params: list[str] = []
    try:
        for i, (arg, default) in enumerate(zip(positional, defaults + list(args.defaults))):
            params.append(param(arg, default, "$" if bound and i == 0 else ""))
            if i == len(args.posonlyargs) - 1:
                params.append("/")
        if args.vararg:
            params.append(f"*{args.vararg.arg}")
        elif args.kwonlyargs:
            params.append("*")
        params += [param(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    except ValueError:
        return None
    if args.kwarg:
        params.append(f"**{args.kwarg.arg}")
    return f"({', '.join(params)})"


_SIMPLE_DEFAULTS = (ast.Constant, ast.Name, ast.Attribute, ast.UnaryOp)


def _literal(text: str) -> str:
    from mypyc.codegen.cstring import c_string_initializer

    return str(c_string_initializer(text.encode("utf-8")))


_TEMPLATE = re.compile(r"static PyTypeObject CPyType_\w+_template_ = \{\n(.*?)\n\};", re.S)
_FIELD = re.compile(r"^\s*\.(tp_name|tp_methods|tp_getset) = \"?(\w+)\"?,$", re.M)
_TP_DOC = re.compile(r"(\.tp_doc = PyDoc_STR\()(NULL|\"(?:[^\"\\]|\\.)*\")\)")
_TABLE = re.compile(r"static (PyMethodDef|PyGetSetDef) (\w+)\[\] = \{\n(.*?)\n\};", re.S)
_METHOD = re.compile(r"(\{\"(\w+)\",[^{}\"]*?PyDoc_STR\()(NULL|\"(?:[^\"\\]|\\.)*\")\)")
_GETSET = re.compile(r"(\{\"(\w+)\",\s*\(getter\)\w+,\s*(?:\(setter\)\w+|NULL),\s*)NULL(, NULL\})")


def _with_doc(old: str, signature: str | None, doc: str | None) -> str:
    """The C docstring: ``signature`` (the source's) else ``old``'s (mypyc's C literal
    ``"name(sig)\\n--\\n\\n"`` or ``NULL``), then ``doc``."""
    if signature is None:
        return old if doc is None else _literal(doc) if old == "NULL" else f"{old} {_literal(doc)}"
    return _literal(f"{signature}\n--\n\n{doc or ''}")


def add_docs(c_code: str, module: str, docs: SourceDocs) -> str:
    """mypyc's C code of ``module`` with the docstrings of its functions, methods, properties and
    native classes in their method, getset and type tables (signatures where mypyc wrote none)."""
    owner: dict[str, str | None] = {}  # a table's C name -> its class (module functions: None)

    # a method of a non-native class is an instance of a callable class "<method>_<class>_obj": its docstring
    methods = {f"{f}_{cls}_obj": doc for (m, cls, f), doc in docs.functions.items() if m == module and cls}

    def type_doc(match: re.Match[str]) -> str:
        fields = dict(_FIELD.findall(match.group(1)))
        name = fields["tp_name"]
        owner.update({fields[k]: name for k in ("tp_methods", "tp_getset") if k in fields})
        if name in methods:
            return _TP_DOC.sub(lambda m: f"{m.group(1)}{_literal(methods[name])})", match.group(0))
        init = docs.signatures.get((module, name, "__init__"))
        signature = None if init is None else name + init.replace("($self, ", "(", 1).replace("($self)", "()", 1)
        doc = docs.classes.get((module, name))
        return _TP_DOC.sub(lambda m: f"{m.group(1)}{_with_doc(m.group(2), signature, doc)})", match.group(0))

    def table(match: re.Match[str]) -> str:
        kind, cls = match.group(1), owner.get(match.group(2))

        def method(m: re.Match[str]) -> str:
            key = (module, cls, m.group(2))
            signature = m.group(2) + docs.signatures[key] if key in docs.signatures else None
            return f"{m.group(1)}{_with_doc(m.group(3), signature, docs.functions.get(key))})"

        def getset(m: re.Match[str]) -> str:
            doc = docs.functions.get((module, cls, m.group(2)))
            return m.group(0) if doc is None else f"{m.group(1)}PyDoc_STR({_literal(doc)}){m.group(3)}"

        body = (_METHOD if kind == "PyMethodDef" else _GETSET).sub(
            method if kind == "PyMethodDef" else getset, match.group(3)
        )
        return match.group(0).replace(match.group(3), body, 1)

    c_code = _TEMPLATE.sub(type_doc, c_code)  # first: which tables are whose
    return _TABLE.sub(table, c_code)


def with_docs(c_path: str, modules: set[str], docs: SourceDocs) -> str:
    """The path of a copy of the C file ``c_path`` with the docs (the file itself unless it is a
    module's); the copy is rewritten only when its text changes (the build recompiles it then)."""
    from mypyc.namegen import exported_name

    name = os.path.basename(c_path)
    module = next((m for m in modules if name == f"__native_{exported_name(m)}.c"), None)
    if module is None:
        return c_path
    with open(c_path, encoding="utf-8") as f:
        text = add_docs(f.read(), module, docs)
    target = c_path[: -len(".c")] + ".docs.c"
    try:
        with open(target, encoding="utf-8") as f:
            unchanged = f.read() == text
    except FileNotFoundError:
        unchanged = False
    if not unchanged:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    return target


def class_docs(docs: SourceDocs) -> dict[str, dict[str, Any]]:
    """Each class's docstring and annotations, by module and name: ``kv_cache_manager_v2/__init__.py``
    (compiled) gives them to the classes mypyc made non-native (it leaves them a filler docstring)
    and to the dataclasses (mypyc gives their fields runtime types)."""
    found: dict[str, dict[str, Any]] = {}
    for module, name in sorted({*docs.classes, *docs.class_annotations}):
        entry = {"doc": docs.classes.get((module, name)), "annotations": docs.class_annotations.get((module, name), {})}
        found.setdefault(module, {})[name] = entry
    return found
