#!/usr/bin/env bash
# Set up (if needed) and run the example: a manager on the host-emulated backend serving
# a few requests through the full life cycle, printing what happened.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python examples/demo.py "$@"
