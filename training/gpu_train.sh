#!/usr/bin/env bash
# The H200 training run of dsv4-mini-py (issue 36), one command on the device machine:
#   bash training/gpu_train.sh --minutes 6 --out $OUT/run      (carry: .cache/whl36 .cache/dsv4_train)
# Needs what this machine prepares (both git-ignored under .cache/):
#   .cache/dsv4_train: `python -m training.prepare --out .cache/dsv4_train` (tokenizer + token arrays);
#   .cache/whl36: transformers with DeepseekV4 (the image's 5.17 predates it) and what its import needs that the
#     image lacks or has too old (huggingface_hub 2.x and its new http stack, regex for cp312):
#     pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .cache/whl36 transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 \
#       truststore==0.10.5 anyio==4.16.0 idna==3.20 click==8.5.1 hf-xet==1.8.0 regex==2026.11.19 h11==0.16.0
# Then here: python -m training.export --run <the run dir that came back> --data .cache/dsv4_train --out models/dsv4-mini-py
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/dsv4_train_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .cache/whl36/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers; from transformers import DeepseekV4ForCausalLM; print("torch", torch.__version__, torch.cuda.get_device_name(), "transformers", transformers.__version__)'
exec python3 -m training.train --data .cache/dsv4_train --device cuda --seq-len 1024 --batch 32 "$@"
