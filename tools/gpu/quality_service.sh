#!/usr/bin/env bash
# Issue 36's service row on the GPU: the disaggregated service (1 prefill + 1 decode worker sharing GPU 0, NIXL
# moving VRAM, production formats: bf16, fp8 KV cache, FP8 GEMMs, MXFP4 experts, speculative K=$SPEC) serving the
# trained dsv4-mini-py, scored by `dsv4 bench quality --url` beside the engine rows of $FORMATS.
# Needs the service's packages (tools/device_wheels/stage.sh install) and the GPU wheels in /tmp/site.
#   tools/gpu/quality_service.sh          -> $OUT/quality_service.md, $OUT/quality_service.log, $OUT/serve.log
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_logs}
SVCSITE=${SVCSITE:-/tmp/svcsite}
SPEC=${SPEC:-1}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}  # cpu: a smoke run of this script (GPUS=0)
GPUS=${GPUS:-0.5}
FORMATS=${FORMATS:-exact bf16,production}  # with the fp32 reference: exact bf16, production, production + MTP K=1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site:$SVCSITE${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0 DSV4_HAPROXY=${DSV4_HAPROXY:-0}
python3 -m service.cli serve --model models/dsv4-mini-py --device "$DEVICE" --dtype bfloat16 --kv-cache-dtype fp8 \
  --speculative-tokens "$SPEC" --worker-num-gpus "$GPUS" --transfer nixl --port "$PORT" --ready-timeout-seconds 400 \
  > "$OUT/serve.log" 2>&1 &
serve=$!
t0=$SECONDS
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2>/dev/null; do
  if ! kill -0 $serve 2>/dev/null || [ $((SECONDS - t0)) -gt ${READY_S:-420} ]; then
    echo "service not ready after $((SECONDS - t0)) s"; tail -30 "$OUT/serve.log"; kill -INT $serve 2>/dev/null; exit 1
  fi
  sleep 2
done
echo "service ready in $((SECONDS - t0)) s"
timeout ${QUALITY_TIMEOUT:-400} python3 -m benchmarks.quality --device "$DEVICE" --files ${QUALITY_FILES:-8} \
  --formats "$FORMATS" --url "http://127.0.0.1:$PORT" \
  --url-label "disaggregated service (1P1D, NIXL; bf16, fp8 KV, FP8 GEMMs, MXFP4 experts, MTP K=$SPEC)" \
  --out "$OUT/quality_service.md" > "$OUT/quality_service.log" 2>&1
rc=$?
tail -14 "$OUT/quality_service.log" | cut -c1-300
kill -INT $serve; wait $serve
exit $rc
