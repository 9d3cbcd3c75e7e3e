#!/usr/bin/env bash
# LoRA SFT with the frozen base weights in FP8 (--liger_config fp8) beside the same run in bf16 (--use_liger), then
# one plot of both runs' loss, tokens/s and peak memory.
#   bash examples/sft_fp8_lora.sh     (needs: pip install swift-liger[swift], an sm_89+ GPU: L4, L40S, RTX 4090,
#                                      H100, H200)
# Offline by default: a random-init Qwen2.5-7B-shaped model (SHAPE=llama3-8b, ...) and rows of ~8k tokens are built
# on the GPU first (examples/offline_model.sh; speed and memory are the real model's, the loss is not meaningful).
# MODEL=Qwen/Qwen2.5-7B-Instruct bash examples/sft_fp8_lora.sh trains a hub model on alpaca-gpt4 instead.
# Without CUDA the offline model build stops first and says why; on a GPU older than sm_89 the fp8 run stops while
# its arguments are parsed and says why.
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
STEPS=${STEPS:-50}
OUT=${OUT:-output/sft_fp8_compare}

if [ -n "${MODEL:-}" ]; then
  data=(--model "$MODEL" --use_hf true --dataset 'AI-ModelScope/alpaca-gpt4-data-en#20000')
else
  SHAPE=${SHAPE:-qwen2.5-7b} SEQ=8192
  source "$(dirname "$0")/offline_model.sh"
  data=("${MODEL_FLAGS[@]}" --dataset "$SFT_DATA")
fi
common=("${data[@]}" --tuner_type lora --lora_rank 16 --target_modules all-linear --torch_dtype bfloat16
        --max_length 8192 --per_device_train_batch_size 1 --gradient_accumulation_steps 8
        --gradient_checkpointing true --max_steps "$STEPS" --logging_steps 5 --save_strategy no
        --report_to tensorboard --use_liger)

swift sft "${common[@]}" --output_dir "$OUT/bf16"
# the fp8 preset is the default preset plus fp8_base: true (configs/liger/fp8.yaml); --liger_fp8_base all also stores
# the frozen linears without LoRA (e.g. with --target_modules q_proj v_proj)
swift sft "${common[@]}" --output_dir "$OUT/fp8" --liger_config fp8
swift-liger plot "$OUT/bf16" "$OUT/fp8" -o "$OUT/compare.png"
echo "what was stored in FP8: the fp8_base lines of the second run's log, and $(ls "$OUT"/fp8/v*/liger_patch.json)"
