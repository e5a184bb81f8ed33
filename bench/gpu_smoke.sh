#!/usr/bin/env bash
# GPU smoke check of the extraction path: run the demo recipe on the GPU in
# bf16 (fla kernels for the Gated DeltaNet layers) and the capture invariant tests.
set -euo pipefail
# Offline GPU machines: install the wheels of datasets, webdataset and flash-linear-attention from a folder.
WHEEL_DIR=${WHEEL_DIR:-.whl}
if [ -d "$WHEEL_DIR" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python3 -c "import torch, transformers, accelerate, datasets, webdataset, fla; print(torch.__version__, transformers.__version__, accelerate.__version__, datasets.__version__, fla.__version__)"
python3 extract.py --set output.dir=/tmp/smoke --set model.dtype=bfloat16 2>&1 | grep -v "sample/s\|examples/s"
python3 -c "import json; s=json.load(open('/tmp/smoke/summary.json')); print({k: s[k] for k in ('num_samples_written','num_tokens_written','tokens_per_second','padding_efficiency')}); print(s['ranks'][0])"
