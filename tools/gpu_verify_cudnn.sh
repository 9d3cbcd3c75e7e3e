#!/usr/bin/env bash
# One device call: the GPU tests of the code no GPU has run yet (FP8 bases, cuDNN-first attention, layer graphs, the
# launch path, packed attention's custom ops), tools/sdpa_probe.py, then `swift sft` LoRA at Qwen2.5-7B shapes, 8k:
# --use_liger with and without --liger_cudnn_attention true, and --use_liger_kernel true, under $OUT/b.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/b"
source "$(dirname "$0")/device_env.sh"
TEST_PATHS=${TEST_PATHS-"tests/ops/test_launch.py tests/ops/test_fp8_linear_op.py tests/patching/test_fp8_base.py tests/fusions/test_cudnn_attention.py tests/patching/test_layer_graphs.py tests/ops/test_varlen_attention_kernel.py tests/ops/test_lora_linear_op.py"} \
  TEST_TIMEOUT=${TEST_TIMEOUT:-170} PYTEST_X= gpu_tests
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.txt" | head -20
echo "== sdpa probe at ${SECONDS}s"
timeout ${PROBE_TIMEOUT:-120} python3 tools/sdpa_probe.py --out "$OUT/sdpa_probe.json" >"$OUT/sdpa_probe.txt" 2>&1
echo "-- rc $?"; cut -c1-300 "$OUT/sdpa_probe.txt" | head -40
echo "== 7B 8k CLI at ${SECONDS}s"
[ $(( ${CALL_S:-570} - SECONDS )) -lt 250 ] && { echo "== CLI skipped: under 250 s left"; exit 0; }
OUT=$OUT/b SHAPE=qwen2.5-7b SEQ=8192 VARIANTS="${VARIANTS:-swift_liger swift_liger_cudnn liger_kernel}" TEST_PATHS= \
  DEADLINE=$(( ${CALL_S:-570} - SECONDS )) STEPS=${STEPS:-10} WARMUP=3 NAME=swift_cli_qwen2_5_7b_cudnn \
  bash "$(dirname "$0")/gpu_swift_cli.sh" 2>&1 | grep -E "^\||done in|^== |rc |Triton built|cudnn_attention"
echo "== all done at ${SECONDS}s"
