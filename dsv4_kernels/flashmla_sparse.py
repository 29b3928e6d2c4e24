"""Sparse MQA decode over two fp8_ds_mla paged caches through FlashMLA (sm90), and its plain-torch reference.

The op (V4's decode attention): query token t attends, with all H heads, to the rows `main_idx[t]` of the
main cache (the SWA ring) and `extra_idx[t]` of the extra cache (compressed entries: the indexer's top-k on
CSA layers, every visible entry on HCA layers); -1 = skip; one sink logit per head; V = K (the 512-wide latent,
RoPE part included). Row ids are the engine's flat page rows, `block * block_size + offset` (a page is whole
blocks), which is exactly FlashMLA's `indices_in_kvcache` convention.

FlashMLA's constraints, checked by `unfit_reason` (the engine falls back to its own kernels when one fails):
- rows of 584 B: 448 e4m3 NoPE values + 64 bf16 RoPE values, 7 UE8M0 scales + 1 pad (dsv4_kernels.geometry's
  fp8_ds_mla block layout: a block's value rows, then its scale rows), i.e. head_dim 512, rope_dim 64;
- 64 or 128 query heads: fewer (tensor-parallel ranks) are padded with zero queries, their outputs dropped;
- top-k widths a multiple of 64: index lists are padded with -1; int32 indices.
Scheduling metadata: FlashMLA fills a `FlashMLASchedMeta` at its first call and requires later calls on it to
keep the shapes (no `topk_length` is passed, so nothing else matters). One object is kept per shape key; the
engine's CUDA-graph capture runs eager warm-up forwards first, so the metadata exists before a capture.
"""

from __future__ import annotations

import torch

from dsv4_kernels.attention import sparse_attention
from dsv4_kernels.geometry import Fp8DsMlaLayout, unpack_fp8_ds_mla

HEAD_DIM = 512
ROPE_DIM = 64
HEAD_COUNTS = (64, 128)
TOPK_MULTIPLE = 64

_SCHED: dict[tuple, object] = {}  # shape key -> flash_mla.FlashMLASchedMeta


def unfit_reason(num_heads: int, layouts: list[Fp8DsMlaLayout]) -> str:
    """Why FlashMLA cannot run this geometry ('' when it can)."""
    if num_heads > max(HEAD_COUNTS):
        return f"{num_heads} query heads (FlashMLA takes up to {max(HEAD_COUNTS)})"
    for lay in layouts:
        if lay.head_dim != HEAD_DIM or lay.rope_dim != ROPE_DIM:
            return (
                f"head_dim {lay.head_dim} / rope_dim {lay.rope_dim} (FlashMLA's V4 format is {HEAD_DIM} / {ROPE_DIM})"
            )
    return ""


def padded_heads(num_heads: int) -> int:
    return next(h for h in HEAD_COUNTS if h >= num_heads)


