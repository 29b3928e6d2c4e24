"""The benchmark's report: the environment line, the markdown section (tables, profile, verdicts) and its
place in BENCHMARKS.md between the bench_gpu markers.

Every decode / prefill row names its routed-experts path (format and kernel); the header names each
engine's decode mode (`EngineCore.decode_mode`); the peer is compared with our fastest experts format at its batch
and context (mxfp4 when that row ran, else bf16); the closing paragraph says what the run used and the
gaps that remain, from the run's own context.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from dsv4_kernels.settings import settings
from service.benchmarks_md import write_section  # noqa: E402

from .peer import transformers_info
from .roofline import expert_bytes, index_row_bytes, kv_row_bytes

SECTION = "## GPU decode and prefill (V4-Flash slice)"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = "not installed"
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0:1]
        env["driver"] = env["driver"][0] if env["driver"] else "unknown"
        env["cuda"] = torch.version.cuda or "?"
    else:
        env["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        env["driver"] = "-"
        env["cuda"] = "-"
    env["transformers"], _ = transformers_info()
    src = settings().transformers_source
    if src:
        env["transformers"] += f" ({src})"
    return env


def fmt_k(n) -> str:
    if not isinstance(n, int):
        return "all"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def render(ctx: dict) -> str:
    lines = [SECTION, ""]
    for part in (_header_lines, _decode_table, _prefill_table, _peer_table, _profile_lines):
        lines.extend(part(ctx))
    lines.extend(ctx["verdicts"])
    return "\n".join(lines).rstrip() + "\n"


def _engine_line(e: dict) -> str:
    if "skip" in e:
        return f"experts `{e['experts']}`: not run ({e['skip']})"
    graphs = f", {e.get('graphs', 0)} CUDA graph(s) captured" if e.get("decode_mode") == "graphs" else ""
    keys = e.get("index_fmt", "mxfp4").upper()
    cache = f"fp8_ds_mla + {keys} indexer keys" if e.get("fp8_cache") else "exact bf16 rows"
    return (
        f"experts `{e['experts']}`: decode mode `{e['decode_mode']}`{graphs}, prefill steps "
        f"`{e.get('prefill_mode', 'eager')}`, KV cache {cache}, weights built "
        f"in {e['build_s']:.0f} s"
    )


def _header_lines(ctx: dict) -> list[str]:
    e = ctx["env"]
    bw, tf = ctx["copy_gbs"], ctx["tflops"]
    lines = []
    lines.append(f"- command: `{ctx['command']}`")
    lines.append(f"- date: {ctx['date']}; total run time {ctx['total_s']:.0f} s (budget {ctx['budget_s']:.0f} s)")
    lines.append(
        f"- GPU: {e['gpu']}, driver {e['driver']}, CUDA {e['cuda']}; torch {e['torch']}, "
        f"triton {e['triton']}, "
        f"transformers {e['transformers']}, Python {e['python']}"
    )
    lines.append(
        f"- roofs measured in this run: device copy {bw:.0f} GB/s (read + write), bf16 matmul "
        f"{tf:.3g} TFLOP/s ({ctx['mm_n']}^3)"
    )
    lines.append(
        f"- slice: {ctx['slice_desc']}; engine dtype bf16, Triton fast paths {'on' if ctx['triton_path'] else 'off'}"
    )
    lines.append(
        "- engines (one per routed-experts format, freed before the next): "
        + "; ".join(_engine_line(x) for x in ctx["engines"])
    )
    lines.append(
        "- decode: B requests at context C enter through the decode-side hand-off API (`reserve_import` + "
        "`commit_import`) with random cache rows (no B x C prefill is run); step = one `EngineCore.step()` "
        "(schedule, batch build, forward, sampling) in a run of steps, no device sync between them (an "
        "overlapped step returns while the next runs, so this is the serving rate), "
        f"median of {ctx['steps']} steps "
        f"after {ctx['warmup']} warm-up (a timed step that captured a new CUDA graph is replaced by another); "
        "touched = distinct routed experts per layer in those steps (mean, padding rows excluded)"
    )
    lines.append(
        "- roofline = bytes the step must read / copy bandwidth. *prod*: FP8 dense (+ scales), bf16 where the "
        "release keeps bf16, MXFP4 touched experts, fp8_ds_mla cache rows (584 B) and MXFP4 indexer keys "
        "(68 B); *engine*: the same tensors and rows as that engine stores them (dense weights as FP8 + "
        "scales when the engine keeps them FP8, else bf16 dequantised at load, touched experts as MXFP4 when kept packed else bf16, cache rows as the engine's KV cache holds them: "
        "the production formats when --kv-cache-dtype auto resolved to fp8, else bf16). "
        "Cache rows read per request: SWA window on every layer, all visible indexer keys + top-512 "
        "entries on CSA layers, all entries on HCA layers; writes and compressor states not counted"
    )
    lines.append("")
    return lines


def _decode_table(ctx: dict) -> list[str]:
    lines = []
    lines.append(
        "| batch | context | experts | step ms | tok/s | touched/layer | prod GB | prod roof ms | x prod roof "
        "| engine GB | engine roof ms | x engine roof |"
    )
    lines.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ctx["decode"]:
        head = f"| {r['batch'] if r['batch'] is not None else 'all'} | {fmt_k(r['ctx'])} | {r['experts']} "
        if "skip" in r:
            lines.append(head + f"| skipped: {r['skip']} | | | | | | | | |")
            continue
        lines.append(
            head + f"| {r['step_ms']:.1f} | {r['tok_s']:.0f} | {r['touched']:.0f} | {r['prod_gb']:.2f} "
            f"| {r['prod_roof_ms']:.2f} | {r['x_prod']:.1f} | {r['eng_gb']:.2f} | {r['eng_roof_ms']:.2f} "
            f"| {r['x_eng']:.1f} |"
        )
    lines.append("")
    return lines


def _prefill_table(ctx: dict) -> list[str]:
    lines = []
    fp8 = ctx.get("fp8_tflops")
    lines.append(
        "| prefill | experts | time s | tok/s | TFLOP | bf16 matmul roof tok/s | % of bf16 roof | % of FP8 roof |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for p in ctx.get("prefill") or [{"experts": "-", "skip": "not run"}]:
        if "skip" not in p:
            share_fp8 = f"{100 * p['share_fp8']:.1f}%" if "share_fp8" in p else "-"
            lines.append(
                f"| 1 x {fmt_k(p['tokens'])} tokens, {p['steps']} step(s), median of {p['n']} "
                f"| {p['experts']} | {p['s']:.2f} | {p['tok_s']:.0f} | {p['tflop']:.1f} "
                f"| {p['roof_tok_s']:.0f} | {100 * p['share']:.1f}% | {share_fp8} |"
            )
        else:
            lines.append(f"| {fmt_k(ctx['prefill_tokens'])} tokens | {p['experts']} | skipped: {p['skip']} | | | | | |")
    lines.append("")
    if fp8:
        lines += [f"FP8 roof: DeepGEMM `fp8_gemm_nt` 8192^3 = {fp8:.0f} TFLOP/s, measured in this run.", ""]
    for p in ctx.get("prefill") or []:
        if "chunk_s" in p:
            lines += [_chunk_text(p), ""]
    for p in ctx.get("prefill") or []:
        prof = p.get("profile")
        if prof:  # device-busy share: how host-bound the prefill is
            top = "; ".join(f"{k} {t / 1e3:.1f} ms ({c}x)" for t, k, c in prof["top"])
            lines += [
                f"Prefill profile ({p['experts']}, one run under torch.profiler): {prof['kernels']} GPU kernels, "
                f"busy {prof['busy_ms']:.1f} ms of {prof['wall_ms']:.1f} ms wall ({p['s'] * 1e3:.0f} ms "
                f"unprofiled). Top kernels: {top}." + _host_text(prof),
                "",
            ]
    return lines


def _chunk_text(p: dict) -> str:
    """Each timed run's seconds, and the last run's chunks as the prompt grows (every chunk up to 16, else the
    chunks ending at each power-of-two prompt length and the last) with the peak allocated memory."""
    picked = []
    for i, (t, done) in enumerate(zip(p["chunk_s"], p["chunk_end"])):
        if len(p["chunk_s"]) <= 16 or done & (done - 1) == 0 or i == len(p["chunk_s"]) - 1:
            picked.append(f"{fmt_k(done)} {t * 1e3:.0f} ms")
    runs = ", ".join(f"{t:.3f}" for t in p["runs_s"])
    return (
        f"Prefill {p['experts']}: runs {runs} s; chunks of <= {fmt_k(p['chunk'])} tokens, time of the chunk "
        f"ending at each prompt length: {'; '.join(picked)}; peak {p['peak_gib']:.2f} GiB allocated "
        f"({p['base_gib']:.2f} GiB before the prompt: weights and the KV pool)."
    )


def _host_text(prof: dict) -> str:
    """The host side of a profiled run (engine_bench._host_table), or nothing for runs before it existed."""
    if "api" not in prof or not (prof["api"] or prof["span_ms"]):
        return ""
    api = "; ".join(f"{n} {t:.1f} ms ({c}x)" for t, n, c in prof["api"])
    gaps = ", ".join(f"{g:.1f}" for g in prof["gaps_ms"])
    return (
        f" GPU idle between its first and last kernel: {prof['idle_ms']:.1f} ms of {prof['span_ms']:.1f} ms "
        f"(longest gaps {gaps} ms). Host time in CUDA API calls: {api}."
    )


def _peer_table(ctx: dict) -> list[str]:
    lines = []
    lines.append(
        f"| peer: decode step, batch {ctx['hf_batch']}, context {fmt_k(ctx['hf_ctx'])} | ms | their ms / our ms |"
    )
    lines.append("|---|---:|---:|")
    ours = _ours_at_peer(ctx)
    if ours:
        lines.append(f"| this engine, its fastest experts format here ({ours['experts']}) | {ours['step_ms']:.1f} | |")
    for h in ctx.get("hf") or [{"skip": "not run"}]:
        what = f"transformers `DeepseekV4ForCausalLM` (bf16, eager attention, experts `{h.get('experts', '?')}`"
        if "skip" in h:
            lines.append(f"| {what}) | skipped: {h['skip']} | |")
            continue
        sp = f"{h['step_ms'] / ours['step_ms']:.2f}x" if ours else "-"
        lines.append(
            f"| {what}; its DynamicCache after a {ctx['hf_chunk']}-token-chunk prefill of "
            f"{h['prefill_s']:.0f} s; median of {h['n']}) | {h['step_ms']:.1f} | {sp} |"
        )
    lines.append("")
    return lines


def _category_text(prof: dict, layers: int) -> str:
    """' Kernels a layer by kind: ...' from the profile's categories (none in older profile JSON)."""
    cats = prof.get("categories")
    if not cats:
        return ""
    return " Kernels a layer by kind: " + "; ".join(f"{k} {n / layers:.1f}" for k, n in cats.items()) + "."


