#!/usr/bin/env bash
# One device call: the real `swift sft` CLI on a random-init Llama-3-8B-shaped model (LoRA r=16, bf16, SDPA,
# gradient checkpointing, batch 1 x ~8k tokens), three variants in their own processes: --use_liger (swift_liger),
# --use_liger_kernel true (ms-swift's liger-kernel integration), plain. Tokens/s and peak memory per variant under
# $OUT/swift_cli_runs.tar.gz, merged into $OUT/swift_cli_llama3_8b_lora.{json,md} (copy those to docs/benchmarks/).
# Needs the ignored .whl/ carried. Whole script < 9 min: per-run timeouts shrink to fit DEADLINE (seconds).
set -uo pipefail
OUT=${OUT:-.out}; R=/tmp/swift_cli_runs; M=/tmp/m8b; DEADLINE=${DEADLINE:-530}
STEPS=${STEPS:-12}; WARMUP=${WARMUP:-3}; SEQ=${SEQ:-8192}
mkdir -p "$OUT/swift_cli" "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \
  || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# .pth files are read only from site dirs: put the hook there so `swift sft --use_liger` sees our flags.
cp swift_liger_hook.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== wheels installed at ${SECONDS}s"

echo "== build $M (32 layers, vocab 128256, rows of ~$((SEQ - 64)) tokens)"
timeout 200 python3 -m swift_liger.bench.swift_cli build "$M" --seq "$SEQ" --device cuda \
  >"$OUT/swift_cli/build.log" 2>&1; rc=$?; grep -v "Writing model shards" "$OUT/swift_cli/build.log" | tail -3
if [ $rc -ne 0 ]; then echo "build failed rc $rc"; tail -30 "$OUT/swift_cli/build.log"; exit 1; fi
cp "$M/build.json" "$OUT/swift_cli/"; du -sh "$M/model"
echo "== built at ${SECONDS}s"

# most important first; e.g. VARIANTS="swift_liger_compiled swift_liger liger_kernel plain" (compile adds ~1 min)
read -r -a VARIANTS <<<"${VARIANTS:-swift_liger liger_kernel plain}"
for i in "${!VARIANTS[@]}"; do
  v=${VARIANTS[$i]}; after=$(( ${#VARIANTS[@]} - i - 1 ))
  left=$(( DEADLINE - SECONDS - 15 ))                  # 15 s kept for the report
  t=$(( left - after * 100 )); [ $t -gt 240 ] && t=240    # leave ~100 s to each later run,
  [ $t -lt 90 ] && t=$(( left < 90 ? left : 90 ))          # but the earlier (more important) run goes first
  if [ $t -lt 60 ]; then echo "== $v skipped: ${left}s left"; continue; fi
  echo "== $v (timeout ${t}s, at ${SECONDS}s)"
  timeout $((t + 20)) python3 -m swift_liger.bench.swift_cli run "$M/model" "$M/sft.jsonl" --variant "$v" --out "$R" \
    --steps "$STEPS" --warmup "$WARMUP" --seq "$SEQ" --timeout "$t" 2>&1 | grep -v "^\[$v\] -m swift" | cut -c1-300
  rc=${PIPESTATUS[0]}
  cp "$R/$v.json" "$R/$v.log" "$OUT/swift_cli/" 2>/dev/null
  cp "$R/$v.logging.jsonl" "$R/$v.liger_patch.json" "$OUT/swift_cli/" 2>/dev/null
  if [ "$rc" -ne 0 ]; then
    tail -60 "$R/$v.log" >"$OUT/swift_cli/$v.tail.txt"
    echo "-- $v rc $rc, log tail:"; grep -v "Train:" "$R/$v.log" | tail -15 | cut -c1-300
  fi
done

echo "== report (at ${SECONDS}s)"
python3 -m swift_liger.bench.swift_cli report "$R" --out "$OUT" --name swift_cli_llama3_8b_lora --build "$M" \
  | grep -E "^\||^GPU|^- "
# $OUT returns at most 8 files: keep the per-variant files as one archive.
(cd "$OUT" && tar czf swift_cli_runs.tar.gz swift_cli && rm -rf swift_cli)
echo "== done at ${SECONDS}s"
