#!/usr/bin/env bash
# One GPU-machine session in named stages (the Hopper fast paths' probes, tests and benchmarks): installs the carried
# .whl wheels (DeepGEMM, FlashMLA, triton_kernels; tools/device_wheels/README.md) into a private dir, then runs the named stages, logging each to $OUT. Stages: probe, ktests, fp8gemm, moe, fp8oracle,
# slice, gputests, flash (FlashMLA kernel + fp8-default engine tests), tp (TP 2 vs TP 1 on one GPU), e2e, ab
# (overlapped decode on/off, FP8 vs MXFP4 indexer keys), coldstart (engine warm-up on fresh compile caches), b1prof
# (the batch-1 decode step's kernels in launch order), prefillmoe (matmul_ogs launch constraints at prefill sizes),
# decodemoe (the same at 1 and 64 tokens, with split-K and narrow-N tiles at 1), mhc (`dsv4 bench kernels mhc`: the
# mHC pre's paths by token count, fp32 and bf16 streams), pytests (pytest on $PYTEST_FILES), quality (`dsv4 bench
# quality` on CUDA: every production format of the trained model), spec (graph verify tests + `dsv4 bench spec`),
# longctx (slice prefill/decode at 32K, 128K and 1M), prefillfmt (slice prefill with MXFP4 vs FP8 experts, 3 runs),
# specprof (where a speculative step's time goes: phases, kernels, vs the one-token step; benchmarks/spec_profile.py),
# prefillhost (a slice prefill's host-device synchronisations and host functions; benchmarks/slice/prefill_host.py),
# prefillab (the 8K prefill with FlashMLA's sparse prefill and the FP8 MoE's sync-free layout off and on), long1m
# (a 1M-token prompt's chunked prefill), indexerab (the long prefill's indexer: Triton vs DeepGEMM fp8_mqa_logits),
# gemv (the few-route MXFP4 MoE GEMV: its GPU tests, its bench rows at 1/2/4 tokens, batch-1 decode with it off/on),
# gemvsweep (that GEMV's launch configurations at 1/2/4 tokens: the best as JSON), prefillgraphs (prefill under CUDA
# graphs: its GPU tests, then the slice prefill at 1K and 8K with DSV4_PREFILL_GRAPHS=0 and 1),
# rope (the in-place inverse RoPE by rows a program and warps: `dsv4 bench kernels rope`), topkrank (the rank-counting
# top-k: GPU tests, sweep, batch-1 decode at 4K / 32K with its two-launch form off and on), prefillglue (the 8K
# prefill's mHC glue: the two-launch chain at prefill sizes, bf16 residual streams), fp8gemv (the few-token FP8
# GEMV: GPU tests, its sweep, the kernel table against DeepGEMM), gemvslice (batch-1 decode at 4K / 32K, GEMV off / on).
# Usage: tools/gpu/stages.sh stage ...   (the whole GPU test run is its own script: tools/gpu/run_tests.sh)
# A command run beside the stages in the same call (benchmarks/slice/run.sh, pytest) sees the wheels only with
# `export PYTHONPATH=/tmp/site:$PWD` (run.sh installs only .cache/whl: without it the slice falls back to bf16 dense
# and the engine's MoE, as one call of 2026-12-07 did).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.whl/*.whl .cache/whl/*.whl)  # GPU libraries + transformers >= 5.23 for the oracle tests
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
status=0
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    probe) python3 -c '
import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
from dsv4_kernels import gpu
for n in ("has_deep_gemm", "has_flash_mla", "has_triton_kernels"):
    print(n, getattr(gpu, n)(), gpu.why_not({"has_deep_gemm": "deep_gemm", "has_flash_mla": "flash_mla"}.get(n, "triton_kernels.matmul")))
