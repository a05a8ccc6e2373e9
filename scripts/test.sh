#!/usr/bin/env bash
# Set up (if needed) and run every check: ruff, import layering, mypy --strict, the test suite in fast mode,
# the mypyc build, and the test suite again compiled.
#   scripts/test.sh            # everything (what CI runs)
#   scripts/test.sh fast       # mypy + fast-mode tests only
#   scripts/test.sh quick      # the edit-test loop: fast mode, stops at the first failure, last failures first
#   scripts/test.sh compiled   # build (skipped when up to date) + compiled tests only
# Extra arguments after the mode go to pytest, e.g. scripts/test.sh fast -k rawref
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
mode="${1:-all}"
shift || true

STAMP=build/mypyc.stamp    # touched by each successful build: no compiled .py newer than it, no rebuild
STASH=build/mypyc-stash    # the compiled modules, moved aside while fast mode runs (they shadow the sources)

compiled_modules() {
  find kv_cache_manager_v2 \( -name '*.so' -o -name '*.pyd' \) -print
  find . -maxdepth 1 \( -name '*__mypyc*.so' -o -name '*__mypyc*.pyd' \) -print
}

stash_compiled() {
  local f files
  files=$(compiled_modules)
  [ -n "$files" ] || return 0  # nothing in place: keep what an earlier run stashed
  rm -rf "$STASH"
  for f in $files; do
    mkdir -p "$STASH/$(dirname "$f")"
    mv "$f" "$STASH/$f"
  done
}

restore_compiled() {
  [ -d "$STASH" ] || return 0
  local f
  for f in $(cd "$STASH" && find . -type f -print); do
    mkdir -p "$(dirname "$f")"
    mv "$STASH/$f" "$f"
  done
  rm -rf "$STASH"
}

build_is_current() {  # a successful build after the last change of any package source, and its modules in place
  [ -f "$STAMP" ] && [ -z "$(find kv_cache_manager_v2 setup_mypyc.py -name '*.py' -newer "$STAMP" -print -quit)" ] \
    && [ -n "$(find . -maxdepth 1 -name '*__mypyc*' -print -quit)" ]
}

elapsed() { echo $(($(date +%s) - $1)); }

build_progress() {  # reads the build's output; prints each step with the seconds since $1 (start)
  local start=$1 total=$2 line done=0
  printf '  %4ds  mypyc: type-checking and generating C for %d modules\n' 0 "$total"
  while IFS= read -r line; do
    case "$line" in
      "building '"*"__mypyc' extension")
        printf '  %4ds  gcc: compiling the shared unit (all modules'"'"' code: the long step)\n' "$(elapsed "$start")" ;;
      "building '"*"' extension")
        done=$((done + 1))
        if [ $((done % 10)) -eq 0 ] || [ "$done" -eq "$total" ]; then
          printf '  %4ds  gcc: module entry points %d/%d\n' "$(elapsed "$start")" "$done" "$total"
        fi ;;
      *": error:"* | "error:"*) echo "$line" ;;
    esac
  done
  printf '  %4ds  done\n' "$(elapsed "$start")"
}

build_compiled() {
  local log=build/mypyc.log start ticker total
  start=$(date +%s)
  total=$(python -c 'import glob, setup_mypyc as s; print(sum(not p.startswith(s.NOT_COMPILED) for p in glob.glob(s.PACKAGE + "/**/*.py", recursive=True)))')
  echo "== mypyc build (production mode; full log $log)"
  restore_compiled  # mypyc rewrites only the C files that change, setuptools recompiles only those
  touch "$STAMP.new"
  (while sleep 30; do printf '  %4ds  (still building)\n' "$(elapsed "$start")"; done) &
  ticker=$!
  if python -u setup_mypyc.py build_ext --inplace -j 2 2>&1 | tee "$log" | build_progress "$start" "$total"; then
    kill "$ticker"
    mv "$STAMP.new" "$STAMP"
  else
    kill "$ticker"
    tail -50 "$log"
    stash_compiled  # never leave a half-built set shadowing the sources
    exit 1
  fi
}

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
  KVCM_EXPECT_COMPILED=0 python -m pytest -q "$@"
}

run_compiled() {
  if build_is_current || { restore_compiled && build_is_current; }; then
    echo "== mypyc build: up to date (no package source newer than $STAMP), skipped"
  else
    build_compiled
  fi
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
  quick) run_fast -x --ff "$@" ;;
  compiled) run_compiled "$@" ;;
  all) run_fast "$@"; run_compiled "$@" ;;
  *) echo "usage: scripts/test.sh [all|fast|quick|compiled] [pytest args]" >&2; exit 2 ;;
esac
