#!/usr/bin/env bash
# GPU smoke check of the extraction path: run the demo recipe on the GPU in bf16 (fla kernels for the
# Gated DeltaNet layers) and print its summary.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 extract.py --set output.dir=/tmp/smoke --set model.dtype=bfloat16 2>&1 | grep -v "sample/s\|examples/s"
python3 -c "import json; s=json.load(open('/tmp/smoke/summary.json')); print({k: s[k] for k in ('num_samples_written','num_tokens_written','tokens_per_second','padding_efficiency')}); print(s['ranks'][0])"
