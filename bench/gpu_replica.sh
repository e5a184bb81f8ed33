#!/usr/bin/env bash
# Targets larger than one GPU (`model.gpus_per_replica`, dflash_prep/target/replica.py), on one node of 2 GPUs, offline,
# random weights from configs. ONE command, about 6 minutes (every step under `timeout`, all of them within
# REPLICA_BUDGET_SECONDS, default 570):
#
#   export WHEEL_DIR=.whl; source bench/gpu_env.sh > /dev/null 2>&1; bash bench/gpu_replica.sh RESULTS_DIR
#   bash bench/gpu_replica.sh RESULTS_DIR --dry-run-cpu      (every step on a CPU with tiny configs, seconds)
#
# Writes under RESULTS_DIR: steps.log (each step: start, command, status, seconds), one log per step, the
# summaries (*.summary.json), gemm.json, env.txt and replica.json (every figure; bench/replica_check.py). Big
# outputs go to WORK_DIR (default /tmp/dflash-replica: the local disk; its filesystem is recorded), each deleted
# once its summary is copied. A failed step does not stop the next.
#
# Steps:
# 1. data: 8000 pre-tokenized samples (the benchmark's lengths, mean ~320 tokens), the 8B and 70B configs.
# 2. gemm: one GPU's dense bf16 GEMM rate (8192^3), the MFU denominator.
# 3. 70b-tp: the Llama-3.3-70B shape (bench/configs/llama3.3-70b.json, random bf16 weights, 141 GB) as ONE replica
#    of 2 GPUs, tensor parallel (2 processes), EAGLE-3 layers [1, 39, 76] + the final state after the norm, ~205k
#    tokens; the random weights are drawn on the GPUs (each process its shards), never on the host.
#    verify-70b-tp: `dflash-prep verify` launched as the same tensor-parallel replica of 2 processes (the reference
#    computed as the extraction computed it); verify-70b-tp-one-process: one process, the reference split by layers
#    over the 2 GPUs (whole GEMMs: other bf16 rounding), with the shard hashes.
#    If 70b-tp fails: 70b-layer-split (1 process holding both GPUs) and its verify instead.
# 4. 8b-warmup (64 samples, not measured: fills the shared Triton cache, model.triton_cache_dir), then the
#    Llama-3.1-8B shape on the same ~2.5M tokens with `dflash-prep launch --num_processes 1` (8b-1gpu) and 2
#    (8b-2gpu: 2 replicas of 1 GPU, data parallel), EAGLE-3 layers stored as fp8_e4m3 (12 KB per token, so the
#    2-GPU run writes ~0.9 GB/s and the disk does not set the pace; each summary's `disk` says if it did).
#    RUN_8B=0 skips this step.
# 5. report: the 8B's per-GPU tok/s ratio (2 GPUs / 2 over 1 GPU; target >= 0.95), the 70B's tok/s, MFU over both
#    GPUs and verify's verdict, printed and in replica.json.
set -uo pipefail
RESULTS=${1:?usage: bash bench/gpu_replica.sh RESULTS_DIR [--dry-run-cpu]}
DRY=0
[ "${2:-}" = "--dry-run-cpu" ] && DRY=1
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
BUDGET=${REPLICA_BUDGET_SECONDS:-570}
WORK=${WORK_DIR:-/tmp/dflash-replica}
rm -rf "$WORK" && mkdir -p "$WORK"
if ! python3 -c "import webdataset, datasets" > /dev/null 2>&1; then
  source bench/gpu_env.sh > "$RESULTS/env.log" 2>&1  # the wheels, when the caller did not source it
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ $DRY = 1 ]; then
  export DFLASH_PREP_CPU_REPLICAS=1  # test-only: a node's processes stand for its GPUs (tensor parallel over gloo)
  TWO_PROCS=(--config_file accelerate_configs/cpu_2proc.yaml)
  N70=48; N8=240; NWARM=16; DRYFLAG=--dry-run-cpu
else
  TWO_PROCS=(--multi_gpu --num_processes 2)
  N70=640; N8=7800; NWARM=64; DRYFLAG=
fi

log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RESULTS/steps.log"; }

# step NAME SECONDS CMD...: CMD under `timeout` (SECONDS, or less when the budget runs out), its output in
# RESULTS/NAME.log, its status in WORK/steps.jsonl; returns CMD's exit code (99: skipped, no time left).
step() {
  local name=$1 want=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 20 ]; then
    log "$name: SKIPPED (no time left in the ${BUDGET}s budget)"
    echo "{\"name\": \"$name\", \"status\": \"skipped\", \"seconds\": 0}" >> "$WORK/steps.jsonl"
    return 99
  fi
  log "$name: start (timeout ${limit}s): $*"
  local start=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$? status
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status="failed (exit code $rc)" ;; esac
  local secs=$(( $(date +%s) - start ))
  echo "{\"name\": \"$name\", \"status\": \"$status\", \"exit_code\": $rc, \"seconds\": $secs}" >> "$WORK/steps.jsonl"
  log "$name: $status in ${secs}s"
  grep -v "sample/s\|examples/s\|it/s\]" "$RESULTS/$name.log" | grep "^\[dflash-prep\] done\|^error\|verify: \|Error" \
    | tail -4 | sed 's/^/    /' | tee -a "$RESULTS/steps.log"
  if [ $rc = 124 ] || [ $rc = 137 ]; then  # the launcher passed the stop on: let the ranks exit, then end any left
    sleep 10                              # (workers run in sessions of their own; their command lines name $WORK)
    for pid in $(pgrep -f -- "$WORK/"); do kill -9 "$pid" 2> /dev/null; done
    sleep 3
  fi
  return $rc
}

