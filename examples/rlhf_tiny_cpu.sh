#!/usr/bin/env bash
# Runs anywhere on CPU, offline, in a few minutes: a tiny random Llama, 5 steps each of DPO, ORPO, SimPO and KTO
# (LoRA) with and without --use_liger; prints the per-step losses side by side and what the patched runs counted.
#   bash examples/rlhf_tiny_cpu.sh
# TRITON=1 bash examples/rlhf_tiny_cpu.sh runs the real Triton kernels in Triton's interpreter (slower).
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
OUT=${OUT:-runs/rlhf_tiny_cpu}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ "${TRITON:-0}" == "1" ]]; then export TRITON_INTERPRET=1 SWIFT_LIGER_BACKEND=triton; fi

swift-liger tiny "$OUT/tiny" --arch llama    # model dir + sft.jsonl + pref.jsonl + kto.jsonl, no network

common=(--model "$OUT/tiny/model" --model_type llama --template chatml --tuner_type lora
        --torch_dtype float32 --fp16 false --bf16 false --check_model false --gradient_accumulation_steps 2
        --dataloader_num_workers 0 --dataset_num_proc 1 --max_steps 5 --logging_steps 1 --max_length 128
        --per_device_train_batch_size 2 --learning_rate 1e-4 --save_strategy no --report_to none --seed 42)

for t in dpo orpo simpo kto; do
  data="$OUT/tiny/pref.jsonl"; [ "$t" = kto ] && data="$OUT/tiny/kto.jsonl"
  swift rlhf --rlhf_type "$t" "${common[@]}" --dataset "$data" --output_dir "$OUT/$t/stock" >"$OUT/$t.stock.log" 2>&1
  swift rlhf --rlhf_type "$t" "${common[@]}" --dataset "$data" --output_dir "$OUT/$t/liger" --use_liger \
    >"$OUT/$t.liger.log" 2>&1
  echo "== $t: loss per step, stock | --use_liger"
  losses='import json, sys; [print(r["loss"]) for r in map(json.loads, sys.stdin) if "loss" in r and "epoch" in r]'
  paste <(cat "$OUT"/$t/stock/v*/logging.jsonl | python3 -c "$losses") \
        <(cat "$OUT"/$t/liger/v*/logging.jsonl | python3 -c "$losses")
  grep -h "log-prob passes" "$OUT/$t.liger.log" | sed 's/.*swift_liger: //'
done
