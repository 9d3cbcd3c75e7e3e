#!/usr/bin/env bash
# The closing device call: GPU test suite, kernel benchmarks, tiny `swift sft` in bf16 with and without
# --use_liger, RollingKVCache benchmark. Logs and results under $OUT.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/bench"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# .pth files are read only from site dirs: put the hook there so `swift sft --use_liger` sees our flags.
cp swift_liger_hook.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
echo "== tests"
SWIFT_LIGER_TEST_GPU=1 timeout 120 python3 -m pytest tests/ops tests/models tests/cache -q -n 8 \
  -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1; grep -E "passed|failed|^FAILED" "$OUT/gpu_tests.log" | tail -12
echo "== bench"
timeout 150 python3 -m swift_liger.bench kernels --out "$OUT/bench" --rep-ms 300 2>&1 | grep -E " ms |failed" | cut -c1-120
timeout 50 python3 -m swift_liger.bench attention --out "$OUT/bench" --rep-ms 300 2>&1 | grep -E " ms |failed" | cut -c1-120
echo "== swift sft (torch_dtype from the tiny model: fp32; add --torch_dtype bfloat16 for bf16)"
python3 -m swift_liger.cli tiny /tmp/tiny >/dev/null 2>&1
F="--model /tmp/tiny/model --model_type qwen3 --template qwen3 --dataset /tmp/tiny/sft.jsonl --tuner_type lora
   --check_model false --gradient_accumulation_steps 1 --dataloader_num_workers 0 --max_steps 10 --logging_steps 1
   --max_length 256 --per_device_train_batch_size 8 --save_strategy no --report_to none --seed 42"
timeout 50 swift sft $F --output_dir /tmp/o_stock >"$OUT/sft_stock.log" 2>&1; echo "stock rc $?"
timeout 50 swift sft $F --output_dir /tmp/o_liger --use_liger >"$OUT/sft_liger.log" 2>&1; echo "liger rc $?"
for d in stock liger; do f=$(ls /tmp/o_$d/v*/logging.jsonl | head -1); cp "$f" "$OUT/sft_$d.jsonl"; done
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", ".out")
rows = {d: [json.loads(l) for l in open(f"{out}/sft_{d}.jsonl") if '"loss"' in l] for d in ("stock", "liger")}
for a, b in zip(rows["stock"], rows["liger"]):
    print(f"step {a.get('global_step/max_steps')}: loss {a['loss']:.5f} vs {b['loss']:.5f}  tok/s "
          f"{a.get('tokens/s')} vs {b.get('tokens/s')}  peak_alloc {a.get('peak_alloc(GiB)')} vs {b.get('peak_alloc(GiB)')}")
PY
echo "== rolling cache"
timeout 60 python3 -m swift_liger.bench.rolling_cache --out "$OUT/bench" --tokens 8192 --tokens-b8 2048 \
  --contexts 4096,16384 --steps 32 >"$OUT/rc.log" 2>&1; grep -E "ms/tok|RESULT|target|failed|Error" "$OUT/rc.log" | head -30
