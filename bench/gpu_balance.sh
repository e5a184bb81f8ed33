#!/usr/bin/env bash
# Issue 13 on one node of 2 GPUs (nvidia-h200-x2), offline (wheels from WHEEL_DIR, see gpu_env.sh):
#   bash bench/gpu_balance.sh RESULTS_DIR [WORK_DIR]     (WORK_DIR default /tmp/balance-work: on the disk, whose
#                                                         rate the split weighs)
# 1. 4,500 samples of the benchmark's lengths (lognormal, mean ~320 tokens, ~1.5M tokens) as pre-tokenized rows;
# 2. the Llama-3.1-8B shape (random bf16 weights), EAGLE-3 layers + the final state, fp8 storage, on 2 GPUs
#    (one process per GPU): the plan split by predicted time, the model loading while the rows are tokenized;
# 3. `dflash-prep verify` on 16 samples (both ranks' shards): the states equal each sample run alone through a
#    model rebuilt in the main thread, so the weights drawn on the load thread of each rank are the seed's;
# 4. per rank: loop seconds against predicted seconds, forwards, writer drain, start-up seconds per stage; and the
#    predicted finish of each rank under the former padded-token split of the same plan.
# Everything goes under RESULTS_DIR (one log per step, summary.json, the ranks' logs, balance.txt); each step has
# a time limit, so the script ends within about 9 minutes whatever happens. Earlier figures (the same shape and
# data, padded-token split, load after tokenizing): loop 36.2 s per rank, forwards ended at ~26 s, writers
# drained ~10 s more, wall 49.9 s.
set -uo pipefail
RESULTS=${1:?usage: bash bench/gpu_balance.sh RESULTS_DIR [WORK_DIR]}
WORK=${2:-/tmp/balance-work}
mkdir -p "$RESULTS" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd)
step() {  # step NAME SECONDS CMD...: run with a time limit, log to RESULTS/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  echo "[$(date -u +%H:%M:%S)] $name: $*" | tee -a "$RESULTS/steps.log"
  timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "[$(date -u +%H:%M:%S)] $name: exit code $rc$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$RESULTS/steps.log"
  grep -v "sample/s\|examples/s" "$RESULTS/$name.log" | tail -n 15
  return $rc
}

echo "[$(date -u +%H:%M:%S)] 0-env: gpu_env.sh" | tee -a "$RESULTS/steps.log"
source "$(dirname "$0")/gpu_env.sh" > "$RESULTS/0-env.log" 2>&1 || { cat "$RESULTS/0-env.log"; exit 1; }
cat "$RESULTS/0-env.log"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing outside the machine: no network waits
OUT=$WORK/out

step 1-data 90 python3 - "$WORK" <<'EOF' || exit 1
import sys
from pathlib import Path
from bench.samples import make_samples, write_pretokenized
s = make_samples(4500, 5.41, 0.9, 16, 4096, 128256, seed=0)
write_pretokenized(Path(sys.argv[1]) / "data.parquet", s, 4500)
print(s.params)
EOF

step 2-extract 330 python3 -m dflash_prep.commands.cli launch --config_file accelerate_configs/multi_gpu.yaml \
    --num_processes 2 extract.py --set "data.path=$WORK/data.parquet" --set data.max_length=4096 \
    --set model.config=bench/configs/llama3.1-8b.json --set model.tokenizer=dflash_prep/demo/tiny-demo/tokenizer \
    --set model.dtype=bfloat16 --set layers.preset=eagle3 --set layers.capture_final=after_norm \
    --set output.dtype=fp8_e4m3 --set batching.max_tokens_per_batch=auto --set output.overwrite=true \
    --set "output.dir=$OUT"
cp "$OUT/summary.json" "$OUT/plan.json" "$RESULTS/" 2>/dev/null
cp -r "$OUT/logs" "$RESULTS/rank-logs" 2>/dev/null

step 3-verify 240 python3 -m dflash_prep.commands.cli verify "$OUT" --num-samples 16 --seed 0

step 4-balance 120 python3 bench/balance_report.py "$OUT" "$RESULTS/balance.txt"
echo "results in $RESULTS"
