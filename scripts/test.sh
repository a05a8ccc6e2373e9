#!/usr/bin/env bash
# Set up (if needed) and run every check: ruff, import layering, mypy --strict, the test suite in fast mode,
# the mypyc build, and the test suite again compiled.
#   scripts/test.sh            # everything (what CI runs)
#   scripts/test.sh fast       # mypy + fast-mode tests only
#   scripts/test.sh compiled   # build + compiled tests only
# Extra arguments after the mode go to pytest, e.g. scripts/test.sh fast -k rawref
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
mode="${1:-all}"
shift || true

run_fast() {
  python setup_mypyc.py clean_compiled > /dev/null  # compiled modules would shadow the sources
  echo "== ruff (lint + format check), import layering"
  ruff check .
  ruff format --check . > /dev/null || { ruff format --diff . | head -40; exit 1; }
  lint-imports --no-cache > /dev/null || { lint-imports --no-cache | tail -20; exit 1; }
  echo "== mypy --strict"
  mypy
  echo "== tests, fast mode (interpreted)"
  KVCM_EXPECT_COMPILED=0 python -m pytest -q "$@"
}

run_compiled() {
  echo "== mypyc build (production mode)"
  python setup_mypyc.py build_ext --inplace -j 2 > build/mypyc.log 2>&1 || { tail -50 build/mypyc.log; exit 1; }
  echo "== tests, production mode (compiled)"
  KVCM_EXPECT_COMPILED=1 python -m pytest -q "$@"
  if [ $# -eq 0 ]; then
    echo "== benchmarks, quick variant (both modes; times are not asserted)"
    python benchmarks/run.py --quick --repeats 1 --out build/bench-quick.json
  fi
}

mkdir -p build
case "$mode" in
  fast) run_fast "$@" ;;
  compiled) run_compiled "$@" ;;
  all) run_fast "$@"; run_compiled "$@" ;;
  *) echo "usage: scripts/test.sh [all|fast|compiled] [pytest args]" >&2; exit 2 ;;
esac
