#!/usr/bin/env bash
# One device call: tools/sdpa_probe.py (SDPA backends at training shapes), the FP8/graph/LoRA GPU tests,
# tools/fp8_profile.py, then `swift sft` FP8 vs bf16 LoRA at 1.5B / 2k (the size rule) under $OUT/a.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/a"
source "$(dirname "$0")/device_env.sh"
echo "== sdpa probe at ${SECONDS}s"
timeout ${PROBE_TIMEOUT:-130} python3 tools/sdpa_probe.py --out "$OUT/sdpa_probe.json" >"$OUT/sdpa_probe.txt" 2>&1
echo "-- rc $?"; cut -c1-400 "$OUT/sdpa_probe.txt"
TEST_PATHS=${TEST_PATHS-"tests/fusions/test_cudnn_attention.py tests/patching/test_layer_graphs.py tests/patching/test_fp8_base.py tests/ops/test_lora_linear_op.py tests/ops/test_fp8_linear_op.py"} \
  TEST_TIMEOUT=${TEST_TIMEOUT:-100} gpu_tests
echo "== profile at ${SECONDS}s"
timeout 140 python3 tools/fp8_profile.py >"$OUT/fp8_profile.txt" 2>&1; echo "-- rc $?"
grep -E "=====|^bf16|^fp8|^quantize|^_scaled|^W_q|GEMM|rows" "$OUT/fp8_profile.txt" | head -60
echo "== 1.5B CLI at ${SECONDS}s"
OUT=$OUT/a SHAPE=qwen2.5-1.5b SEQ=2048 VARIANTS="swift_liger swift_liger_fp8" TEST_PATHS= DEADLINE=$(( 575 - SECONDS )) \
  STEPS=16 WARMUP=4 NAME=swift_cli_fp8_small bash "$(dirname "$0")/gpu_swift_cli.sh" 2>&1 | grep -E "^\||done in|^== |rc "
echo "== all done at ${SECONDS}s"
