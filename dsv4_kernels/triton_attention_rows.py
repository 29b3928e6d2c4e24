"""Triton row ids of a step's sparse attention: the SWA window and the compressed entries, one launch.

Reference (engine/model/attention.py and engine/model/attention_fp8.py before this kernel):
    swa part:  torch.where(swa_valid, swa_rows, -1)
    CSA part:  ids = indexer top-k (-1 padded); rows = engine.model.batch.paged_rows(table, page_rows, seg, ids);
               torch.where(ids >= 0, rows + base, -1)
    HCA part:  torch.where(valid, rows + base, -1) over the visible entries' rows; or, per request (what the
               engine passes: engine.model.batch.VisibleEntries), rows [B, K] with each token's visible count:
               torch.where(j < count[t], rows[seg[t], j] + base, -1)
each written into its own int32 destination, padded with -1 up to the destination's width (FlashMLA takes top-k
widths in multiples of 64; the Triton MQA kernel takes both parts side by side in one [T, W + K] tensor, i.e.
two column views of it). One program per token; ids and rows are int64 or int32; no host sync, static shapes.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

_NONE, _IDS, _ROWS, _COUNT = 0, 1, 2, 3


@triton.jit(do_not_specialize=["W", "LA", "K", "LB", "P"])
def _rows_kernel(
    swa_ptr,
    sv_ptr,
    ids_ptr,
    table_ptr,
    seg_ptr,
    cv_ptr,
    oa_ptr,
    ob_ptr,
    W,
    LA,
    K,
    LB,
    P,
    page_rows,
    base,
    stride_st,
    stride_svt,
    stride_it,
    stride_tb,
    stride_cvt,
    stride_oa,
    stride_ob,
    COMP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    for j0 in range(0, LA, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inside = j < W
        r = tl.load(swa_ptr + t * stride_st + j, mask=inside, other=0).to(tl.int64)
        v = tl.load(sv_ptr + t * stride_svt + j, mask=inside, other=0)
        tl.store(oa_ptr + t * stride_oa + j, tl.where(inside & (v != 0), r, -1).to(tl.int32), mask=j < LA)
    if COMP != 0:
        for j0 in range(0, LB, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            inside = j < K
            if COMP != 3:
                x = tl.load(ids_ptr + t * stride_it + j, mask=inside, other=-1).to(tl.int64)
            if COMP == 1:  # entry ids of this token's request -> its paged rows (engine.model.batch.paged_rows)
                b = tl.load(seg_ptr + t + tl.arange(0, 1)).to(tl.int64)  # [1]: the interpreter needs vectors
                e = tl.maximum(x, 0)
                page = tl.minimum(e // page_rows, P - 1)
                pid = tl.load(table_ptr + b * stride_tb + page, mask=inside, other=0).to(tl.int64)
                row = pid * page_rows + e % page_rows
                ok = inside & (x >= 0)
            elif COMP == 2:  # visible rows + their validity
                row = x
                ok = inside & (tl.load(cv_ptr + t * stride_cvt + j, mask=inside, other=0) != 0)
            else:  # the request's entry rows, the first count[t] of them visible
                b = tl.load(seg_ptr + t + tl.arange(0, 1)).to(tl.int64)  # [1]: the interpreter needs vectors
                n = tl.load(cv_ptr + t + tl.arange(0, 1))
                ok = inside & (j < n)
                row = tl.load(ids_ptr + b * stride_it + j, mask=ok, other=-1).to(tl.int64)
            tl.store(ob_ptr + t * stride_ob + j, tl.where(ok, row + base, -1).to(tl.int32), mask=j < LB)


def attention_rows(
    swa_rows: torch.Tensor,
    swa_valid: torch.Tensor,
    out_swa: torch.Tensor,
    *,
    ids: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    seg: torch.Tensor | None = None,
    page_rows: int = 1,
    comp_rows: torch.Tensor | None = None,
    comp_valid: torch.Tensor | None = None,
    comp_count: torch.Tensor | None = None,
    base: int = 0,
    out_comp: torch.Tensor | None = None,
) -> None:
    """Write the attention's row ids (module docstring) into int32 out_swa [T, >= W] and out_comp [T, >= K].

    swa_rows: int [T, W]; swa_valid: bool [T, W]; then either the CSA form (ids int [T, K], -1 padded; table int
    [B, P] the entry group's page table; seg int [T] each token's request row; page_rows) or the HCA form
    (comp_rows int [T, K], comp_valid bool [T, K]; or per request: comp_rows int [B, K], seg int [T], comp_count
    int [T], token t seeing comp_rows[seg[t], :comp_count[t]]) or neither; base: added to valid entry rows. Destinations may be
    column views of one tensor (unit last stride)."""
    t, w = swa_rows.shape
    mode = _IDS if ids is not None else _NONE if comp_rows is None else _COUNT if comp_count is not None else _ROWS
    comp = ids if mode == _IDS else comp_rows
    if swa_valid.shape != swa_rows.shape or swa_valid.dtype != torch.bool:
        raise ValueError(
            f"swa_valid must be bool {tuple(swa_rows.shape)}, got {swa_valid.dtype} {tuple(swa_valid.shape)}"
        )
    for name, out, width in (("out_swa", out_swa, w), ("out_comp", out_comp, 0 if comp is None else comp.shape[1])):
        if (
            out is None
            and name == "out_swa"
            or out is not None
            and (
                out.dtype != torch.int32
                or out.dim() != 2
                or out.shape[0] != t
                or out.shape[1] < width
                or out.stride(-1) != 1
            )
        ):
            raise ValueError(f"{name} must be int32 [T={t}, >= {width}] with unit last stride")
    if mode != _NONE:
        if (
            out_comp is None
            or comp is None
            or comp.dim() != 2
            or comp.shape[0] != t
            and mode != _COUNT
            or comp.stride(-1) != 1
        ):
            raise ValueError(f"entry ids / rows must be [T={t}, K] with unit last stride and out_comp given")
        if mode == _IDS and (table is None or seg is None or table.dim() != 2 or seg.shape != (t,)):
            raise ValueError("the CSA form needs table [B, P] and seg [T]")
        if mode == _ROWS and (comp_valid is None or comp_valid.shape != comp.shape or comp_valid.dtype != torch.bool):
            raise ValueError("the HCA form needs comp_valid bool, shaped as comp_rows")
        if mode == _COUNT and (seg is None or seg.shape != (t,) or comp_count is None or comp_count.shape != (t,)):
            raise ValueError("the per-request HCA form needs seg [T] and comp_count [T]")
    require_triton(swa_rows.device)
    if t == 0:
        return
    swa_rows = swa_rows if swa_rows.stride(-1) == 1 else swa_rows.contiguous()
    swa_valid = swa_valid if swa_valid.stride(-1) == 1 else swa_valid.contiguous()
    # the kernel takes every pointer: the ones its COMP mode does not read point at swa_rows (checked above: each
    # tensor the mode reads is given)
    dummy = swa_rows
    comp = comp if comp is not None else dummy
    table = table if mode == _IDS and table is not None else dummy
    seg = seg if mode in (_IDS, _COUNT) and seg is not None else dummy
    cv = swa_valid
    if mode == _ROWS and comp_valid is not None:
        cv = comp_valid
    elif mode == _COUNT and comp_count is not None:
        cv = comp_count
    cv = cv if cv.stride(-1) == 1 else cv.contiguous()
    ob = out_comp if out_comp is not None else out_swa
    lb, k = (ob.shape[1], comp.shape[1]) if mode != _NONE else (0, 0)
    widest = max(out_swa.shape[1], lb)
    _rows_kernel[(t,)](
        swa_rows,
        swa_valid,
        comp,
        table,
        seg,
        cv,
        out_swa,
        ob,
        w,
        out_swa.shape[1],
        k,
        lb,
        table.shape[1] if mode == _IDS else 1,
        page_rows,
        base,
        swa_rows.stride(0),
        swa_valid.stride(0),
        comp.stride(0),
        table.stride(0),
        cv.stride(0),
        out_swa.stride(0),
        ob.stride(0),
        COMP=mode,
        BLOCK=min(1024, triton.next_power_of_2(max(widest, 1))),
        **pdl_kwargs(swa_rows),
    )
