#!/usr/bin/env bash
# GPU check of packed rows (`batching.packing`), everything written under RESULTS_DIR (default bench/results):
#   1. bench/packing_check.py: one packed row of 8 samples (17-384 tokens) vs each sample alone, fp32 (TF32 off) and
#      bf16, on 8-layer slices of the Qwen3.6-27B and Llama-3.1-8B shapes with `model.kernels: auto`
#      -> packing_check.json, packing_check.log (bound 1e-3 in fp32); then the same on every family's GPU-sized
#      config (bench/families.py: sliding windows, softcap, sinks, MLA, MoE, Gated DeltaNet), with the attention
#      function's own check (varlen_attn with windows of 1-128 keys against attention written out)
#      -> packing_check_families.json, packing_check_families.log;
#   2. a bf16 extraction with packed rows (`batching.packing: true`: refused, exit 2, where not exact) of each tiny
#      architecture (the demo's Qwen3.5 hybrid, final state before the norm; a Llama with EAGLE-3 layers, final
#      state after the norm; scratch output in /tmp/packing-ARCH), then `dflash-prep verify` on it
#      -> extract-ARCH.log, summary-ARCH.json, manifest-ARCH.json, verify-ARCH.log.
# Every step has a timeout; a failed step is logged and the next one runs; exit code 1 if any step failed.
# ONLY_CHECK=1 runs step 1 alone, SKIP_CHECK=1 step 2 alone (each well under 10 minutes).
#   bash bench/gpu_packing.sh [RESULTS_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RESULTS=${1:-bench/results}
mkdir -p "$RESULTS"
status=0
step() { echo "[gpu_packing] $(date -u +%H:%M:%S) $*" | tee -a "$RESULTS/gpu_packing.log"; }

if [ "${SKIP_CHECK:-0}" != 1 ]; then
  step "packing_check (fp32 + bf16, 8-layer slices)"
  timeout 540 python3 bench/packing_check.py --json "$RESULTS/packing_check.json" 2>&1 \
      | grep -v "falling back" | tee "$RESULTS/packing_check.log"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; step "packing_check FAILED"; }
  step "packing_check (fp32 + bf16, every family's GPU-sized config)"
  timeout 540 python3 bench/packing_check.py --models none --families all \
      --json "$RESULTS/packing_check_families.json" 2>&1 | grep -v "falling back" \
      | tee "$RESULTS/packing_check_families.log"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; step "packing_check (families) FAILED"; }
fi
[ "${ONLY_CHECK:-0}" = 1 ] && { step "done (ONLY_CHECK), exit $status"; exit $status; }

for arch in qwen3.5 llama; do
  out=/tmp/packing-$arch
  extra=(--set layers.capture_final=before_norm)
  if [ $arch = llama ]; then
    extra=(--set model.config=bench/configs/tiny-llama.json --set layers.preset=eagle3 --set layers.capture_final=after_norm)
  fi
  step "extract $arch (bf16, batching.packing: true)"
  timeout 300 python3 extract.py --set output.dir=$out --set output.overwrite=true --set model.dtype=bfloat16 \
      --set data.max_samples=300 --set batching.packing=true "${extra[@]}" > "$RESULTS/extract-$arch.log" 2>&1 \
      || { status=1; step "extract $arch FAILED"; }
  grep "packing\|packed\|plan:\|kernels\|done\|error" "$RESULTS/extract-$arch.log" | tee -a "$RESULTS/gpu_packing.log"
  timeout 60 python3 -c "import json; m=json.load(open('$out/manifest.json')); print('$arch manifest packing:', m['packing'], 'kernels:', m['kernels']['applied'])" \
      2>&1 | tee -a "$RESULTS/gpu_packing.log"
  cp "$out/summary.json" "$RESULTS/summary-$arch.json" 2>/dev/null; cp "$out/manifest.json" "$RESULTS/manifest-$arch.json" 2>/dev/null
  step "verify $arch"
  timeout 300 python3 -m dflash_prep.commands.cli verify $out --num-samples 16 --seed 0 > "$RESULTS/verify-$arch.log" 2>&1 \
      || { status=1; step "verify $arch FAILED"; }
  tail -5 "$RESULTS/verify-$arch.log" | tee -a "$RESULTS/gpu_packing.log"
done
step "done, exit $status"
exit $status
