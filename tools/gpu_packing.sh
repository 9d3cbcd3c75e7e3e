#!/usr/bin/env bash
# One device call: `swift sft` on long-tailed chat rows (log-uniform 64..SEQ tokens), stock padded batches vs packed
# rows through our attention: plain and --use_liger at BATCH rows per step (padded to the longest), and
# --use_liger --packing true --attn_impl swift_liger at one packed row of SEQ tokens per step. tokens/s counts real
# (non-pad) tokens. Results: $OUT/packing/<variant>.json + the run logs.
#   SHAPE=qwen2.5-1.5b SEQ=8192 BATCH=4 ROWS=256 STEPS=10 WARMUP=3 VARIANTS="swift_liger_packing plain swift_liger"
set -uo pipefail
OUT=${OUT:-.out}; SHAPE=${SHAPE:-qwen2.5-1.5b}; SEQ=${SEQ:-8192}; BATCH=${BATCH:-4}; ROWS=${ROWS:-256}
STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}; M=/tmp/pack_${SHAPE}_${SEQ}; R=$OUT/packing
mkdir -p "$R"
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m swift_liger.bench.swift_cli build "$M" --shape "$SHAPE" --seq "$SEQ" --rows "$ROWS" \
  --lengths longtail --device cuda 2>&1 | grep -v "Writing model" | tail -2
cp "$M/build.json" "$R/"
echo "== built at ${SECONDS}s"
for v in ${VARIANTS:-swift_liger_packing plain swift_liger}; do
  b=$BATCH; case $v in *packing*) b=1;; esac
  echo "== $v batch $b (at ${SECONDS}s)"
  timeout ${RUN_TIMEOUT:-170} python3 -m swift_liger.bench.swift_cli run "$M/model" "$M/sft.jsonl" --variant "$v" \
    --out "$R" --steps "$STEPS" --warmup "$WARMUP" --seq "$SEQ" --timeout $(( ${RUN_TIMEOUT:-170} - 10 )) \
    --extra="--per_device_train_batch_size $b" 2>&1 | grep -v "^\[$v\] -m swift" | tail -4 | cut -c1-250
done
echo "== done at ${SECONDS}s"
