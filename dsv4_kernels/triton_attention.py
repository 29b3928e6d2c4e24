"""Triton sparse MQA attention with a per-head sink, reading candidate KV rows in place.

Reference: `dsv4_kernels.attention.sparse_attention`. Every query token attends, with all H heads, to K
candidate rows of one shared latent (K = V) named by row indices into a flat or paged row store, so the
[T, K, D] gather the reference needs is never materialised. Stores:
- `sparse_mqa_attention`: rows of D values (bf16 / fp32), kv[row];
- `sparse_mqa_attention_multi`: the same over up to three row stores of one dtype (e.g. the engine's SWA
  ring, this step's fresh kv and a compressed-entry group), row ids index their concatenation;
- `sparse_mqa_attention_fp8`: fp8_ds_mla bytes (dsv4_kernels/geometry.py), dequantised on the fly: e4m3 NoPE
  values times a UE8M0 scale per 64, then raw bf16 RoPE values. Works directly on the paged cache
  (value rows first, scale rows after all of them); packed [R, row_bytes] rows are the block_size=1 case.

The kernels and their algorithm (MQA reuse, one fp32 online softmax with the sink folded in, split K merged by a
second kernel): dsv4_kernels/triton_attention_kernels.py. This module plans the launch (column segments, head
blocks, K splits) and checks the inputs.
"""

from __future__ import annotations

import functools

import torch

from dsv4_kernels.geometry import Fp8DsMlaLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_attention_kernels import merge_kernel, sparse_attn_kernel
from dsv4_kernels.triton_pdl import pdl_kwargs

triton, tl = import_triton()

LOG2E = 1.4426950408889634
FP8_SCALE_BLOCK = 64  # NoPE values per UE8M0 scale in fp8_ds_mla
MAX_SEGMENTS = 4
SEG_MAX = 256  # widest column segment (wgmma's largest N)
_PLAIN, _FP8_NOPE, _BF16_ROPE = 0, 1, 2  # segment kinds
# CUDA launch defaults per store kind (block_h None = all heads up to 64 in one block), from graph-timed
# sm_90 sweeps at H=64, D=512, K=640 (`dsv4 bench kernels triton --tune`, BENCHMARKS.md '## GPU kernels').
DEFAULTS = {
    "plain": {"block_h": None, "block_k": 64, "num_warps": 8, "num_stages": 2},
    "fp8": {"block_h": None, "block_k": 64, "num_warps": 8, "num_stages": 2},
}


# ---- host side ---------------------------------------------------------------------------------------
def _pow2_pieces(width: int, cap: int, quantum: int) -> list[int]:
    """Split `width` (a multiple of quantum) into power-of-two pieces <= cap, largest first."""
    pieces = []
    while width > 0:
        p = min(cap, 1 << (width.bit_length() - 1))
        if p < quantum:
            p = width  # the sub-quantum remainder becomes one padded piece
        pieces.append(p)
        width -= p
    return pieces


def _segments(pieces: list[tuple[int, int]], limit: int = MAX_SEGMENTS) -> list[tuple[int, int]]:
    """(offset, width) pieces -> at most `limit`, merging the trailing ones of one kind (padded later)."""
    pieces = list(pieces)
    while len(pieces) > limit:
        (o, w), (_, w2) = pieces[-2], pieces[-1]
        pieces[-2:] = [(o, w + w2)]
    return pieces


def plain_segments(d: int, seg_max: int = SEG_MAX) -> list[tuple[int, int]]:
    """Column segments (offset, width) of a D-wide plain row: power-of-two widths <= seg_max, at most 4."""
    if d < 1:
        raise ValueError(f"head dim must be >= 1, got {d}")
    out, o = [], 0
    for w in _pow2_pieces(d, seg_max, 16):
        out.append((o, w))
        o += w
    return _segments(out)


