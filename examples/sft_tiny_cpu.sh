#!/usr/bin/env bash
# Runs anywhere in ~2 minutes on CPU, offline: a tiny random Qwen3 model, 10 LoRA steps with and without
# --use_liger, and a plot. (`make demo` does the same and prints a side-by-side table.)
#   bash examples/sft_tiny_cpu.sh
# TRITON=1 bash examples/sft_tiny_cpu.sh runs the real Triton kernels in Triton's interpreter (slower).
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
OUT=${OUT:-runs/tiny_cpu}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ "${TRITON:-0}" == "1" ]]; then export TRITON_INTERPRET=1 SWIFT_LIGER_BACKEND=triton; fi

swift-liger tiny "$OUT/tiny"      # model dir + sft.jsonl + pref.jsonl, deterministic, no network

common=(--model "$OUT/tiny/model" --model_type qwen3 --template qwen3 --dataset "$OUT/tiny/sft.jsonl"
        --tuner_type lora --torch_dtype float32 --fp16 false --bf16 false --check_model false
        --gradient_accumulation_steps 1 --dataloader_num_workers 0 --dataset_num_proc 1
        --max_steps 10 --logging_steps 1 --max_length 128 --per_device_train_batch_size 4
        --learning_rate 2e-3 --save_strategy no --report_to tensorboard --seed 42)

swift sft "${common[@]}" --output_dir "$OUT/stock"
swift sft "${common[@]}" --output_dir "$OUT/liger" --use_liger
# one fusion off, from the CLI:   --use_liger --liger_cross_entropy fused   (keeps logits, so token_acc is logged)

swift-liger plot "$OUT/stock" "$OUT/liger" -o "$OUT/compare.png"
cat "$OUT"/liger/v*/liger_patch.json
