#!/usr/bin/env bash
# One device call: FP8 GPU tests + tools/fp8_profile.py, then `swift sft` FP8 vs bf16 LoRA at 1.5B / 2k
# (small: graph_layers) and 7B / 8k, each under its own folder of $OUT (a/, b/).
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/a" "$OUT/b"
TEST_PATHS="tests/patching/test_layer_graphs.py tests/patching/test_fp8_base.py tests/ops/test_lora_linear_op.py tests/ops/test_fp8_linear_op.py" \
  FIT=0 TEST_TIMEOUT=90 bash "$(dirname "$0")/gpu_fp8_diag.sh"
OUT=$OUT/a SECTIONS=small bash "$(dirname "$0")/gpu_fp8_fit.sh" 2>&1 | grep -E "^\||done in|^== |rc "
OUT=$OUT/b SHAPE=qwen2.5-7b SEQ=8192 VARIANTS="swift_liger_fp8 swift_liger" TEST_PATHS= DEADLINE=$(( 420 - SECONDS )) \
  NAME=swift_cli_fp8_qwen2_5_7b bash "$(dirname "$0")/gpu_swift_cli.sh" 2>&1 | grep -E "^\||done in|^== |rc "
echo "== all done at ${SECONDS}s"