' 2>&1 | tee "$OUT/probe.log" ;;
    ktests) timeout ${KTESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp8_linear.py \
              tests/kernels/test_mxfp4_ogs.py tests/engine/test_fp8_weights.py > "$OUT/ktests.log" 2>&1 || status=1
            grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/ktests.log" | cut -c1-300 ;;
    fp8gemm) timeout ${FP8GEMM_TIMEOUT:-300} python3 -m benchmarks.kernels fp8-gemm --out "$OUT/fp8_gemm.md" 2>&1 | tail -60 \
               | tee "$OUT/fp8gemm.log" || status=1 ;;
    mhc) for dt in ${MHC_DTYPES:-float32 bfloat16}; do  # merge: dsv4 bench kernels mhc --merge mhc_float32.md mhc_bfloat16.md
           timeout ${MHC_TIMEOUT:-150} python3 -m benchmarks.kernels mhc --dtype $dt --out "$OUT/mhc_$dt.md" ${MHC_ARGS:-} \
             > "$OUT/mhc_$dt.log" 2>&1 || status=1
           echo "--- $dt streams"; grep -E "^hc_pre|sweep|Error" "$OUT/mhc_$dt.log" | cut -c1-200
         done ;;
    pytests) timeout ${PYTESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_FILES:-tests/kernels} \
               > "$OUT/pytests.log" 2>&1 || status=1
             grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/pytests.log" | cut -c1-300 ;;
    moe) timeout 300 python3 -m benchmarks.kernels moe --tokens 1 16 64 128 --out "$OUT/mxfp4_moe.md" 2>&1 | tee "$OUT/moe.log" || status=1 ;;
    fp8oracle) timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_fp8_engine.py 2>&1 \
                 > "$OUT/fp8oracle.log" 2>&1 || status=1
               grep -E "^\[gpu fp8|^(FAILED|ERROR)|passed|failed|Error" "$OUT/fp8oracle.log" | cut -c1-400 ;;
    slice) timeout ${SLICE_TIMEOUT:-420} benchmarks/slice/run.sh --budget-s ${SLICE_BUDGET:-300} --out "$OUT/bench_gpu.md" ${SLICE_ARGS:-} \
             > "$OUT/slice.log" 2>&1 || status=1
           grep -E "^(engine|decode|prefill|transformers|profile)|SKIPPED|Error|FAILED" "$OUT/slice.log" | cut -c1-300 ;;
    gputests) tools/gpu/run_tests.sh ${GPU_TEST_ARGS:-} > "$OUT/gputests.log" 2>&1 || status=1
              grep -E "^(FAILED|ERROR)|passed|failed|^\[gpu|agree|Error" "$OUT/gputests.log" | cut -c1-300 ;;
    rest) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py \
            tests/kernels/test_triton_swa_insert.py tests/engine/test_fast_paths.py tests/engine/test_moe_grouped.py \
            > "$OUT/rest.log" 2>&1 || status=1
          grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/rest.log" | cut -c1-300 ;;
    memplan) python3 -c '
