#!/usr/bin/env bash
# Packing / padding-free SFT without flash-attn, on CPU, offline, in about a minute: a tiny random Qwen3 model,
# the stock padded run, the same rows padding-free (one packed row per step, --attn_impl swift_liger: same losses),
# and a --packing run, then a plot of the three.
#   bash examples/sft_packing_tiny_cpu.sh
# TRITON=1 runs the real Triton kernels in Triton's interpreter (slower); without it, CPU tensors run the PyTorch
# references. On a GPU the same flags run the Triton varlen attention kernel.
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
OUT=${OUT:-runs/packing_tiny_cpu}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ "${TRITON:-0}" == "1" ]]; then export TRITON_INTERPRET=1 SWIFT_LIGER_BACKEND=triton; fi

swift-liger tiny "$OUT/tiny"

common=(--model "$OUT/tiny/model" --model_type qwen3 --template qwen3 --dataset "$OUT/tiny/sft.jsonl#64"
        --tuner_type lora --lora_dropout 0 --torch_dtype float32 --fp16 false --bf16 false --check_model false
        --gradient_accumulation_steps 1 --dataloader_num_workers 0 --dataset_num_proc 1 --max_steps 8
        --logging_steps 1 --max_length 128 --per_device_train_batch_size 4 --learning_rate 2e-3
        --save_strategy no --report_to none --seed 42)

swift sft "${common[@]}" --output_dir "$OUT/padded"
# ms-swift alone refuses --padding_free without flash-attn; --attn_impl swift_liger runs it (no --use_liger needed)
swift sft "${common[@]}" --output_dir "$OUT/padding_free" --padding_free true --attn_impl swift_liger
# with --use_liger, packing picks --attn_impl swift_liger by itself (one log line says so)
swift sft "${common[@]}" --output_dir "$OUT/packing" --packing true --use_liger

swift-liger plot "$OUT/padded" "$OUT/padding_free" "$OUT/packing" -o "$OUT/compare.png"
