#!/usr/bin/env bash
# The service's Python packages on the GPU machine (no network there; its image lacks Ray, FastAPI, OpenAI, NIXL).
# Here:   tools/device_wheels/stage.sh build        -> .svcwhl/part1, part2 (ignored; each carried by one device call)
# Device: tools/device_wheels/stage.sh part1        copies the carried .svcwhl/part1 into $SVCWHL (kept while the
#                                                  machine stays warm between back-to-back calls)
#         tools/device_wheels/stage.sh install      pip-installs every staged wheel into $SVCSITE, checks the imports
#         tools/device_wheels/stage.sh install part2   copies part2 first, then installs
# After install: export PYTHONPATH="$PWD:$SVCSITE" (tools/gpu/service_run.sh does).
set -uo pipefail
cd "$(dirname "$0")/../.."
SVCWHL=${SVCWHL:-/tmp/svcwhl}
SVCSITE=${SVCSITE:-/tmp/svcsite}

copy_part() {
  local part=$1
  if [ ! -d ".svcwhl/$part" ]; then echo "no .svcwhl/$part here (name it in the call's carry)" >&2; return 1; fi
  mkdir -p "$SVCWHL" && cp .svcwhl/"$part"/*.whl .svcwhl/"$part"/ALL_WHEELS.txt "$SVCWHL"/ || return 1
  echo "staged $part: $(ls .svcwhl/"$part"/*.whl | wc -l) wheels; $SVCWHL now holds $(ls "$SVCWHL"/*.whl | wc -l)" \
       "of $(wc -l < "$SVCWHL/ALL_WHEELS.txt") ($(du -sh "$SVCWHL" | cut -f1))"
}

install() {
  shopt -s nullglob
  local wheels=("$SVCWHL"/*.whl)
  [ ${#wheels[@]} -gt 0 ] || { echo "nothing staged in $SVCWHL" >&2; return 1; }
  local missing
  missing=$(cd "$SVCWHL" && while read -r w; do [ -f "$w" ] || echo "$w"; done < ALL_WHEELS.txt)
  if [ -n "$missing" ]; then  # a part staged by an earlier call is gone: that machine went back
    echo "missing wheels in $SVCWHL (the machine was not kept warm since the earlier part's call? stage it again):" >&2
    echo "$missing" | head -5 >&2
    return 3
  fi
  if [ -f "$SVCSITE/.installed" ] && cmp -s "$SVCSITE/.installed" "$SVCWHL/ALL_WHEELS.txt"; then
    echo "already installed in $SVCSITE"
    return 0
  fi
  local t0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SVCSITE" \
    "${wheels[@]}" || return 1
  cp "$SVCWHL/ALL_WHEELS.txt" "$SVCSITE/.installed"
  echo "installed ${#wheels[@]} wheels into $SVCSITE in $((SECONDS - t0)) s"
  PYTHONPATH="$PWD:$SVCSITE" python3 - <<'EOF'
import importlib, sys
ok = True
for name in ("ray", "ray.serve", "fastapi", "starlette", "uvicorn", "pydantic", "openai", "grpc", "google.protobuf",
             "nixl_cu13", "router.protos", "kv_transfer.nixl_backend"):
    try:
        m = importlib.import_module(name)
        print(f"import {name}: ok {getattr(m, '__version__', '')} ({(getattr(m, '__file__', '') or '')[:60]})")
    except Exception as e:  # noqa: BLE001 - report every failure
        ok = False
        print(f"import {name}: FAILED {type(e).__name__}: {e}")
from kv_transfer.nixl_backend import import_nixl
print("nixl module:", import_nixl()[2].__name__)
sys.exit(0 if ok else 1)
EOF
}

case ${1:-} in
  build) python3 tools/device_wheels/svc_wheels.py build "${@:2}" ;;
  install) for p in "${@:2}"; do copy_part "$p" || exit 1; done; install ;;
  part*) copy_part "$1" ;;
  *) echo "usage: $0 build | partN | install [partN...]" >&2; exit 2 ;;
esac
