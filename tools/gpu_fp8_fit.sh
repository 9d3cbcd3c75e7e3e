#!/usr/bin/env bash
# One device call for FP8 LoRA bases (issue 30), second part: a 24 GiB card emulated on the H200 (long_context's
# --mem-cap-gib 24) at Qwen2.5-7B shapes, 8k tokens per row: the largest batch and tok/s of LoRA over FP8 bases
# against QLoRA (NF4, bitsandbytes) and bf16 LoRA, all swift_liger; then the small-shape `swift sft` check
# (Qwen2.5-1.5B shapes, FP8 bases vs bf16, tools/gpu_swift_cli.sh). Carry .whl with bitsandbytes (slim_bnb.sh).
#   SECTIONS="fit small"   FIT_DEADLINE=150   SMALL_SHAPE=qwen2.5-1.5b SMALL_SEQ=2048
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
LC="python3 -m swift_liger.bench.long_context --mem-cap-gib 24 --model qwen2.5-7b --seqs 8k --warmup 1 --steps 1"
for s in ${SECTIONS:-fit small}; do
  echo "== $s at ${SECONDS}s"
  case $s in
  fit)
    timeout $(( ${FIT_DEADLINE:-150} + 15 )) $LC --out "$OUT/fit24_fp8" --tuner lora --variants swift_liger_fp8,swift_liger \
      --batches 1,2,4,8 --point-timeout 45 --deadline "${FIT_DEADLINE:-150}" >"$OUT/fit24_fp8.log" 2>&1
    echo "-- rc $?"; grep -E "^  [a-z_0-9]+ +[0-9]+[kM]? |^largest|Stopped" "$OUT/fit24_fp8.log" | cut -c1-170
    timeout $(( ${FIT_DEADLINE:-150} - 20 )) $LC --out "$OUT/fit24_qlora" --tuner qlora --variants swift_liger \
      --batches 1,4,8 --point-timeout 45 --deadline $(( ${FIT_DEADLINE:-150} - 35 )) >"$OUT/fit24_qlora.log" 2>&1
    echo "-- rc $?"; grep -E "^  [a-z_0-9]+ +[0-9]+[kM]? |^largest|Stopped" "$OUT/fit24_qlora.log" | cut -c1-170
    ;;
  small)
    SHAPE=${SMALL_SHAPE:-qwen2.5-1.5b} SEQ=${SMALL_SEQ:-2048} VARIANTS="swift_liger_fp8 swift_liger" TEST_PATHS= \
      DEADLINE=$(( 560 - SECONDS )) STEPS=${SMALL_STEPS:-20} WARMUP=5 \
      NAME=swift_cli_fp8_small bash "$(dirname "$0")/gpu_swift_cli.sh"
    ;;
  esac
done
# $OUT returns at most 8 files and 2 folders down: keep the long_context reports whole as archives.
(cd "$OUT" && for d in fit24_fp8 fit24_qlora; do [ -d $d ] && tar czf $d.tar.gz $d && rm -rf $d; done)
echo "== done at ${SECONDS}s"
