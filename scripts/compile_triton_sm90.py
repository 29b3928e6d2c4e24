"""Compile the cache-writing Triton kernels for sm_90 (H100 / H200) on any host, no GPU needed.

The interpreter accepts programs the GPU compiler rejects (reshapes, dot shapes, pointer casts), so this runs
each public wrapper at V4-Flash shapes on CPU tensors, records the kernel launch instead of running it, and
compiles the recorded launch with triton's own CUDA backend (ptxas ships in the triton wheel) for
GPUTarget("cuda", 90, 32), with the constexprs the CUDA path would use (hardware fp8 cast, bf16 dots).
It reports registers / spills (ptxas -v) and checks that every fp32 -> e4m3 conversion is the single
round-to-nearest-even cvt (cvt.rn.satfinite.e4m3x2.f32), not a double-rounding path through fp16.

With --pdl every launch is recorded as the CUDA path makes it with $DSV4_PDL on (PDL=True, launch_pdl=True:
dsv4_kernels.triton_pdl) and each kernel must then hold griddepcontrol.wait (and hold none without --pdl).

Usage: python scripts/compile_triton_sm90.py [--only mhc,router,topk,step_ends,swa,indexer_query,compressor,compress_step,
         attention_glue,prologue,indexer,moe_glue,sampling,fallback,fp8_gemv] [--pdl] [--jobs N] [--no-report]
         (exit 1 on any failure)
--jobs N compiles the groups in N child processes (round-robin; a cold triton cache makes the whole run ~3 min on
one core). --no-report skips the ptxas -v run that reports registers and spills (a second ptxas pass per kernel).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (read when kernels are decorated)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

_SIG = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
        torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_LAUNCH = ("num_warps", "num_stages", "launch_pdl")
# What the wrappers pass when their tensors are on CUDA (they run on CPU tensors here).
_CUDA_CONSTEXPRS = {"HW_FP8": True, "LIBDEVICE": True}


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def signature(fn, args, kw) -> tuple[dict, dict, dict]:
    names = fn.arg_names
    sig, consts = {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _SIG[value.dtype]
        elif isinstance(value, bool):
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, int):
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
        else:
            sig[name] = "fp32"
    for name, value in kw.items():
        if name not in _LAUNCH:
            sig[name], consts[name] = "constexpr", _CUDA_CONSTEXPRS.get(name, value)
    bf16 = any(v == "*bf16" for v in sig.values())
    if "BF16_DOT" in consts:
        consts["BF16_DOT"] = bf16
    options = {k: kw[k] for k in _LAUNCH if k in kw}
    options.setdefault("num_warps", 4)
    return sig, consts, options


def ptxas_report(ptx: str) -> str:
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas(90).path  # the ptxas triton itself uses for sm_90
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    res = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    out = res.stderr + res.stdout
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"regs {regs.group(1) if regs else '?'} spill-stores {spill.group(1) if spill else '?'} B"


def compile_calls(label: str, rec: Recorder, report: bool = True) -> list[str]:
    """Compile every recorded launch of one kernel (report: ptxas -v's registers / spills too); -> error lines
    (empty = all compiled)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    errors = []
    for args, kw in rec.calls:
        sig, consts, options = signature(rec.fn, args, kw)
        what = f"{label} [{', '.join(f'{k}={v}' for k, v in consts.items() if k.isupper())}]"[:220]
        try:
            k = tcompile(ASTSource(rec.fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as e:  # noqa: BLE001 - report every failing variant, keep going
            errors.append(f"FAIL {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(errors[-1], flush=True)
            continue
        ptx = k.asm["ptx"]
        note = ""
        if "PDL" in consts and ("griddepcontrol.wait" in ptx) != bool(consts["PDL"]):
            errors.append(f"FAIL {what}: griddepcontrol.wait {'missing' if consts['PDL'] else 'present'} in the PTX")
        if consts.get("PDL"):
            note += " pdl wait"
        if consts.get("HW_FP8") and "e4m3" in ptx:
            if re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f16x2", ptx) or "cvt.rn.f16" in ptx and "e4m3x2.f32" not in ptx:
                errors.append(f"FAIL {what}: fp32 -> e4m3 goes through fp16 (double rounding)")
            note += " fp8 cvt: " + ("direct f32" if "e4m3x2.f32" in ptx else "other")
        print(f"ok   {what}: {ptxas_report(ptx) if report else 'compiled'}{note}", flush=True)
    rec.calls.clear()
    return errors


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def swa_cases():
    from dsv4_kernels import geometry as g
    from dsv4_kernels import triton_swa_insert as m

    d, rope, t = 512, 64, 4
    cos, sin = torch.rand(t, rope // 2), torch.rand(t, rope // 2)
    rows = torch.arange(t)
    layout = g.Fp8DsMlaLayout(d, rope)
    for dtype in (torch.bfloat16, torch.float32):
        kv = _rand(t, d, dtype=dtype)
        m.swa_insert(kv, torch.ones(d), cos, sin, 1e-6, torch.zeros(2, layout.block_bytes(), dtype=torch.uint8),
                     rows, layout)
        m.swa_insert(kv, torch.ones(d), cos, sin, 1e-6, torch.zeros(128, d, dtype=dtype), rows)
    return m, ["_swa_insert_kernel"]


def indexer_query_cases():
    from dsv4_kernels import geometry as g
    from dsv4_kernels import triton_indexer_query as m

    q = _rand(4, 64, 128)
    cos, sin = torch.rand(4, 32), torch.rand(4, 32)
    for fmt in ("mxfp4", "fp8"):
        for dtype in (torch.bfloat16, torch.float32):
            m.indexer_query(q.to(dtype), cos, sin, g.IndexerKeyLayout(128, fmt), return_rotated=True)
        m.indexer_query(q, cos, sin, g.IndexerKeyLayout(128, fmt), hadamard=False)
    rows = torch.randint(0, 99, (4, 300))
    m.indexer_prologue(q, cos, sin, _rand(4, 64), 0.125, rows, rows > 50)
    return m, ["_indexer_q_kernel", "_prologue_kernel"]


def compressor_cases():
    from dsv4_kernels import geometry as g
    from dsv4_kernels import triton_compressor as m

    n = 4
    for slots, d, layout in ((8, 512, g.Fp8DsMlaLayout(512, 64, 64)), (128, 512, g.Fp8DsMlaLayout(512, 64, 2)),
                             (8, 128, g.IndexerKeyLayout(128, "mxfp4")), (8, 128, g.IndexerKeyLayout(128, "fp8"))):
        kv, score = _rand(n, slots, d), torch.randn(n, slots, d)
        cache = torch.zeros(2, layout.block_bytes(), dtype=torch.uint8)
        m.pool_norm_rope_quant(kv, score, torch.ones(d), 1e-6, torch.rand(n, 32), torch.rand(n, 32), cache,
                               torch.arange(n), layout)
    # The engine's existing kernel shares _pool_cols (its BF16_BITS default keeps it as it was).
    m.pool_norm_rope(_rand(n, 8, 512), torch.randn(n, 8, 512), torch.ones(512), 1e-6, torch.rand(n, 32),
                     torch.rand(n, 32))
    return m, ["_pool_quant_kernel", "_pool_norm_rope_kernel"]  # (the state ring: compress_step_cases)


def compress_step_cases():
    """The engine's decode compressor (V4-Flash: kv4 / kv128 entries, MXFP4 / FP8 indexer keys, exact rows)."""
    from dsv4_kernels import geometry as g
    from dsv4_kernels import triton_compress_step as m
    from dsv4_kernels import triton_state_save as s

    t, ring = 4, 64
    cos, sin = torch.rand(100, 32), torch.rand(100, 32)
    for ratio, d, layout in ((4, 512, g.Fp8DsMlaLayout(512, 64, 64)), (128, 512, g.Fp8DsMlaLayout(512, 64, 2)),
                             (4, 128, g.IndexerKeyLayout(128, "mxfp4", 64)),
                             (4, 128, g.IndexerKeyLayout(128, "fp8", 64)), (4, 512, None)):
        overlap = ratio == 4
        w = 2 * d if overlap else d
        kvg = _rand(t, 2 * w)  # column views of one GEMM output
        cur = torch.randint(0, ring + t, (t, ratio))
        cache = torch.zeros(128, d, dtype=torch.bfloat16) if layout is None else \
            torch.zeros(2, layout.block_bytes(), dtype=torch.uint8)
        m.close_windows(torch.zeros(ring, 2 * w), kvg[:, :w], kvg[:, w:], torch.randn(ratio, w), torch.arange(t), cur,
                        cur if overlap else None, cur > 3 if overlap else None, torch.ones(d), 1e-6, cos, sin,
                        torch.arange(t) * ratio, torch.arange(t), cache, layout)
        s.save_state(kvg[:, :w], kvg[:, w:], torch.randn(ratio, w), torch.arange(t), torch.zeros(ring, 2 * w),
                     torch.arange(t), torch.arange(t))
    return (m, s), ["_close_kernel", "_save_kernel"]


def attention_glue_cases():
    """Attention row ids (CSA ids through the page table, HCA rows) and the output's inverse RoPE."""
    from dsv4_kernels import triton_attention_rows as m
    from dsv4_kernels import triton_fp8_quant as q
    from dsv4_kernels import triton_norm_rope as r
    from dsv4_kernels.rope import InverseRope

    t = 4
    swa, valid = torch.randint(0, 999, (t, 128)), torch.rand(t, 128) > 0.5
    out = torch.empty(t, 128 + 512, dtype=torch.int32)
    m.attention_rows(swa, valid, out[:, :128], ids=torch.randint(-1, 900, (t, 512)), table=torch.randint(0, 99, (t, 8)),
                     seg=torch.arange(t), page_rows=64, base=1000, out_comp=out[:, 128:])
    m.attention_rows(swa, valid, out[:, :128], comp_rows=torch.randint(0, 99, (t, 64)),
                     comp_valid=torch.rand(t, 64) > 0.5, out_comp=out[:, 128:])
    for dtype in (torch.bfloat16, torch.float32):
        r.rope(_rand(t, 64, 512, dtype=dtype), torch.rand(t, 32), torch.rand(t, 32), inverse=True)
    # the decode path's in-place inverse rotation (the pairs kernel) and the q / kv RMSNorm + RoPE
    r.rope(_rand(t, 64, 512), torch.rand(t, 32), torch.rand(t, 32), inverse=True, inplace=True)
    r.rms_norm_rope(_rand(t, 64, 512), torch.rand(t, 32), torch.rand(t, 32), 1e-6)
    r.rms_norm_rope(_rand(t, 512), torch.rand(t, 32), torch.rand(t, 32), 1e-6, torch.ones(512))
    # the inverse RoPE riding in wo_a's grouped quantiser (8 groups of 8 heads x 512; padded rows for DeepGEMM)
    back = InverseRope(torch.rand(t, 32), torch.rand(t, 32), 512)
    q.quant_act_1x128_grouped(_rand(t, 8, 4096).transpose(0, 1), True, 256, back)
    return (m, r, q), ["_rows_kernel", "_rope_kernel", "_rope_pairs_kernel", "_norm_rope_kernel", "_quant_kernel"]


def mhc_cases():
    """mHC pre (split-K mixing logits, Sinkhorn, collapse; with and without the fused input norm) and post at
    V4-Flash widths: one decode token (16-row tile) and a 256-token step (64-row tile)."""
    from dsv4_kernels import triton_mhc as m
    from dsv4_kernels import triton_mhc_chain as c

    hc, d, n_mix = 4, 4096, 24
    fn, base, scale = torch.randn(n_mix, hc * d), torch.randn(n_mix), torch.rand(3)
    for dtype in (torch.float32, torch.bfloat16):  # the engine's residual streams are fp32 by default
        for t in (1, 256, 4096):  # 4096: a prefill chunk (tensor-core mix kernels; fp32: the rows path)
            streams = torch.empty(t, hc, d, dtype=dtype)  # recorded, never run: no values needed
            m.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, norm_weight=torch.rand(d), out_eps=1e-6,
                     out_dtype=torch.bfloat16)
            m.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
            m.hc_pre_quant(streams, fn, base, scale, 20, 1e-6, 1e-6, norm_weight=torch.rand(d), out_eps=1e-6,
                           out_dtype=torch.bfloat16, pow2=True)
            m.hc_post(torch.empty(t, d, dtype=torch.bfloat16), streams, torch.rand(t, hc), torch.rand(t, hc, hc))
        for t in (1, 64):  # the block-boundary chain (decode sizes: one token a program, then 8)
            streams = torch.empty(t, hc, d, dtype=dtype)
            kw = {"norm_weight": torch.rand(d), "out_eps": 1e-6, "out_dtype": torch.bfloat16}
            c.post_pre_norm_quant(torch.empty(t, d, dtype=torch.bfloat16), streams, torch.rand(t, hc),
                                  torch.rand(t, hc, hc), fn, base, scale, 20, 1e-6, 1e-6, **kw, pow2=True)
            c.pre_norm_quant(streams, fn, base, scale, 20, 1e-6, 1e-6, **kw, pow2=None)
    return (m, c), ["_hc_mix_kernel", "_hc_mix_bf16x3_kernel", "_hc_pre_kernel", "_hc_pre_split_kernel",
               "_norm_rows_kernel", "_hc_post_kernel", "_hc_weights_kernel", "_hc_collapse_kernel",
               "_post_mix_kernel", "_pre_norm_quant_kernel"]


def step_ends_cases():
    """The step's first and last launches at V4-Flash widths: embeddings into hc streams + both RoPEs' cos / sin
    (libdevice's), and hc_head + the final norm over gathered logit rows (one decode token, a 64-token step)."""
    from dsv4_kernels import triton_hc_head as h
    from dsv4_kernels import triton_step_inputs as s

    hc, d = 4, 4096
    for t in (1, 64):
        for dtype in (torch.float32, torch.bfloat16):
            s.step_inputs(_rand(1000, d), torch.arange(t), torch.arange(t), hc, dtype, torch.rand(2, 32), torch.rand(2))
            h.hc_head_norm(torch.empty(t, hc, d, dtype=dtype), torch.randn(hc, hc * d), torch.randn(hc), torch.rand(1),
                           1e-6, 1e-6, torch.rand(d), 1e-6, torch.bfloat16, torch.arange(t))
    return (s, h), ["_step_inputs_kernel", "_head_mix_kernel", "_head_norm_kernel"]


def topk_cases():
    """The indexer's radix top-k at decode sizes: 512 of 1024 and of 8192 candidates (two blocks); the rank-counting
    kernel at 1 x 2048 and 4 x 1000."""
    from dsv4_kernels import triton_topk as m
    from dsv4_kernels import triton_topk_rank as rank
    from dsv4_kernels import triton_topk_sort as sort

    for rows, cands in ((1, 1024), (64, 8192)):
        m.topk_columns(torch.randn(rows, cands), 512)
    for cands, k in ((1024, 512), (300, 512), (100, 1), (8192, 512)):  # blocks it takes, k = the block, k = 1
        sort.topk_columns_sorted(torch.randn(1, cands), k)
    for rows, cands in ((1, 2048), (4, 1000)):
        rank.topk_columns_ranked(torch.randn(rows, cands), 512)
    rank.topk_columns_ranked(torch.randn(1, 8192), 512, segment=2048)  # two launches: pieces, then indirect
    return (m, sort, rank), ["_topk_kernel", "_topk_sort_kernel", "_rank_topk_kernel"]


def fp8_gemv_cases():
    """The few-token FP8 GEMV: the joined wq_a|wkv projection (1536 x 4096) at one and two tokens, and a grouped
    projection (wo_a's 8 groups of 1024 x 4096) at one token."""
    from dsv4_kernels import triton_fp8_gemv as g

    e4 = torch.float8_e4m3fn
    for n, k, groups, m in ((1536, 4096, 1, 1), (1536, 4096, 1, 2), (8192, 4096, 8, 1)):
        w, ws = torch.empty(n, k, dtype=e4), torch.empty(n // 128, k // 128)
        xq, xs = torch.empty(groups, m, k, dtype=e4), torch.empty(groups, m, k // 128)
        g.fp8_gemv(xq, xs, w, ws, torch.empty(groups, m, n // groups, dtype=torch.bfloat16))
    return (g,), ["_fp8_gemv_kernel"]


def router_cases():
    """The MoE router at V4-Flash widths (256 experts x 4096, top-6): the GEMV's partials and the routing kernel
    adding them (one decode token), the routing kernel on cuBLAS's logits (a 64-token step)."""
    from dsv4_kernels import triton_moe as m
    from dsv4_kernels import triton_router as r

    gate, bias = torch.randn(256, 4096, dtype=torch.bfloat16), torch.randn(256)
    r.takes_gemv = lambda x: x.shape[0] <= r.GEMV_MAX_TOKENS  # CPU tensors here: take the CUDA path's choice
    m.router_logits = lambda x, g: torch.empty(x.shape[0], g.shape[0])  # (recorded launches only)
    for t in (1, 64):
        m.route(torch.empty(t, 4096, dtype=torch.bfloat16), gate, 6, 2.5, bias=bias)
    return (m, r), ["_route_kernel", "_router_gemv_kernel"]


def prologue_cases():
    """The decode step's first launch: every index tensor from the per-bucket descriptor table (values unread)."""
    from dsv4_kernels import triton_decode_prologue as m

    for queries in (1, 2):  # decode, verify
        m.decode_prologue(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(8, 64, dtype=torch.int64),
                          torch.zeros(6, m.NUM_FIELDS, dtype=torch.int64), 1000, 100, queries=queries)
    return m, ["_prologue_kernel"]


def indexer_cases():
    """The indexer's decode scores over paged MXFP4 / FP8 keys and plain rows (64 heads x 128), and the split
    radix top-k of a few long rows."""
    from dsv4_kernels import geometry as g
    from dsv4_kernels import triton_indexer as m
    from dsv4_kernels import triton_topk_split as split

    t, s = 4, 2048
    q, w, rows = _rand(t, 64, 128), torch.rand(t, 64), torch.randint(0, 999, (t, s))
    for fmt in ("mxfp4", "fp8"):
        layout = g.IndexerKeyLayout(128, fmt, 64)
        m.indexer_scores(q, torch.zeros(64, layout.block_bytes(), dtype=torch.uint8), rows, w, layout)
    m.indexer_scores(q, _rand(1000, 128), rows, w)
    for _, kw in m._indexer_scores_kernel.calls:  # CPU tensors here: the warps the wrapper gives CUDA tensors
        kw.update(num_warps=8 if kw["FMT"] else 4, num_stages=2)
    split.topk_columns_split(torch.randn(2, 65536), 512)
    return (m, split), ["_indexer_scores_kernel", "_split_topk_kernel"]


def moe_glue_cases():
    """The MoE glue around the expert GEMMs at V4-Flash widths (top-6 of 256, 2048 intermediate, 4096 hidden)."""
    from dsv4_kernels import triton_moe_glue as m

    t, k = 4, 6
    m.sort_pairs(torch.randint(-1, 256, (t, k)), torch.rand(t, k), 256)
    gate_up = _rand(t * k, 2 * 2048)
    m.swiglu(gate_up[:, :2048], gate_up[:, 2048:], 10.0)
    m.swiglu_quant(gate_up[:, :2048], gate_up[:, 2048:], 10.0)
    m.combine(_rand(t, k, 4096), _rand(t, 4096))
    m.combine(_rand(t, k, 4096))
    return m, ["_sort_pairs_kernel", "_swiglu_kernel", "_swiglu_quant_kernel", "_combine_kernel"]


def sampling_cases():
    """The step's sampling launches over the V4 vocabulary (129280): greedy pick (both stages), Exp(1) noise."""
    from dsv4_kernels import triton_greedy as m
    from dsv4_kernels import triton_sampling as s

    for n in (1, 64):
        m.greedy_pick(torch.randn(n, 129280))
        s.exp_noise(torch.zeros(n, dtype=torch.int64), 129280)
    return (m, s), ["_greedy_partial_kernel", "_greedy_combine_kernel", "_exp_noise_kernel"]


def fallback_cases():
    """Kernels the decode step runs only where a library path is off: the engine's sparse MQA attention (no
    FlashMLA: exact rows, a single and a split K) and its MXFP4 experts (no triton_kernels / Marlin), the FP8
    grouped MoE's k-way sum (prefill-sized steps). V4-Flash widths: 64 heads x 512, 256 experts x 4096 / 2048.
    The wrappers give CPU tensors their interpreter launch options (4 warps, not the CUDA path's), so the attention
    and expert kernels' spills here are not the GPU's; what this group checks is that they compile (with --pdl)."""
    from dsv4_kernels import triton_attention as a
    from dsv4_kernels import triton_moe as m
    from dsv4_kernels import triton_pair_combine as p

    t = 4
    for splits in (1, 4):
        a.sparse_mqa_attention(_rand(t, 64, 512), _rand(1000, 512), torch.randint(0, 999, (t, 640)), torch.rand(64),
                               0.04, num_splits=splits)
    e, h, inter = 8, 4096, 2048
    w13 = torch.zeros(e, inter, h // 2, dtype=torch.uint8)
    s13 = torch.zeros(e, inter, h // 32, dtype=torch.uint8)
    m.mxfp4_moe(_rand(t, h), torch.rand(t, 6), torch.randint(0, e, (t, 6)), w13, s13,
                torch.zeros(e, h, inter // 2, dtype=torch.uint8), torch.zeros(e, h, inter // 32, dtype=torch.uint8),
                w13, s13, 10.0)
    p.gather_combine(_rand(64, h), torch.randint(-1, 64, (t, 6)), torch.rand(t, 6), _rand(t, h))
    return (a, m, p), ["sparse_attn_kernel", "merge_kernel", "_gate_up_kernel", "_down_kernel",
                       "_gather_combine_kernel"]


GROUPS = {"mhc": mhc_cases, "router": router_cases, "topk": topk_cases, "step_ends": step_ends_cases,
          "swa": swa_cases, "indexer_query": indexer_query_cases, "compressor": compressor_cases,
          "compress_step": compress_step_cases, "attention_glue": attention_glue_cases,
          "prologue": prologue_cases, "indexer": indexer_cases, "moe_glue": moe_glue_cases, "sampling": sampling_cases,
          "fallback": fallback_cases, "fp8_gemv": fp8_gemv_cases}
MODULES = {"mhc": ("dsv4_kernels.triton_mhc", "dsv4_kernels.triton_mhc_mix", "dsv4_kernels.triton_mhc_rows",
                   "dsv4_kernels.triton_mhc_chain", "dsv4_kernels.triton_norm_quant", "dsv4_kernels.triton_fp8_quant"),
           "router": ("dsv4_kernels.triton_moe", "dsv4_kernels.triton_router"),
           "step_ends": ("dsv4_kernels.triton_step_inputs", "dsv4_kernels.triton_hc_head"),
           "topk": ("dsv4_kernels.triton_topk", "dsv4_kernels.triton_topk_sort", "dsv4_kernels.triton_topk_rank"),
           "swa": ("dsv4_kernels.triton_swa_insert",),
           "indexer_query": ("dsv4_kernels.triton_indexer_query",),
           "compressor": ("dsv4_kernels.triton_compressor",), "compress_step": ("dsv4_kernels.triton_compress_step",
                                                                            "dsv4_kernels.triton_state_save"),
           "attention_glue": ("dsv4_kernels.triton_attention_rows", "dsv4_kernels.triton_norm_rope",
                              "dsv4_kernels.triton_fp8_quant"),
           "prologue": ("dsv4_kernels.triton_decode_prologue",),
           "indexer": ("dsv4_kernels.triton_indexer", "dsv4_kernels.triton_topk_split", "dsv4_kernels.triton_topk"),
           "moe_glue": ("dsv4_kernels.triton_moe_glue",),
           "sampling": ("dsv4_kernels.triton_greedy", "dsv4_kernels.triton_sampling"),
           "fallback": ("dsv4_kernels.triton_attention", "dsv4_kernels.triton_moe", "dsv4_kernels.triton_pair_combine"),
           "fp8_gemv": ("dsv4_kernels.triton_fp8_gemv",)}


def run_jobs(names: list[str], args) -> int:
    """The groups round-robin over args.jobs child runs of this script, side by side; their output in order."""
    shares = [names[i :: args.jobs] for i in range(args.jobs)]
    flags = (["--pdl"] if args.pdl else []) + (["--no-report"] if args.no_report else [])
    procs = [
        subprocess.Popen([sys.executable, __file__, "--only", ",".join(share), *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for share in shares if share
    ]
    failed = 0
    for proc in procs:
        out, _ = proc.communicate()
        print(out, end="", flush=True)
        failed += proc.returncode != 0
    pdl = " with PDL (griddepcontrol.wait in each)" if args.pdl else ""
    print(f"\n{failed} job(s) failed" if failed else f"\nall kernels compiled for sm_90{pdl}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument("--pdl", action="store_true", help="record the launches with PDL on (DSV4_PDL's CUDA path)")
    ap.add_argument("--jobs", type=int, default=1, help="compile the groups in this many child processes")
    ap.add_argument("--no-report", action="store_true", help="skip ptxas -v (registers / spills)")
    args = ap.parse_args()
    names = [g for g in args.only.split(",") if g] or list(GROUPS)
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        print(f"unknown group(s) {unknown}; known: {','.join(GROUPS)}", file=sys.stderr)
        return 2
    if args.jobs > 1 and len(names) > 1:
        return run_jobs(names, args)
    from dsv4_kernels import gpu

    if not gpu.has_triton():
        print("needs triton", file=sys.stderr)
        return 2
    from dsv4_kernels import triton_pdl

    triton_pdl.force(args.pdl)  # CPU tensors stand in for CUDA ones: the launches' PDL kwargs as on an sm_90 GPU
    errors = []
    for name in names:
        kernels, originals = {}, []
        for module_name in MODULES[name]:
            module = __import__(module_name, fromlist=["_"])
            module.require_triton = lambda device: None  # CPU tensors stand in for CUDA ones; nothing runs
            for k in dir(module):
                if k.endswith("_kernel") and not isinstance(getattr(module, k), Recorder):
                    kernels[k] = Recorder(getattr(module, k))
                    originals.append((module, k, getattr(module, k)))
                    setattr(module, k, kernels[k])
        try:
            GROUPS[name]()
        finally:
            for module, k, fn in originals:
                setattr(module, k, fn)
        for k, rec in kernels.items():
            errors += compile_calls(f"{name}.{k}", rec, report=not args.no_report)
    pdl = " with PDL (griddepcontrol.wait in each)" if args.pdl else ""
    print(f"\n{len(errors)} failure(s)" if errors else f"\nall kernels compiled for sm_90{pdl}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
