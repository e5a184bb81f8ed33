#!/usr/bin/env bash
# The 27B hybrid's forward levers on one H200, one command (about 9 minutes: a whole device call; every step under
# `timeout`, all within DEADLINE_SECONDS, default 540; the kernels check gets what the benchmark leaves):
#
#   export WHEEL_DIR=.whl; source bench/gpu_env.sh > /dev/null 2>&1; bash bench/gpu_levers.sh RESULTS_DIR
#
# Outputs of every benchmark go to /dev/shm (the disk does not set the pace). Steps, each logged to
# RESULTS_DIR/logs/NAME.log, a failed step does not stop the next:
# 1. 27b-padded: padded batches (`batching.packing=false`) with the defaults' kernels: the figure of issue 11's
#    "today's padding" target; cold and warm passes.
# 2. kernels-check: bench/kernels_check.py on the 27B slice in fp32 (fused kernels of `auto`, fla_gated_norm included,
#    vs eager).
set -uo pipefail
R=${1:?usage: bash bench/gpu_levers.sh RESULTS_DIR}
mkdir -p "$R/logs" && R=$(cd "$R" && pwd)
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
DEADLINE=${DEADLINE_SECONDS:-540}
OUT=/dev/shm/bench-out
STEP_TAG=levers
STEP_GREP='tok/s\|\[bench\].*: \(ok\|error\)\|worst\|layer  \|error'
source bench/gpu_step.sh  # step NAME SECONDS COMMAND...
MODEL=${MODEL:-qwen3.6-27b}  # tiny-llama ... for a dry run of this script on a CPU
B=(python3 bench/run_bench.py --results-dir "$R" --model "$MODEL" --out-dir "$OUT")
step 27b-padded 380 "${B[@]}" --dflash-set batching.packing=false --modes dflash_prep,dflash_prep_warm
step kernels-check 200 python3 bench/kernels_check.py --models "${KC_MODELS:-qwen3.6-27b}" --json "$R/kernels_check_gated_norm.json"
echo "[levers] done after $(( $(date +%s) - T0 )) s"