def _seg_args(segs: list[tuple[int, int, int, int]]) -> dict:
    """[(store offset, width, kind, q offset)] -> the kernel's constexpr segment arguments."""
    args = {"NSEG": len(segs)}
    for i in range(MAX_SEGMENTS):
        o, w, kind, qo = segs[i] if i < len(segs) else (0, 16, 0, 0)
        args.update({f"O{i}": o, f"W{i}": w, f"P{i}": max(16, triton.next_power_of_2(w)), f"KD{i}": kind, f"QO{i}": qo})
    return args


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pick_splits(device: torch.device, programs: int, num_tiles: int) -> int:
    """Split K so the grid has about one wave of programs (each keeping >= 1 tile)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(sms // max(programs, 1), num_tiles))


def _check_common(q: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, d: int) -> None:
    if q.dim() != 3 or q.shape[-1] != d or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, H, {d}] with unit stride on the last dim, got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32/bf16/fp16, got {q.dtype}")
    if rows.dim() != 2 or rows.shape[0] != q.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [T={q.shape[0]}, K], got {rows.dtype} {tuple(rows.shape)}")
    if sink.shape != (q.shape[1],):
        raise ValueError(f"sink must be [H={q.shape[1]}], got {tuple(sink.shape)}")
    require_triton(q.device)


def _launch(
    q,
    stores,
    rows,
    sink,
    scale,
    segs,
    *,
    fp8,
    layout=None,
    bf16_operands=False,
    num_splits=None,
    block_h=None,
    block_k=None,
    num_warps=None,
    num_stages=None,
):
    t, h, d = q.shape
    k = rows.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or h == 0:
        return out
    if k == 0:
        return out.zero_()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    sink = sink.float().contiguous()
    # One head block holds all heads up to 64, so each row tile is read once per token (MQA reuse).
    cfg = DEFAULTS["fp8" if fp8 else "plain"]
    block_h = block_h or cfg["block_h"] or min(64, max(16, triton.next_power_of_2(h)))
    block_k = block_k or cfg["block_k"]
    if q.is_cuda and stores[0].element_size() >= 4 and d > 256:
        # fp32 rows of wide heads: [64, D] q and kv tiles need 279 KB of shared memory, Hopper has 227 KB
        block_h, block_k = min(block_h, 32), min(block_k, 32)
    if block_h < 16 or block_k < 16:
        raise ValueError(f"block_h and block_k must be >= 16 (tl.dot), got {block_h}, {block_k}")
    head_blocks = triton.cdiv(h, block_h)
    num_tiles = triton.cdiv(k, block_k)
    if num_splits is None:
        num_splits = _pick_splits(q.device, t * head_blocks, num_tiles)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    split = num_splits > 1
    if split:
        pacc = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(t, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        pacc = pml = out  # unused
    bf16_dot = q.is_cuda and q.dtype == torch.bfloat16 and bf16_operands
    extra = {}
    if q.is_cuda:
        extra = {"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    kv0 = stores[0]
    sizes = [s.shape[0] for s in stores] + [0] * (3 - len(stores))
    strides = [s.stride(0) for s in stores] + [0] * (3 - len(stores))
    # Element offsets of stores 1, 2 from store 0 (one dtype, so exact), and the alignment (in elements)
    # every row start is known to have, which lets the compiler use 16-byte async copies.
    item = kv0.element_size()
    offs = [0] + [(s.data_ptr() - kv0.data_ptr()) // item for s in stores[1:]]
    offs += [0] * (3 - len(offs))
    align = (
        16 // item if not fp8 and all(x % (16 // item) == 0 for x in strides + offs) and kv0.data_ptr() % 16 == 0 else 1
    )
    if fp8:
        fp8_args = dict(
            block_size=layout.block_size,
            stride_block=kv0.stride(0),
            TOKEN_STRIDE=layout.token_stride,
            SCALE_STRIDE=layout.scale_stride,
        )
    else:
        fp8_args = dict(block_size=1, stride_block=0, TOKEN_STRIDE=1, SCALE_STRIDE=1)
    sparse_attn_kernel[(t, head_blocks, num_splits)](
        q,
        kv0,
        rows,
        sink,
        out,
        pacc,
        pml,
        h,
        k,
        tiles_per_split,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        rows.stride(0),
        sizes[0],
        sizes[0] + sizes[1],
        strides[0],
        strides[1],
        strides[2],
        offs[1],
        offs[2],
        fp8_args.pop("block_size"),
        fp8_args.pop("stride_block"),
        scale * LOG2E,
        D=d,
        NSRC=len(stores),
        ALIGN=align,
        FP8=fp8,
        SCALE_BLOCK=FP8_SCALE_BLOCK,
        **fp8_args,
        **_seg_args(segs),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        SPLIT=split,
        BF16_DOT=bf16_dot,
        **extra,
        **pdl_kwargs(q),
    )
    if split:
        merge_h = min(8, triton.next_power_of_2(h))  # no dot here: small head blocks keep registers low
        merge_kernel[(t, triton.cdiv(h, merge_h))](
            pacc,
            pml,
            sink,
            out,
            h,
            num_splits,
            out.stride(0),
            out.stride(1),
            D=d,
            PD=triton.next_power_of_2(d),
            BLOCK_H=merge_h,
            **({"num_warps": 4} if q.is_cuda else {}),
            **pdl_kwargs(pacc),
        )
    return out


def _check_store(kv: torch.Tensor, d: int, dtype: torch.dtype | None = None) -> None:
    if kv.dim() != 2 or kv.shape[1] != d or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [R, D={d}] with unit stride on the last dim, got {tuple(kv.shape)}")
    if dtype is not None and kv.dtype != dtype:
        raise ValueError(f"all kv stores must share one dtype, got {kv.dtype} and {dtype}")


def sparse_mqa_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    seg_max: int = SEG_MAX,
) -> torch.Tensor:
    """Sparse MQA attention with sinks over rows of a flat KV store.

    q: [T, H, D] fp32/bf16/fp16 (last dim contiguous); kv: [R, D] rows, any float dtype, last dim
    contiguous (row stride free, so a paged pool's [pages * page_rows, D] view works); rows: int32/int64
    [T, K], -1 = invalid (window slots and selected compressed entries alike); sink: [H] (fp32);
    scale: softmax scale. -> [T, H, D] in q.dtype.

    Equals `dsv4_kernels.attention.sparse_attention(q, kv[rows.clamp(min=0)], rows >= 0, sink, scale)`;
    logits, softmax and accumulation run in fp32 (bf16 tensor-core operands on GPU for bf16 inputs).
    Row indices must be < R (not checked: that would need a device sync).
    num_splits / block_h / block_k / num_warps / num_stages / seg_max override the launch heuristics.
    """
    return sparse_mqa_attention_multi(
        q,
        [kv],
        rows,
        sink,
        scale,
        num_splits=num_splits,
        block_h=block_h,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        seg_max=seg_max,
    )


def sparse_mqa_attention_multi(
    q: torch.Tensor,
    stores: list[torch.Tensor] | tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    **launch,
) -> torch.Tensor:
    """`sparse_mqa_attention` over the row concatenation of 1-3 stores [R_i, D] of one dtype, not copied.

    Row id r < R_0 is stores[0][r], R_0 <= r < R_0 + R_1 is stores[1][r - R_0], and so on; -1 = invalid.
    Lets a caller attend to rows living in separate tensors (a ring, this step's fresh rows, an entry
    pool) in one pass.
    """
    stores = list(stores)
    if not 1 <= len(stores) <= 3:
        raise ValueError(f"1 to 3 kv stores, got {len(stores)}")
    if stores[0].dim() != 2:
        raise ValueError(f"kv must be [R, D] with unit stride on the last dim, got {tuple(stores[0].shape)}")
    d = stores[0].shape[1]
    for s in stores:
        _check_store(s, d, stores[0].dtype)
    _check_common(q, rows, sink, d)
    seg_max = launch.pop("seg_max", SEG_MAX)
    segs = [(o, w, _PLAIN, o) for o, w in plain_segments(d, seg_max)]
    return _launch(
        q, stores, rows, sink, scale, segs, fp8=False, bf16_operands=stores[0].dtype == torch.bfloat16, **launch
    )


def fp8_segments(layout: Fp8DsMlaLayout, seg_max: int = SEG_MAX) -> list[tuple[int, int, int, int]]:
    """(byte offset in the value row, width, kind, q column) of each segment of an fp8_ds_mla row."""
    nope = _segments(
        [(o, w) for o, w in _offsets(_pow2_pieces(layout.nope_dim, seg_max, FP8_SCALE_BLOCK))],
        MAX_SEGMENTS - (1 if layout.rope_dim else 0),
    )
    segs = [(o, w, _FP8_NOPE, o) for o, w in nope]
    if layout.rope_dim:
        segs.append((layout.nope_dim, layout.rope_dim, _BF16_ROPE, layout.nope_dim))
    return segs


def _offsets(widths: list[int]) -> list[tuple[int, int]]:
    out, o = [], 0
    for w in widths:
        out.append((o, w))
        o += w
    return out


def sparse_mqa_attention_fp8(
    q: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    layout: Fp8DsMlaLayout,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    seg_max: int = SEG_MAX,
) -> torch.Tensor:
    """Sparse MQA attention with sinks over fp8_ds_mla rows, dequantised in the kernel.

    q: [T, H, layout.head_dim]; cache: uint8 [num_blocks, >= layout.block_bytes()] paged cache (value rows
    of a block first, then its scale rows; the block stride may exceed block_bytes), or packed rows
    [R, layout.row_bytes] with a block_size=1 layout; rows: int32/int64 [T, K] global slots
    (slot s = block s // block_size, position s % block_size), -1 = invalid; sink: [H]. -> [T, H, D] q.dtype.

    Equals the reference on `geometry.read_rows` + `unpack_fp8_ds_mla` of the same slots.
    """
    if not isinstance(layout, Fp8DsMlaLayout):
        raise TypeError(f"layout must be an Fp8DsMlaLayout, got {type(layout).__name__}")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(-1) != 1:
        raise ValueError(
            f"cache must be uint8 [blocks, bytes] with unit last stride, got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.shape[1] < layout.block_bytes():
        raise ValueError(
            f"cache rows of {cache.shape[1]} B cannot hold a {layout.block_size}-row block ({layout.block_bytes()} B)"
        )
    if cache.stride(0) % 2 or cache.data_ptr() % 2:
        raise ValueError(
            f"cache must start on an even byte with an even block stride (the RoPE values are "
            f"read as bf16), got stride {cache.stride(0)}"
        )
    _check_common(q, rows, sink, layout.head_dim)
    return _launch(
        q,
        [cache],
        rows,
        sink,
        scale,
        fp8_segments(layout, seg_max),
        fp8=True,
        layout=layout,
        bf16_operands=True,
        num_splits=num_splits,
        block_h=block_h,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
