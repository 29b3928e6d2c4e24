#!/usr/bin/env bash
# The disaggregated service on one machine, in named stages, each under a timeout, logs and JSON
# in $OUT. On a GPU machine (DEVICE=cuda, the default where nvidia-smi answers): Ray started by `dsv4`'s own
# launcher, a prefill and a decode worker sharing GPU 0 (--worker-num-gpus 0.5) with NIXL moving VRAM between
# their processes, against the colocated engine; NIXL's raw READ rate between two processes; the decode
# worker's process killed mid-stream. DEVICE=cpu runs the same stages smaller on the built-in tiny model.
#   tools/gpu/service_run.sh [stage ...]      stages: env model warm serve raw fault report (default: all, in order)
# Needs the service's packages: on the GPU machine `tools/device_wheels/stage.sh install` first (PYTHONPATH gets
# $SVCSITE when it exists). The section lands in $OUT/gpu_service.md; merge it where the tree is with
#   python3 tools/gpu/service_run.py merge <files_at>/gpu_service.md
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_service_out}
LOGS=${LOGS:-/tmp/gpu_service_logs}  # one log a stage; all of them end up in $OUT/stages.log (8 files come back)
mkdir -p "$OUT" "$LOGS"
SVCSITE=${SVCSITE:-/tmp/svcsite}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${SVCSITE:+:$SVCSITE}${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
if [ -z "${DEVICE:-}" ]; then nvidia-smi -L >/dev/null 2>&1 && DEVICE=cuda || DEVICE=cpu; fi
if [ "$DEVICE" = cuda ]; then
  MODEL=${MODEL:-/tmp/dsv4-mini_v4}
  PRESET=${PRESET:-mini_v4}  # V4's attention geometry (64 heads x 512, window 128, indexer 64 x 128 top-512), 4 layers
  # The token check compares two runs bit for bit, so both must run deterministic kernels. The model is made
  # quantised (FP8 dense, MXFP4 experts: V4's checkpoint format, and the model tests/kv_transfer/test_gpu_handoff.py
  # found bit-exact), and its MXFP4 experts stay packed (=1: the Triton MoE paths, whose k-way sum has no
  # atomics). The run of 2026-12-01 used dequantised bf16 experts, whose combine was then CUDA's atomic
  # index_add_ (dsv4_kernels.moe.moe_experts_grouped sums over k without atomics since).
  export DSV4_MXFP4_MOE=${DSV4_MXFP4_MOE:-1}
  # One compile cache for the warm stage and the workers (tools/gpu/stages.sh coldstart fills the same one first)
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dsv4-cc/deep_gemm}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsv4-cc/triton}
  # a cache an earlier call brought back (tools/gpu/stages.sh coldstart's $OUT/compile_cache.tar.xz), carried as .cc/
  if [ -f .cc/compile_cache.tar.xz ] && [ ! -d /tmp/dsv4-cc ]; then
    mkdir -p /tmp/dsv4-cc && tar -C /tmp/dsv4-cc -xJf .cc/compile_cache.tar.xz && echo "compile cache from .cc/ unpacked"
  fi
  ENGINE=(--device cuda --dtype bfloat16 --max-cached-tokens ${KV_TOKENS:-65536})
  SHARE=(--worker-num-gpus 0.5)
  SERVE=(--num-requests ${REQUESTS:-64} --concurrency ${CONCURRENCY:-8} --min-prompt 256 --max-prompt 2048
         --max-new-tokens 64 --max-batch-tokens 4096 --check-tokens 8)
  RAW=(--device cuda --sizes-mib 1 4 64 1024 --descs 1 256 --iters 5)
  FAULT=(--prompt-tokens 512 --max-new-tokens 400 --kill-after 16 --max-batch-tokens 4096)
else
  MODEL=${MODEL:-}  # the built-in tiny model (a MODEL path: made from PRESET in the model stage)
  PRESET=${PRESET:-tiny}
  ENGINE=()
  SHARE=()
  SERVE=(--num-requests ${REQUESTS:-16} --concurrency 4 --min-prompt 16 --max-prompt 200 --max-new-tokens 16
         --check-tokens 4)
  RAW=(--device cpu --sizes-mib 1 16 --descs 1 64 --iters 3)
  FAULT=(--max-new-tokens 120)
fi
MODEL_ARG=(); [ -n "$MODEL" ] && MODEL_ARG=(--model "$MODEL")
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(env model warm serve raw fault report)
status=0
BUDGET_S=${BUDGET_S:-520}  # the whole run; a stage's limit shrinks to what is left (report keeps 20 s)

run_stage() {  # name timeout_s command...: log to $OUT/name.log, show its end
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  local reserve=20; [ "$name" = report ] && reserve=0
  left=$((BUDGET_S - SECONDS - reserve))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$name" = report ] && [ "$limit" -lt 30 ] && limit=30  # always writes what the other stages left
  if [ "$limit" -lt 15 ]; then
    echo "=== $name: skipped, ${left} s left of the ${BUDGET_S} s budget"; status=1; return 1
  fi
  echo "=== $name $(date -u +%T) (limit ${limit} s)"
  # SIGINT first: KeyboardInterrupt runs the stage's finally blocks, which stop its service and local Ray cluster
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  grep -vE "NIXL INFO|^\s*$|WARNING: Running pip|^\[[0-9.]+\] +\[" "$LOGS/$name.log" | tail -n "${TAIL:-25}" | cut -c1-400
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
  { echo "=== $name: rc $rc in $((SECONDS - t0)) s"; cat "$LOGS/$name.log"; } >> "$OUT/stages.log"
  if [ $rc -ne 0 ]; then
    status=1
    case $name in serve|fault)  # what the workers said: the Ray session's logs, errors first
      "$PY" -c "from service.launcher import ray_logs_tail; print(ray_logs_tail(40000, 4000))" >> "$OUT/stages.log" 2>&1 ;;
    esac
  fi
  return $rc
}

