#!/usr/bin/env bash
# GPU decode / prefill benchmark of a V4-Flash-shaped slice vs its rooflines and transformers (one H200,
# under 10 minutes). Prints the markdown table; pass --write to put it into BENCHMARKS.md, --out FILE to
# keep a copy, --smoke for the tiny CPU check, --experts mxfp4|bf16 for the routed-expert formats (default
# both, one engine each). See benchmarks/slice/cli.py for what is measured.
#
# The peer is transformers' DeepseekV4ForCausalLM. When wheels sit in .cache/whl (git-ignored), they are
# installed into a private target dir and used (on the GPU machine: carry .cache/whl); otherwise the
# installed transformers is used if it has the model. The wheels used on 2026-11-29 (Python 3.12 there):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .cache/whl transformers==5.24.0 regex==2026.11.19
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

installed=$($PY - <<'PYEOF' 2>/dev/null || echo "not importable"
try:
    import transformers
    v = transformers.__version__
except Exception:
    print("not importable"); raise SystemExit
try:
    from transformers import DeepseekV4ForCausalLM  # noqa: F401
    print(f"{v}, has DeepseekV4ForCausalLM")
except Exception:
    print(f"{v}, lacks DeepseekV4ForCausalLM")
PYEOF
)
source_note="installed: $installed"
shopt -s nullglob
wheels=(.cache/whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  site=${DSV4_BENCH_SITE:-/tmp/dsv4_bench_site}
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"; then
    export PYTHONPATH="$site:$PYTHONPATH"
    source_note="carried wheel; the image's transformers: $installed"
  else
    echo "benchmarks/slice/run.sh: could not install ${wheels[*]}; using the installed transformers" >&2
  fi
fi
export DSV4_TRANSFORMERS_SOURCE="$source_note"
export DSV4_BENCH_COMMAND="benchmarks/slice/run.sh $*"
exec $PY -m benchmarks.slice "$@"
