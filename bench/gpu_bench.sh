#!/usr/bin/env bash
# The benchmark on an offline GPU machine: install the wheels of datasets, webdataset and
# flash-linear-attention from a folder (default .whl/), then run bench/run_bench.py with the given arguments.
#   bash bench/gpu_bench.sh --model llama3.1-8b --modes per_sample,fixed_batch,dflash_prep,per_sample_warm,fixed_batch_warm,dflash_prep_warm --results-dir DIR
set -euo pipefail
WHEEL_DIR=${WHEEL_DIR:-.whl}
if [ -d "$WHEEL_DIR" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python3 -c "import torch, transformers, datasets, webdataset, fla; print(torch.__version__, transformers.__version__, datasets.__version__, fla.__version__)"
python3 bench/run_bench.py "$@" 2>&1 | grep -v "sample/s\|examples/s"