for stage in "${stages[@]}"; do
  case $stage in
    env) run_stage env 90 "$PY" - "$OUT/env.json" "$DEVICE" <<'EOF'
import json, sys, time, platform
from importlib import metadata
import torch
out, device = sys.argv[1], sys.argv[2]
def ver(*names):
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return "missing"
env = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU only",
       "torch": torch.__version__, "ray": ver("ray"), "nixl": ver("nixl-cu13", "nixl-cu12", "nixl"),
       "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
import ray
from kv_transfer.nixl_backend import import_nixl
env["nixl_module"] = import_nixl()[2].__name__
ray.init(address="local", include_dashboard=False, logging_level="WARNING")
env["ray_resources"] = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
ray.shutdown()
print(json.dumps(env, indent=1))
json.dump(env, open(out, "w"), indent=1)
if device == "cuda" and not env["ray_resources"].get("GPU"):
    sys.exit("Ray sees no GPU on this machine")
EOF
    ;;
    model) if [ -n "$MODEL" ]; then
             run_stage model 120 "$PY" -m service.cli make-model --preset "$PRESET" --quantize --out "$MODEL"
           fi
           "$PY" - "$OUT/env.json" "$MODEL" <<'EOF'
import json, os, sys
from engine.loading.make_model import default_model_dir
path, model = sys.argv[1], sys.argv[2] or default_model_dir()
c = json.load(open(os.path.join(model, "config.json")))
env = json.load(open(path)) if os.path.exists(path) else {}
quant = "FP8 dense / MXFP4 expert" if c.get("quantization_config") else "unquantised"
env["model"] = (f"{os.path.basename(model.rstrip('/'))}: random {quant} weights, {c['num_hidden_layers']} layers "
                f"(compress ratios {c['compress_ratios']}), hidden {c['hidden_size']}, "
                f"{c['num_attention_heads']} heads x "
                f"{c['head_dim']}, window {c['sliding_window']}, indexer {c['index_n_heads']} x {c['index_head_dim']} "
                f"top-{c['index_topk']}, {c['n_routed_experts']} experts (top-{c['num_experts_per_tok']}), "
                f"vocab {c['vocab_size']}")
json.dump(env, open(path, "w"), indent=1)
print(env["model"])
EOF
    ;;
    warm) [ "$DEVICE" = cuda ] || continue  # compiles every kernel the workers need into the shared caches
          # ($DG_JIT_CACHE_DIR, $TRITON_CACHE_DIR), so their own start-up warm-up (engine.execution.warmup) loads them
          run_stage warm ${WARM_TIMEOUT:-400} "$PY" -c 'import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from engine.llm import load_engine
load_engine(sys.argv[1] or None, device="cuda", dtype="bfloat16", max_batch_tokens=4096, max_cached_tokens=65536,
            warmup=True)
' "$MODEL" ;;
    serve) run_stage serve ${SERVE_TIMEOUT:-330} "$PY" -m service.cli bench serve "${MODEL_ARG[@]}" "${ENGINE[@]}" \
             "${SHARE[@]}" "${SERVE[@]}" --topologies colocated,1P1D --transfer nixl --no-write \
             --json-out "$OUT/serve.json"
           # the kernels compiled in serving steps and the Triton variants first needed there (engine.telemetry.compile_watch
           # logs both): the Ray workers' logs, and this stage's own log for the colocated engine (it runs in the
           # bench's process)
           grep -rhE "kernels compiled since the last look|variant first needed while serving" \
             "$("$PY" -c 'from service.launcher import ray_logs_dir
print(ray_logs_dir() or "/tmp/ray/session_latest/logs")')" "$LOGS/serve.log" 2>/dev/null | tail -100 \
             > "$OUT/compiles.log"
           echo "compile lines logged by the engines: $(wc -l < "$OUT/compiles.log") (compiles.log)" ;;
    raw) UCX_PROTO_INFO=y run_stage nixl_raw ${RAW_TIMEOUT:-150} "$PY" -m benchmarks.kernels nixl-raw "${RAW[@]}" \
           --json-out "$OUT/nixl_raw.json"
         # which UCX transports carried the READs (UCX_PROTO_INFO prints its protocol choices)
         "$PY" - "$OUT/nixl_raw.json" "$LOGS/nixl_raw.log" <<'EOF'
import json, os, re, sys
path, log = sys.argv[1], sys.argv[2]
if os.path.exists(path):
    text = open(log, errors="replace").read()
    seen = sorted(set(re.findall(r"\b(cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|rc_verbs|dc_mlx5|tcp|sysv|posix|cma|xpmem)\b", text)))
    d = json.load(open(path)); d["transports"] = ", ".join(seen) or "not printed"
    json.dump(d, open(path, "w"), indent=1); print("UCX transports seen:", d["transports"])
EOF
         ;;
    fault) run_stage fault ${FAULT_TIMEOUT:-300} "$PY" tools/gpu/service_run.py fault "${MODEL_ARG[@]}" "${ENGINE[@]}" \
             "${SHARE[@]}" "${FAULT[@]}" --transfer nixl --json-out "$OUT/fault.json" ;;
    report) TAIL=80 run_stage report 60 "$PY" tools/gpu/service_run.py report --dir "$OUT" --out "$OUT/gpu_service.md" ;;
    *) echo "unknown stage $stage (env model warm serve raw fault report)"; status=2 ;;
  esac
done
exit $status
