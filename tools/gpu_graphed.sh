#!/usr/bin/env bash
# One device call: CUDA-graphed decoder layers (graph_layers, in ours) against stock, eager ours and compiled
# layers (issue 27, item 3). Part 1: parity (same weights, non-zero adapters, same batches; losses, gradient norms,
# first-step gradients) at LoRA dropout 0 and 0.05. Part 2: step times, one process per point.
# Results in $OUT/graphed.tgz.   PARITY_SHAPE=qwen2.5-0.5b  POINTS="qwen2.5-0.5b:8x512 qwen2.5-1.5b:1x2048"
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/graphed"
source "$(dirname "$0")/device_env.sh"
PARITY_SHAPE=${PARITY_SHAPE:-qwen2.5-0.5b}; PARITY_VARIANTS=${PARITY_VARIANTS:-stock,ours_eager,ours_compiled,ours}
POINTS=${POINTS:-"qwen2.5-0.5b:8x512 qwen2.5-1.5b:1x2048 qwen2.5-1.5b:4x2048 qwen2.5-3b:1x2048"}
VARIANTS=${VARIANTS:-stock,ours_eager,ours}; VARY=${VARY:-0}; ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-3}
DEADLINE=${DEADLINE:-560}
for p in ${DROPOUTS:-0 0.05}; do
  d=$OUT/graphed/parity_p$p; mkdir -p "$d"
  echo "== parity dropout $p (at ${SECONDS}s)"
  timeout $(( DEADLINE - SECONDS - 30 )) python3 tools/train_lab.py --shape "$PARITY_SHAPE" --layers 4 --tokens 8x512 \
    --vary 64 --variants "$PARITY_VARIANTS" --parity 4 --dropout "$p" --out "$d" 2>&1 | grep -v -i "warn" | tail -12
done
for point in $POINTS; do
  shape=${point%%:*}; tok=${point#*:}
  if [ $SECONDS -gt $(( DEADLINE - 70 )) ]; then echo "== $shape $tok skipped at ${SECONDS}s"; continue; fi
  d=$OUT/graphed/${shape}_${tok}; mkdir -p "$d"
  echo "== $shape $tok (at ${SECONDS}s)"
  timeout $(( DEADLINE - SECONDS - 10 )) python3 tools/train_lab.py --shape "$shape" --tokens "$tok" \
    --variants "$VARIANTS" --rounds "$ROUNDS" --steps "$STEPS" --warmup 2 --vary "$VARY" --no-profile --reentrant 1 \
    --out "$d" 2>&1 | grep -v -i "warn" | tail -6
done
tar czf "$OUT/graphed.tgz" -C "$OUT" graphed && rm -rf "$OUT/graphed"
echo "== done at ${SECONDS}s"
