#!/usr/bin/env bash
# What fits on one GPU (README "What fits on one GPU"): a shipped recipe with swift_liger, then the same recipe stock
# (its use_liger / liger_* keys dropped), and one plot of both runs' loss, speed and memory.
#   bash examples/sft_fits_one_gpu.sh qlora_24gb|long_context|full_16k      (needs a CUDA GPU and hub access)
# qlora_24gb:   Qwen2.5-7B-Instruct QLoRA, 8k-token rows, batch 4 (configs/sft/qwen2_5_7b_qlora_24gb.yaml); under a
#               24 GiB cap stock fits batch 1
# long_context: Llama-3.1-8B-Instruct LoRA on 128k-token rows, long_context preset, 32 GiB of pinned host memory
#               (configs/sft/llama3_lora_long_context.yaml)
# full_16k:     Qwen2.5-1.5B-Instruct full fine-tuning on 16k-token rows with save_attention
#               (configs/sft/qwen2_5_1_5b_full_16k.yaml)
# The stock run may run out of memory: that is the comparison; the script goes on to the plot either way.
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
case "${1:-}" in
  qlora_24gb) cfg=configs/sft/qwen2_5_7b_qlora_24gb.yaml ;;
  long_context) cfg=configs/sft/llama3_lora_long_context.yaml ;;
  full_16k) cfg=configs/sft/qwen2_5_1_5b_full_16k.yaml ;;
  *) echo "usage: bash $0 qlora_24gb|long_context|full_16k" >&2; exit 2 ;;
esac
STEPS=${STEPS:-20}
OUT=${OUT:-output/fits_$1}
mkdir -p "$OUT"
python3 - "$cfg" "$OUT/stock.yaml" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
stock = {k: v for k, v in cfg.items() if k != "use_liger" and not k.startswith("liger_")}
yaml.safe_dump(stock, open(sys.argv[2], "w"), sort_keys=False)
PY
swift sft "$cfg" --max_steps "$STEPS" --save_strategy no --output_dir "$OUT/liger"
swift sft "$OUT/stock.yaml" --max_steps "$STEPS" --save_strategy no --output_dir "$OUT/stock" \
  || echo "the stock run failed (out of memory?): see $OUT/stock"
swift-liger plot "$OUT/stock" "$OUT/liger" -o "$OUT/compare.png" || echo "nothing to plot for the stock run"
