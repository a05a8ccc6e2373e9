"""Production mode: compile every module of kv_cache_manager_v2 with mypyc (opt level 3).

python setup_mypyc.py build_ext --inplace      # compiled .so files next to the sources
python setup_mypyc.py clean_compiled           # remove them again (back to fast mode)
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Command, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "kv_cache_manager_v2"
#: Modules left interpreted in production mode, each with its reason (tests/test_build_mode.py reads this).
#: ``events/``: msgspec.Struct subclasses cannot be native classes and pyzmq is plain Python; they run
#: off the scheduler's hot path (the compiled queue is ``_events.py``) and need the optional extra.
#: ``metrics.py``: runs only when Prometheus scrapes, on prometheus-client (optional extra, plain Python).
#: The simulator's presentation: ``sim/__main__.py`` (``python -m`` needs a code object), ``sim/_cli.py``
#: (argparse, optional tqdm) and ``sim/_plot.py`` (matplotlib, untyped); the replay loop they drive is compiled.
#: The package's ``__init__.py``: re-exports only, and mypyc drops docstrings (its map is what ``help()`` shows).
NOT_COMPILED = (
    "kv_cache_manager_v2/__init__.py",
    "kv_cache_manager_v2/events/",
    "kv_cache_manager_v2/metrics.py",
    "kv_cache_manager_v2/sim/__main__.py",
    "kv_cache_manager_v2/sim/_cli.py",
    "kv_cache_manager_v2/sim/_plot.py",
    "kv_cache_manager_v2/sim/_run.py",
)


def compiled_artifacts() -> list[str]:
    """The extension files an in-place mypyc build leaves behind."""
    found = glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.so"), recursive=True)
    found += glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.pyd"), recursive=True)
    found += glob.glob(os.path.join(ROOT, "*__mypyc*.so")) + glob.glob(os.path.join(ROOT, "*__mypyc*.pyd"))
    return sorted(found)


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


def main() -> None:
    os.chdir(ROOT)
    if "clean_compiled" in sys.argv:
        setup(name=PACKAGE, cmdclass={"clean_compiled": CleanCompiled}, script_args=["clean_compiled"])
        return
    from mypyc.build import mypycify

    sources = sorted(
        path
        for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
        if not path.replace(os.sep, "/").startswith(NOT_COMPILED)
    )
    ext_modules = mypycify(sources, opt_level="3", debug_level="0")
    setup(name=PACKAGE, packages=[], ext_modules=ext_modules, cmdclass={"clean_compiled": CleanCompiled})


if __name__ == "__main__":
    main()
