#!/usr/bin/env bash
# The regeneration benchmark on an offline GPU machine (wheels from WHEEL_DIR, see gpu_env.sh), then
# regen_bench.py ARGS...; both benchmark shapes in about 8 minutes on one H200:
#   bash bench/gpu_regen.sh bench/results/regen-$(date +%Y%m%d)
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 bench/regen_bench.py "$@"
