#!/usr/bin/env bash
# One device call (issue 27): the graph_layers GPU tests, then the real CLI per point (SHAPE:SEQ:BATCH) with
# --use_liger (graph_layers on by default) against --use_liger --liger_graph_layers false and the other VARIANTS.
# Everything under $OUT/calls.tgz.   POINTS="qwen2.5-0.5b:512:8 qwen2.5-1.5b:2048:1"  VARIANTS="swift_liger swift_liger_eager"
# GPU_TESTS: the test files run first unless SKIP_TESTS is set (default tests/patching/test_layer_graphs.py).
# A point may name its own deadline (s), variants and tuner: qwen2.5-7b:4096:1:300:swift_liger,swift_liger_eager:full
# A deadline (default 200) covers the point's model build and all its runs, less 15 s for the report; a run that
# would start with under 60 s left is skipped. 0.5B-3B runs take 22-42 s each, so 3 variants need ~200 s and more
# for a new build (tools/gpu_grid.sh computes them).
# Each point starts from an empty runs directory: a warm machine's earlier runs never enter its report.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT/c"
if [ -z "${SKIP_TESTS:-}" ]; then
  SWIFT_LIGER_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
    ${GPU_TESTS:-tests/patching/test_layer_graphs.py} >"$OUT/c/gpu_tests.txt" 2>&1
  echo "-- tests rc $? at ${SECONDS}s"; tail -3 "$OUT/c/gpu_tests.txt"
fi
declare -A SEEN   # a point named again (a repeat, interleaved with others) reports apart as <tag>_r2, _r3, ...
for point in ${POINTS:-qwen2.5-0.5b:512:8 qwen2.5-1.5b:2048:1}; do
  IFS=: read -r shape seq batch deadline variants tuner <<<"$point"
  echo "== $shape $seq x $batch at ${SECONDS}s"
  [ -n "$variants" ] || variants=${VARIANTS:-swift_liger,swift_liger_eager}
  tag=${shape}_${seq}_$batch${tuner:+_$tuner}${LENGTHS:+_$LENGTHS}   # LENGTHS=longtail: rows of varying length
  SEEN[$tag]=$(( ${SEEN[$tag]:-0} + 1 )); [ "${SEEN[$tag]}" -gt 1 ] && tag=${tag}_r${SEEN[$tag]}
  rm -rf "/tmp/runs_$tag"
  SHAPE=$shape SEQ=$seq BATCH=$batch STEPS=${STEPS:-10} WARMUP=3 VARIANTS="${variants:+${variants//,/ }}" \
    TUNER=${tuner:-lora} DEADLINE=${deadline:-200} R=/tmp/runs_$tag OUT=$OUT/c/$tag \
    bash tools/gpu_swift_cli.sh 2>&1 | grep -E "^\||^- |rc |skipped|failed" | cut -c1-400
  for f in /tmp/runs_$tag/*.log; do   # what graph_layers did (integration/runtime.py's log line)
    grep -h "graph_layers in the first step" "$f" | sed "s|.*swift_liger: |$(basename "$f" .log): |" | cut -c1-700
  done
  tar czf "$OUT/calls.tgz" -C "$OUT" c   # after every point: a call cut short keeps what ran
done
rm -rf "$OUT/c"
