#!/usr/bin/env bash
# The GPU half of the test suite, on a CUDA machine: compiled Triton kernel tests, the CUDA engine vs
# transformers and vs itself (CUDA graphs), and the GPU-vs-CPU greedy check. Logs go to $OUT (or ./gpu_logs).
# Carried wheels in .cache/whl (transformers >= 5.23 for the oracle) are installed into a private dir first.
# Usage: scripts/gpu_tests.sh [stage ...]   stages: kernels engine check (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.cache/whl/*.whl)
if [ ${#wheels[@]} -gt 0 ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dsv4_site "${wheels[@]}"; then
  export PYTHONPATH="/tmp/dsv4_site:$PYTHONPATH"
fi
$PY -c 'import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)'
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(kernels engine check)
status=0
for stage in "${stages[@]}"; do
  case $stage in
    kernels) timeout ${KERNELS_TIMEOUT:-400} $PY -m pytest -q -p no:cacheprovider tests/kernels/ \
               tests/engine/test_fast_paths.py tests/engine/test_moe_grouped.py 2>&1 | tee "$OUT/kernels.log" || status=1 ;;
    engine) timeout ${ENGINE_TIMEOUT:-240} $PY -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_engine.py \
              tests/engine/test_warmup.py tests/engine/test_gpu_fp8_engine.py tests/engine/test_gpu_flashmla_engine.py 2>&1 | tee "$OUT/engine.log" || status=1 ;;
    check) timeout ${CHECK_TIMEOUT:-150} $PY scripts/check_gpu_engine.py --tokens 24 2>&1 | tee "$OUT/check.log" \
             || status=1 ;;
    *) echo "unknown stage $stage" >&2; status=2 ;;
  esac
done
exit $status