def _profile_lines(ctx: dict) -> list[str]:
    lines = []
    prof = ctx.get("profile")
    if prof and "skip" not in prof and prof["kernels"]:
        top = "; ".join(f"{k} {t / 1e3:.1f} ms ({c}x)" for t, k, c in prof["top"])
        lines.append(
            f"Profile of one decode step (experts {prof['experts']}, decode mode `{prof['decode_mode']}`, "
            f"batch {prof['batch']}, context {fmt_k(prof['ctx'])}, run synchronously under torch.profiler, wall "
            f"{prof['wall_ms']:.0f} ms): {prof['kernels']} GPU kernels "
            f"({prof.get('per_layer', prof['kernels'] / ctx['cfg'].num_layers):.0f} a layer), summed kernel time "
            f"{prof['busy_ms']:.1f} ms ({100 * prof['busy_ms'] / prof['wall_ms']:.0f}% of the wall time). "
            f"Top kernels by device time: {top}." + _category_text(prof, ctx["cfg"].num_layers)
        )
        lines.append("")
    return lines


def _ours_at_peer(ctx: dict) -> dict | None:
    """Our fastest row (over the experts formats) at the peer's batch and context."""
    rows = [r for r in ctx["decode"] if r["batch"] == ctx["hf_batch"] and r["ctx"] == ctx["hf_ctx"] and "skip" not in r]
    return min(rows, key=lambda r: r["step_ms"], default=None)


