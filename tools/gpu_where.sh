#!/usr/bin/env bash
# One device call: the GPU tests of what changed (FIRST_TESTS, one process), issue 27's "where the time goes"
# (tools/train_lab.py per CASES entry SHAPE:BxS:LAYERS: stock, ours, ours_mask_bits, Liger-Kernel in one process;
# host vs device time, launches, device kernel time by kind and the top kernels of one profiled step), optionally the
# `swift sft` CLI at CLI=SHAPE:SEQ (--use_liger vs Liger-Kernel), then older unverified GPU tests (TEST_PATHS) in
# the time left. DROPOUT_LAB=S: after the tests, tools/lora_dropout_lab.py's sweep (S seconds at most); FP8_PROFILE=S:
# tools/fp8_profile.py (S seconds at most); ATTN_LAB="ARGS": tools/attn_lab.py ARGS (ATTN_S seconds at most).
# Everything lands in $OUT/where.tgz after each section.
#   CALL_S=560 CASES="qwen2.5-7b:1x8192:8" CLI="qwen2.5-7b:8192" bash tools/gpu_where.sh
set -uo pipefail
OUT=${OUT:-.out}; W=$OUT/where; mkdir -p "$W"
source "$(dirname "$0")/device_env.sh"
pack() { tar czf "$OUT/where.tgz" -C "$W" . 2>/dev/null; }
left() { echo $(( ${CALL_S:-570} - SECONDS )); }
if [ -n "${FIRST_TESTS-x}" ]; then   # the tests of what changed this session, before the profiles
  echo "== first GPU tests at ${SECONDS}s"
  # one process by default: test_layer_graphs.py reads the root conftest by name, which xdist workers may resolve to
  # another; FIRST_N=8 spreads the other files over 8 workers (one process compiled 58 varlen/FP8 tests in 200 s)
  SWIFT_LIGER_TEST_GPU=1 timeout "${FIRST_TIMEOUT:-90}" python3 -m pytest -q -rf -p no:cacheprovider ${FIRST_N:+-n $FIRST_N} \
    ${FIRST_TESTS:-tests/ops/test_lora_dropout_kernel.py tests/ops/test_lora_linear_op.py tests/patching/test_layer_graphs.py} \
    >"$W/gpu_tests_first.txt" 2>&1; echo "-- tests rc $? at ${SECONDS}s"
  pkill -f execnet 2>/dev/null; grep -E "^FAILED|^ERROR|passed|failed" "$W/gpu_tests_first.txt" | cut -c1-200 | tail -8
  pack
fi
if [ -n "${DROPOUT_LAB-}" ]; then   # DROPOUT_LAB=S: tools/lora_dropout_lab.py's sweep, S seconds at most
  echo "== lora_dropout_lab at ${SECONDS}s"
  timeout $(( DROPOUT_LAB + 60 )) python3 tools/lora_dropout_lab.py --out "$W" --deadline "$DROPOUT_LAB" ${DROPOUT_LAB_ARGS:-} \
    2>&1 | grep -E '"best"|cublas|"copy"|device|skipped|Error' | cut -c1-300
  pack
fi
if [ -n "${FP8_PROFILE-}" ]; then   # FP8_PROFILE=S: tools/fp8_profile.py (op times, quantization configs), S s at most
  echo "== fp8_profile at ${SECONDS}s"
  timeout "$FP8_PROFILE" python3 tools/fp8_profile.py ${FP8_PROFILE_ARGS:-} >"$W/fp8_profile.txt" 2>&1
  echo "-- fp8_profile rc $? at ${SECONDS}s"; grep -E "^quantize_rows|^fp8:|^bf16:|mismatch" "$W/fp8_profile.txt" | head -40
  pack
fi
if [ -n "${ATTN_LAB-}" ]; then   # ATTN_LAB="ARGS": tools/attn_lab.py ARGS (ATTN_S seconds at most) -> attn_lab.json
  echo "== attn_lab at ${SECONDS}s"
  timeout "${ATTN_S:-180}" python3 tools/attn_lab.py --out "$W/attn_lab.json" $ATTN_LAB 2>&1 \
    | grep -vE "Warning|warn" | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:200]); continue
    print(r.get('impl'), r.get('heads'), r.get('layout'), r.get('ms') and round(r['ms'], 3), r.get('fwd_ms') and round(r['fwd_ms'], 3),
          r.get('tflops') and round(r['tflops']), r.get('error', '')[:120])"
  echo "-- attn_lab done at ${SECONDS}s"
  pack
fi
for case in ${CASES:-qwen2.5-7b:1x8192:8 llama3-8b:1x8192:8 qwen2.5-0.5b:8x512:0 qwen2.5-1.5b:4x2048:0 qwen2.5-3b:4x2048:0}; do
  IFS=: read -r shape tok layers <<<"$case"   # layers 0: the shape's own
  [ "$(left)" -lt "${NEED_S:-110}" ] && { echo "== $case skipped: $(left) s left"; continue; }
  echo "== train_lab $shape $tok at ${SECONDS}s"
  mkdir -p "$W/$shape-$tok"
  timeout $(( $(left) - 15 )) python3 tools/train_lab.py --shape "$shape" --tokens "$tok" --layers "${layers:-0}" \
    --variants "${LAB_VARIANTS:-stock,ours,ours_mask_bits,liger}" --rounds "${ROUNDS:-3}" --steps 2 --warmup 1 \
    --out "$W/$shape-$tok" 2>&1 | grep -vE "profiler_st|Warning|warn" | cut -c1-330
  python3 tools/train_lab.py report "$W/$shape-$tok/train_lab.json" > "$W/$shape-$tok/train_lab.md" 2>/dev/null
  pack
done
if [ -n "${CLI-}" ] && [ "$(left)" -gt 250 ]; then   # CLI="SHAPE:SEQ": `swift sft` LoRA, --use_liger vs Liger-Kernel
  IFS=: read -r shape seq <<<"$CLI"
  echo "== CLI $shape $seq at ${SECONDS}s"
  OUT=$W/cli SHAPE=$shape SEQ=$seq VARIANTS="${CLI_VARIANTS:-swift_liger liger_kernel}" TEST_PATHS= \
    DEADLINE=$(( $(left) - 10 )) STEPS=${STEPS:-10} WARMUP=3 NAME=swift_cli_${shape//[.-]/_}_where \
    bash "$(dirname "$0")/gpu_swift_cli.sh" 2>&1 | grep -E "^\||done in|^== |rc |Triton built|graph_layers" | cut -c1-400
  pack
fi
if [ -n "${TEST_PATHS-x}" ] && [ "$(left)" -gt 60 ]; then
  echo "== GPU tests at ${SECONDS}s"
  SWIFT_LIGER_TEST_GPU=1 timeout $(( $(left) - 10 )) python3 -m pytest -q -n 8 -rf -p no:cacheprovider \
    ${TEST_PATHS:-tests/ops/test_varlen_attention_kernel.py tests/ops/test_rms_norm_kernel.py tests/ops/test_rope_kernel.py tests/ops/test_qk_norm_rope_kernel.py tests/fusions/test_cudnn_attention.py} \
    >"$W/gpu_tests.txt" 2>&1; echo "-- tests rc $? at ${SECONDS}s"
  pkill -f execnet 2>/dev/null; grep -E "^FAILED|^ERROR|passed|failed" "$W/gpu_tests.txt" | cut -c1-200 | tail -15
  pack
fi
echo "== all done at ${SECONDS}s"
