#!/usr/bin/env bash
# Preference training on GPU without and with swift_liger, then one plot comparing the two runs.
#   RLHF_TYPE=dpo bash examples/rlhf_lora.sh      (dpo | orpo | simpo | kto; needs pip install swift-liger[swift],
#                                                  a CUDA GPU)
# Offline by default: a random-init Qwen2.5-7B-shaped model (SHAPE=llama3-8b, ...) and preference pairs of two ~2k
# token sequences built on the GPU (examples/offline_model.sh). MODEL=Qwen/Qwen3-8B trains a hub model on a hub
# preference set instead.
#   TUNER=full SHAPE=qwen2.5-1.5b bash examples/rlhf_lora.sh   (full fine-tuning; dpo/kto load a reference model)
# With --use_liger the trainer takes its log-probs from hidden states: no [tokens, vocab] logits for the policy or
# the reference pass. The first step logs how many passes ran that way; liger_patch.json records it.
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
RLHF_TYPE=${RLHF_TYPE:-dpo}
TUNER=${TUNER:-lora}
STEPS=${STEPS:-100}
OUT=${OUT:-output/${RLHF_TYPE}_${TUNER}_compare}
if [ -n "${MODEL:-}" ]; then
  DATASET=hjh0119/shareAI-Llama3-DPO-zh-en-emoji                     # chosen + rejected_response rows
  [ "$RLHF_TYPE" = kto ] && DATASET='AI-ModelScope/ultrafeedback-binarized-preferences-cleaned-kto#20000'  # + label
  data=(--model "$MODEL" --use_hf true --dataset "$DATASET")
else
  SHAPE=${SHAPE:-qwen2.5-7b} SEQ=2048
  source "$(dirname "$0")/offline_model.sh"
  data=("${MODEL_FLAGS[@]}" --dataset "$PREF_DATA")                 # chosen + rejected_response rows
fi

tuner=(--tuner_type "$TUNER")
[ "$TUNER" = lora ] && tuner+=(--lora_rank 16 --lora_alpha 32 --target_modules all-linear)
common=(--rlhf_type "$RLHF_TYPE" "${data[@]}" "${tuner[@]}" --torch_dtype bfloat16 --max_length 4096
        --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --gradient_checkpointing true --max_steps "$STEPS" --logging_steps 5 --save_strategy no --report_to tensorboard)

# 1) stock ms-swift (swift_liger still logs step_time(s), tokens/s, peak memory and MFU: liger_metrics is on)
swift rlhf "${common[@]}" --output_dir "$OUT/stock"
# 2) the same run with swift_liger; --liger_cross_entropy off keeps every other kernel but the stock logits path
swift rlhf "${common[@]}" --output_dir "$OUT/liger" --use_liger

swift-liger plot "$OUT/stock" "$OUT/liger" -o "$OUT/compare.png"
echo "what ran: $(ls "$OUT"/liger/v*/liger_patch.json)"
