#!/usr/bin/env bash
# One device call: GRPO rollouts without vLLM. swift_liger.bench.rollout times ms-swift's pt engine generating one
# GRPO group (GENERATIONS x NEW tokens) on the stock LoRA policy vs the --use_liger one (eager, ring, CUDA-graph
# ring), interleaved rounds, per shape -> $OUT/rollout_<shape>_<NEW>.json. CLI=1 adds the real `swift rlhf` GRPO CLI
# with real rollouts (--use_liger, whose rollouts default to exact,graph decode on CUDA, vs plain; CLI_STEPS steps of
# CLI_SEQ completion tokens). Needs the ignored .whl/ carried (../shared/gpu/fetch_wheels.sh liger-kernel==0.8.5).
#
#   SHAPES="qwen2.5-1.5b qwen2.5-7b" (SHAPES="" for none) NEW=1024 ROUNDS=2 VARIANTS=plain,swift_liger,swift_liger_ring,swift_liger_graph
#   TEST_PATHS="tests/ops/test_decode_attention_kernel.py tests/cache"   GPU tests first (SWIFT_LIGER_TEST_GPU=1)
#   CLI=1 CLI_SHAPE=qwen2.5-1.5b CLI_SEQ=512 CLI_STEPS=3 DEADLINE=560
set -uo pipefail
OUT=${OUT:-.out}; SHAPES=${SHAPES-qwen2.5-1.5b}; NEW=${NEW:-1024}; ROUNDS=${ROUNDS:-2}; GENERATIONS=${GENERATIONS:-8}
VARIANTS=${VARIANTS:-plain,swift_liger,swift_liger_ring,swift_liger_graph}; DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
gpu_tests

build() {   # build SHAPE SEQ -> /tmp/model_SHAPE_SEQ
  local M=/tmp/model_$1_$2
  if [ ! -f "$M/build.json" ]; then
    timeout 300 python3 -m swift_liger.bench.swift_cli build "$M" --shape "$1" --seq "$2" --rows 8 --pref-rows 8 \
      --device cuda >"/tmp/build_$1_$2.log" 2>&1 || { echo "build $1 failed"; tail -20 "/tmp/build_$1_$2.log"; return 1; }
  fi
  echo "== built $M at ${SECONDS}s"
}

BUILD_SEQ=${BUILD_SEQ:-$NEW}   # the build's dataset length (grpo.jsonl prompts are ~96 tokens whatever it is)
for shape in $SHAPES; do
  build "$shape" "$BUILD_SEQ" || continue
  M=/tmp/model_${shape}_${BUILD_SEQ}; name=rollout_${shape//[.-]/_}_${NEW}
  left=$(( DEADLINE - SECONDS - 20 ))
  if [ $left -lt 60 ]; then echo "== $shape skipped: ${left}s left"; continue; fi
  echo "== rollout $shape x $NEW (timeout ${left}s)"
  timeout -s INT -k 10 "$left" python3 -m swift_liger.bench.rollout "$M/model" "$M/grpo.jsonl" --new-tokens "$NEW" \
    --generations "$GENERATIONS" --rounds "$ROUNDS" --variants "$VARIANTS" --out "$OUT/$name.json" \
    >"/tmp/$name.log" 2>&1; echo "-- rc $? at ${SECONDS}s"
  grep -E '^\{"(variant|warmup)"' "/tmp/$name.log" | cut -c1-260; grep -A40 '^{$' "/tmp/$name.log" | tr -d ' \n' | cut -c1-900; echo
  grep -iE -A3 "error|Traceback|File " "/tmp/$name.log" | tail -30
  cp "/tmp/$name.log" "$OUT/" 2>/dev/null
done

if [ "${CLI:-0}" = 1 ]; then
  CLI_SHAPE=${CLI_SHAPE:-qwen2.5-1.5b}; CLI_SEQ=${CLI_SEQ:-512}; CLI_STEPS=${CLI_STEPS:-3}
  build "$CLI_SHAPE" "$CLI_SEQ" && M=/tmp/model_${CLI_SHAPE}_${CLI_SEQ}
  for v in ${CLI_VARIANTS:-swift_liger plain}; do
    left=$(( DEADLINE - SECONDS - 15 )); [ $left -lt 60 ] && { echo "== cli $v skipped"; continue; }
    echo "== swift rlhf grpo, real rollouts, $v (timeout ${left}s)"
    timeout $((left + 10)) python3 -m swift_liger.bench.swift_cli run "$M/model" "$M/grpo.jsonl" --task grpo \
      --rollout real --variant "$v" --out /tmp/cli_rollout --steps "$CLI_STEPS" --warmup 1 --seq "$CLI_SEQ" \
      --timeout "$left" 2>&1 | grep -v "^\[$v\] -m swift" | cut -c1-300
    cp /tmp/cli_rollout/grpo_lora_$v.json "$OUT/cli_rollout_$v.json" 2>/dev/null
    grep -h "rolling_cache\|Error" /tmp/cli_rollout/grpo_lora_$v.log 2>/dev/null | cut -c1-400 | tail -4
  done
fi
echo "== done at ${SECONDS}s"
