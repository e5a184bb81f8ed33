#!/usr/bin/env bash
# One benchmark round on a machine with 2 GPUs, both busy, under one deadline (DEADLINE_SECONDS, default 570):
#   GPU 0: the Qwen3.6-27B-class hybrid; GPU 1: the Llama-3.1-8B shape.
# Per model, one process on one sample list: packed rows of at most PACKED_ROW_TOKENS (default 32768) tokens
# (`batching.packing=true`), cold and warm; the A/B, padded batches at the benchmark's auto budget
# (dflash_prep_variant with batching.packing=false, cold, then dflash_prep_variant_warm: the padded shapes warm
# too); dflash_prep_fresh (a new process with the Triton cache the earlier passes filled). The 8B also runs a
# profiled packed pass (host and GPU time by op), then packed rows of 65,536 tokens (row-size A/B).
# Outputs: both models' shards on /dev/shm when it has room (>= 60 GB free), else on the local disk (/tmp): the
# 27B alone produces 0.57 GB/s of bf16 states when packed, more than the ext4 disk of the third round took. Each
# report says where (fs in its environment).
#   bash bench/gpu_round.sh RESULTS_DIR          (ONE_GPU=1: both models on GPU 0, the 27B first)
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
echo "[round] /dev/shm free: ${SHM_FREE_GB:-?} GB; outputs under $OUT8"
B="python3 bench/run_bench.py --results-dir $R"
ROW=${PACKED_ROW_TOKENS:-32768}
gpu0() {
  step 27b-packed 0 $B --model qwen3.6-27b --out-dir $OUT8 --dflash-set batching.packing=true \
      --dflash-set batching.max_tokens_per_batch=$ROW \
      --modes dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_variant_warm,dflash_prep_fresh \
      --variant-set batching.packing=false --variant-set batching.max_tokens_per_batch=65536
}
gpu1() {  # gpu1 GPU
  step 8b-packed $1 $B --model llama3.1-8b --out-dir $OUT8 --dflash-set batching.packing=true \
      --dflash-set batching.max_tokens_per_batch=$ROW \
      --modes ${MODES_8B:-dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_fresh,dflash_prep_profile} \
      --variant-set batching.packing=false --variant-set batching.max_tokens_per_batch=131072
  step 8b-packed-65k $1 $B --model llama3.1-8b --out-dir $OUT8 --dflash-set batching.packing=true \
      --dflash-set batching.max_tokens_per_batch=65536 --modes dflash_prep,dflash_prep_warm
}
if [ "${ONE_GPU:-0}" = 1 ]; then  # a machine of one GPU: the 27B, then the 8B, one after the other on GPU 0
  gpu0; MODES_8B=${MODES_8B:-dflash_prep,dflash_prep_warm,dflash_prep_profile,dflash_prep_variant} gpu1 0
else
  gpu0 & gpu1 1 & wait
fi
echo "[round] done after $(( $(date +%s) - T0 )) s"
ls -la "$R"
