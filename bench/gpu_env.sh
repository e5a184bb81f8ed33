# Sourced by the GPU scripts: on an offline GPU machine, install the wheels of datasets, webdataset and
# flash-linear-attention and liger-kernel from a folder (WHEEL_DIR, default .whl/) and put them and the checkout on
# PYTHONPATH.
WHEEL_DIR=${WHEEL_DIR:-.whl}
if [ -d "$WHEEL_DIR" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python3 -c "import torch, transformers, accelerate, datasets, webdataset, fla; print(torch.__version__, transformers.__version__, accelerate.__version__, datasets.__version__, fla.__version__)"
