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


def _sim_sandbox(tmp: str) -> dict[str, str]:
    """A copy of ``scripts/sim.sh`` and ``scripts/compiled_build.sh`` in ``tmp`` with stand-ins: a
    ``setup_env.sh`` that puts a fake ``python`` (its mypyc build writes a ``*__mypyc*.so`` and its
    gcc level, and logs that level) and a ``kv-cache-sim`` that says whether a compiled module is in place."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(os.path.join(tmp, "scripts"))
    os.makedirs(os.path.join(tmp, "bin"))
    os.makedirs(os.path.join(tmp, "kv_cache_manager_v2"))
    for name in ("sim.sh", "compiled_build.sh"):
        shutil.copy(os.path.join(root, "scripts", name), os.path.join(tmp, "scripts", name))
    with open(os.path.join(tmp, "kv_cache_manager_v2", "mod.py"), "w") as f:
        f.write("x = 1\n")
    for name in ("setup_mypyc.py", "scripts/mypyc_docs.py"):  # the build's inputs besides the package
        with open(os.path.join(tmp, name), "w") as f:
            f.write("")
    with open(os.path.join(tmp, "scripts", "setup_env.sh"), "w") as f:
        f.write('set -euo pipefail\nROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"\ncd "$ROOT"\n')
        f.write('export PATH="$ROOT/bin:$PATH"\n')
    scripts = {
        "python": '#!/bin/bash\nif [ "$1" = -c ]; then echo 1; exit 0; fi\necho "${KVCM_MYPYC_OPT:-3}" >> builds.log\n'
        'echo "building \'x__mypyc\' extension"\ntouch x__mypyc.so\necho "${KVCM_MYPYC_OPT:-3}" > build/mypyc.opt-level\n',
        "kv-cache-sim": "#!/bin/bash\nif ls *__mypyc*.so >/dev/null 2>&1; then echo sim compiled; else echo sim interpreted; fi\n",
    }
    for name, text in scripts.items():
        path = os.path.join(tmp, "bin", name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    return dict(os.environ, PATH=os.environ.get("PATH", ""))


def _builds(tmp: str) -> list[str]:
    """The gcc level of each build the sandbox's fake python ran, in order."""
    path = os.path.join(tmp, "builds.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().split()


@pytest.mark.mode_independent  # (the build scripts, in a sandbox)
def test_sim_script_runs_on_the_compiled_core(tmp_path: object) -> None:
    """``scripts/sim.sh`` builds the compiled core on its first run (progress shown), skips the
    build while no source changed, and runs interpreted with ``KVCM_SIM_INTERPRETED=1``."""
    import subprocess
    import time

    tmp = str(tmp_path)
    env = _sim_sandbox(tmp)

    def sim(**extra: str) -> str:
        r = subprocess.run(["bash", "scripts/sim.sh"], cwd=tmp, env={**env, **extra}, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout + r.stderr

    def builds() -> int:
        return len(_builds(tmp))

    started = time.monotonic()
    first = sim()
    # (the build's 30 s progress ticker once left a sleep holding the output: each build waited for it)
    assert time.monotonic() - started < 20, "a build's output stayed open after the build"
    assert "sim compiled" in first and "mypyc build" in first and "compiling the shared unit" in first, first
    assert builds() == 1
    assert "sim compiled" in sim() and builds() == 1  # up to date: no second build
    assert "sim interpreted" in sim(KVCM_SIM_INTERPRETED="1") and builds() == 1
    assert "sim compiled" in sim() and builds() == 1  # the stashed build comes back
    later = os.path.getmtime(os.path.join(tmp, "build", "mypyc.stamp")) + 10
    os.utime(os.path.join(tmp, "kv_cache_manager_v2", "mod.py"), (later, later))
    assert "sim compiled" in sim() and builds() == 2  # a source changed: built again


@pytest.mark.mode_independent  # (the build scripts, in a sandbox)
def test_the_tests_build_at_o1_and_the_simulator_at_o3(tmp_path: object) -> None:
    """``ensure_compiled any`` (scripts/test.sh) builds at gcc -O1 and takes a current build of any
    level; ``scripts/sim.sh`` (like the benchmarks) runs only on an -O3 build, rebuilding a test build."""
    import subprocess

    tmp = str(tmp_path)
    env = _sim_sandbox(tmp)

    def run(command: str) -> str:
        script = f"source scripts/setup_env.sh; source scripts/compiled_build.sh; {command}"
        r = subprocess.run(["bash", "-c", script], cwd=tmp, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout + r.stderr

    assert "gcc -O1" in run("ensure_compiled any") and _builds(tmp) == ["1"]
    assert "up to date (gcc -O1" in run("ensure_compiled any") and _builds(tmp) == ["1"]
    assert "sim compiled" in run("bash scripts/sim.sh") and _builds(tmp) == ["1", "3"]  # rebuilt optimised
    assert "sim compiled" in run("bash scripts/sim.sh") and _builds(tmp) == ["1", "3"]
    assert "up to date (gcc -O3" in run("ensure_compiled any") and _builds(tmp) == ["1", "3"]  # the tests take it
    assert "gcc -O2" in run("build_compiled 2") and _builds(tmp) == ["1", "3", "2"]


@pytest.mark.mode_independent  # (the build scripts, in a sandbox)
def test_test_script_shares_the_build() -> None:
    """``scripts/test.sh`` and ``scripts/sim.sh`` use one build script (stamp, stash, progress)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("test.sh", "sim.sh"):
        with open(os.path.join(root, "scripts", name)) as f:
            text = f.read()
        assert "compiled_build.sh" in text and "setup_mypyc.py build_ext" not in text, name


@pytest.mark.mode_independent  # (the test runner's own rules)
def test_the_compiled_run_skips_only_the_mode_independent_tests() -> None:
    """The compiled run of ``scripts/test.sh`` deselects the tests marked ``mode_independent``
    (they run nothing compiled); the fast run keeps every test."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "test.sh")) as f:
        text = f.read()
    run_fast = text[text.index("run_fast() {") : text.index("run_compiled() {")]
    run_compiled = text[text.index("run_compiled() {") :]
    assert '-m "not mode_independent"' in run_compiled and "mode_independent" not in run_fast


@pytest.mark.mode_independent  # (the test runner's own rules)
def test_the_costliest_tests_are_handed_out_first() -> None:
    """conftest orders the tests for xdist: marked ``slow`` first, then hypothesis's state machines
    (``runTest``), then the rest, each group in file order."""
    import conftest

    class Item:  # what the hook reads of a pytest item
        def __init__(self, name: str, slow: bool) -> None:
            self.name, self.slow = name, slow

        def get_closest_marker(self, marker: str) -> object:
            return object() if marker == "slow" and self.slow else None

    items = [Item("a", False), Item("runTest", False), Item("b", True), Item("c", False), Item("d", True)]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [(i.name, i.slow) for i in items] == [
        ("b", True),
        ("d", True),
        ("runTest", False),
        ("a", False),
        ("c", False),
    ]


@pytest.mark.mode_independent  # (the build scripts, in a sandbox)
def test_the_build_compiles_only_the_c_files_that_changed(tmp_path: object) -> None:
    """``setup_mypyc.py`` compiles an extension's C files in parallel and skips each object file
    newer than its C file and the headers: an edit recompiles the modules whose C code changed, a
    changed header all of them."""
    import time

    from setup_mypyc import _incremental_compile

    tmp = str(tmp_path)
    compiled: list[str] = []

    class Compiler:  # the three hooks of a distutils compiler that compile_files uses
        def _setup_compile(
            self, out: object, macros: object, inc: object, sources: list[str], dep: object, extra: object
        ) -> tuple[object, list[str], object, list[str], dict[str, tuple[str, str]]]:
            build = {src[:-2] + ".o": (src, ".c") for src in sources}
            return macros, list(build), extra, [], build

        def _get_cc_args(self, pp_opts: list[str], debug: bool, before: object) -> list[str]:
            return ["-c"]

        def _compile(self, obj: str, src: str, ext: str, cc_args: object, extra: object, pp_opts: object) -> None:
            compiled.append(os.path.basename(src))
            with open(obj, "w") as f:
                f.write("")

    def touch(name: str, when: float) -> str:  # (times after mypyc's runtime headers, also inputs)
        path = os.path.join(tmp, name)
        with open(path, "a"):
            pass
        os.utime(path, (now + when, now + when))
        return path

    now = time.time()

    compile_files = _incremental_compile(Compiler(), 2)
    sources = [touch("a.c", 1000), touch("b.c", 1000)]
    header = touch("shared.h", 1000)
    compile_files(sources, depends=[header])
    assert sorted(compiled) == ["a.c", "b.c"]
    for name in ("a.o", "b.o"):
        touch(name, 2000)
    compiled.clear()
    compile_files(sources, depends=[header])
    assert compiled == []  # nothing changed
    touch("b.c", 3000)
    compile_files(sources, depends=[header])
    assert compiled == ["b.c"]  # one module's C code changed
    compiled.clear()
    for name in ("a.o", "b.o"):
        touch(name, 4000)
    touch("shared.h", 5000)
    compile_files(sources, depends=[header])
    assert sorted(compiled) == ["a.c", "b.c"]  # the header every module includes changed


def test_storage_statistics_keep_their_value_type_and_are_built_by_compiled_code() -> None:
    """``StorageStatistics`` (asked every step by the simulator, and by engines) and
    ``TierStatistics`` (``take_iteration_stats``, every step) behave as the frozen dataclasses
    they are (defaults, equality, hash, frozen fields, ``replace``, ``asdict``), and compiled
    they are built by compiled code: the ``__init__`` a dataclass generates stays interpreted
    (about 10k instructions a call, a sixth of a simulator step)."""
    import dataclasses
    import types

    from kv_cache_manager_v2 import CacheTier, StorageStatistics, TierStatistics
    from kv_cache_manager_v2._common import CacheLevel, PoolGroupIndex

    s = StorageStatistics(PoolGroupIndex(1), (4, 8), 10, 3, 2)
    assert (s.pool_group_index, s.slot_sizes, s.total, s.free, s.evictable) == (1, (4, 8), 10, 3, 2)
    assert (s.pinned, s.retained, s.available, s.unavailable) == (0, 0, 5, 5)
    full = StorageStatistics(PoolGroupIndex(1), (4, 8), 10, 3, 2, pinned=1, retained=2)
    assert (full.pinned_bytes, full.retained_bytes) == (12, 24)
    assert s == dataclasses.replace(full, pinned=0, retained=0)
    assert hash(s) == hash(StorageStatistics(PoolGroupIndex(1), (4, 8), 10, 3, 2))
    assert s != full and dataclasses.asdict(full)["retained"] == 2
    assert repr(s).startswith("StorageStatistics(pool_group_index=1, slot_sizes=(4, 8), total=10")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.free = 4  # type: ignore[misc]
    t = TierStatistics(CacheLevel(1), CacheTier.HOST_MEM, 100, 40, 60, 2, 20, 3, 30, 4, 40, 1)
    assert (t.level, t.tier, t.total_bytes, t.used_bytes, t.peak_used_bytes, t.io_errors, t.state_bytes) == (
        1,
        CacheTier.HOST_MEM,
        100,
        40,
        60,
        1,
        0,
    )
    assert (t.offloaded_pages, t.offloaded_bytes, t.onboarded_pages, t.onboarded_bytes) == (2, 20, 3, 30)
    assert (t.dropped_pages, t.dropped_bytes) == (4, 40) and dataclasses.replace(t, state_bytes=5).state_bytes == 5
    assert t == dataclasses.replace(t) and hash(t) == hash(dataclasses.replace(t))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.io_errors = 0  # type: ignore[misc]
    if kv_cache_manager_v2.compiled:
        for cls in (StorageStatistics, TierStatistics):
            assert not isinstance(cls.__dict__["__init__"], types.FunctionType), cls