def verdicts(ctx: dict) -> list[str]:
    out = [
        "Aims: decode step <= 2.0x the production-format roofline at batch 64 (contexts 4K and 32K), "
        "<= 3x at batch 1; batch 128 >= 2x the 6.2K tok/s measured before it; >= 10x transformers' default path "
        "at batch 16, context 4K."
    ]
    for r in ctx["decode"]:
        if r["batch"] in (1, 64) and "skip" not in r:
            aim = 2.0 if r["batch"] == 64 else 3.0
            ok = "met" if r["x_prod"] <= aim else f"missed by {r['x_prod'] / aim:.2f}x"
            out.append(
                f"- batch {r['batch']}, context {fmt_k(r['ctx'])}, {r['experts']}: {r['x_prod']:.1f}x the "
                f"production-format roofline ({r['x_eng']:.1f}x the engine-format one; aim {aim:.0f}x): {ok}."
            )
        if r["batch"] == 128 and "skip" not in r:
            ok = "met" if r["tok_s"] >= 2 * 6200 else f"missed by {2 * 6200 / r['tok_s']:.2f}x"
            out.append(
                f"- batch 128, context {fmt_k(r['ctx'])}, {r['experts']}: {r['tok_s']:.0f} tok/s (aim >= 12400): {ok}."
            )
    ours = _ours_at_peer(ctx)
    peers = [h for h in ctx.get("hf") or [] if "skip" not in h]
    if ours and peers:
        for h in peers:
            sp = h["step_ms"] / ours["step_ms"]
            out.append(
                f"- batch {ctx['hf_batch']}, context {fmt_k(ctx['hf_ctx'])}, experts {ours['experts']}: "
                f"{sp:.2f}x the speed of transformers with experts `{h['experts']}`: "
                f"{'met' if sp >= 10 else 'missed'} (aim 10x)."
            )
    else:
        out.append("- speed-up over transformers: not measured (see the peer rows).")
    replaced = [r for r in ctx["decode"] if r.get("captured_timed")]
    if replaced:
        out.append(
            "- timed steps that captured a CUDA graph (context crossed a bucket edge) and were replaced: "
            + ", ".join(f"batch {r['batch']} context {fmt_k(r['ctx'])} ({r['captured_timed']})" for r in replaced)
            + "."
        )
    out.append("")
    out.append(_gaps(ctx))
    return out


