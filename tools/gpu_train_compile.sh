#!/usr/bin/env bash
# One device call: compiled decoder layers through each torch.compile backend (issue 27, item 3), one process per
# backend and point so every first step starts from a cold dynamo/inductor state (fresh TORCHINDUCTOR_CACHE_DIR).
# Each process interleaves stock, ours (eager) and one compiled variant (tools/train_lab.py); results in
# $OUT/compile.tgz (compile/<shape>_<tokens>_<variant>/train_lab.json).
#   POINTS="qwen2.5-0.5b:8x512 qwen2.5-1.5b:1x2048"  COMPILED="ours_compiled_aot ours_compiled_dynamo ours_compiled"
#   VARY=40 (odd batches 40 tokens shorter: the second length's first step shows a recompile)  ROUNDS=3  STEPS=3
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/compile"
source "$(dirname "$0")/device_env.sh"
POINTS=${POINTS:-"qwen2.5-0.5b:8x512 qwen2.5-1.5b:1x2048 qwen2.5-3b:1x2048"}
COMPILED=${COMPILED:-"ours_compiled_aot ours_compiled_dynamo ours_compiled"}
VARY=${VARY:-40}; ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-3}; DEADLINE=${DEADLINE:-560}
for point in $POINTS; do
  shape=${point%%:*}; tok=${point#*:}
  for v in $COMPILED; do
    if [ $SECONDS -gt $(( DEADLINE - 60 )) ]; then echo "== $shape $tok $v skipped at ${SECONDS}s"; continue; fi
    d=$OUT/compile/${shape}_${tok}_$v; mkdir -p "$d"
    echo "== $shape $tok $v (at ${SECONDS}s)"
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout $(( DEADLINE - SECONDS )) python3 tools/train_lab.py --shape "$shape" \
      --tokens "$tok" --variants "stock,ours,$v" --rounds "$ROUNDS" --steps "$STEPS" --warmup 3 --vary "$VARY" \
      --no-profile --reentrant 1 --out "$d" 2>&1 | grep -v -i "warn" | tail -5
  done
done
tar czf "$OUT/compile.tgz" -C "$OUT" compile && rm -rf "$OUT/compile"   # $OUT brings back a few files
echo "== done at ${SECONDS}s"
