#!/usr/bin/env bash
# One device call made of named sections, run in the order given; logs and results under $OUT.
#   bash tools/gpu_call.sh tests mem e2e tinysft rolling
# tests:   GPU test suite (ops, models, cache)
# bench:   kernel and attention benchmarks (python -m swift_liger.bench kernels|attention)
# mem:     what is alive at the training-step peak, ours vs Liger-Kernel (2 layers, tools/mem_peak.py)
# e2e:     Llama-3-8B-shaped LoRA loop, 32 layers (E2E_VARIANTS, default swift_liger,liger)
# tinysft: tiny `swift sft` in bf16: stock, --use_liger, --use_liger + lora_fusion; per-step losses side by side
# rolling: RollingKVCache decode benchmark (ROLLING_ARGS)
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/bench"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# .pth files are read only from site dirs: put the hook there so `swift sft --use_liger` sees our flags.
cp swift_liger_hook.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
t0=$(date +%s)
stamp() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
for section in "$@"; do
  case "$section" in
  tests)
    stamp tests
    SWIFT_LIGER_TEST_GPU=1 timeout 200 python3 -m pytest ${TEST_PATHS:-tests/ops tests/models tests/cache} -q -n 8 \
      -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1; echo "pytest rc $?"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -15 ;;
  bench)
    for suite in kernels attention; do
      stamp "bench $suite"
      timeout 150 python3 -m swift_liger.bench "$suite" --out "$OUT/bench" --rep-ms 300 2>&1 | grep -E " ms |failed" \
        | cut -c1-120
    done ;;
  mem)
    for v in swift_liger liger; do
      stamp "mem $v"
      timeout 120 python3 tools/mem_peak.py --variant "$v" --layers 2 --top 22 2>&1 | grep -v Warning | tail -26
    done ;;
  e2e)
    stamp e2e
    timeout 300 python3 -m swift_liger.bench.e2e --all --variants "${E2E_VARIANTS:-swift_liger,liger}" \
      --out "$OUT/bench" --steps 4 --warmup 2 2>&1 | grep -E "tok/s|failed" ;;
  tinysft)
    stamp tinysft
    python3 -m swift_liger.cli tiny /tmp/tiny >/dev/null 2>&1
    F="--model /tmp/tiny/model --model_type qwen3 --template qwen3 --dataset /tmp/tiny/sft.jsonl --tuner_type lora
       --torch_dtype bfloat16 --check_model false --gradient_accumulation_steps 1 --dataloader_num_workers 0
       --max_steps 10 --logging_steps 1 --max_length 256 --per_device_train_batch_size 8 --save_strategy no
       --report_to none --seed 42 --liger_metrics true
    --target_modules all-linear --gradient_checkpointing true"
    declare -A FLAGS=([stock]="" [liger]="--use_liger" [liger_lora]="--use_liger --liger_lora_fusion true")
    for d in stock liger liger_lora; do
      timeout 60 swift sft $F --output_dir /tmp/o_$d ${FLAGS[$d]} >"$OUT/sft_bf16_$d.log" 2>&1; echo "$d rc $?"
      f=$(ls /tmp/o_$d/v*/logging.jsonl | head -1); cp "$f" "$OUT/sft_bf16_$d.jsonl"
    done
    grep -h "lora_fusion in the first step" "$OUT"/sft_bf16_*.log | cut -c1-200
    python3 - <<'PY'
import json, os
out = os.environ.get("OUT", ".out")
runs = ("stock", "liger", "liger_lora")
rows = {d: [r for r in map(json.loads, open(f"{out}/sft_bf16_{d}.jsonl")) if "loss" in r] for d in runs}
for i, a in enumerate(rows["stock"]):
    line = [f"step {a.get('global_step/max_steps')}:"]
    for d in runs:
        r = rows[d][i] if i < len(rows[d]) else {}
        line.append(f"{d} loss {r.get('loss', float('nan')):.5f} tok/s {r.get('tokens/s')} peak {r.get('peak_alloc(GiB)')}")
    print("  ".join(line))
PY
    ;;
  rolling)
    stamp rolling
    timeout "${ROLLING_TIMEOUT:-240}" python3 -m swift_liger.bench.rolling_cache --out "$OUT/bench" ${ROLLING_ARGS:-} \
      >"$OUT/rc.log" 2>&1
    grep -E "ms/tok|long run|agreement|targets|Error|error" "$OUT/rc.log" | head -60 ;;
  *) echo "unknown section $section" ;;
  esac
done
stamp done
