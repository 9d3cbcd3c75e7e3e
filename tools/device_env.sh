# Sourced by the GPU-session scripts: the carried wheels (.whl/, from ../shared/gpu/fetch_wheels.sh) into /tmp/site,
# offline Hugging Face settings, and the import hook in a site dir (.pth files are not read from PYTHONPATH dirs)
# so `swift sft --use_liger` sees our flags.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \
  || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cp swift_liger_hook.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== wheels installed at ${SECONDS}s"

gpu_tests() {   # TEST_PATHS (pytest paths) on the GPU (SWIFT_LIGER_TEST_GPU=1) -> $OUT/gpu_tests.txt; PYTEST_X= runs on past failures
  [ -n "${TEST_PATHS:-}" ] || return 0
  echo "== GPU tests: $TEST_PATHS"
  SWIFT_LIGER_TEST_GPU=1 timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q ${PYTEST_X--x} -p no:cacheprovider $TEST_PATHS \
    >"$OUT/gpu_tests.txt" 2>&1; echo "-- tests rc $? at ${SECONDS}s"; tail -4 "$OUT/gpu_tests.txt"
}
