#!/usr/bin/env bash
# The benchmark on an offline GPU machine (wheels from WHEEL_DIR, see gpu_env.sh), then run_bench.py ARGS...:
#   bash bench/gpu_bench.sh --model llama3.1-8b --modes per_sample,fixed_batch,dflash_prep,per_sample_warm,fixed_batch_warm,dflash_prep_warm --results-dir DIR
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 bench/run_bench.py "$@" 2>&1 | grep -v "sample/s\|examples/s"
