#!/usr/bin/env bash
# GPU check of `model.kernels` (offline wheels from WHEEL_DIR, see gpu_env.sh): fused vs eager in fp32 on 8-layer
# slices of both benchmark shapes (kernels_check.py; SKIP_CHECK=1 skips it), then a bf16 extraction with the fused
# kernels of each tiny architecture (the demo's Qwen3.5 hybrid with the final state before the norm; a Llama with
# EAGLE-3 layers and the final state after the norm) and `dflash-prep verify` on it (its reference runs with the
# same kernels; then once more against eager).   bash bench/gpu_kernels.sh [RESULTS_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RESULTS=${1:-bench/results}
mkdir -p "$RESULTS"
status=0
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  python3 bench/kernels_check.py --json "$RESULTS/kernels_check.json" || status=1
fi
for arch in qwen3.5 llama; do
  out=/tmp/kernels-$arch
  extra=(--set layers.capture_final=before_norm)  # the final norm is described before the kernels patch it
  if [ $arch = llama ]; then
    extra=(--set model.config=bench/configs/tiny-llama.json --set layers.preset=eagle3 --set layers.capture_final=after_norm)
  fi
  python3 extract.py --set output.dir=$out --set output.overwrite=true --set model.dtype=bfloat16 \
      --set data.max_samples=300 "${extra[@]}" 2>&1 | grep --line-buffered "kernels\|done\|error" || status=1
  python3 -c "import json; m=json.load(open('$out/manifest.json')); print('$arch manifest kernels:', m['kernels'])" || status=1
  python3 -m dflash_prep.commands.cli verify $out --num-samples 16 --seed 0 2>&1 | tail -5 || status=1
  python3 -m dflash_prep.commands.cli verify $out --num-samples 16 --seed 0 --skip-hash --set model.kernels=eager 2>&1 | tail -2
done
exit $status
