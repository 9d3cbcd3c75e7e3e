#!/usr/bin/env bash
# One device call: install carried wheels, run the op test suite on CUDA, then the benchmarks.
#   bash tools/gpu_suite.sh [tests|bench|all] [extra bench args]
# Writes logs and benchmark JSON/markdown under $OUT (or ./.out).
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/bench"
what=${1:-all}; shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  SWIFT_LIGER_TEST_GPU=1 timeout 280 python3 -m pytest tests/ops tests/models -q -x -n 8 -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for s in kernels attention loss_head; do
    timeout 200 python3 -m swift_liger.bench "$s" --out "$OUT/bench" "$@" 2>&1 | grep -v "^|" | tail -40
  done
fi
