# Sourced by the GPU examples when MODEL is unset: a random-init model of $SHAPE's shapes (qwen2.5-7b, llama3-8b,
# qwen2.5-1.5b, ...) and rows of ~$SEQ tokens, built on the GPU by swift_liger's benchmark builder, offline and
# deterministic (~30 s and 15 GB of disk at 7B). Speed and memory are the real model's; the loss is not meaningful.
# Sets MODEL_FLAGS (--model DIR --model_type T --template T), SFT_DATA (chat rows) and PREF_DATA (chosen/rejected).
M=$OUT/model_${SHAPE}_${SEQ}
if [ ! -f "$M/build.json" ] && [ "${DEVICE:-cuda}" = cuda ] && \
    ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "$0: building the offline $SHAPE model needs a CUDA GPU (none found); MODEL=<hub id or local dir> trains" \
       "a real model instead, and the CPU examples (examples/*_cpu.sh) run anywhere" >&2
  exit 2
fi
[ -f "$M/build.json" ] || python -m swift_liger.bench.swift_cli build "$M" --shape "$SHAPE" --seq "$SEQ" --device "${DEVICE:-cuda}"
mapfile -t MODEL_FLAGS < <(python - "$M/build.json" <<'PY'
import json, sys
flags = json.load(open(sys.argv[1]))["swift_flags"]
i = flags.index("--dataset")
print("\n".join(flags[:i] + flags[i + 2:]))
PY
)
SFT_DATA=$M/sft.jsonl
PREF_DATA=$M/pref.jsonl
