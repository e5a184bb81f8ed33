#!/usr/bin/env bash
# The 27B hybrid end to end on a longer job, and the exactness of the transformers it runs, on one H200 (one
# command, every step under `timeout`, all within DEADLINE_SECONDS, default 540):
#
#   export WHEEL_DIR=.whl; source bench/gpu_env.sh > /dev/null 2>&1
#   ALT_WHEELS=.whl524 bash bench/gpu_long.sh RESULTS_DIR
#
# ALT_WHEELS (optional): a folder of wheels (e.g. transformers 5.24 and a huggingface_hub it accepts) installed
# first on PYTHONPATH for every step: all figures are then those of that transformers. Outputs on /dev/shm.
# Steps, each logged to RESULTS_DIR/logs/NAME.log; a failed step does not stop the next:
# 1. packing-check: bench/packing_check.py on the 27B slice (fp32 and bf16, packed row vs each sample alone; cold
#    Triton compiles of both dtypes take more than 150 s on a fresh machine: PC_SECONDS, default 300);
# 2. 27b-long: bench/run_bench.py, defaults (packed rows, `model.kernels: auto`), LONG_TOKENS real tokens
#    (default 800,000: ~41 GB of bf16 states, ~3x the standard 250,000), cold then warm pass;
# 3. 27b-short (SHORT=1): the standard 250,000-token run, cold then warm (SHORT_MODES: e.g. add dflash_prep_fresh,
#    a new process with the Triton cache the first pass filled);
# 4. 8b (RUN_8B=1): the Llama-3.1-8B shape's standard run, cold then warm.
set -uo pipefail
R=${1:?usage: bash bench/gpu_long.sh RESULTS_DIR}
mkdir -p "$R/logs" && R=$(cd "$R" && pwd)
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
DEADLINE=${DEADLINE_SECONDS:-540}
OUT=${OUT_DIR:-/dev/shm/bench-out}
STEP_TAG=long
STEP_GREP='tok/s\|\[bench\].*: \(ok\|error\)\|worst\|error\|Error'
source bench/gpu_step.sh  # step NAME SECONDS COMMAND...
if [ -n "${ALT_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-alt "$ALT_WHEELS"/*.whl
  export PYTHONPATH="/tmp/site-alt:${PYTHONPATH:-$PWD}"
fi
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" \
  | tee "$R/logs/versions.txt"
MODEL=${MODEL:-qwen3.6-27b}  # tiny-qwen3.5 ... for a dry run of this script on a CPU
PC_DEVICE=${PC_DEVICE:-cuda}
[ "${PC_SECONDS:-300}" -gt 0 ] && step packing-check "${PC_SECONDS:-300}" python3 bench/packing_check.py --models "${PC_MODELS:-qwen3.6-27b}" --device "$PC_DEVICE" \
  --json "$R/packing_check_long.json"
B=(python3 bench/run_bench.py --results-dir "$R" --model "$MODEL" --out-dir "$OUT" --modes dflash_prep,dflash_prep_warm)
[ "${LONG:-1}" = 1 ] && step 27b-long 330 "${B[@]}" --num-samples "${LONG_SAMPLES:-3000}" --dflash-max-tokens "${LONG_TOKENS:-800000}"
B=(python3 bench/run_bench.py --results-dir "$R" --out-dir "$OUT")
[ "${SHORT:-0}" = 1 ] && step 27b-short "${SHORT_SECONDS:-200}" "${B[@]}" --model "$MODEL" \
  --modes "${SHORT_MODES:-dflash_prep,dflash_prep_warm}"
[ "${RUN_8B:-0}" = 1 ] && step 8b 200 "${B[@]}" --model "${MODEL_8B:-llama3.1-8b}" --modes dflash_prep,dflash_prep_warm
echo "[long] done after $(( $(date +%s) - T0 )) s"
