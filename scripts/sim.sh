#!/usr/bin/env bash
# Set up (if needed) and run the main job: the serving simulator (kv-cache-sim) on its built-in
# workload, or with your options, e.g. scripts/sim.sh --model llama-3-70b --gpu 40GiB --trace t.jsonl
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
kv-cache-sim "$@"
