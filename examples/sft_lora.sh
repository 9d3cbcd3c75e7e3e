#!/usr/bin/env bash
# LoRA SFT of Qwen3-8B on GPU, without and with swift_liger, then one plot comparing the two runs.
#   bash examples/sft_lora.sh            (needs: pip install swift-liger[swift], a CUDA GPU, hub access)
# Multi-GPU: NPROC_PER_NODE=8 bash examples/sft_lora.sh  (swift launches torchrun; every rank is patched).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
STEPS=${STEPS:-200}
OUT=${OUT:-output/sft_lora_compare}

common=(--model "$MODEL" --use_hf true --tuner_type lora --lora_rank 16 --target_modules all-linear
        --dataset 'AI-ModelScope/alpaca-gpt4-data-en#20000' --torch_dtype bfloat16 --max_length 4096
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --gradient_checkpointing true
        --max_steps "$STEPS" --logging_steps 5 --save_strategy no --report_to tensorboard)

# 1) stock ms-swift (swift_liger still logs step_time(s), tokens/s, peak memory and MFU: liger_metrics is on)
swift sft "${common[@]}" --output_dir "$OUT/stock"

# 2) the same run with swift_liger's kernels; per-fusion flags override the preset, e.g. --liger_swiglu false
swift sft "${common[@]}" --output_dir "$OUT/liger" --use_liger --liger_config default

# The same as (2) from a YAML file: swift sft configs/sft/qwen3_lora.yaml
swift-liger plot "$OUT/stock" "$OUT/liger" -o "$OUT/compare.png"
echo "what was patched: $(ls "$OUT"/liger/v*/liger_patch.json)"
