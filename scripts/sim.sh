#!/usr/bin/env bash
# Set up (if needed) and run the main job: the serving simulator (kv-cache-sim) on its built-in
# workload, or with your options, e.g. scripts/sim.sh --model llama-3-70b --gpu 40GiB --trace t.jsonl
# It runs on the compiled core (2-6x faster): the first run builds it (about 2 minutes on 2 cores, progress
# shown; again only after a package source changed). KVCM_SIM_INTERPRETED=1 skips the build and
# runs interpreted.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/compiled_build.sh"
if [ -n "${KVCM_SIM_INTERPRETED:-}" ]; then
  stash_compiled  # (a compiled build in place would shadow the sources)
elif ! build_is_current 3 && ! { restore_compiled && build_is_current 3; }; then
  # (the test build, gcc -O1, is rebuilt at -O3: the simulator's timings are the optimised code's)
  echo "kv-cache-sim runs on the compiled core: building it once (KVCM_SIM_INTERPRETED=1 runs interpreted instead)" >&2
  build_compiled 3 >&2 || echo "the build failed: running interpreted" >&2
fi
kv-cache-sim "$@"
