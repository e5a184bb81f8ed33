#!/usr/bin/env bash
# GPU check of `model.kernels` (offline wheels from WHEEL_DIR, see gpu_env.sh): fused vs eager in fp32 on 8-layer
# slices of both benchmark shapes (kernels_check.py), then a bf16 extraction with the fused kernels of each tiny
# architecture (the demo's Qwen3.5 hybrid; a Llama with EAGLE-3 layers and the final state after the norm) and
# `dflash-prep verify` on it (its reference run is eager).   bash bench/gpu_kernels.sh [RESULTS_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RESULTS=${1:-bench/results}
mkdir -p "$RESULTS"
status=0
python3 bench/kernels_check.py --json "$RESULTS/kernels_check.json" || status=1
for arch in qwen3.5 llama; do
  out=/tmp/kernels-$arch
  extra=()
  if [ $arch = llama ]; then
    extra=(--set model.config=bench/configs/tiny-llama.json --set layers.preset=eagle3 --set layers.capture_final=after_norm)
  fi
  python3 extract.py --set output.dir=$out --set output.overwrite=true --set model.dtype=bfloat16 \
      --set data.max_samples=300 "${extra[@]}" 2>&1 | grep -v "sample/s\|examples/s" | grep "kernels\|done\|error" || status=1
  python3 -c "import json; m=json.load(open('$out/manifest.json')); print('$arch manifest kernels:', m['kernels'])" || status=1
  python3 -m dflash_prep.cli verify $out --num-samples 16 --seed 0 2>&1 | tail -4 || status=1
done
exit $status
