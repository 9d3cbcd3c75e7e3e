#!/usr/bin/env bash
# Issue 27's grid through the real `swift sft` CLI, one call-sized part per device call (each part fits a 10-minute
# call: at most 3 points of 3 runs at 0.5B-3B, 1-2 at 7B-8B): PART=3 bash tools/gpu_grid.sh   (PART=list: the parts)
# Every point runs plain first (the baseline, so a deadline never cuts it), then --use_liger, then
# --use_liger_kernel; GRID_VARIANTS adds more (e.g. "plain swift_liger liger_kernel swift_liger_eager").
# Points are SHAPE:SEQ:BATCH[:DEADLINE][:TUNER] as in tools/gpu_call_graphs.sh (SEQ = row length, BATCH = rows);
# results in $OUT/calls.tgz, merged afterwards with tools/graph_calls_report.py --call DIR COMMIT COMMAND ...
set -uo pipefail
P1="qwen2.5-0.5b:512:8:150 qwen2.5-0.5b:2048:1:150 qwen2.5-0.5b:2048:4:150"
P2="qwen2.5-0.5b:8192:1:150 qwen2.5-0.5b:16384:1:180"
P3="qwen2.5-1.5b:512:8:160 qwen2.5-1.5b:2048:1:160 qwen2.5-1.5b:2048:4:160"
P4="qwen2.5-1.5b:8192:1:160 qwen2.5-1.5b:16384:1:190"
P5="qwen2.5-3b:512:8:170 qwen2.5-3b:2048:1:170 qwen2.5-3b:2048:4:170"
P6="qwen2.5-3b:8192:1:170 qwen2.5-3b:16384:1:200"
P7="qwen2.5-7b:512:8:250 qwen2.5-7b:2048:1:250"
P8="qwen2.5-7b:2048:4:260 qwen2.5-7b:8192:1:290"
P9="qwen2.5-7b:16384:1:360"
P10="llama3-8b:512:8:250 llama3-8b:2048:1:250"
P11="llama3-8b:2048:4:260 llama3-8b:8192:1:290"
P12="llama3-8b:16384:1:360"
P13="qwen2.5-0.5b:512:8:150:full qwen2.5-0.5b:2048:1:150:full qwen2.5-0.5b:2048:4:150:full"
P14="qwen2.5-0.5b:8192:1:150:full qwen2.5-0.5b:16384:1:180:full"
P15="qwen2.5-1.5b:512:8:160:full qwen2.5-1.5b:2048:1:160:full qwen2.5-1.5b:2048:4:160:full"
P16="qwen2.5-1.5b:8192:1:160:full qwen2.5-1.5b:16384:1:190:full"
P17="qwen2.5-3b:512:8:170:full qwen2.5-3b:2048:1:170:full qwen2.5-3b:2048:4:170:full"
P18="qwen2.5-3b:8192:1:170:full qwen2.5-3b:16384:1:200:full"
if [ "${PART:-list}" = list ]; then
  for i in $(seq 1 18); do v="P$i"; echo "PART=$i: ${!v}"; done; exit 0
fi
v="P$PART"; [ -n "${!v:-}" ] || { echo "PART must be 1-18 or list"; exit 2; }
variants=$(tr ' ' ',' <<<"${GRID_VARIANTS:-plain swift_liger liger_kernel}")
points=""
for p in ${!v}; do
  IFS=: read -r shape seq batch deadline tuner <<<"$p"
  points+="$shape:$seq:$batch:$deadline:$variants${tuner:+:$tuner} "
done
echo "== part $PART: $points"
SKIP_TESTS=${SKIP_TESTS:-1} POINTS="$points" STEPS=${STEPS:-8} bash "$(dirname "$0")/gpu_call_graphs.sh"
