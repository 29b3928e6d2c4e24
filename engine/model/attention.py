"""V4 attention block on paged caches: SWA window + compressed entries (CSA via the indexer, HCA all).

Per layer and step:
1. q = rope(unweighted_rms(wq_b(rms(wq_a x)))), kv = rope(rms(wkv x)) at each token's position.
2. SWA keys: the W positions ending at the query, from this step's kv (chunk) or the SWA ring.
3. Compressor: the entries whose window closes in this step are pooled from chunk rows and the state
   ring, normalised, rotated at the window start and written to the entry pages; the chunk tail goes
   to the state ring so later steps (and a decode worker after a hand-off) can finish open windows.
4. CSA: the indexer scores every visible index key and keeps the top-k entries; HCA: every visible entry.
5. Sparse attention with sinks, inverse rope on the output, grouped output projection.

Step 5 has two implementations (engine.model.fast_paths.use_triton picks): the reference gathers each query's
keys into [T, K, D] and calls `dsv4_kernels.attention.sparse_attention`; the fast path (CUDA) builds one row-id
tensor [T, K] into the concatenation [SWA ring | this step's kv | entry group] and runs the Triton MQA
kernel (`dsv4_kernels.triton_attention.sparse_mqa_attention_multi`), which reads the rows in place. On the fast
path the SWA ring is written after the attention (it reads the ring's older rows and takes this step's
rows from the chunk), which is exactly what the reference's gather-then-write sees.

Quantised caches (`--kv-cache-dtype fp8`, engine.model.cache): every read and write of swa / kv{r} / index goes
through the group codec. This step's kv rows enter the SWA keys as the cache stores them (pack + unpack,
as a production kernel reading the fp8 cache after the write sees them), so a key's value never depends
on whether it came from the chunk or the ring, and chunked prefill computes what unchunked prefill does.
On the fast path (`_path`) fp8 pools take engine.model.attention_fp8: FlashMLA reading the caches in place on
decode steps whose geometry it takes ("fp8_flashmla"), else the Triton kernel over dequantised stores
("fp8_triton"); the compressor packs its entries with the Triton quantised-entry kernel and the indexer
scores the packed keys in its kernel. All of it without a host sync, so fp8 decode runs under CUDA graphs.

The fast path keeps a decode step's launches per layer few (CUDA graphs replay them, but each still costs launch
latency at batch 1): the plain projections of x (compressor wkv | wgate, the indexer compressor's, the indexer
head weights) are one GEMM (`_stack_x_projections`); each compressor is two launches (dsv4_kernels.triton_compress_step:
windows closed from their slot rows in place, cos / sin gathered from a table of window starts, entries written
into their cache; then the state ring); the indexer's glue before its scoring kernel is one launch
(dsv4_kernels.triton_indexer_query.indexer_prologue); the attention's row ids are one launch
(dsv4_kernels.triton_attention_rows); decode steps write their kv rows into the SWA ring with the norm + RoPE launch
(dsv4_kernels.triton_swa_insert); the output's inverse RoPE is one launch (dsv4_kernels.triton_norm_rope.rope).
"""

from __future__ import annotations

import torch

from dsv4_kernels.attention import sparse_attention
from dsv4_kernels.compressor import overlap_slots, pool_windows
from dsv4_kernels.fp8_linear import Fp8Weight
from dsv4_kernels.indexer import SCORES_BUDGET, visible_topk
from dsv4_kernels.norm import rms_norm, unweighted_rms_norm
from dsv4_kernels.rope import InverseRope, apply_rope
from engine.model import attention_fp8
from engine.model.batch import CompressPlan, StepBatch, paged_rows
from engine.model.cache import CacheLayer, CachePool
from engine.model.config import ModelConfig
from engine.model.fast_paths import use_deepgemm_indexer, use_flash_mla, use_triton
from engine.model.linear import (
    QuantizedAct,
    Weight,
    can_concat_rows,
    concat_rows,
    grouped_then_linear,
    linear,
    linear_from,
    pow2_activations,
    rms_norm_for,
    split_rows,
    take_fp8_weights,
    uses_fp8_gemm,
)
from engine.model.parallel import SINGLE, ParallelContext


