#!/usr/bin/env bash
# The GPU run of the test suite, on a CUDA machine: every test marked `gpu` (needs CUDA: the engine vs transformers
# and vs the CPU engine, CUDA graphs, the library paths, hand-off, TP on one GPU, ...) and every `triton` one (the
# Triton kernels compiled for the GPU instead of interpreted). tests/test_cuda_tests_marked.py fails when a test
# that needs CUDA lacks the `gpu` marker, so nothing here is a hand-kept list.
#   tools/gpu/run_tests.sh [pytest args]     e.g. -k flashmla, or paths to narrow the run (default: tests); log in $OUT/gpu_tests.log
# Carried wheels (.whl/: DeepGEMM, FlashMLA, triton_kernels, Marlin; .cache/whl/: transformers >= 5.23 for the
# oracle) are installed into a private dir first (tools/device_wheels/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.whl/*.whl .cache/whl/*.whl)
if [ ${#wheels[@]} -gt 0 ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dsv4_site "${wheels[@]}"; then
  export PYTHONPATH="/tmp/dsv4_site:$PYTHONPATH"
fi
$PY -c 'import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)'
# --continue-on-collection-errors: the device image lacks the service's packages (ray, fastapi, openai, pydantic):
# those modules fail to import there and hold no gpu test. One H200 call of 470 s covered about 40% of the run:
# split it by path over calls (e.g. `tools/gpu/run_tests.sh tests/engine`, then the rest).
timeout ${GPU_TESTS_TIMEOUT:-1500} $PY -m pytest -q -s -p no:cacheprovider --continue-on-collection-errors \
  -m "gpu or triton" "${@:-tests}" 2>&1 \
  | tee "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
