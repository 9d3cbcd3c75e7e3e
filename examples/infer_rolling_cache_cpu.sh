#!/usr/bin/env bash
# Multi-turn streaming chat through the real `swift infer` CLI with constant KV memory, on CPU, offline, in ~15 s:
# a tiny random Qwen3 model (it answers gibberish; the point is the plumbing), patched by swift_liger with a
# RollingKVCache of 4 sinks + a 32-token window, far smaller than the conversation below.
#   bash examples/infer_rolling_cache_cpu.sh           # the scripted turns below
#   INTERACTIVE=1 bash examples/infer_rolling_cache_cpu.sh   # type at the <<< prompt (`clear`, `exit`, ...)
# On a real model and a GPU: swift infer --infer_backend pt --model <dir> --use_liger --liger_rolling_cache 4096,4
# (the same flags work for `swift deploy --infer_backend pt`; other backends are refused with --use_liger).
set -euo pipefail
# after `make venv` in a checkout: its swift / swift-liger / python when none is on PATH
command -v swift-liger >/dev/null || PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
OUT=${OUT:-runs/infer_cpu}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SWIFT_LIGER_BACKEND=${SWIFT_LIGER_BACKEND:-torch}   # PyTorch reference ops on CPU (Triton needs CUDA)

swift-liger tiny "$OUT/tiny" >/dev/null     # model dir, deterministic, no network

cmd=(swift infer --model "$OUT/tiny/model" --model_type qwen3 --template qwen3 --torch_dtype float32
     --infer_backend pt --stream true --max_new_tokens 24
     --use_liger --liger_rolling_cache 32,4)
if [[ "${INTERACTIVE:-0}" == "1" ]]; then
    exec "${cmd[@]}"
fi
printf '%s\n' "Hello, what is the quick river?" "What is 3 plus 4?" "Tell me more about the blue stone." \
    "Why is the tiger happy?" "What is 12 plus 30?" "How does the small model learn?" exit | "${cmd[@]}"
# The log shows "swift_liger: patched the inference model: ... rolling_cache" and the RollingKVCache line; each turn
# re-sends the whole history (hundreds of tokens by the end) while the cache stays 4+32 tokens per layer.
