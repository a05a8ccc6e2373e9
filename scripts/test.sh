#!/usr/bin/env bash
# Set up (if needed) and run every check: ruff, import layering, mypy --strict, the test suite in fast mode,
# the mypyc build, and the test suite again compiled. The tests run on every core (pytest-xdist, -n auto);
# the build compiles one C file per module, two at a time, and on a rerun only what changed.
#   scripts/test.sh            # everything (what CI runs)
#   scripts/test.sh fast       # mypy + fast-mode tests only
#   scripts/test.sh quick      # the edit-test loop: fast mode, stops at the first failure, last failures first,
#                              # without the tests marked slow (the simulator's sweeps)
#   scripts/test.sh compiled   # build (skipped when up to date) + compiled tests only
# Extra arguments after the mode go to pytest, e.g. scripts/test.sh fast -k rawref (-n 0: one process)
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# (pytest workers then reuse the tests' cached bytecode: collection ~7 -> ~2 CPU s each)
unset PYTHONDONTWRITEBYTECODE
mode="${1:-all}"
shift || true

source "$(dirname "${BASH_SOURCE[0]}")/compiled_build.sh"  # ensure_compiled, stash_compiled

lint_and_types() {
  echo "== ruff (lint + format check), import layering"
  ruff check .
  ruff format --check . > /dev/null || { ruff format --diff . | head -40; exit 1; }
  lint-imports --no-cache > /dev/null || { lint-imports --no-cache | tail -20; exit 1; }
  echo "== mypy --strict"
  mypy
}

run_fast() {
  stash_compiled  # compiled modules would shadow the sources
  lint_and_types
  echo "== tests, fast mode (interpreted)"
  KVCM_EXPECT_COMPILED=0 python -m pytest -q -n auto "$@"
}

run_compiled() {
  ensure_compiled any || exit 1  # a current build of any level, else the test build (gcc -O1)
  echo "== tests, production mode (compiled; the mode-independent ones ran in fast mode)"
  KVCM_EXPECT_COMPILED=1 python -m pytest -q -n auto -m "not mode_independent" "$@"
  if [ $# -eq 0 ]; then
    echo "== benchmarks, quick variant (compiled: the tests ran both modes; times are not asserted)"
    # on the build the tests used (gcc -O1 unless an -O3 one was current): that the benchmarks run,
    # not their timings (benchmarks/run.py alone rebuilds at -O3)
    KVCM_MYPYC_OPT="$(cat "$LEVEL")" python benchmarks/run.py --quick --repeats 1 --modes compiled --out build/bench-quick.json
  fi
}

case "$mode" in
  fast) run_fast "$@" ;;
  quick) run_fast -x --ff -m "not slow" "$@" ;;
  compiled) run_compiled "$@" ;;
  all) run_fast "$@"; run_compiled "$@" ;;
  *) echo "usage: scripts/test.sh [all|fast|quick|compiled] [pytest args]" >&2; exit 2 ;;
esac