def _gaps(ctx: dict) -> str:
    """What the run used and where the engine still reads or does more than the production roof."""
    cfg = ctx["cfg"]
    ran = [e for e in ctx["engines"] if "skip" not in e]
    modes = sorted({e["decode_mode"] for e in ran})
    how = (
        (
            f"Decode steps ran in mode {', '.join(f'`{m}`' for m in modes) or '-'}"
            + (
                " (one CUDA graph replayed per (batch-slot, context) bucket; captured during warm-up)"
                if "graphs" in modes
                else " (no CUDA graphs: they need a 16-bit CUDA engine with the Triton path)"
            )
            + ", with the Triton fast paths "
            + (
                "on (norm+RoPE, compressor, indexer, sparse attention, mHC)"
                if ctx["triton_path"]
                else "off (torch reference ops)"
            )
            + "; routed experts: "
            + "; ".join(f"{e['experts']}" for e in ran)
            + "."
        )
        if ran
        else "No engine ran."
    )
    fp8 = [e for e in ran if e.get("dense") == "fp8"]
    gaps = [
        (
            "dense projections run FP8 through DeepGEMM with 1x128 activation quantisation fused where the seeds "
            "fuse it (wq_a|wkv one GEMM; q_norm + quantisation one launch shared by wq_b and the indexer's wq_b; "
            "wo_a's groups one quantiser; the shared expert's w1|w3 one GEMM, its down projection fed by the fused "
            "SwiGLU-quantiser), the other projections one quantiser launch each"
        )
        if fp8
        else "dense projections are bf16 GEMMs on FP8-rounded weights (2x the FP8 bytes; no FP8 GEMM)",
        (
            f"the KV cache holds fp8_ds_mla rows and {(ran[0] if ran else {}).get('index_fmt', 'mxfp4').upper()} "
            f"indexer keys (--index-cache-dtype auto: FP8 on Hopper, where the indexer scores them 2.7x faster than "
            f"MXFP4, at 132 B "
            f"a key vs 68; the prod roof counts MXFP4 keys, the engine roof the engine's): decode attention is "
            f"FlashMLA's sparse kernel, the indexer dequantises the keys in the engine's Triton kernel"
        )
        if all(e.get("fp8_cache") for e in ran)
        else (
            f"the KV cache holds exact bf16 rows ({kv_row_bytes(cfg, 'engine')} B a KV row vs "
            f"{kv_row_bytes(cfg, 'prod')} B fp8_ds_mla, {index_row_bytes(cfg, 'engine')} B an indexer key vs "
            f"{index_row_bytes(cfg, 'prod')} B MXFP4): --kv-cache-dtype auto resolved to exact rows here "
            "(no FlashMLA, or not a bf16 CUDA engine)"
        ),
        (
            "the indexer's top-k (unordered picks, what the attention kernels take) counts each score's rank "
            "against its row for small steps (rows x candidates^2 <= 2^25: batch 1 up to 4096 candidates; "
            "dsv4_kernels/triton_topk_rank.py), else is a Triton radix select: split over many programs a row for "
            "small batches of long rows (dsv4_kernels/triton_topk_split.py), one program a row for other decode "
            "steps up to 8192 candidates (the bitonic sort up to 1024), torch.topk elsewhere "
            "(triton_indexer.topk_of_scores; `dsv4 bench kernels topk`)"
        ),
        (
            "packed MXFP4 experts run through triton_kernels' matmul, with the expert sort, the SwiGLU and the "
            "k-way sum (+ shared expert) as one Triton launch each around it (`dsv4 bench kernels moe` measures the "
            "matmul against copy bandwidth)"
        )
        if any("triton_kernels" in e["experts"] for e in ran)
        else (
            "routed experts ran on the engine's own packed-MXFP4 Triton kernel, not triton_kernels (its share of "
            "copy bandwidth is measured by `dsv4 bench kernels moe`, section mxfp4_moe, not by this run)"
        )
        if any(e["format"] == "mxfp4" for e in ran)
        else "routed experts ran as bf16 grouped GEMMs",
        (
            "under graphs greedy decode steps overlap (engine.execution.decode_overlap): step N+1 is launched from step N's "
            "device tokens before N is read back, so the host's schedule, read-back and finish checks run while the "
            "GPU works"
        )
        if any(e.get("overlap") for e in ran)
        else (
            "under graphs each step still pays a host schedule, a [3, slots] input copy and, for greedy requests, "
            "one [2, slots] read-back of the tokens the graph picked (other sampling runs outside the graph)"
        ),
        "without graphs the step's index tensors are built on the host",
    ]
    if any(e["format"] == "bf16" for e in ran):
        gaps.append(
            f"the bf16 experts read {expert_bytes(cfg, 'engine') / 1e6:.3g} MB per touched expert vs "
            f"{expert_bytes(cfg, 'prod') / 1e6:.3g} MB packed MXFP4"
        )
    return (
        how + " Remaining gaps against the production roof: " + "; ".join(gaps) + " (the engine-format "
        "columns are the fair roof for these engines). transformers' default experts path (`grouped_mm`) runs "
        "each expert projection as one grouped GEMM, its `eager` path is a Python loop over experts, and its "
        "attention is eager (dense over the window + all compressed entries) in both."
    )


def write_benchmarks(path: Path, section: str) -> None:
    """Put the section into BENCHMARKS.md's `bench_gpu` section (replacing an older one)."""
    write_section("bench_gpu", section, path)
