#!/usr/bin/env bash
# LoRA SFT on GPU, without and with swift_liger, then one plot comparing the two runs.
#   bash examples/sft_lora.sh            (needs: pip install swift-liger[swift], a CUDA GPU)
# Offline by default: a random-init Llama-3-8B-shaped model (SHAPE=qwen2.5-7b, ...) and rows of ~4k tokens built on
# the GPU (examples/offline_model.sh). MODEL=Qwen/Qwen3-8B bash examples/sft_lora.sh trains a hub model on alpaca-gpt4.
# Multi-GPU: NPROC_PER_NODE=8 bash examples/sft_lora.sh  (swift launches torchrun; every rank is patched).
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
STEPS=${STEPS:-200}
OUT=${OUT:-output/sft_lora_compare}

if [ -n "${MODEL:-}" ]; then
  data=(--model "$MODEL" --use_hf true --dataset 'AI-ModelScope/alpaca-gpt4-data-en#20000')
else
  SHAPE=${SHAPE:-llama3-8b} SEQ=4096
  source "$(dirname "$0")/offline_model.sh"
  data=("${MODEL_FLAGS[@]}" --dataset "$SFT_DATA")
fi
common=("${data[@]}" --tuner_type lora --lora_rank 16 --target_modules all-linear --torch_dtype bfloat16 --max_length 4096
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --gradient_checkpointing true
        --max_steps "$STEPS" --logging_steps 5 --save_strategy no --report_to tensorboard)

# 1) stock ms-swift (swift_liger still logs step_time(s), tokens/s, peak memory and MFU: liger_metrics is on)
swift sft "${common[@]}" --output_dir "$OUT/stock"

# 2) the same run with swift_liger's kernels; per-fusion flags override the preset, e.g. --liger_swiglu false
swift sft "${common[@]}" --output_dir "$OUT/liger" --use_liger --liger_config default

# The same as (2) from a YAML file: swift sft configs/sft/qwen3_lora.yaml
swift-liger plot "$OUT/stock" "$OUT/liger" -o "$OUT/compare.png"
echo "what was patched: $(ls "$OUT"/liger/v*/liger_patch.json)"