keep_summary() {  # keep_summary OUT NAME: RESULTS/NAME.summary.json, the rank logs; then OUT is deleted
  cp "$1/summary.json" "$RESULTS/$2.summary.json" 2> /dev/null
  mkdir -p "$RESULTS/$2.logs" && cp "$1"/logs/*.log "$RESULTS/$2.logs/" 2> /dev/null
  rm -rf "$1"
}

{
  echo "work dir: $WORK"; df -h "$WORK" | tail -1; findmnt -n -o FSTYPE,SOURCE --target "$WORK"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
  python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)"
  env | grep -E "^(NCCL_|TORCH_SYMM|NVSHMEM_)" | sort
} > "$RESULTS/env.txt" 2>&1
FS=$(findmnt -n -o FSTYPE --target "$WORK" 2> /dev/null | head -1 || stat -f -c %T "$WORK" 2> /dev/null || echo unknown)
case $FS in tmpfs|ramfs) KIND="memory, not a disk" ;; *) KIND="a disk, not /dev/shm" ;; esac
printf '"%s (%s filesystem: %s)"\n' "$WORK" "$FS" "$KIND" > "$WORK/disk.json"
log "results in $RESULTS, outputs in $WORK ($(cat "$WORK/disk.json")), budget ${BUDGET}s$([ $DRY = 1 ] && echo ', DRY RUN ON CPU')"

step data 90 python3 -m bench.replica_check data "$WORK" $DRYFLAG
step gemm 60 python3 -m bench.replica_check gemm "$RESULTS" $DRYFLAG

COMMON=(--set "data.path=$WORK/data.parquet" --set data.max_length=4096 --set model.tokenizer=dflash_prep/demo/tiny-demo/tokenizer
        --set model.dtype=bfloat16 --set layers.preset=eagle3 --set batching.max_tokens_per_batch=auto
        --set batching.num_workers=2 --set "model.triton_cache_dir=$WORK/triton" --set output.overwrite=true)
LAUNCH=(python3 -m dflash_prep.commands.cli launch)

# --- the 70B shape: one replica of 2 GPUs ------------------------------------------------------------------------
C70=(--set "model.config=$WORK/configs/70b.json" --set model.gpus_per_replica=2 --set "data.max_samples=$N70"
     --set layers.capture_final=after_norm --set output.dtype=bfloat16)
if step 70b-tp 200 "${LAUNCH[@]}" "${TWO_PROCS[@]}" extract.py "${COMMON[@]}" "${C70[@]}" \
    --set "output.dir=$WORK/out-70b-tp"; then
  # the reference computed as the extraction ran: the same tensor-parallel replica of 2 processes
  step verify-70b-tp 200 "${LAUNCH[@]}" "${TWO_PROCS[@]}" -m dflash_prep.commands.cli verify "$WORK/out-70b-tp" \
      --num-samples 8 --seed 0 --skip-hash
  # and, for comparison, one process (the reference split by layers over the GPUs: whole GEMMs)
  step verify-70b-tp-one-process 170 python3 -m dflash_prep.commands.cli verify "$WORK/out-70b-tp" --num-samples 8 --seed 0
  keep_summary "$WORK/out-70b-tp" 70b-tp
else
  keep_summary "$WORK/out-70b-tp" 70b-tp
  if step 70b-layer-split 200 "${LAUNCH[@]}" --num_processes 1 extract.py "${COMMON[@]}" "${C70[@]}" \
      --set model.replica_parallelism=layer_split --set "output.dir=$WORK/out-70b-ls"; then
    step verify-70b-layer-split 150 python3 -m dflash_prep.commands.cli verify "$WORK/out-70b-ls" --num-samples 8 --seed 0
  fi
  keep_summary "$WORK/out-70b-ls" 70b-layer-split
fi

# --- the 8B shape: 1 GPU, then 2 GPUs (2 replicas of 1), the same data (RUN_8B=0 skips it) ---------------------------
if [ "${RUN_8B:-1}" = 1 ]; then
C8=(--set "model.config=$WORK/configs/8b.json" --set layers.capture_final=none --set output.dtype=fp8_e4m3)
step 8b-warmup 90 "${LAUNCH[@]}" --num_processes 1 extract.py "${COMMON[@]}" "${C8[@]}" --set "data.max_samples=$NWARM" \
    --set "output.dir=$WORK/out-8b-warmup"
rm -rf "$WORK/out-8b-warmup"
step 8b-1gpu 170 "${LAUNCH[@]}" --num_processes 1 extract.py "${COMMON[@]}" "${C8[@]}" --set "data.max_samples=$N8" \
    --set "output.dir=$WORK/out-8b-1gpu"
keep_summary "$WORK/out-8b-1gpu" 8b-1gpu
step 8b-2gpu 130 "${LAUNCH[@]}" "${TWO_PROCS[@]}" extract.py "${COMMON[@]}" "${C8[@]}" --set "data.max_samples=$N8" \
    --set "output.dir=$WORK/out-8b-2gpu"
keep_summary "$WORK/out-8b-2gpu" 8b-2gpu
fi

# --- figures ------------------------------------------------------------------------------------------------------
python3 -m bench.replica_check report "$WORK" "$RESULTS" 2>&1 | tee "$RESULTS/report.log"
cp "$WORK/steps.jsonl" "$RESULTS/steps.jsonl" 2> /dev/null
log "done in $(( $(date +%s) - T0 ))s"
