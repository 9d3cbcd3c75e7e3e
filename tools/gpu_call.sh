#!/usr/bin/env bash
# One device call made of named sections, run in the order given; logs and results under $OUT.
#   bash tools/gpu_call.sh tests mem e2e tinysft rolling
# tests:   GPU test suite (ops, models, cache)
# bench:   kernel and attention benchmarks (python -m swift_liger.bench kernels|attention)
# mem:     what is alive at the training-step peak, ours vs Liger-Kernel (2 layers, tools/mem_peak.py)
# e2e:     Llama-3-8B-shaped LoRA loop, 32 layers (E2E_VARIANTS, default swift_liger,liger)
# tinysft: tiny `swift sft` in bf16: stock, --use_liger, --use_liger + lora_fusion; per-step losses side by side
# tinyrlhf: tiny `swift rlhf` (dpo bf16 + fp32, orpo, kto; LoRA): stock vs --use_liger, every logged metric compared
# logprobs: the preference-loss head op benchmark (python -m swift_liger.bench logprobs)
# families: stock vs swift_liger per model family, LoRA and full (python -m swift_liger.bench.families; FAMILY_ARGS)
# qlora:   QLoRA tests on CUDA (no xdist), then tiny `swift sft --quant_method bnb --quant_bits 4` bf16: stock vs
#          --use_liger, per-step losses (needs the bitsandbytes wheel in .whl/: ../shared/gpu/slim_bnb.sh)
# rolling: RollingKVCache decode benchmark (ROLLING_ARGS; ROLLING_ARGS=--only-hybrid: the Gemma-2 hybrid cache only)
# decode:  issue 15's eager/graph grid at 32 layers: profile past the window, then matched context at window -/+,
#          2x, 8x (DECODE_BATCHES default 1,4; DECODE_KINDS, DECODE_CONTEXTS, DECODE_STEPS x DECODE_ROUNDS;
#          DECODE_ARGS adds e.g. --pad-step 64); results in $OUT/decode
# sweep:   per-op sweep against every peer, CUDA-graph timing (python -m swift_liger.bench.sweep run; SWEEP_ARGS).
#          The 119 cases take ~2 calls: copy the first call's sweep.jsonl into the tree (untracked files travel) and
#          run the second with SWEEP_ARGS="--graphs --deadline 520 --skip that/sweep.jsonl"; `sweep report A B` merges
# tune:    launch-configuration grid per op, CUDA-graph timing (python3 tools/tune.py; TUNE_OPS, default rms_norm)
# eager:   interleaved eager decode across caches (python -m swift_liger.bench.eager_decode; EAGER_ARGS)
# labs:    LABS (default "flce glu host"): tools/flce_lab.py (linear+CE GEMMs, chunk sizes, BLAS backends, profile;
#          FLCE_ARGS), "train": tools/train_lab.py (training step: host vs device, launches, syncs; TRAIN_ARGS),
#          tools/glu_lab.py (SwiGLU 28672 repeated), tools/host_lab.py (host µs per decode-sized op
#          call), "step": tools/step_lab.py (eager decode host time per layer; STEP_ARGS); logs and JSON in $OUT/labs
# longctx: longest trainable context per variant, 8B LoRA (python -m swift_liger.bench.long_context; LONGCTX_ARGS)
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/bench"
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
stamp() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
for section in "$@"; do
  case "$section" in
  tests)
    stamp tests
    # -vv (addopts has -q): every result line names its test, so a run cut by the time limit still says which ones failed
    SWIFT_LIGER_TEST_GPU=1 timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest ${TEST_PATHS:-tests/ops tests/patching tests/fusions tests/test_patcher.py tests/cache} -n 16 -rf \
      -vv -p no:cacheprovider -W ignore::pytest.PytestWarning >"$OUT/gpu_tests.log" 2>&1; echo "pytest rc $?"
    pkill -f "python3 -m pytest" 2>/dev/null; pkill -f "execnet" 2>/dev/null; sleep 1   # workers a timeout orphaned
    echo "tests: $(grep -c " PASSED " "$OUT/gpu_tests.log") passed, $(grep -c " SKIPPED " "$OUT/gpu_tests.log") skipped"
    grep -E "[0-9]+ (passed|failed)|FAILED|^ERROR| ERROR " "$OUT/gpu_tests.log" | cut -c1-220 | tail -15 ;;
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
  tinyrlhf)
    stamp tinyrlhf
    python3 -m swift_liger.cli tiny /tmp/tinyl --arch llama >/dev/null 2>&1
    F="--model /tmp/tinyl/model --model_type llama --template chatml --tuner_type lora --check_model false
       --gradient_accumulation_steps 2 --dataloader_num_workers 0 --max_steps 10 --logging_steps 1 --max_length 256
       --per_device_train_batch_size 4 --save_strategy no --report_to none --seed 42 --learning_rate 1e-4
       --liger_metrics true"
    for spec in dpo:bfloat16 dpo:float32 orpo:float32 kto:float32; do
      t=${spec%%:*}; dt=${spec##*:}; data=/tmp/tinyl/pref.jsonl; [ "$t" = kto ] && data=/tmp/tinyl/kto.jsonl
      prec="--torch_dtype $dt"; [ "$dt" = float32 ] && prec="$prec --bf16 false --fp16 false"
      for d in stock liger; do
        extra=""; [ "$d" = liger ] && extra="--use_liger"
        timeout 90 swift rlhf --rlhf_type "$t" $F $prec --dataset $data --output_dir /tmp/or_${t}_${dt}_$d $extra \
          >"/tmp/or_${t}_${dt}_$d.log" 2>&1; echo "$t $dt $d rc $?"
      done
    done
    grep -h "log-prob passes" /tmp/or_*_liger.log | cut -c1-200
    python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", ".out")
skip = {"elapsed_time", "remaining_time", "train_speed(s/it)", "step_time(s)", "tokens/s", "rss(GiB)", "memory(GiB)",
        "global_step/max_steps", "peak_alloc(GiB)", "peak_reserved(GiB)", "MFU"}
def rows(name):
    paths = glob.glob(f"/tmp/or_{name}/v*/logging.jsonl")
    return [r for r in map(json.loads, open(paths[0])) if "loss" in r and "global_step/max_steps" in r] if paths else []
summary = {}
for spec in ("dpo_bfloat16", "dpo_float32", "orpo_float32", "kto_float32"):
    a, b = rows(f"{spec}_stock"), rows(f"{spec}_liger")
    worst = {}
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if k in skip or not isinstance(v, (int, float)) or not isinstance(rb.get(k), (int, float)):
                continue
            rel = abs(v - rb[k]) / max(abs(v), 1e-6)
            worst[k] = max(worst.get(k, 0.0), rel)
    summary[spec] = {"steps": [len(a), len(b)], "max_rel_diff": worst,
                     "loss_stock": [r["loss"] for r in a], "loss_liger": [r["loss"] for r in b],
                     "peak_alloc_stock": max((r.get("peak_alloc(GiB)", 0) for r in a), default=None),
                     "peak_alloc_liger": max((r.get("peak_alloc(GiB)", 0) for r in b), default=None)}
    print(spec, "steps", len(a), len(b), "max rel diff: loss %.2e," % worst.get("loss", float("nan")),
          "worst metric %s %.2e" % max(worst.items(), key=lambda kv: kv[1]) if worst else "")
json.dump(summary, open(f"{out}/tiny_rlhf_h200.json", "w"), indent=1)
PY
    ;;
  logprobs)
    stamp "bench logprobs"
    timeout 240 python3 -m swift_liger.bench logprobs --out "$OUT/bench" --rep-ms 300 2>&1 | grep -E " ms |failed" \
      | cut -c1-140 ;;
  families)
    stamp families
    timeout "${FAMILIES_TIMEOUT:-300}" python3 -m swift_liger.bench.families --out "$OUT/bench" ${FAMILY_ARGS:-} \
      >"$OUT/families.log" 2>&1; echo "families rc $?"
    grep -E "^\| |Error|error" "$OUT/families.log" | cut -c1-200 | tail -30 ;;
  qlora)
    stamp qlora
    SWIFT_LIGER_TEST_GPU=1 timeout "${QLORA_TESTS_TIMEOUT:-150}" python3 -m pytest tests/patching/test_qlora.py \
      tests/ops/test_lora_linear_op.py -rf -p no:cacheprovider >"$OUT/gpu_qlora_tests.log" 2>&1
    echo "pytest rc $?"; grep -E "passed|failed|^FAILED" "$OUT/gpu_qlora_tests.log" | tail -8
    python3 -m swift_liger.cli tiny /tmp/tinyq --arch llama >/dev/null 2>&1
    F="--model /tmp/tinyq/model --model_type llama --template chatml --dataset /tmp/tinyq/sft.jsonl --tuner_type lora
       --torch_dtype bfloat16 --check_model false --gradient_accumulation_steps 1 --dataloader_num_workers 0
       --max_steps 10 --logging_steps 1 --max_length 256 --per_device_train_batch_size 8 --save_strategy no
       --report_to none --seed 42 --target_modules all-linear --quant_method bnb --quant_bits 4
       --bnb_4bit_use_double_quant true"
    for d in stock liger; do
      extra=""; [ "$d" = liger ] && extra="--use_liger"
      timeout 90 swift sft $F --output_dir /tmp/oq_$d $extra >"$OUT/qlora_$d.log" 2>&1; echo "$d rc $?"
    done
    grep -h "lora_fusion in the first step" "$OUT"/qlora_liger.log | cut -c1-200
    for d in stock liger; do
      f=$(ls /tmp/oq_$d/v*/logging.jsonl 2>/dev/null | head -1); [ -n "$f" ] || continue
      python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(sys.argv[2], \
[round(x['loss'], 5) for x in r if 'loss' in x and 'global_step/max_steps' in x])" "$f" "$d"
    done ;;
  rolling)
    stamp rolling
    timeout "${ROLLING_TIMEOUT:-240}" python3 -m swift_liger.bench.rolling_cache --out "$OUT/bench" ${ROLLING_ARGS:-} \
      >"$OUT/rc.log" 2>&1
    grep -E "ms/tok|long run|agreement|targets|Error|error" "$OUT/rc.log" | head -60 ;;
  decode)
    stamp decode
    # ours with our kernels (swift infer --use_liger), both position modes, eager and graphed; HF's sliding caches
    # on the stock model and on ours (the cache's own share)
    DECODE_DEFAULT_KINDS=rolling_absolute+liger,rolling_streaming+liger,rolling_absolute+graph+liger,rolling_streaming+graph+liger,hf_dynamic_sliding,hf_static_sliding,hf_dynamic_sliding+liger,hf_static_sliding+liger
    timeout "${DECODE_TIMEOUT:-420}" python3 -m swift_liger.bench.rolling_cache --out "$OUT/decode" --layers 32 \
      --batches "${DECODE_BATCHES:-1,4}" --contexts "${DECODE_CONTEXTS:-3840,4352,8192,32768}" \
      --steps "${DECODE_STEPS:-16}" --rounds "${DECODE_ROUNDS:-3}" --warmup 8 --profile-steps "${DECODE_PROFILE:-16}" \
      --kinds "${DECODE_KINDS:-$DECODE_DEFAULT_KINDS}" \
      --long-kinds= --no-agreement --no-hybrid ${DECODE_ARGS:-} >"$OUT/decode.log" 2>&1; echo "decode rc $?"
    grep -E "ms/tok|ms/step|targets|Error|error" "$OUT/decode.log" | head -80 ;;
  eager)
    stamp eager
    # interleaved eager decode, stock model + transformers' sliding caches vs ours + rings (issue 15 item 1)
    timeout "${EAGER_TIMEOUT:-540}" python3 -m swift_liger.bench.eager_decode --out "$OUT/eager" ${EAGER_ARGS:-} \
      >"$OUT/eager.log" 2>&1; echo "eager rc $?"
    grep -E "ms/tok|rror" "$OUT/eager.log" | cut -c1-160 | tail -90 ;;
  sweep)
    stamp sweep
    timeout "${SWEEP_TIMEOUT:-540}" python3 -m swift_liger.bench.sweep run --out "$OUT/sweep" \
      ${SWEEP_ARGS:---graphs --deadline 520} >"$OUT/sweep.log" 2>&1; echo "sweep rc $?"
    tail -3 "$OUT/sweep.log" ;;
  labs)
    mkdir -p "$OUT/labs"
    for lab in ${LABS:-flce glu host}; do
      stamp "${lab}_lab"
      case "$lab" in
        flce) timeout "${FLCE_TIMEOUT:-240}" python3 tools/flce_lab.py --out "$OUT/labs" \
                --deadline "${FLCE_DEADLINE:-220}" ${FLCE_ARGS:-} >"$OUT/labs/flce_lab.log" 2>&1 ;;
        glu)  timeout 120 python3 tools/glu_lab.py --out "$OUT/labs" >"$OUT/labs/glu_lab.log" 2>&1 ;;
        host) timeout 90 python3 tools/host_lab.py --out "$OUT/labs" >"$OUT/labs/host_lab.log" 2>&1 ;;
        step) timeout "${STEP_TIMEOUT:-200}" python3 tools/step_lab.py --out "$OUT/labs" ${STEP_ARGS:-} \
                >"$OUT/labs/step_lab.log" 2>&1 ;;
        train) timeout "${TRAIN_TIMEOUT:-300}" python3 tools/train_lab.py --out "$OUT/labs" ${TRAIN_ARGS:-} \
                >"$OUT/labs/train_lab.log" 2>&1
               grep -E "^==|wall|Error|error" "$OUT/labs/train_lab.log" | cut -c1-250 ;;
      esac
      echo "${lab}_lab rc $?"
      grep -h '"op"\|"impl"\|"variant"\|"section": "op"' "$OUT/labs/${lab}_lab.log" 2>/dev/null | grep -v cprofile | cut -c1-160
    done ;;
  tune)
    stamp tune
    timeout "${TUNE_TIMEOUT:-150}" python3 tools/tune.py ${TUNE_OPS:-rms_norm} >"$OUT/tune.log" 2>&1; echo "tune rc $?"
    grep -E " ms " "$OUT/tune.log" | head -${TUNE_LINES:-24} ;;
  longctx)
    stamp longctx
    timeout "${LONGCTX_TIMEOUT:-570}" python3 -m swift_liger.bench.long_context --out "$OUT/bench" \
      ${LONGCTX_ARGS:---deadline 540} >"$OUT/longctx.log" 2>&1; echo "longctx rc $?"
    grep -E "^  [a-z_]+ +[0-9]+[kM]? x[0-9]|^  [a-z_]+: skipped|^longest trained|^Stopped|Error|error" \
      "$OUT/longctx.log" | cut -c1-200 | tail -40 ;;
  *) echo "unknown section $section" ;;
  esac
done
stamp done
