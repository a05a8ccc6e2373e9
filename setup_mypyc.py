"""Production mode: compile every module of kv_cache_manager_v2 with mypyc (gcc -O3).

python setup_mypyc.py build_ext --inplace -j 2  # compiled .so files next to the sources
KVCM_MYPYC_OPT=1 python setup_mypyc.py build_ext --inplace -j 2  # the test build: gcc -O1
python setup_mypyc.py clean_compiled            # remove them again (back to fast mode)

``KVCM_MYPYC_OPT`` (1, 2 or 3, default 3) is gcc's optimisation level. ``scripts/test.sh`` builds at
-O1: the same C code (mypyc generates it before gcc sees a flag); the whole build took 157 instead
of 243 CPU seconds and the compiled tests 255 instead of 261 (measured on 2 loaded cores: the tests'
time is mostly interpreted test code). The benchmarks and ``scripts/sim.sh`` want -O3 and rebuild
when the build in place is another level (``LEVEL_FILE``). Each level keeps its own object files (``build/temp-O<n>``),
so switching back and forth recompiles only what changed since that level's last build.

Each module's C code is its own file (mypyc's ``multi_file``), compiled ``-j`` files at a time; a
rebuild recompiles only the files whose C code changed (mypyc rewrites a file only when its text
changes) or whose shared headers did. Compared with one C file for all modules: 220 instead of 480
CPU seconds for a full build, the same instructions per call (callgrind, within 0.2 %).
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from setuptools import Command, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "kv_cache_manager_v2"
#: Modules left interpreted in production mode, each with its reason (tests/test_build_mode.py reads this).
#: ``events/``: msgspec.Struct subclasses cannot be native classes and pyzmq is plain Python; they run
#: off the scheduler's hot path (the compiled queue is ``_events.py``) and need the optional extra.
#: ``metrics.py``: runs only when Prometheus scrapes, on prometheus-client (optional extra, plain Python).
#: The simulator's presentation: ``sim/__main__.py`` (``python -m`` needs a code object), ``sim/_cli.py``
#: (argparse, optional tqdm), ``sim/_signals.py`` (a signal handler raising) and ``sim/_plot.py`` (matplotlib, untyped); the replay loop they drive is compiled.
#: The package's ``__init__.py``: re-exports, the package map ``help()`` shows, and the docs of non-native classes.
NOT_COMPILED = (
    "kv_cache_manager_v2/__init__.py",
    "kv_cache_manager_v2/events/",
    "kv_cache_manager_v2/metrics.py",
    "kv_cache_manager_v2/sim/__main__.py",
    "kv_cache_manager_v2/sim/_cli.py",
    "kv_cache_manager_v2/sim/_time_cli.py",
    "kv_cache_manager_v2/sim/_signals.py",
    "kv_cache_manager_v2/sim/_plot.py",
    "kv_cache_manager_v2/sim/_run.py",
)


#: The docstrings and annotations of the compiled modules' classes, by module (scripts/mypyc_docs.py): the
#: package's ``__init__.py`` gives them to the classes mypyc made non-native (it leaves a filler docstring).
CLASS_DOCS_FILE = os.path.join(ROOT, PACKAGE, "_compiled_docs.json")

#: The gcc level of the build in place (or stashed by scripts/compiled_build.sh), written after each build.
LEVEL_FILE = os.path.join(ROOT, "build", "mypyc.opt-level")
OPT_LEVELS = ("1", "2", "3")


def opt_level() -> str:
    """The gcc level this build uses: ``$KVCM_MYPYC_OPT``, default 3."""
    level = os.environ.get("KVCM_MYPYC_OPT", "3")
    if level not in OPT_LEVELS:
        raise SystemExit(f"KVCM_MYPYC_OPT={level!r}: use one of {', '.join(OPT_LEVELS)} (-O0 turns C asserts on)")
    return level


def built_level() -> str | None:
    """The gcc level of the last successful build (None: none recorded)."""
    try:
        with open(LEVEL_FILE) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def compiled_artifacts() -> list[str]:
    """The extension files an in-place mypyc build leaves behind."""
    found = glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.so"), recursive=True)
    found += glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.pyd"), recursive=True)
    found += glob.glob(os.path.join(ROOT, "*__mypyc*.so")) + glob.glob(os.path.join(ROOT, "*__mypyc*.pyd"))
    return sorted(found + glob.glob(CLASS_DOCS_FILE))


class CleanCompiled(Command):
    description = "remove the mypyc-compiled modules (return to fast mode)"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        for path in compiled_artifacts():
            os.remove(path)
            print(f"removed {os.path.relpath(path, ROOT)}")
        if os.path.exists(LEVEL_FILE):
            os.remove(LEVEL_FILE)


def _up_to_date(obj: str, inputs: list[str]) -> bool:
    if not os.path.exists(obj):
        return False
    built = os.path.getmtime(obj)
    return all(os.path.getmtime(path) <= built for path in inputs if os.path.exists(path))


class ParallelBuildExt(build_ext):
    """``build_ext`` whose compiler builds an extension's C files ``-j`` at a time (default: one per
    core) and skips each object file newer than its C file, the extension's headers and mypyc's
    runtime headers. setuptools alone builds extensions in parallel but each one's files in a row,
    and recompiles all of them when one changed."""

    def finalize_options(self) -> None:
        level = opt_level()  # one object and library directory per level: switching levels reuses each one's objects
        self.build_temp = self.build_temp or os.path.join("build", f"temp-O{level}")
        self.build_lib = self.build_lib or os.path.join("build", f"lib-O{level}")
        super().finalize_options()

    def run(self) -> None:
        super().run()
        os.makedirs(os.path.dirname(LEVEL_FILE), exist_ok=True)
        with open(LEVEL_FILE, "w") as f:
            f.write(opt_level() + "\n")

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            self.compiler.compile = _incremental_compile(self.compiler, self.parallel or os.cpu_count() or 1)
        super().build_extensions()


def _incremental_compile(compiler: Any, jobs: int) -> Callable[..., list[str]]:
    from mypyc.build import include_dir

    runtime_headers = glob.glob(os.path.join(include_dir(), "*.h"))
    pool = ThreadPoolExecutor(jobs)  # shared by the extensions build_ext builds at once

    def compile_files(
        sources: list[str],
        output_dir: str | None = None,
        macros: Any = None,
        include_dirs: Any = None,
        debug: bool = False,
        extra_preargs: list[str] | None = None,
        extra_postargs: list[str] | None = None,
        depends: list[str] | None = None,
    ) -> list[str]:
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs
        )
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        headers = list(depends or ()) + runtime_headers
        todo = [obj for obj in objects if not _up_to_date(obj, [build[obj][0], *headers])]
        done = [0]
        many = len(sources) > 1  # the shared library (a module's own extension is one small file)

        def one(obj: str) -> None:
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
            done[0] += 1
            if many:
                print(f"compiled C file {done[0]}/{len(todo)}: {os.path.basename(src)}", flush=True)

        if many:
            print(
                f"compiling {len(todo)} of {len(sources)} C files ({len(sources) - len(todo)} up to date)", flush=True
            )
        for future in [pool.submit(one, obj) for obj in todo]:
            future.result()
        return objects

    return compile_files


def add_docs(sources: list[str], ext_modules: list[Any]) -> None:
    """Compile the sources' docstrings and signatures too (mypyc writes signatures only, some not):
    the extensions build copies of mypyc's C files with them in their method, getset and type tables
    (C string literals only: no code changes); the docs of the classes it makes non-native go to
    ``CLASS_DOCS_FILE``."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import json

    import mypyc_docs

    docs = mypyc_docs.SourceDocs(sources)
    modules = {mypyc_docs.module_name(path) for path in sources}
    for ext in ext_modules:
        ext.sources = [mypyc_docs.with_docs(path, modules, docs) for path in ext.sources]
    with open(CLASS_DOCS_FILE, "w", encoding="utf-8") as f:
        json.dump(mypyc_docs.class_docs(docs), f, indent=0, sort_keys=True)


def main() -> None:
    os.chdir(ROOT)
    if "clean_compiled" in sys.argv:
        setup(
            name=PACKAGE,
            cmdclass={"clean_compiled": CleanCompiled},
            script_args=["clean_compiled"],
        )
        return
    from mypyc.build import mypycify

    sources = sorted(
        path
        for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
        if not path.replace(os.sep, "/").startswith(NOT_COMPILED)
    )
    ext_modules = mypycify(sources, opt_level=opt_level(), debug_level="0", multi_file=True)
    add_docs(sources, ext_modules)
    setup(
        name=PACKAGE,
        packages=[],
        ext_modules=ext_modules,
        cmdclass={"clean_compiled": CleanCompiled, "build_ext": ParallelBuildExt},
    )


if __name__ == "__main__":
    main()
