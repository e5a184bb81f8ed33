#!/usr/bin/env bash
# Targets larger than one GPU (`model.gpus_per_replica`, dflash_prep/replica.py), on one node of 2 GPUs
# (nvidia-h200-x2), offline (wheels from WHEEL_DIR, see gpu_env.sh):
#   bash bench/gpu_replica.sh [WORK_DIR]        (default /dev/shm/replica: outputs in memory, not on the disk)
#
# 1. The Llama-3.3-70B shape (bench/configs/llama3.3-70b.json, random bf16 weights: 141 GB, more than one GPU)
#    as ONE replica of 2 GPUs, EAGLE-3 layers [1, 39, 76] + the final state after the norm. Random weights are
#    only sharded by transformers while a checkpoint loads, so this runs the layer split (one process holding both
#    GPUs, `--num_processes 1`); then `dflash-prep verify` on it (rebuilt split over the same 2 GPUs) and its MFU
#    over both GPUs (2 x decoder params run x tok/s / (2 x 989 TFLOP/s bf16 dense)).
# 2. The Llama-3.1-8B shape saved as a checkpoint (random weights, 16 GB), so tensor parallelism applies: 1 GPU
#    (gpus_per_replica 1) against one tensor-parallel replica of 2 GPUs (`--num_processes 2`, one per GPU), same
#    data; both verified; the summary's tok/s and `replicas` printed side by side.
# Prints the commands and the figures; copy them with the summaries to bench/results/.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
WORK=${1:-/dev/shm/replica}
mkdir -p "$WORK"
TOK=recipes/tiny-demo/tokenizer  # any tokenizer serves pre-tokenized rows (ids checked against the config's vocab)
LAUNCH="python3 -m dflash_prep.cli launch"
VERIFY="python3 -m dflash_prep.cli verify"
run() { echo "+ $*"; "$@" 2>&1 | grep -v "sample/s\|examples/s"; }

python3 - "$WORK" <<'EOF'
import sys
from pathlib import Path
from bench.samples import make_samples, write_pretokenized
work = Path(sys.argv[1])
s = make_samples(4000, 5.41, 0.9, 16, 4096, 128256, seed=0)  # the benchmark's lengths (mean ~320 tokens)
write_pretokenized(work / "data.parquet", s, 4000)
EOF

COMMON=(--set "data.path=$WORK/data.parquet" --set data.max_length=4096 --set "model.tokenizer=$TOK"
        --set model.dtype=bfloat16 --set layers.preset=eagle3 --set layers.capture_final=after_norm
        --set batching.max_tokens_per_batch=auto --set output.overwrite=true)

# --- 1. the 70B shape, one replica of 2 GPUs (layer split) -----------------------------------------------------
OUT70=$WORK/out-70b
run $LAUNCH --num_processes 1 extract.py "${COMMON[@]}" --set model.config=bench/configs/llama3.3-70b.json \
    --set model.gpus_per_replica=2 --set data.max_samples=1000 --set "output.dir=$OUT70"
run $VERIFY "$OUT70" --num-samples 8 --seed 0
python3 - "$OUT70" <<'EOF'
import json, sys
s = json.load(open(f"{sys.argv[1]}/summary.json"))
r = s["ranks"][0]
flops = 2 * r["decoder_params_run"] * s["tokens_per_second"]
print("70B shape:", s["replicas"], f"{s['tokens_per_second']:,.0f} tok/s, MFU over 2 GPUs "
      f"{flops / (2 * 989e12):.3f}, peak GPU memory (first GPU) {r['peak_gpu_memory_bytes'] / 1e9:.1f} GB")
EOF

# --- 2. the 8B shape as a checkpoint: 1 GPU against 1 tensor-parallel replica of 2 GPUs --------------------------
CKPT=$WORK/llama3.1-8b-ckpt
python3 - "$CKPT" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from dflash_prep.norms import randomize_norm_gains
config = AutoConfig.from_pretrained("bench/configs/llama3.1-8b.json")
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
randomize_norm_gains(model, 0)
model.save_pretrained(sys.argv[1])
EOF
for n in 1 2; do
  run $LAUNCH --num_processes $n extract.py "${COMMON[@]}" --set model.config=null --set "model.name_or_path=$CKPT" \
      --set model.gpus_per_replica=$n --set "output.dir=$WORK/out-8b-gpus$n"
  run $VERIFY "$WORK/out-8b-gpus$n" --num-samples 8 --seed 0
done
python3 - "$WORK" <<'EOF'
import json, sys
one, two = (json.load(open(f"{sys.argv[1]}/out-8b-gpus{n}/summary.json")) for n in (1, 2))
print("8B shape, 1 GPU:", one["replicas"], f"{one['tokens_per_second']:,.0f} tok/s")
print("8B shape, 1 replica of 2 GPUs:", two["replicas"], f"{two['tokens_per_second']:,.0f} tok/s "
      f"({two['tokens_per_second'] / one['tokens_per_second']:.2f}x of 1 GPU on 2 GPUs)")
EOF
