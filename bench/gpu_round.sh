#!/usr/bin/env bash
# One benchmark round on a machine with 2 GPUs, both busy, under one deadline (DEADLINE_SECONDS, default 570):
#   GPU 0: the Qwen3.6-27B-class hybrid; GPU 1: the Llama-3.1-8B shape, then the GPU exactness checks.
# Per model, two processes on the same samples:
#   (a) padded batches (batching.packing=false): the baselines, dflash_prep cold and warm, and the fused-kernel A/B
#       (dflash_prep_variant with model.kernels=eager), the fused kernels' figures at today's padding;
#   (b) batching.packing true (packed rows): dflash_prep cold and warm, the packing A/B (dflash_prep_variant
#       with batching.packing=false) and dflash_prep_fresh (a new process with the Triton cache (a) and (b) filled).
# Outputs: the 27B's shards on the local disk (/tmp); the 8B's on /dev/shm when it has room (the two models write
# at once, and the 8B alone needs ~0.9 GB/s), else /tmp. Each report says where (fs in its environment).
#   bash bench/gpu_round.sh RESULTS_DIR
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
R=${1:-bench/results}
mkdir -p "$R/logs"
T0=$(date +%s)
DEADLINE=${DEADLINE_SECONDS:-570}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
step() {  # step NAME GPU COMMAND...: run under the time left, log to R/logs/NAME.log, never stop the others
  local name=$1 gpu=$2; shift 2
  local t=$(left)
  if [ "$t" -le 20 ]; then echo "[round] $name: skipped, deadline"; return; fi
  echo "[round] $name: start on GPU $gpu ($t s left)"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$t" "$@" > "$R/logs/$name.log" 2>&1
  echo "[round] $name: exit $? after $(( $(date +%s) - T0 )) s"
  grep -h "tok/s\|\[bench\].*: \(ok\|error\)\|max_rel\|PASS\|FAIL\|error" "$R/logs/$name.log" | tail -12
}
SHM_FREE_GB=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
OUT8=/tmp/bench-out; [ "${SHM_FREE_GB:-0}" -ge 60 ] && OUT8=/dev/shm/bench-out
echo "[round] /dev/shm free: ${SHM_FREE_GB:-?} GB; 8B outputs under $OUT8; 27B outputs under /tmp/bench-out"
B="python3 bench/run_bench.py --results-dir $R"
gpu0() {
  step 27b-padded 0 $B --model qwen3.6-27b --out-dir /tmp/bench-out --dflash-set batching.packing=false \
      --modes fixed_batch,dflash_prep,dflash_prep_warm,dflash_prep_variant --variant-set model.kernels=eager \
      --fixed-batch-max-seconds 20
  step 27b-packed 0 $B --model qwen3.6-27b --out-dir /tmp/bench-out --dflash-set batching.packing=true \
      --modes dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_fresh --variant-set batching.packing=false
}
gpu1() {
  step 8b-padded 1 $B --model llama3.1-8b --out-dir $OUT8 --dflash-set batching.packing=false \
      --modes per_sample,fixed_batch,dflash_prep,dflash_prep_warm,dflash_prep_variant --variant-set model.kernels=eager \
      --per-sample-max-seconds 20 --fixed-batch-max-seconds 20
  step 8b-packed 1 $B --model llama3.1-8b --out-dir $OUT8 --dflash-set batching.packing=true \
      --modes dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_fresh --variant-set batching.packing=false
  step packing-check 1 python3 bench/packing_check.py --json "$R/packing_check.json"
  # WHEEL_DIR=/nonexistent: the wheels are installed once, above (reinstalling would swap files under the 27B run)
  step packing-verify 1 env SKIP_CHECK=1 WHEEL_DIR=/nonexistent bash bench/gpu_packing.sh "$R"
  step kernels-verify 1 env SKIP_CHECK=1 WHEEL_DIR=/nonexistent bash bench/gpu_kernels.sh "$R"
}
gpu0 & gpu1 & wait
echo "[round] done after $(( $(date +%s) - T0 )) s"
ls -la "$R"
