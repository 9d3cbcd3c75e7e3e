#!/usr/bin/env bash
# One device call: the FP8 GPU tests, tools/fp8_profile.py (where an FP8 projection's time goes), and the 24 GiB
# fit's FP8 batch 8 point (long_context --mem-cap-gib 24).
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
export TEST_PATHS=${TEST_PATHS:-tests/ops/test_fp8_linear_op.py tests/patching/test_fp8_base.py tests/ops/test_lora_linear_op.py}
source "$(dirname "$0")/device_env.sh"
TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests
echo "== profile at ${SECONDS}s"
timeout 150 python3 tools/fp8_profile.py >"$OUT/fp8_profile.txt" 2>&1; echo "-- rc $?"
grep -E "=====|^bf16|^fp8|^quantize|^_scaled|^W_q|GEMM" "$OUT/fp8_profile.txt"
if [ "${FIT:-1}" = 1 ]; then
  echo "== fit b8 at ${SECONDS}s"
  timeout 100 python3 -m swift_liger.bench.long_context --mem-cap-gib 24 --model qwen2.5-7b --seqs 8k --warmup 1 \
    --steps 1 --out "$OUT/fit24_fp8_b8" --tuner lora --variants swift_liger_fp8 --batches 8 --point-timeout 80 \
    --deadline 90 >"$OUT/fit24_fp8_b8.log" 2>&1
  grep -E "^  [a-z_0-9]+ +[0-9]+[kM]? |^largest|Stopped" "$OUT/fit24_fp8_b8.log" | cut -c1-170
  (cd "$OUT" && tar czf fit24_fp8_b8.tar.gz fit24_fp8_b8 && rm -rf fit24_fp8_b8)
fi
echo "== done at ${SECONDS}s"
