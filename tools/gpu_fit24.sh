#!/usr/bin/env bash
# A 24 GiB card emulated on the H200 (every child capped with set_per_process_memory_fraction): results under $OUT.
#   bash tools/gpu_fit24.sh [q7lora] [q7qlora] [l8qlora]
# q7lora:  Qwen2.5-7B shapes, LoRA, 8k tokens per sequence: largest batch and tok/s (plain, Liger-Kernel, ours)
# q7qlora: the same with an NF4 base (QLoRA)
# l8qlora: Llama-3-8B shapes, QLoRA, batch 1: longest context (ours, and ours with tiled MLP + offloaded checkpoints)
# PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True) passes through to every child.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
LC="python3 -m swift_liger.bench.long_context --mem-cap-gib 24"
t0=$(date +%s)
for section in "${@:-q7lora q7qlora l8qlora}"; do
  for s in $section; do
    echo "== $s (t=$(( $(date +%s) - t0 ))s)"
    case "$s" in
    q7lora)  timeout "${Q7_TIMEOUT:-160}" $LC --out "$OUT/q7lora" --model qwen2.5-7b --tuner lora \
               --variants plain,liger,swift_liger --seqs 8k --batches 1,2,4,8 --warmup 1 --steps 1 \
               --point-timeout 45 --deadline "${Q7_DEADLINE:-150}" >"$OUT/q7lora.log" 2>&1 ;;
    q7qlora) timeout "${Q7_TIMEOUT:-160}" $LC --out "$OUT/q7qlora" --model qwen2.5-7b --tuner qlora \
               --variants plain,liger,swift_liger --seqs 8k --batches 1,2,4,8 --warmup 1 --steps 1 \
               --point-timeout 45 --deadline "${Q7_DEADLINE:-150}" >"$OUT/q7qlora.log" 2>&1 ;;
    l8qlora) timeout "${L8_TIMEOUT:-200}" $LC --out "$OUT/l8qlora" --model llama3-8b --tuner qlora \
               --variants swift_liger,long_context --seqs "${L8_SEQS:-64k,100k,128k}" --warmup 0 --steps 1 \
               --point-timeout 90 --deadline "${L8_DEADLINE:-190}" >"$OUT/l8qlora.log" 2>&1 ;;
    *) echo "unknown section $s"; continue ;;
    esac
    echo "$s rc $?"
    grep -E "^  [a-z_]+ +[0-9]+[kM]? |^largest|^longest|Stopped" "$OUT/$s.log" | cut -c1-170 | tail -16
  done
done
echo "== done (t=$(( $(date +%s) - t0 ))s)"
