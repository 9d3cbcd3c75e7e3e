#!/usr/bin/env bash
# Issue 27's grid through the real `swift sft` CLI, one call-sized part per device call (each part fits a 10-minute
# call: at most 3 points of 3 runs at 0.5B-3B, 1-2 at 7B-8B): PART=3 bash tools/gpu_grid.sh   (PART=list: the parts)
# Every point runs plain first (the baseline, so a deadline never cuts it), then --use_liger, then
# --use_liger_kernel; GRID_VARIANTS adds more (e.g. "plain swift_liger liger_kernel swift_liger_eager").
# Points are SHAPE:SEQ:BATCH[:TUNER] (SEQ = row length, BATCH = rows). A point's deadline is computed: the model
# build, then per run the CLI's start-up and load plus the steps (measured on the H200: 0.5B-3B runs take 22-42 s,
# 7B-8B 50-80 s plus a 50-80 s build), and the 60 s tools/gpu_swift_cli.sh wants left before a later run starts.
# SKIP_TESTS= (empty) runs the graph_layers GPU tests first. Results in $OUT/calls.tgz, merged afterwards with
# tools/graph_calls_report.py --call DIR COMMIT COMMAND ...
set -uo pipefail
P1="qwen2.5-0.5b:512:8 qwen2.5-0.5b:2048:1 qwen2.5-0.5b:2048:4"
P2="qwen2.5-0.5b:8192:1 qwen2.5-0.5b:16384:1"
P3="qwen2.5-1.5b:512:8 qwen2.5-1.5b:2048:1 qwen2.5-1.5b:2048:4"
P4="qwen2.5-1.5b:8192:1 qwen2.5-1.5b:16384:1"
P5="qwen2.5-3b:512:8 qwen2.5-3b:2048:1 qwen2.5-3b:2048:4"
P6="qwen2.5-3b:8192:1 qwen2.5-3b:16384:1"
P7="qwen2.5-7b:512:8 qwen2.5-7b:2048:1"
P8="qwen2.5-7b:2048:4 qwen2.5-7b:8192:1"
P9="qwen2.5-7b:16384:1"
P10="llama3-8b:512:8 llama3-8b:2048:1"
P11="llama3-8b:2048:4 llama3-8b:8192:1"
P12="llama3-8b:16384:1"
P13="qwen2.5-0.5b:512:8:full qwen2.5-0.5b:2048:1:full qwen2.5-0.5b:2048:4:full"
P14="qwen2.5-0.5b:8192:1:full qwen2.5-0.5b:16384:1:full"
P15="qwen2.5-1.5b:512:8:full qwen2.5-1.5b:2048:1:full qwen2.5-1.5b:2048:4:full"
P16="qwen2.5-1.5b:8192:1:full qwen2.5-1.5b:16384:1:full"
P17="qwen2.5-3b:512:8:full qwen2.5-3b:2048:1:full qwen2.5-3b:2048:4:full"
P18="qwen2.5-3b:8192:1:full qwen2.5-3b:16384:1:full"
# Parts 19-21: rows of varying length (log-uniform 64 .. row length - 64 tokens, 320 rows, 40 steps), as real data
# brings them: every batch a new shape until graph_layers has met its buckets. tok/s = all measured tokens / seconds.
P19="qwen2.5-0.5b:2048:1 qwen2.5-0.5b:1024:8"
P20="qwen2.5-1.5b:2048:1 qwen2.5-1.5b:1024:8"
P21="qwen2.5-3b:2048:1 qwen2.5-7b:4096:1"
if [ "${PART:-list}" = list ]; then
  for i in $(seq 1 21); do v="P$i"; echo "PART=$i: ${!v}$([ "$i" -ge 19 ] && echo ' (varying lengths)')"; done; exit 0
fi
v="P$PART"; [ -n "${!v:-}" ] || { echo "PART must be 1-21 or list"; exit 2; }
steps=${STEPS:-8}
if [ "$PART" -ge 19 ]; then
  export LENGTHS=longtail ROWS=${ROWS:-320}; steps=${STEPS:-40}
  GRID_VARIANTS=${GRID_VARIANTS:-plain swift_liger swift_liger_eager liger_kernel}
fi
variants=$(tr ' ' ',' <<<"${GRID_VARIANTS:-plain swift_liger liger_kernel}")
points=""
for p in ${!v}; do
  IFS=: read -r shape seq batch tuner <<<"$p"
  case $shape in qwen2.5-7b|llama3-8b) build=90 run=80 ;; *) build=40 run=45 ;; esac
  nv=$(wc -w <<<"${variants//,/ }")
  deadline=$(( build + run * nv + run * seq / 16384 + 75 ))   # 16k rows: the steps themselves add up to a run
  [ "$PART" -ge 19 ] && deadline=$(( deadline + 15 * nv ))    # 40 steps, a capture per new bucket
  points+="$shape:$seq:$batch:$deadline:$variants${tuner:+:$tuner} "
done
echo "== part $PART: $points"
SKIP_TESTS=${SKIP_TESTS-1} POINTS="$points" STEPS=$steps bash "$(dirname "$0")/gpu_call_graphs.sh"
