#!/usr/bin/env bash
# One device call for FP8 LoRA bases (issue 30): the FP8 tests on the GPU, the projection benchmark (bf16 vs FP8,
# forward + input gradient, and LoRA over either base), then the real `swift sft` LoRA comparison of
# `--use_liger --liger_fp8_base true` against `--use_liger` (tools/gpu_swift_cli.sh, same call).
#   SHAPE=qwen2.5-7b SEQ=8192 VARIANTS="swift_liger_fp8 swift_liger"   (the defaults)   CLI=0: skip the CLI part
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/fp8"
export SHAPE=${SHAPE:-qwen2.5-7b} SEQ=${SEQ:-8192} VARIANTS=${VARIANTS:-swift_liger_fp8 swift_liger}
export TEST_PATHS=${TEST_PATHS:-tests/ops/test_fp8_linear_op.py tests/patching/test_fp8_base.py tests/ops/test_lora_linear_op.py}
source "$(dirname "$0")/device_env.sh"
gpu_tests
python3 -c "import torch; print('capability', torch.cuda.get_device_capability())"
echo "== fp8_linear bench at ${SECONDS}s"
timeout 200 python3 -m swift_liger.bench fp8_linear --out "$OUT/fp8" --rep-ms 200 >"$OUT/fp8/bench.log" 2>&1
echo "-- bench rc $? at ${SECONDS}s"; grep -E "fp8_linear" "$OUT/fp8/bench.log" | head -40
if [ "${CLI:-1}" = 1 ]; then
  TEST_PATHS= DEADLINE=${DEADLINE:-$(( 560 - SECONDS ))} NAME=${NAME:-swift_cli_fp8_${SHAPE//[.-]/_}} \
    bash "$(dirname "$0")/gpu_swift_cli.sh"
fi