class AttentionBlock:
    def __init__(self, cfg: ModelConfig, weights: dict, layer: int, parallel: ParallelContext | None = None):
        """parallel: with tp ranks this block holds num_heads / tp heads and o_groups / tp output groups, or part
        of one group when o_groups < tp (engine.model.sharding cut the weights); its output is then a partial sum,
        all-reduced before returning."""
        self.cfg = cfg
        self.layer = layer
        self.parallel = parallel or SINGLE
        self.num_heads = self.parallel.local(cfg.num_heads, "num_attention_heads")
        self.o_groups = self.parallel.local_groups(cfg.o_groups, "o_groups")
        self.ratio = cfg.compress_ratios[layer]
        self.rope_kind = "compress" if self.ratio > 1 else "main"
        p = f"layers.{layer}.attn."
        # FP8 projections kept as e4m3 + scales (engine.model.linear) become Fp8Weight values here.
        self.w = take_fp8_weights(
            {k[len(p) :]: v for k, v in weights.items() if k.startswith(p)}, pow2_activations(cfg.quantization)
        )
        self._flashmla: bool | None = (
            None  # FlashMLA runs this block's fp8 decode steps (decided at the first fp8 step)
        )
        # bytes of indexer scores a step holds at once (query blocks, dsv4_kernels.indexer.query_blocks); tests lower
        # it to force several blocks on small shapes
        self.scores_budget = SCORES_BUDGET
        # wq_a and wkv both read x: stacked into one projection (one GEMM, one activation quantisation) where
        # both are FP8 (engine.model.linear.concat_rows); the originals become views of it.
        self.q_lora = cfg.q_lora_rank
        wq_a, wkv = self.w["wq_a.weight"], self.w["wkv.weight"]
        self.stacked_qkv = None
        if isinstance(wq_a, Fp8Weight) and can_concat_rows(wq_a, wkv):
            self.stacked_qkv = concat_rows(wq_a, wkv)
            self.w["wq_a.weight"], self.w["wkv.weight"] = split_rows(self.stacked_qkv, wq_a.shape[0])
        self.x_stack, self.x_cols = _stack_x_projections(self.w, self.ratio)

    @property
    def first_projection(self) -> Weight | None:
        """The FP8 projection that reads the block input first (wq_a | wkv stacked), whose activation quantisation
        the mHC pre can fuse into its norm (engine.model.model._hc); None where they are not stacked."""
        return self.stacked_qkv

    def forward(
        self, x: torch.Tensor, batch: StepBatch, pool: CachePool, ropes: dict, qa: QuantizedAct | None = None
    ) -> torch.Tensor:
        """x: [T, hidden] (normed block input) -> [T, hidden]. qa: x already quantised for `first_projection`."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        t = x.shape[0]
        cos, sin = ropes[self.rope_kind]
        fast_ops = use_triton(x.device)
        if self.stacked_qkv is not None and uses_fp8_gemm(x, self.stacked_qkv):
            both = linear_from(x, qa, self.stacked_qkv)
            q_lat, kv_pre = both[:, : self.q_lora], both[:, self.q_lora :]
        else:
            q_lat, kv_pre = linear(x, w["wq_a.weight"]), linear(x, w["wkv.weight"])
        # q_res feeds wq_b and the indexer's wq_b: normed and FP8-quantised once where both run DeepGEMM
        readers = [w["wq_b.weight"]] + ([w["indexer.wq_b.weight"]] if self.ratio == 4 else [])
        q_res, q_res_fp8 = rms_norm_for(q_lat, w["q_norm.weight"], eps, *readers)
        q, q_index = self._q_projections(q_res, q_res_fp8)
        q = q.view(t, self.num_heads, cfg.head_dim)
        q = _norm_rope(q, cos, sin, eps, None, fast_ops)

        swa = pool.groups["swa"]
        ring = swa.bind(self.layer)
        path = self._path(swa.quantised, fast_ops, batch, pool, kv_pre.dtype, ring)
        # decode steps on the fast paths write this step's rows into the ring first (engine.model.attention_fp8)
        ring_first = path == "fp8_flashmla" or (path == "exact_triton" and _one_token_each(batch))
        if ring_first:
            kv = attention_fp8.insert_decode_rows(kv_pre, w["norm.weight"], cos, sin, eps, ring, batch)
        else:
            kv = _norm_rope(kv_pre, cos, sin, eps, w["norm.weight"], fast_ops)
        packed = swa.encode(kv) if swa.quantised and path != "fp8_flashmla" else None  # rows as the ring stores them
        if path == "reference":
            valid = batch.swa.valid
            if packed is not None:  # a quantised ring
                keys = batch.swa.gather(swa.decode(packed).to(kv.dtype), ring)
                batch.swa_write.apply_packed(packed, ring)  # after the gather, as below
            else:
                keys = batch.swa.gather(kv, ring)
                batch.swa_write.apply(kv, ring)  # after the gather: the chunk may overwrite slots it just read

        entries = comp_rows = comp_valid = comp_ids = comp = None
        if self.ratio > 1 and fast_ops:
            # one GEMM for every plain projection of x (compressor, indexer compressor, indexer head weights)
            xp = self._x_projections(x)
            entries = self._compress_fast(
                xp, batch, pool, ropes, f"kv{self.ratio}", f"state{self.ratio}", "compressor."
            )
            if self.ratio == 4:
                comp_ids = self._indexer(x, q_index, batch, pool, ropes, xp)
                comp = {
                    "ids": comp_ids,
                    "table": batch.tables["kv4"],
                    "seg": batch.seq_of_token,
                    "page_rows": pool.groups["kv4"].spec.page_rows,
                }
            else:
                vis = batch.visible[f"kv{self.ratio}"]  # per request: rows [B, E], counts [T]
                comp = {"comp_rows": vis.rows, "seg": vis.seg, "comp_count": vis.count}
            if path in ("fp8_triton", "reference"):  # these take rows, ids and visibility apart
                comp_rows, comp_valid, comp_ids = self._entry_rows(batch, pool, comp_ids, x.device)
        elif self.ratio > 1:
            entries = self._compress(
                x, batch, pool, ropes, f"kv{self.ratio}", f"state{self.ratio}", "compressor.", cfg.head_dim
            )
            if self.ratio == 4:
                comp_ids = self._indexer(x, q_index, batch, pool, ropes)
            comp_rows, comp_valid, comp_ids = self._entry_rows(batch, pool, comp_ids, x.device)
        if self.ratio > 1 and path == "reference":
            assert entries is not None and comp_rows is not None and comp_valid is not None  # a compressed layer
            keys = torch.cat([keys, entries.read(comp_rows).to(keys.dtype)], dim=1)
            valid = torch.cat([valid, comp_valid], dim=1)

        sink, scale = w["attn_sink"], cfg.head_dim**-0.5
        if path == "exact_triton":
            o = self._attend_triton(q, kv, ring.tensor, entries.tensor if entries is not None else None, comp, batch)
            if not ring_first:
                batch.swa_write.apply(kv, ring)  # after the kernel, which read the ring's older rows
        elif path == "fp8_flashmla":
            o = attention_fp8.flashmla_attend(q, ring, entries, comp, batch, sink, scale)
        elif path == "fp8_triton":
            assert packed is not None  # the fp8 paths run on a quantised ring
            o = attention_fp8.dequantised_attend(
                q, swa.decode(packed), ring, entries, comp_rows, comp_ids, comp_valid, batch, sink, scale
            )
            batch.swa_write.apply_packed(packed, ring)  # after the kernel, as on the exact path
        else:
            o = sparse_attention(q, keys, valid, sink, scale)
        # = dsv4_kernels.attention.grouped_output_projection of the output turned back by the query's RoPE, with FP8
        # weights where they were kept (the turn then rides in wo_a's activation quantiser; o is this step's own
        # output, so it may be turned in place)
        back = InverseRope(cos, sin, cfg.head_dim)
        out = grouped_then_linear(
            o.reshape(t, self.o_groups, -1), w["wo_a.weight"], self.o_groups, w["wo_b.weight"], back
        )
        return self.parallel.all_reduce(out)  # row-parallel wo_b: partial sums

    def _q_projections(self, q_res: torch.Tensor, qa: QuantizedAct | None):
        """(wq_b q_res [T, H * head_dim], the indexer's wq_b q_res [T, Hi * Di] on CSA layers else None), both from
        q_res's one quantisation. Not stacked into one GEMM as wq_a | wkv are: on an H100 at batch 1 DeepGEMM took
        22.7 us for the stacked [40960, 1024] against 15.6 + 5.7 for the two (BENCHMARKS.md, batch-1 launches)."""
        w = self.w
        q = linear_from(q_res, qa, w["wq_b.weight"])
        return q, (linear_from(q_res, qa, w["indexer.wq_b.weight"]) if self.ratio == 4 else None)

    def _entry_rows(self, batch: StepBatch, pool: CachePool, comp_ids, device):
        """(global entry rows [T, E], visibility [T, E], entry numbers [T, E]) of this layer's entry group: the
        per-token lists of the paths that gather per query (reference, fp8_triton); the others never build them."""
        if self.ratio == 4:
            comp_rows = paged_rows(
                batch.tables["kv4"],
                pool.groups["kv4"].spec.page_rows,
                batch.seq_of_token.unsqueeze(1).expand_as(comp_ids),
                comp_ids,
            )
            return comp_rows, comp_ids >= 0, comp_ids
        vis = batch.visible[f"kv{self.ratio}"]
        rows = vis.token_rows()
        return rows, vis.token_valid(), torch.arange(rows.shape[1], device=device).expand_as(rows)

    def _x_projections(self, x: torch.Tensor) -> dict:
        """name -> x @ w[name].t() for the plain projections of x ([T, n] column views of one GEMM when stacked)."""
        if self.x_stack is None:
            return {name: x @ self.w[name].t() for name in self.x_cols}
        out = x @ self.x_stack.t()
        return {name: out[:, a:b] for name, (a, b) in self.x_cols.items()}

    def _path(
        self, quantised: bool, fast_ops: bool, batch: StepBatch, pool: CachePool, dtype: torch.dtype, ring: CacheLayer
    ) -> str:
        """Which attention path this step takes (module docstring): reference, exact_triton, fp8_triton or
        fp8_flashmla. Static per (pool, step shape): no host sync."""
        if not fast_ops:
            return "reference"
        if not quantised:
            return "exact_triton" if dtype == ring.tensor.dtype else "reference"
        one_token_each = batch.num_tokens == batch.cu.shape[0] - 1  # a decode step: every request runs one token
        if one_token_each and ring.tensor.is_cuda and dtype == torch.bfloat16 and self._flashmla_fits(pool, ring):
            return "fp8_flashmla"
        return "fp8_triton"

    def _flashmla_fits(self, pool: CachePool, ring: CacheLayer) -> bool:
        if self._flashmla is None:
            entries = [pool.groups[f"kv{self.ratio}"].bind(self.layer)] if self.ratio > 1 else []
            reason = attention_fp8.flashmla_unfit_reason(self.num_heads, ring, entries)
            self._flashmla = use_flash_mla(ring.tensor.device) and not reason
        return self._flashmla

    def _attend_triton(self, q, kv, ring, entries, comp: dict | None, batch: StepBatch) -> torch.Tensor:
        """Sparse attention over rows read in place: row ids into [ring | kv | entries] (-1 = invalid).

        comp: the entry side as dsv4_kernels.triton_attention_rows.attention_rows takes it (None without entries)."""
        from dsv4_kernels.triton_attention import sparse_mqa_attention_multi  # imports triton: only on this path
        from dsv4_kernels.triton_attention_rows import attention_rows

        kv = kv.contiguous()
        # batch.swa.row already indexes [ring rows | chunk rows]; the entry group's rows follow them.
        stores, base = [ring, kv], ring.shape[0] + kv.shape[0]
        if entries is not None:
            stores.append(entries.to(kv.dtype) if entries.dtype != kv.dtype else entries)
        if sum(s.shape[0] for s in stores) >= 2**31:
            raise ValueError("attention stores past int32 row ids")
        w = batch.swa.row.shape[1]
        # entry columns: of the CSA ids [T, K], or of the HCA per-request rows [B, K]
        k = 0 if comp is None else (comp["ids"] if "ids" in comp else comp["comp_rows"]).shape[1]
        rows = torch.empty(q.shape[0], w + k, dtype=torch.int32, device=q.device)
        attention_rows(
            batch.swa.row,
            batch.swa.valid,
            rows[:, :w],
            base=base,
            out_comp=rows[:, w:] if comp is not None else None,
            **(comp or {}),
        )
        return sparse_mqa_attention_multi(q, stores, rows, self.w["attn_sink"], self.cfg.head_dim**-0.5)

    def _compress_fast(
        self, xp: dict, batch: StepBatch, pool: CachePool, ropes: dict, entry_group: str, state_group: str, prefix: str
    ) -> CacheLayer:
        """`_compress` in two launches (dsv4_kernels.triton_compress_step): the closing windows read their slots where
        they live and go straight into the entry cache, then the state ring keeps the chunk tail."""
        from dsv4_kernels.triton_compress_step import close_windows  # imports triton: only on this path
        from dsv4_kernels.triton_state_save import save_state

        plan: CompressPlan = batch.compress[entry_group]
        w = self.w
        entries = pool.groups[entry_group].bind(self.layer)
        state = pool.groups[state_group].layer(self.layer)
        ape, kv, gate = w[prefix + "ape"], xp[prefix + "wkv.weight"], xp[prefix + "wgate.weight"]
        if plan.num_entries:
            cos, sin = _entry_rope_table(self.cfg, ape.shape[0], ropes, kv.device)
            prev = plan.prev
            close_windows(
                state,
                kv,
                gate,
                ape,
                batch.positions,
                plan.cur.row,
                prev.row if prev else None,
                prev.valid if prev else None,
                w[prefix + "norm.weight"],
                self.cfg.rms_norm_eps,
                cos,
                sin,
                plan.entry_pos,
                plan.entry_row,
                entries.tensor,
                entries.group.packed_codec.layout if entries.quantised else None,
                hadamard=False,
                skip_row=pool.scratch_pages[entry_group] * pool.groups[entry_group].spec.page_rows,
            )
        save_state(kv, gate, ape, batch.positions, state, plan.state_write.chunk_row, plan.state_write.ring_row)
        return entries

    def _compress(
        self,
        x,
        batch: StepBatch,
        pool: CachePool,
        ropes: dict,
        entry_group: str,
        state_group: str,
        prefix: str,
        dim: int,
    ) -> CacheLayer:
        """Close this step's windows into `entry_group`; returns that group's layer (read it with .read(rows))."""
        plan: CompressPlan = batch.compress[entry_group]
        w, eps = self.w, self.cfg.rms_norm_eps
        entries = pool.groups[entry_group].bind(self.layer)
        state = pool.groups[state_group].layer(self.layer)
        ape = w[prefix + "ape"]
        kv = x @ w[prefix + "wkv.weight"].t()
        score = (x @ w[prefix + "wgate.weight"].t()).float() + ape[batch.positions % ape.shape[0]].float()
        rows = torch.cat([kv.float(), score], dim=-1)  # the state ring's fp32 [kv | score] row
        if plan.num_entries:
            half = kv.shape[-1]
            cur = plan.cur.gather(rows, state)
            cur_kv, cur_score = cur[..., :half], cur[..., half:]
            if plan.prev is not None:
                prev = plan.prev.gather(rows, state)
                prev_valid = plan.prev.valid[:, 0]
                pkv, pscore = overlap_slots(prev[..., :half], prev[..., half:], cur_kv, cur_score, prev_valid)
            else:
                pkv, pscore = cur_kv, cur_score
            cos, sin = ropes["compress_at"](plan.entry_pos)
            if use_triton(x.device) and entries.quantised:
                # pooled, normalised, rotated and packed into the entry pages in one kernel; keys unrotated
                # (no Hadamard), as the group codec stores them on the reference path
                from dsv4_kernels.triton_compressor import pool_norm_rope_quant  # imports triton: only on this path

                pool_norm_rope_quant(
                    pkv.to(x.dtype).contiguous(),
                    pscore.contiguous(),
                    w[prefix + "norm.weight"],
                    eps,
                    cos,
                    sin,
                    entries.tensor,
                    plan.entry_row,
                    entries.group.packed_codec.layout,
                    hadamard=False,
                )
            else:
                if use_triton(x.device):
                    from dsv4_kernels.triton_compressor import pool_norm_rope  # imports triton: only on this path

                    pooled = pool_norm_rope(pkv.to(x.dtype), pscore, w[prefix + "norm.weight"], eps, cos, sin)
                else:
                    pooled = pool_windows(pkv.to(x.dtype), pscore)
                    pooled = apply_rope(rms_norm(pooled, w[prefix + "norm.weight"], eps), cos, sin)
                entries.write(plan.entry_row, pooled)
        plan.state_write.apply(rows, state)
        return entries

    def _indexer(
        self, x, q_index, batch: StepBatch, pool: CachePool, ropes: dict, xp: dict | None = None
    ) -> torch.Tensor:
        """Top-k kv4 entry ids per query, -1 padded. -> int64 [T, index_topk]. q_index: the indexer's query
        projection [T, index_n_heads * index_head_dim] (`_q_projections`).

        xp: the stacked x projections (`_x_projections`) on the fast path: the indexer compressor and the head
        weights come from them, and its prologue (RoPE, head-weight scaling, padding, candidate rows) is one
        launch (dsv4_kernels.triton_indexer_query.indexer_prologue)."""
        cfg, w = self.cfg, self.w
        if xp is not None:
            keys = self._compress_fast(xp, batch, pool, ropes, "index", "index_state", "indexer.compressor.")
        else:
            keys = self._compress(
                x, batch, pool, ropes, "index", "index_state", "indexer.compressor.", cfg.index_head_dim
            )
        cos, sin = ropes["compress"]
        q = q_index.view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        vis = batch.visible["index"]
        if use_triton(x.device):
            from dsv4_kernels.triton_indexer import indexer_topk  # imports triton: only on this path
            from dsv4_kernels.triton_indexer_query import indexer_prologue

            store, layout = keys.tensor, None
            if keys.quantised:  # paged MXFP4 / FP8 keys, dequantised in the kernel
                layout = keys.group.index_layout
                store = store.view(-1, layout.block_size * layout.row_bytes)
            # zero-padded key dims (test presets): q . k unchanged
            raw_weights = (
                xp["indexer.weights_proj.weight"] if xp is not None else x @ w["indexer.weights_proj.weight"].t()
            )
            q, head_weights, _ = indexer_prologue(
                q, cos, sin, raw_weights, cfg.index_n_heads**-0.5, width=layout.index_head_dim if layout else None
            )
            if layout is not None and _deepgemm_indexer_fits(q, layout, vis.rows, batch):
                from dsv4_kernels.deepgemm_indexer import fp8_indexer_topk

                return fp8_indexer_topk(
                    q, store, layout, vis.rows, vis.count, head_weights, cfg.index_topk, False, self.scores_budget
                )
            # Candidates per request (vis.rows [B, E], vis.count [T]); scores in query blocks of at most
            # self.scores_budget bytes. cu_seqlens: prefill-shaped steps take the shared-key prefill kernel.
            # Unordered picks on CUDA (the attention kernels skip -1 wherever it is); the CPU keeps topk's order,
            # which its tests compare.
            return indexer_topk(
                q.contiguous(),
                store,
                vis.rows,
                head_weights.contiguous(),
                cfg.index_topk,
                layout,
                cu_seqlens=batch.cu,
                ordered=not x.is_cuda,
                seg=vis.seg,
                count=vis.count,
                budget=self.scores_budget,
            )
        q = apply_rope(q, cos, sin)
        head_weights = (x @ w["indexer.weights_proj.weight"].t()).float() * cfg.index_n_heads**-0.5
        return visible_topk(
            q, keys.read, vis.rows, vis.seg, vis.count, head_weights, cfg.index_topk, self.scores_budget
        )


def _deepgemm_indexer_fits(q: torch.Tensor, layout, rows: torch.Tensor, batch: StepBatch) -> bool:
    """A prefill chunk of one sequence over FP8 keys, where DeepGEMM's indexer kernel is switched on
    (engine.model.fast_paths.use_deepgemm_indexer; dsv4_kernels.deepgemm_indexer: FP8 queries). Shapes only."""
    if _one_token_each(batch) or not use_deepgemm_indexer(q.device, q.dtype):
        return False
    from dsv4_kernels.deepgemm_indexer import unfit_reason

    return not unfit_reason(q, layout, rows)


def _one_token_each(batch: StepBatch) -> bool:
    """A decode step: every request runs one token (static: host-known sizes, no sync)."""
    return batch.num_tokens == batch.cu.shape[0] - 1


_X_PROJECTIONS = (
    "compressor.wkv.weight",
    "compressor.wgate.weight",
    "indexer.compressor.wkv.weight",
    "indexer.compressor.wgate.weight",
    "indexer.weights_proj.weight",
)


def _stack_x_projections(w: dict, ratio: int):
    """The block's plain (not FP8) projections of x stacked into one weight, the originals turned into row views
    of it (no extra memory; x @ view.t() is the same product). -> (stacked [N, hidden] or None, name -> columns)."""
    names = [n for n in _X_PROJECTIONS if n in w] if ratio > 1 else []
    mats = [w[n] for n in names]
    cols, start = {}, 0
    for n, m in zip(names, mats):
        cols[n] = (start, start + m.shape[0])
        start += m.shape[0]
    same = all(
        isinstance(m, torch.Tensor)
        and not isinstance(m, Fp8Weight)
        and m.dim() == 2
        and m.dtype == mats[0].dtype
        and m.device == mats[0].device
        and m.shape[1] == mats[0].shape[1]
        for m in mats
    )
    if len(mats) < 2 or not same:
        return None, cols
    stacked = torch.cat(mats, dim=0)
    for n, (a, b) in cols.items():
        w[n] = stacked[a:b]
    return stacked, cols


_ENTRY_TABLES: dict = {}


def _entry_rope_table(cfg: ModelConfig, ratio: int, ropes: dict, device) -> tuple:
    """cos / sin of the compress RoPE at window starts 0, r, 2r, ... below max_position_embeddings (which
    --max-model-len caps), built once per (rope, length, ratio, device) from the engine's own Rope (ropes'
    "compress_at"), so a step gathers them in its compressor kernel instead of computing them.
    V4-Flash at 1M positions: 64 MiB (ratio 4) + 2 MiB (ratio 128), shared by every layer."""
    key = (cfg.compress_rope, cfg.max_position_embeddings, ratio, str(device))
    table = _ENTRY_TABLES.get(key)
    if table is None:
        from dsv4_kernels.triton_compress_step import entry_rope_table

        table = _ENTRY_TABLES[key] = entry_rope_table(ropes["compress_at"], cfg.max_position_embeddings, ratio, device)
    return table


def _norm_rope(x: torch.Tensor, cos, sin, eps: float, weight: torch.Tensor | None, fast: bool) -> torch.Tensor:
    """RMSNorm (weighted, or per head without a weight) then RoPE; the fused Triton kernel when `fast`."""
    if fast:
        from dsv4_kernels.triton_norm_rope import rms_norm_rope  # imports triton: only on this path

        return rms_norm_rope(x.contiguous(), cos, sin, eps, weight)
    normed = unweighted_rms_norm(x, eps) if weight is None else rms_norm(x, weight, eps)
    return apply_rope(normed, cos, sin)