import logging; logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from engine.llm import LLM
llm = LLM(device="cuda", dtype="bfloat16")
print("pool tokens", llm.engine.cache_config.max_tokens)
' 2>&1 | grep -v "^$" | tail -5 ;;
    ogssweep) timeout 240 python3 -m benchmarks.kernels moe --tokens 64 128 --ogs-sweep --ogs-best-out "$OUT/ogs_best.json" --ogs-out "$OUT/moe_sweep.md" \
                > "$OUT/ogssweep.log" 2>&1 || status=1
              sed -n '/ogs sweep/,$p' "$OUT/ogssweep.log" | cut -c1-200
              # later stages run with the fastest constraints at the largest token count
              [ -s "$OUT/ogs_best.json" ] && export DSV4_OGS_CONSTRAINTS="$(cat "$OUT/ogs_best.json")" \
                && echo "DSV4_OGS_CONSTRAINTS=$DSV4_OGS_CONSTRAINTS" ;;
    e2e) timeout 200 python3 -m benchmarks.hopper_e2e 2>&1 | grep -v "^$" | tail -12 || status=1 ;;
    # A/B of overlapped greedy decode (engine.execution.decode_overlap) and of the indexer key format, b1 and b64 at 4K / 32K
    ab) for v in "overlap=1 keys=auto" "overlap=0 keys=auto" "overlap=1 keys=mxfp4"; do
          set -- $v; o=${1#overlap=}; k=${2#keys=}
          DSV4_OVERLAP_DECODE=$o timeout ${AB_TIMEOUT:-150} benchmarks/slice/run.sh --budget-s ${AB_BUDGET:-120} --no-peer \
            --experts mxfp4 --batches 1 64 --contexts 4096 32768 --index-cache "$k" --out "$OUT/ab_o${o}_$k.md" \
            > "$OUT/ab_o${o}_$k.log" 2>&1 || status=1
          echo "--- overlap $o, index keys $k"; grep -E "^(decode|prefill) " "$OUT/ab_o${o}_$k.log" | cut -c1-200
        done ;;
    coldstart) python3 -m service.cli make-model --preset mini_v4 --quantize --out /tmp/mini >/dev/null 2>&1
         # fresh compile caches per run (COLD_VARIANTS of: "1" nvcc, "1_nvrtc", "0"), run side by side (the
         # compiles are CPU-bound on 16 cores; the steps are small), each under its own limit
         for tag in ${COLD_VARIANTS:-1 1_nvrtc}; do
           w=${tag%%_*}; extra=; [ "$tag" != "${tag%_nvrtc}" ] && extra=--nvrtc
           [ "$tag" = 1 ] && extra="--cache-dir ${COLD_CACHE:-/tmp/dsv4-cc}"  # kept for service_run.sh's workers
           timeout ${COLD_TIMEOUT:-180} python3 -m benchmarks.cold_start --model /tmp/mini --warmup $w $extra \
             > "$OUT/warm$tag.log" 2>&1 &
         done
         wait
         # the nvcc run's caches come back (compressed), to be carried into later calls (service_run.sh)
         tar -C "${COLD_CACHE:-/tmp/dsv4-cc}" -cJf "$OUT/compile_cache.tar.xz" . 2>/dev/null; ls -la "$OUT"
         for tag in ${COLD_VARIANTS:-1 1_nvrtc}; do
           echo "--- warm$tag"; grep -E "warm-up|load_engine|compile caches|^request|compiled|Triton kernels" "$OUT/warm$tag.log" | cut -c1-600 | tail -60
         done ;;
    flash) timeout ${FLASH_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_flashmla_sparse.py \
             tests/engine/test_gpu_flashmla_engine.py > "$OUT/flash.log" 2>&1 || status=1
           grep -E "^\[gpu flashmla|^(FAILED|ERROR)|passed|failed" "$OUT/flash.log" | cut -c1-400 ;;
    b1prof) timeout ${B1_TIMEOUT:-240} benchmarks/slice/run.sh --budget-s ${B1_BUDGET:-180} --batches 1 --contexts 4096 \
              --experts mxfp4 --no-peer --profile-batch 1 --profile-dump "$OUT/kernels_b1.txt" \
              --prefill-dump "$OUT/kernels_prefill.txt" --out "$OUT/b1.md" \
              > "$OUT/b1prof.log" 2>&1 || status=1
            grep -E "^(decode|profile|prefill)" "$OUT/b1prof.log" | cut -c1-300 ;;
    prefillmoe) timeout ${PMOE_TIMEOUT:-300} python3 -m benchmarks.kernels moe --tokens 4096 8192 --ogs-sweep \
                  --ogs-out "$OUT/moe_prefill_sweep.md" 2>&1 | tail -40 | tee "$OUT/prefillmoe.log" || status=1 ;;
    decodemoe) timeout ${DMOE_TIMEOUT:-200} python3 -m benchmarks.kernels moe --tokens 1 64 --ogs-sweep \
                 --ogs-out "$OUT/moe_decode_sweep.md" 2>&1 | tail -40 | tee "$OUT/decodemoe.log" || status=1 ;;
    tp) timeout ${TP_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_tensor_parallel.py \
          > "$OUT/tp.log" 2>&1 || status=1
        grep -E "^\[gpu tp|^tp |Error" "$OUT/tp.log" | cut -c1-400 ;;
    quality) timeout ${QUALITY_TIMEOUT:-590} python3 -m benchmarks.quality --device cuda --files ${QUALITY_FILES:-8} \
          --out "$OUT/quality_cuda.md" > "$OUT/quality.log" 2>&1 || status=1
        tail -20 "$OUT/quality.log" | cut -c1-300 ;;
    prefillhost) timeout ${PREFILLHOST_TIMEOUT:-240} python3 -m benchmarks.slice.prefill_host --tokens 8192 \
          --experts ${PREFILLHOST_EXPERTS:-mxfp4} > "$OUT/prefill_host.log" 2>&1 || status=1
        grep -v Warning "$OUT/prefill_host.log" | head -90 | cut -c1-250 ;;
    specprof) timeout ${SPECPROF_TIMEOUT:-300} python3 -m benchmarks.spec_profile --k ${SPEC_K:-1} --batches 1 16 64 \
          --out "$OUT/spec_profile.md" > "$OUT/specprof.log" 2>&1 || status=1
        tail -40 "$OUT/spec_profile.md" | cut -c1-250 ;;
    spec) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_spec_bucketed.py tests/engine/test_spec_mtp_graphs.py \
          tests/engine/test_speculative.py tests/engine/test_spec_overlap.py tests/engine/test_verify_prologue.py \
          tests/engine/test_decode_prologue.py > "$OUT/spec_tests.log" 2>&1 || status=1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/spec_tests.log" | cut -c1-300
        timeout ${SPEC_TIMEOUT:-400} python3 -m benchmarks.spec --k ${SPEC_K:-1} --batches 1 16 64 --rates 0.6 0.8 0.9 \
          --out "$OUT/spec_k${SPEC_K:-1}.md" > "$OUT/spec.log" 2>&1 || status=1
        tail -25 "$OUT/spec.log" | cut -c1-250 ;;
    # longctx: then `python -m benchmarks.slice.long_context --files $OUT/long_context.md --note ... --write`
    longctx) timeout ${LONGCTX_TIMEOUT:-540} benchmarks/slice/run.sh --budget-s ${LONGCTX_BUDGET:-480} --experts mxfp4 \
          --batches 1 16 --contexts 32768 131072 1048000 --prefill-tokens 131072 --prefill-chunk 8192 --no-peer \
          --out "$OUT/long_context.md" > "$OUT/longctx.log" 2>&1 || status=1
        tail -30 "$OUT/longctx.log" | cut -c1-250 ;;
    prefillfmt) timeout ${PREFILLFMT_TIMEOUT:-400} benchmarks/slice/run.sh --experts mxfp4 fp8 --prefill-only \
          --prefill-runs 3 --no-peer --out "$OUT/prefill_formats.md" > "$OUT/prefillfmt.log" 2>&1 || status=1
        tail -20 "$OUT/prefillfmt.log" | cut -c1-250 ;;
    # long1m: a 1,048,000-token prompt prefilled in 8K chunks (one untimed run + one timed), decode at that context;
    # then `python -m benchmarks.slice.long_context --files <the longctx run> $OUT/long_1m.md --note ... --write`
    long1m) timeout ${LONG1M_TIMEOUT:-560} benchmarks/slice/run.sh --budget-s ${LONG1M_BUDGET:-520} --experts mxfp4 \
          --batches 1 --contexts 1048000 --prefill-tokens 1048000 --prefill-chunk 8192 --prefill-runs 1 --no-peer \
          --out "$OUT/long_1m.md" > "$OUT/long1m.log" 2>&1 || status=1
        grep -v Warning "$OUT/long1m.log" | tail -30 | cut -c1-300 ;;
    # indexerab: a 128K-token prompt's chunked prefill with the indexer's scores through the Triton kernel (bf16
    # queries) and through DeepGEMM's fp8_mqa_logits (FP8 queries), back to back (tests first:
    # tests/kernels/test_deepgemm_indexer.py, tests/engine/test_gpu_flashmla_engine.py -k indexer)
    indexerab) for v in triton deepgemm; do
            DSV4_INDEXER_PREFILL=$v timeout ${INDEXERAB_TIMEOUT:-240} benchmarks/slice/run.sh --budget-s 200 \
              --experts mxfp4 --batches 1 --contexts 131072 --prefill-tokens ${INDEXERAB_TOKENS:-131072} \
              --prefill-chunk 8192 --prefill-runs 1 --no-peer --out "$OUT/indexer_$v.md" > "$OUT/indexerab_$v.log" 2>&1 \
              || status=1
            echo "== indexer $v"; grep -E "^(prefill|Prefill)" "$OUT/indexerab_$v.log" | cut -c1-300
          done ;;
    # gemv: the few-route MXFP4 MoE GEMV (dsv4_kernels.triton_mxfp4_gemv): its GPU tests (against ogs_moe at V4-Flash
    # shapes, CUDA graphs), `dsv4 bench kernels moe` at 1, 2 and 4 tokens (GEMV rows beside triton_kernels, graph
    # timed), then the slice's batch-1 decode with DSV4_MXFP4_GEMV=0 and =1 back to back (b1prof's run: kernels too)
    gemv) timeout ${GEMV_TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs \
            tests/kernels/test_triton_mxfp4_gemv.py > "$OUT/gemv_tests.log" 2>&1 || status=1
          grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gemv_tests.log" | cut -c1-300
          timeout ${GEMV_BENCH_TIMEOUT:-300} python3 -m benchmarks.kernels moe --tokens 1 2 4 --out "$OUT/moe_gemv.md" \
            2>&1 | tail -30 | tee "$OUT/gemv_bench.log" || status=1
          for v in 0 1; do
            DSV4_MXFP4_GEMV=$v timeout ${B1_TIMEOUT:-240} benchmarks/slice/run.sh --budget-s ${B1_BUDGET:-180} --batches 1 \
              --contexts 4096 --experts mxfp4 --no-peer --profile-batch 1 --profile-dump "$OUT/kernels_b1_gemv$v.txt" \
              --out "$OUT/b1_gemv$v.md" > "$OUT/b1_gemv$v.log" 2>&1 || status=1
            echo "== DSV4_MXFP4_GEMV=$v"; grep -E "^(decode|profile)" "$OUT/b1_gemv$v.log" | cut -c1-300
          done ;;
    # gemvsweep: the GEMV's launch configs (GemvConfig: block_sr, kc, warps, stages, split-K target) at V4-Flash
    # shapes, 1/2/4 tokens, graph timed, each checked against the default's output (benchmarks/kernels/
    # moe_gemv_sweep.py: staged under GEMVSWEEP_BUDGET s of configs, then the triton_kernels reference). Progress lines
    # as it goes (a cut run still shows each config's times); the tables and the best configs (one JSON line) are
    # printed and written before the reference runs. Adopt one: DEFAULT_CONFIG in dsv4_kernels/triton_mxfp4_gemv.py.
    gemvsweep) timeout ${GEMVSWEEP_TIMEOUT:-150} python3 -m benchmarks.kernels moe --tokens 1 2 4 --gemv-sweep \
            --gemv-budget-s ${GEMVSWEEP_BUDGET:-80} --gemv-out "$OUT/gemv_sweep.md" --gemv-best-out "$OUT/gemv_best.json" \
            > "$OUT/gemvsweep.log" 2>&1 || status=1
          grep -vE "Warning|warn_once" "$OUT/gemvsweep.log" | cut -c1-1500 | tail -120 ;;
    # prefillab: the 8K prefill by expert format with FlashMLA's sparse prefill and the FP8 MoE's sync-free layout
    # off (as before) and on, one run.sh each (same warm machine, back to back); then
    # `python -m benchmarks.slice.long_context --prefill-formats --files $OUT/prefill_ab_*.md --note ... --write`
    prefillab) for v in "0 exact" "1 exact" "1 bound"; do set -- $v
            DSV4_FLASH_MLA_PREFILL=$1 DSV4_FP8_MOE_LAYOUT=$2 timeout ${PREFILLAB_TIMEOUT:-200} benchmarks/slice/run.sh \
              --experts ${PREFILLAB_EXPERTS:-mxfp4 fp8} --prefill-only --prefill-runs 3 --no-peer \
              --out "$OUT/prefill_ab_fm$1_$2.md" > "$OUT/prefillab_fm$1_$2.log" 2>&1 || status=1
            echo "== flashmla prefill $1, fp8 moe layout $2"; grep -E "^(prefill|Prefill)" "$OUT/prefillab_fm$1_$2.log" | cut -c1-300
          done ;;
    # prefillgraphs: prefill steps under CUDA graphs (engine.execution.prefill_graphs): their GPU tests, then the slice
    # prefill at 1K and 8K tokens with DSV4_PREFILL_GRAPHS off and on (the first run captures; 3 timed runs each)
    prefillgraphs) timeout ${PGRAPH_TESTS_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu \
          tests/engine/test_gpu_prefill_graphs.py > "$OUT/prefill_graph_tests.log" 2>&1 || status=1
        grep -E "^\[prefill|^(FAILED|ERROR)|passed|failed" "$OUT/prefill_graph_tests.log" | cut -c1-300
        for t in ${PGRAPH_TOKENS:-1024 8192}; do for g in 0 1; do
            DSV4_PREFILL_GRAPHS=$g timeout ${PGRAPH_TIMEOUT:-200} benchmarks/slice/run.sh \
              --experts ${PGRAPH_EXPERTS:-mxfp4 fp8} --prefill-only --prefill-tokens "$t" --prefill-runs 3 --no-peer \
              --out "$OUT/prefill_graphs_${t}_g$g.md" > "$OUT/prefillgraphs_${t}_g$g.log" 2>&1 || status=1
            echo "== $t tokens, DSV4_PREFILL_GRAPHS=$g"
            grep -E "^(engine|prefill|Prefill)" "$OUT/prefillgraphs_${t}_g$g.log" | cut -c1-300
          done; done ;;
    # topkrank: the rank-counting top-k's GPU tests and sweep (one launch by blocks, two by segment), then batch-1
    # decode at 4K and 32K with the two-launch rule off and on (DSV4_TOPK_RANK_SEGMENT)
    topkrank) timeout ${TOPK_TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_topk.py \
            > "$OUT/topk_tests.log" 2>&1 || status=1
        tail -1 "$OUT/topk_tests.log"
        timeout ${TOPK_SWEEP_TIMEOUT:-150} python3 -c 'import torch; from benchmarks.kernels.topk import sweep_rank
sweep_rank(torch.device("cuda"))' 2>&1 | tee "$OUT/topk_rank_sweep.log" | grep -v "^$" || status=1
        for seg in 0 ${TOPK_SEGMENT:-2048}; do
          DSV4_TOPK_RANK_SEGMENT=$seg timeout ${TOPK_SLICE_TIMEOUT:-200} benchmarks/slice/run.sh --experts mxfp4 --no-peer \
            --prefill-tokens 1024 --prefill-runs 1 --contexts 4096 32768 --batches 1 --budget-s 150 \
            --out "$OUT/topk_b1_seg$seg.md" > "$OUT/topk_b1_seg$seg.log" 2>&1 || status=1
          echo "== DSV4_TOPK_RANK_SEGMENT=$seg"; grep -E "^\| 1 \|" "$OUT/topk_b1_seg$seg.md"
        done ;;
    # prefillglue: the 8K fp8-expert prefill's mHC boundary, as two 4K-token chunks (the chain kernels' limit,
    # triton_mhc_chain.LIMIT_TOKENS), 3 runs each: default, the two-launch chain at prefill sizes
    # (DSV4_HC_CHAIN_MAX_TOKENS=4096: post + next mix, then pre + norm + quant; ~8 ms of the step is mHC glue), and
    # bf16 residual streams (DSV4_FP32_RESIDUAL=0: half the glue's bytes; a precision change to state if kept)
    prefillglue) for v in "8 1" "4096 1" "8 0"; do set -- $v  # --budget-s: 60 s to build an engine + 5 kept back, after ~9 s of roofs
            DSV4_HC_CHAIN_MAX_TOKENS=$1 DSV4_FP32_RESIDUAL=$2 timeout ${PGLUE_TIMEOUT:-110} benchmarks/slice/run.sh \
              --budget-s 90 --experts fp8 --prefill-only --prefill-chunk 4096 --prefill-runs 3 --no-peer \
              --out "$OUT/prefill_glue_$1_$2.md" \
              > "$OUT/prefillglue_$1_$2.log" 2>&1 || status=1
            echo "== chain max tokens $1, fp32 residual $2"; grep -E "^Prefill .*runs|^\| 1 x" "$OUT/prefill_glue_$1_$2.md" | cut -c1-250
          done ;;
    # fp8gemv: the few-token FP8 GEMV (dsv4_kernels.triton_fp8_gemv): its GPU tests with the switch on, the tile x
    # warps sweep at 1 token, then the kernel table against DeepGEMM at 1 / 2 / 4 tokens
    fp8gemv) DSV4_FP8_GEMV_MAX_TOKENS=4 timeout ${GEMV_TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs \
               tests/kernels/test_triton_fp8_gemv.py tests/kernels/test_fp8_linear.py > "$OUT/fp8gemv_tests.log" 2>&1 || status=1
             grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fp8gemv_tests.log" | cut -c1-300
             timeout ${GEMV_SWEEP_TIMEOUT:-200} python3 -m benchmarks.kernels fp8-gemm --tokens 1 2 --gemv-sweep \
               --out "$OUT/fp8_gemv_sweep.md" > "$OUT/fp8_gemv_sweep.log" 2>&1 || status=1
             grep -E "^\| |Best|Error" "$OUT/fp8_gemv_sweep.log" | cut -c1-200
             DSV4_FP8_GEMV_MAX_TOKENS=0 timeout ${GEMV_TABLE_TIMEOUT:-200} python3 -m benchmarks.kernels fp8-gemm --tokens 1 2 4 \
               --out "$OUT/fp8_gemm_gemv.md" > "$OUT/fp8_gemm_gemv.log" 2>&1 || status=1
             grep -E "^\| [a-z]" "$OUT/fp8_gemm_gemv.md" | cut -c1-220 ;;
    # gemvslice: batch-1 decode at 4K / 32K with the FP8 GEMV off and on (DSV4_FP8_GEMV_MAX_TOKENS 0 and $GEMV_ON),
    # back to back on the same machine
    gemvslice) for on in 0 ${GEMV_ON:-4}; do
               DSV4_FP8_GEMV_MAX_TOKENS=$on timeout ${GEMV_SLICE_TIMEOUT:-200} benchmarks/slice/run.sh --experts mxfp4 --no-peer \
                 --prefill-tokens 1024 --prefill-runs 1 --contexts 4096 32768 --batches 1 --budget-s 150 \
                 --out "$OUT/gemv_b1_$on.md" > "$OUT/gemv_b1_$on.log" 2>&1 || status=1
               echo "== DSV4_FP8_GEMV_MAX_TOKENS=$on"; grep -E "^\| 1 \||roofs measured" "$OUT/gemv_b1_$on.md" | cut -c1-250
             done ;;
    # rope: the in-place inverse RoPE's rows a program x warps at 8K / 64 / 1 tokens (`dsv4 bench kernels rope`)
    rope) timeout ${ROPE_TIMEOUT:-120} python3 -m benchmarks.kernels rope --out "$OUT/rope_sweep.md" > "$OUT/rope.log" 2>&1 \
            || status=1
          sort -t'|' -k2,2n -k5,5g "$OUT/rope_sweep.md" | grep -E "^\| [0-9]" | awk -F'|' '$2!=p{print; p=$2; n=0} ' ;
          grep -E "default|False|Error" "$OUT/rope.log" | cut -c1-200 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