def pad_topk(idx: torch.Tensor, multiple: int = TOPK_MULTIPLE) -> torch.Tensor:
    """int [T, K] -> int32 [T, K'] with K' the next multiple of `multiple` (-1 padding), contiguous."""
    k = idx.shape[1]
    want = max(multiple, -(-k // multiple) * multiple)
    idx = idx.to(torch.int32)
    if want != k:
        idx = torch.nn.functional.pad(idx, (0, want - k), value=-1)
    return idx.contiguous()


def _blocks(cache: torch.Tensor, layout: Fp8DsMlaLayout) -> torch.Tensor:
    """One layer's flat rows uint8 [R, 584] -> FlashMLA's [blocks, block_size, 1, 584] view (no copy)."""
    if (
        cache.dtype != torch.uint8
        or cache.dim() != 2
        or cache.shape[1] != layout.row_bytes
        or not cache.is_contiguous()
    ):
        raise ValueError(
            f"cache must be contiguous uint8 [R, {layout.row_bytes}], got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.shape[0] % layout.block_size:
        raise ValueError(f"{cache.shape[0]} rows are not whole {layout.block_size}-row blocks")
    return cache.view(-1, layout.block_size, 1, layout.row_bytes)


def _extra_parts(
    extra: torch.Tensor | None, layout: Fp8DsMlaLayout | None, idx: torch.Tensor | None
) -> tuple[torch.Tensor, Fp8DsMlaLayout, torch.Tensor] | None:
    """The extra cache, its layout and its row ids: all three given, or none (ValueError naming the missing)."""
    if extra is None and layout is None and idx is None:
        return None
    if extra is None or layout is None or idx is None:
        missing = [n for n, v in (("extra", extra), ("extra_layout", layout), ("extra_idx", idx)) if v is None]
        raise ValueError(f"the extra cache needs extra, extra_layout and extra_idx together; missing {missing}")
    return extra, layout, idx


def sparse_decode(
    q: torch.Tensor,
    main: torch.Tensor,
    main_layout: Fp8DsMlaLayout,
    main_idx: torch.Tensor,
    extra: torch.Tensor | None,
    extra_layout: Fp8DsMlaLayout | None,
    extra_idx: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """FlashMLA sparse decode. q: bf16 [T, H, 512]; main / extra: one layer's uint8 rows [R, 584];
    main_idx [T, K1] / extra_idx [T, K2]: int row ids, -1 = skip; sink: [H]. -> bf16 [T, H, 512].
    Equals `reference_sparse_decode` up to FlashMLA's bf16 rounding of the softmax weights."""
    from dsv4_kernels.gpu import import_flash_mla

    flash_mla = import_flash_mla()
    t, h, d = q.shape
    extras = _extra_parts(extra, extra_layout, extra_idx)
    reason = unfit_reason(h, [main_layout] + ([extras[1]] if extras is not None else []))
    if reason or d != HEAD_DIM or q.dtype != torch.bfloat16:
        raise ValueError(
            f"FlashMLA sparse decode cannot run q {q.dtype} {tuple(q.shape)}: {reason or 'needs bf16 [T, H, 512]'}"
        )
    hp = padded_heads(h)
    if hp != h:
        q = torch.cat([q, q.new_zeros(t, hp - h, d)], dim=1)
        sink = torch.cat([sink.float(), sink.new_zeros(hp - h, dtype=torch.float32)])
    main_idx = pad_topk(main_idx).unsqueeze(1)
    extra_args = {}
    extra_key = None
    if extras is not None:
        ex_cache, ex_layout, ex_idx = extras
        ex_idx = pad_topk(ex_idx).unsqueeze(1)
        extra_args = {"extra_k_cache": _blocks(ex_cache, ex_layout), "extra_indices_in_kvcache": ex_idx}
        extra_key = (ex_idx.shape[-1], ex_layout.block_size)
    key = (q.device.index, t, hp, main_idx.shape[-1], main_layout.block_size, extra_key)
    sched = _SCHED.get(key)
    if sched is None:
        sched = _SCHED[key] = flash_mla.get_mla_metadata()[0]
    out, _ = flash_mla.flash_mla_with_kvcache(
        q.unsqueeze(1).contiguous(),
        _blocks(main, main_layout),
        None,
        None,
        HEAD_DIM,
        sched,
        softmax_scale=scale,
        is_fp8_kvcache=True,
        indices=main_idx,
        attn_sink=sink.float().contiguous(),
        **extra_args,
    )
    return out[:, 0, :h]


def _decode_rows(cache: torch.Tensor, layout: Fp8DsMlaLayout, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx (clamped at 0) of one layer's paged fp8_ds_mla cache -> fp32 [*idx.shape, head_dim]."""
    flat = idx.reshape(-1).clamp(min=0).long()
    bs, vb = layout.block_size, layout.token_stride
    blocks = cache.reshape(-1, bs * layout.row_bytes)
    blk, pos = flat // bs, flat % bs
    values = blocks[:, : bs * vb].unflatten(1, (bs, vb))[blk, pos]
    scales = blocks[:, bs * vb :].unflatten(1, (bs, layout.row_bytes - vb))[blk, pos]
    rows = unpack_fp8_ds_mla(torch.cat([values, scales], dim=1), layout)
    return rows.float().view(*idx.shape, layout.head_dim)


def reference_sparse_decode(
    q: torch.Tensor,
    main: torch.Tensor,
    main_layout: Fp8DsMlaLayout,
    main_idx: torch.Tensor,
    extra: torch.Tensor | None,
    extra_layout: Fp8DsMlaLayout | None,
    extra_idx: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch: dequantise the named rows of both caches, then `dsv4_kernels.attention.sparse_attention`."""
    keys, valid = _decode_rows(main, main_layout, main_idx), main_idx >= 0
    extras = _extra_parts(extra, extra_layout, extra_idx)
    if extras is not None:
        ex_cache, ex_layout, ex_idx = extras
        keys = torch.cat([keys, _decode_rows(ex_cache, ex_layout, ex_idx)], dim=1)
        valid = torch.cat([valid, ex_idx >= 0], dim=1)
    return sparse_attention(q, keys.to(q.dtype), valid, sink, scale)
