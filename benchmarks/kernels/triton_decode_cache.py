"""Bench cases of the cache-writing Triton kernels, for benchmarks/kernels/triton_decode.py (kept apart for size).

Groups: swa_insert (norm + rope + fp8_ds_mla row write), indexer_query (RoPE + Hadamard + MXFP4 / FP8 q),
compressor_cache (state save; pool + norm + rope + quantised entry write). V4-Flash shapes: D=512, rope 64,
Hi=64, Di=128. These ops write as much as they read, so their byte count is read + write (the copy roof
counts both too); the reference is the plain-torch chain (norm, rope, geometry pack, write_rows).
`case_groups(Case, rand, close, device)` returns {name: cases(t)} built on triton_decode's helpers.
"""

from __future__ import annotations

import torch

HEAD_DIM, ROPE_DIM, INDEX_HEADS, INDEX_DIM, EPS = 512, 64, 64, 128, 1e-6


def bytes_check(out_cache: torch.Tensor, ref_cache: torch.Tensor, min_equal: float = 0.99) -> str:
    equal = (out_cache == ref_cache).float().mean().item()
    return "ok" if equal >= min_equal else f"MISMATCH {100 * equal:.2f}% bytes equal"


def case_groups(Case, rand, close, device: str) -> dict:
    """{group name: (t -> [Case])} for the cache kernels; Case / rand / close are triton_decode's own."""
    from dsv4_kernels import geometry as g
    from dsv4_kernels.rope import rope_cos_sin, rope_inv_freq

    def cos_sin(n: int, theta: float):
        return rope_cos_sin(torch.randint(0, 65536, (n,), device=device), rope_inv_freq(theta, ROPE_DIM))

    def paged(layout, rows: int) -> torch.Tensor:
        return torch.zeros(-(-rows // layout.block_size), layout.block_bytes(), dtype=torch.uint8, device=device)

    def swa_insert_cases(t: int) -> list:
        from dsv4_kernels.norm import rms_norm
        from dsv4_kernels.rope import apply_rope
        from dsv4_kernels.triton_swa_insert import swa_insert

        kv = rand(t, HEAD_DIM, seed=30)
        weight = rand(HEAD_DIM, dtype=torch.float32, scale=0.1, seed=31) + 1
        cos, sin = cos_sin(t, 10000.0)
        layout = g.Fp8DsMlaLayout(HEAD_DIM, ROPE_DIM)
        rows = torch.randperm(2 * t + 64, device=device)[:t]
        cache, ref_cache = paged(layout, 2 * t + 64), paged(layout, 2 * t + 64)

        def reference():
            out = apply_rope(rms_norm(kv, weight, EPS), cos, sin)
            g.write_rows(ref_cache, layout, rows, g.pack_fp8_ds_mla(out, layout))
            return out

        def check(out, expected):
            return close(out, expected) if close(out, expected) != "ok" else bytes_check(cache, ref_cache)

        moved = kv.numel() * 2 + HEAD_DIM * 4 + 2 * cos.numel() * 4 + t * (HEAD_DIM * 2 + layout.row_bytes)
        return [
            Case(
                "swa insert fp8_ds_mla (r+w)",
                f"T={t} D={HEAD_DIM} rope={ROPE_DIM}",
                lambda: swa_insert(kv, weight, cos, sin, EPS, cache, rows, layout),
                reference,
                moved,
                check=check,
            )
        ]

    def indexer_query_cases(t: int) -> list:
        from dsv4_kernels.indexer import quantize_query
        from dsv4_kernels.triton_indexer_query import indexer_query

        q = rand(t, INDEX_HEADS, INDEX_DIM, seed=32)
        cos, sin = cos_sin(t, 160000.0)
        out = []
        for fmt in ("mxfp4", "fp8"):
            layout = g.IndexerKeyLayout(INDEX_DIM, fmt)

            def check(got, expected):
                return bytes_check(
                    torch.cat([got[0].flatten(), got[1].flatten().view(torch.uint8)]),
                    torch.cat([expected[0].flatten(), expected[1].flatten().view(torch.uint8)]),
                )

            moved = q.numel() * 2 + 2 * cos.numel() * 4 + t * INDEX_HEADS * layout.row_bytes
            out.append(
                Case(
                    f"indexer q rope+hadamard+{fmt} (r+w)",
                    f"T={t} Hi={INDEX_HEADS} Di={INDEX_DIM}",
                    lambda layout=layout: indexer_query(q, cos, sin, layout),
                    lambda layout=layout: quantize_query(q, cos, sin, layout)[:2],
                    moved,
                    check=check,
                )
            )
        return out

    def compressor_cache_cases(t: int) -> list:
        from dsv4_kernels.compressor import pool_windows, state_rows
        from dsv4_kernels.hadamard import hadamard
        from dsv4_kernels.norm import rms_norm
        from dsv4_kernels.rope import apply_rope
        from dsv4_kernels.triton_compressor import pool_norm_rope_quant
        from dsv4_kernels.triton_state_save import save_state

        out = []
        kinds = (
            ("ratio 4 fp8_ds_mla", 8, HEAD_DIM, g.Fp8DsMlaLayout(HEAD_DIM, ROPE_DIM, g.compressed_block_rows(4))),
            ("ratio 128 fp8_ds_mla", 128, HEAD_DIM, g.Fp8DsMlaLayout(HEAD_DIM, ROPE_DIM, g.compressed_block_rows(128))),
            ("indexer mxfp4", 8, INDEX_DIM, g.IndexerKeyLayout(INDEX_DIM, "mxfp4", g.compressed_block_rows(4))),
        )
        for what, slots, d, layout in kinds:
            kv = rand(t, slots, d, seed=33)
            score = rand(t, slots, d, dtype=torch.float32, seed=34)
            weight = rand(d, dtype=torch.float32, scale=0.1, seed=35) + 1
            cos, sin = cos_sin(t, 160000.0)
            rows = torch.randperm(2 * t + 64, device=device)[:t]
            cache, ref_cache = paged(layout, 2 * t + 64), paged(layout, 2 * t + 64)
            key = isinstance(layout, g.IndexerKeyLayout)

            def reference(
                kv=kv,
                score=score,
                weight=weight,
                cos=cos,
                sin=sin,
                rows=rows,
                layout=layout,
                ref_cache=ref_cache,
                key=key,
            ):
                entries = apply_rope(rms_norm(pool_windows(kv, score), weight, EPS), cos, sin)
                entries = hadamard(entries) if key else entries
                g.write_rows(ref_cache, layout, rows, g.pack_rows(layout, entries.float()))
                return entries

            def check(got, expected, cache=cache, ref_cache=ref_cache):
                verdict = close(got, expected)
                return verdict if verdict != "ok" else bytes_check(cache, ref_cache)

            moved = kv.numel() * 2 + score.numel() * 4 + t * (d * 2 + layout.row_bytes)
            out.append(
                Case(
                    f"compressor pool+quant ({what}, r+w)",
                    f"T={t} slots={slots} d={d}",
                    lambda kv=kv, score=score, weight=weight, cos=cos, sin=sin, cache=cache, rows=rows, layout=layout: (
                        pool_norm_rope_quant(kv, score, weight, EPS, cos, sin, cache, rows, layout)
                    ),
                    reference,
                    moved,
                    check=check,
                )
            )

        w = 2 * HEAD_DIM  # ratio-4 state: coff 2
        kv, gate = rand(t, w, seed=36), rand(t, w, seed=37)
        ape = rand(4, w, dtype=torch.float32, seed=38)
        positions = torch.randint(0, 65536, (t,), device=device)
        rows = torch.randperm(2 * t + 8, device=device)[:t]
        chunk_rows = torch.arange(t, device=device)  # every row of the chunk kept (the engine's RingWrite pairs)
        state, ref_state = (torch.zeros(2 * t + 8, 2 * w, device=device) for _ in range(2))

        def state_reference():
            ref_state[rows] = state_rows(kv, gate, ape, positions)
            return ref_state

        out.append(
            Case(
                "compressor state save (r+w)",
                f"T={t} W={w}",
                lambda: save_state(kv, gate, ape, positions, state, chunk_rows, rows) or state,
                state_reference,
                2 * kv.numel() * 2 + t * 2 * w * 4,
                check=lambda a, b: "ok" if torch.equal(a, b) else "MISMATCH",
            )
        )
        return out

    return {
        "swa_insert": swa_insert_cases,
        "indexer_query": indexer_query_cases,
        "compressor_cache": compressor_cache_cases,
    }
