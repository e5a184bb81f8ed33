#!/usr/bin/env bash
# Kernel-level profile of one packed forward of a benchmark model (bench/forward_profile.py), with the image's
# transformers and, when ALT_WHEELS names a folder of wheels (e.g. a newer transformers and its huggingface_hub),
# again in a second process with those first on PYTHONPATH: the two Gated DeltaNet paths side by side.
#
#   bash bench/gpu_profile.sh RESULTS_DIR            # MODEL=qwen3.6-27b ROW_TOKENS=32768 ALT_WHEELS=.whl524
set -uo pipefail
out=${1:?results dir}
mkdir -p "$out"
model=${MODEL:-qwen3.6-27b}
rows=${ROW_TOKENS:-32768}
source "$(dirname "$0")/gpu_env.sh" > "$out/env.txt" 2>&1
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|huggingface|httpx|tokenizers|triton|click) " >> "$out/env.txt"
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/steps.log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s" | tee -a "$out/steps.log"
  tail -n 45 "$out/$name.log"
}
if [ "${WRITER_BENCH:-1}" = 1 ]; then  # the host's writer lanes on tmpfs, for the drain after the last forward
  step writer-bench 90 python3 bench/writer_bench.py --dir /dev/shm --threads 1,4 --gb 3 --json "$out/writer-bench.json"
fi
step profile-image "${LIMIT_IMAGE:-200}" python3 bench/forward_profile.py --model "$model" --row-tokens "$rows" \
  --json "$out/profile-image.json"
if [ -n "${ALT_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-alt "$ALT_WHEELS"/*.whl
  step profile-alt "${LIMIT_ALT:-160}" env PYTHONPATH="/tmp/site-alt:$PYTHONPATH" python3 bench/forward_profile.py \
    --model "$model" --row-tokens "$rows" --json "$out/profile-alt.json"
fi
