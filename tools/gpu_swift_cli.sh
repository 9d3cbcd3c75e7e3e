#!/usr/bin/env bash
# One device call: the real `swift sft` / `swift rlhf` CLI on a random-init model built on the GPU, each variant in
# its own process (--use_liger, --use_liger_kernel true, plain, ...), merged into $OUT/<NAME>_<task>_<tuner>.{json,md}
# (copy those to docs/benchmarks/); per-run logs, logging.jsonl and liger_patch.json in $OUT/swift_cli_runs.tar.gz.
# Needs the ignored .whl/ carried (../shared/gpu/fetch_wheels.sh liger-kernel==0.8.5).
#
#   SHAPE=llama3-8b SEQ=8192 TASKS=sft                      the 8B `swift sft` LoRA comparison (the defaults)
#   SHAPE=qwen2.5-7b SEQ=4096 TASKS="dpo orpo" GA=4         preference pairs of 2 x ~4k tokens
#   BATCH=8 SEQ=512                                          8 rows of ~448 tokens per step (default batch 1)
#   EXTRA="--label_smoothing_factor 0.1" NAME=...              more swift flags for every run (name the report apart)
#   LENGTHS=longtail ROWS=256                                 rows of log-uniform 64..SEQ-64 tokens (varying batch shapes)
#   COLD_TRITON=1                                                every run with an empty Triton cache of its own (cold first steps)
#   TUNER=full  VARIANTS="swift_liger plain"  VARIANTS_orpo="plain"  STEPS=8 WARMUP=3  DEADLINE=530 (whole call, s)
#   TEST_PATHS="tests/ops/test_logprobs_op.py ..."              run these tests on the GPU first (SWIFT_LIGER_TEST_GPU=1)
#   TASKS=grpo SEQ=2048                                      8 completions of 2048 tokens per prompt (instant rollout)
#   TASKS=gkd TEACHER_SHAPE=qwen2.5-7b SHAPE=qwen2.5-1.5b    distillation from a second build (the teacher)
set -uo pipefail
OUT=${OUT:-.out}; R=${R:-/tmp/swift_cli_runs}; DEADLINE=${DEADLINE:-530}
SHAPE=${SHAPE:-llama3-8b}; SEQ=${SEQ:-8192}; TASKS=${TASKS:-sft}; TUNER=${TUNER:-lora}; GA=${GA:-1}
STEPS=${STEPS:-12}; WARMUP=${WARMUP:-3}; M=/tmp/model_${SHAPE}_${SEQ}${LENGTHS:+_$LENGTHS}${ROWS:+_$ROWS}
NAME=${NAME:-swift_cli_${SHAPE//[.-]/_}}
mkdir -p "$OUT/swift_cli" "$R"
source "$(dirname "$0")/device_env.sh"
gpu_tests

if [ -f "$M/build.json" ]; then
  echo "== reusing $M"
else
  build() { timeout 240 python3 -m swift_liger.bench.swift_cli build "$M" --shape "$SHAPE" --seq "$SEQ" --device cuda \
    ${LENGTHS:+--lengths "$LENGTHS"} ${ROWS:+--rows "$ROWS"} "$@" >"$OUT/swift_cli/build.log" 2>&1; }
  FROM=()   # an earlier build of this shape on this machine (another --seq): link its weights, write only datasets
  for d in /tmp/model_${SHAPE}_*; do
    [ -f "$d/build.json" ] && [ "$SEQ" -le 32768 ] && { FROM=(--model-from "$d"); break; }
  done
  echo "== build $M ($SHAPE, rows of ~$((SEQ - 64)) tokens)${FROM:+, weights from ${FROM[1]}}"
  build "${FROM[@]}"; rc=$?
  if [ $rc -ne 0 ] && [ ${#FROM[@]} -gt 0 ]; then   # refused (another model config, an older build): build it all
    rm -rf "$M"; build; rc=$?
  fi
  grep -v "Writing model shards" "$OUT/swift_cli/build.log" | tail -3
  if [ $rc -ne 0 ]; then echo "build failed rc $rc"; tail -30 "$OUT/swift_cli/build.log"; exit 1; fi
  du -shL "$M/model"
fi
cp "$M/build.json" "$OUT/swift_cli/"
TEACHER=()
if [ -n "${TEACHER_SHAPE:-}" ]; then
  MT=/tmp/model_${TEACHER_SHAPE}_${SEQ}
  if [ ! -f "$MT/build.json" ]; then
    echo "== build teacher $MT"
    timeout 300 python3 -m swift_liger.bench.swift_cli build "$MT" --shape "$TEACHER_SHAPE" --seq "$SEQ" \
      --device cuda >"$OUT/swift_cli/build_teacher.log" 2>&1 || { echo "teacher build failed"; exit 1; }
  fi
  TEACHER=(--teacher "$MT/model")
fi
echo "== built at ${SECONDS}s"

read -r -a TASK_LIST <<<"$TASKS"
variants_of() { local name="VARIANTS_$1"; echo "${!name:-${VARIANTS:-swift_liger liger_kernel plain}}"; }
total=0; for task in "${TASK_LIST[@]}"; do total=$(( total + $(wc -w <<<"$(variants_of "$task")") )); done; i=0
for task in "${TASK_LIST[@]}"; do
  case $task in sft|gkd) data="$M/sft.jsonl";; grpo) data="$M/grpo.jsonl";; *) data="$M/pref.jsonl";; esac
  read -r -a VLIST <<<"$(variants_of "$task")"   # most important first
  for v in "${VLIST[@]}"; do
    after=$(( total - i - 1 )); i=$(( i + 1 ))
    left=$(( DEADLINE - SECONDS - 15 ))                   # 15 s kept for the reports
    t=$(( left - after * 100 )); [ $t -gt 240 ] && t=240   # leave ~100 s to each later run,
    [ $t -lt 90 ] && t=$(( left < 90 ? left : 90 ))          # but the earlier (more important) run goes first
    if [ $t -lt 60 ]; then echo "== $task $v skipped: ${left}s left"; continue; fi
    stem=$v; [ "$task/$TUNER" != sft/lora ] && stem=${task}_${TUNER}_$v
    echo "== $task $TUNER $v (timeout ${t}s, at ${SECONDS}s)"
    timeout $((t + 20)) python3 -m swift_liger.bench.swift_cli run "$M/model" "$data" --task "$task" --tuner "$TUNER" \
      --grad-accum "$GA" "${TEACHER[@]}" --variant "$v" --out "$R" --steps "$STEPS" --warmup "$WARMUP" --seq "$SEQ" --timeout "$t" \
      ${BATCH:+--extra=--per_device_train_batch_size=$BATCH} ${EXTRA:+--extra="$EXTRA"} ${COLD_TRITON:+--cold-triton} \
      2>&1 | grep -v "^\[$v\] -m swift" | cut -c1-300
    rc=${PIPESTATUS[0]}
    cp "$R/$stem.json" "$R/$stem.log" "$R/$stem.logging.jsonl" "$R/$stem.liger_patch.json" "$OUT/swift_cli/" 2>/dev/null
    if [ "$rc" -ne 0 ]; then
      tail -60 "$R/$stem.log" >"$OUT/swift_cli/$stem.tail.txt"
      echo "-- $stem rc $rc, log tail:"; grep -v "Train:" "$R/$stem.log" | tail -15 | cut -c1-300
    fi
  done
  echo "== report $task (at ${SECONDS}s)"
  rname=${NAME}_${task}_${TUNER}; [ "$task" = sft ] && rname=${NAME}_${TUNER}   # swift_cli_llama3_8b_lora
  python3 -m swift_liger.bench.swift_cli report "$R" --out "$OUT" --name "$rname" --build "$M" \
    --task "$task" --tuner "$TUNER" | grep -E "^\||^GPU|^- "
done
# $OUT returns at most 8 files: keep the per-run files as one archive.
(cd "$OUT" && tar czf swift_cli_runs.tar.gz swift_cli && rm -rf swift_cli)
echo "== done at ${SECONDS}s"
