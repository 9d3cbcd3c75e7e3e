#!/usr/bin/env bash
# One device call: a long `swift sft --use_liger` run (memory flat? any NaN?) and a bf16 parity run (stock vs
# --use_liger, same seed) on a random-init Qwen2.5-0.5B-shaped model, LoRA, short rows; results in $OUT/soak.*
# (python -m swift_liger.bench.soak). Needs the ignored .whl/ carried.
#   SOAK_STEPS=1000 PARITY_STEPS=200 BATCH=8 SEQ=512 DEADLINE=590 bash tools/gpu_soak.sh
# At ~0.27 s (stock) / ~0.36 s (--use_liger) per step on an H200 (this shape is launch-bound), parity takes ~220 s
# and 1000 soak steps ~390 s with start-up: more than one 600 s call. PARITY_STEPS=0 skips the parity pair (the soak
# then gets the whole call; pass earlier parity runs to `python -m swift_liger.bench.soak` yourself).
set -uo pipefail
OUT=${OUT:-.out}; M=/tmp/model_soak; R=/tmp/soak_runs; DEADLINE=${DEADLINE:-590}
SOAK_STEPS=${SOAK_STEPS:-1000}; PARITY_STEPS=${PARITY_STEPS:-200}; BATCH=${BATCH:-8}; SEQ=${SEQ:-512}
mkdir -p "$OUT" "$R"
source "$(dirname "$0")/device_env.sh"
timeout 120 python3 -m swift_liger.bench.swift_cli build "$M" --shape qwen2.5-0.5b --seq "$SEQ" --rows 256 \
  --pref-rows 2 --device cuda 2>&1 | grep -v "Writing model" | tail -2
F="--model $M/model --model_type qwen2 --template qwen --dataset $M/sft.jsonl --tuner_type lora
   --target_modules all-linear --torch_dtype bfloat16 --attn_impl sdpa --check_model false --max_length $SEQ
   --per_device_train_batch_size $BATCH --gradient_accumulation_steps 1 --dataloader_num_workers 0
   --dataset_num_proc 1 --save_strategy no --report_to none --seed 42 --learning_rate 1e-4 --liger_metrics true"
left() { echo $(( DEADLINE - SECONDS )); }
run() {  # name timeout extra...
  local name=$1 t=$2; shift 2
  echo "== $name (timeout ${t}s, at ${SECONDS}s)"
  timeout "$t" swift sft $F --output_dir "$R/$name" "$@" >"$R/$name.log" 2>&1; echo "-- $name rc $? at ${SECONDS}s"
  grep -h "first step" "$R/$name.log" | cut -c1-200 | head -3
}
if [ "$PARITY_STEPS" -gt 0 ]; then
  run parity_stock 130 --max_steps "$PARITY_STEPS" --logging_steps 1
  run parity_liger 130 --max_steps "$PARITY_STEPS" --logging_steps 1 --use_liger
fi
run soak $(( $(left) - 20 )) --max_steps "$SOAK_STEPS" --logging_steps 10 --use_liger
[ "$PARITY_STEPS" -gt 0 ] || { cp "$(ls $R/soak/v*/logging.jsonl | head -1)" "$OUT/soak.logging.jsonl"
  echo "== done at ${SECONDS}s (no parity runs)"; exit 0; }
meta=$(python3 - <<PY
import json, subprocess, torch, transformers, triton
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": transformers.__version__, "shape": "qwen2.5-0.5b (random init), LoRA all-linear",
                  "batch": $BATCH, "max_length": $SEQ, "soak_steps": $SOAK_STEPS, "parity_steps": $PARITY_STEPS,
                  "command": "swift sft $(echo $F | tr '\n' ' ')"}))
PY
)
python3 -m swift_liger.bench.soak "$R/soak" "$R/parity_stock" "$R/parity_liger" --out "$OUT" --meta "$meta" \
  | head -60
for n in soak parity_stock parity_liger; do cp "$(ls $R/$n/v*/logging.jsonl | head -1)" "$OUT/$n.logging.jsonl"; done
echo "== done at ${SECONDS}s"
