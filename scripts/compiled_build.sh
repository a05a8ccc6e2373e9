# Sourced by test.sh and sim.sh (after setup_env.sh): the mypyc build of the package, skipped when
# current, with its progress on the terminal; moving the compiled modules aside for fast mode.
#   ensure_compiled 3     # build at gcc -O3 unless that build is up to date (sim.sh; the benchmarks' level)
#   ensure_compiled any   # any up-to-date build will do, else build at $KVCM_MYPYC_OPT, default -O1 (test.sh)
# Both return 1 if the build failed (nothing compiled left in place). -O1 is the test build: the same C
# code, gcc in about half the time (setup_mypyc.py says the trade-off); each level has its own objects.
STAMP=build/mypyc.stamp    # touched by each successful build: no compiled .py newer than it, no rebuild
STASH=build/mypyc-stash    # the compiled modules, moved aside while fast mode runs (they shadow the sources)
LEVEL=build/mypyc.opt-level  # the gcc level of the build in place or stashed (setup_mypyc.py writes it)
TEST_OPT_LEVEL=1           # the level test.sh builds at when no current build is there
mkdir -p build

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

build_is_current() {  # a successful build (at level $1 unless "any") after the last change of any package source, in place
  [ -f "$STAMP" ] && [ -z "$(find kv_cache_manager_v2 setup_mypyc.py scripts/mypyc_docs.py -name '*.py' -newer "$STAMP" -print -quit)" ] \
    && [ -n "$(find . -maxdepth 1 -name '*__mypyc*' -print -quit)" ] \
    && { [ "$1" = any ] || [ "$(cat "$LEVEL" 2>/dev/null)" = "$1" ]; }
}

elapsed() { echo $(($(date +%s) - $1)); }

build_progress() {  # reads the build's output; prints each step with the seconds since $1 (start)
  local start=$1 total=$2 line done=0 c
  printf '  %4ds  mypyc: type-checking and generating C for %d modules\n' 0 "$total"
  while IFS= read -r line; do
    case "$line" in
      "building '"*"__mypyc' extension")
        printf '  %4ds  gcc: compiling the shared unit (one C file per module, those that changed, 2 at a time: the long step)\n' "$(elapsed "$start")" ;;
      "compiling "*" C files ("*)  # the shared unit's C files: those whose code changed, 2 at a time
        printf '  %4ds  gcc: %s\n' "$(elapsed "$start")" "$line" ;;
      "compiled C file "*)
        c=${line#compiled C file }; c=${c%%:*}  # k/n
        if [ $((${c%/*} % 10)) -eq 0 ] || [ "${c%/*}" = "${c#*/}" ]; then
          printf '  %4ds  gcc: C files %s\n' "$(elapsed "$start")" "$c"
        fi ;;
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

build_compiled() {  # at gcc -O$1; returns 1 (the log's tail printed, nothing compiled left in place) if the build fails
  local level=$1 log=build/mypyc.log start ticker total
  start=$(date +%s)
  total=$(python -c 'import glob, setup_mypyc as s; print(sum(not p.startswith(s.NOT_COMPILED) for p in glob.glob(s.PACKAGE + "/**/*.py", recursive=True)))')
  echo "== mypyc build (production mode, gcc -O$level; full log $log)"
  restore_compiled  # mypyc rewrites only the C files that change, setuptools recompiles only those
  touch "$STAMP.new"
  # (sleep's output elsewhere: killing the loop leaves it running for up to 30 s, and a sleep holding our
  # stdout kept a caller reading it, e.g. a test's subprocess.run, waiting that long)
  (while sleep 30 > /dev/null 2>&1; do printf '  %4ds  (still building)\n' "$(elapsed "$start")"; done) &
  ticker=$!
  if KVCM_MYPYC_OPT=$level python -u setup_mypyc.py build_ext --inplace -j 2 2>&1 | tee "$log" | build_progress "$start" "$total"; then
    kill "$ticker"
    mv "$STAMP.new" "$STAMP"
  else
    kill "$ticker"
    tail -50 "$log"
    stash_compiled  # never leave a half-built set shadowing the sources
    return 1
  fi
}

ensure_compiled() {  # $1: the gcc level wanted, or "any" (then a build is at $KVCM_MYPYC_OPT, default $TEST_OPT_LEVEL)
  if build_is_current "$1" || { restore_compiled && build_is_current "$1"; }; then
    echo "== mypyc build: up to date (gcc -O$(cat "$LEVEL"); no package source newer than $STAMP), skipped"
  elif [ "$1" = any ]; then
    build_compiled "${KVCM_MYPYC_OPT:-$TEST_OPT_LEVEL}"
  else
    build_compiled "$1"
  fi
}
