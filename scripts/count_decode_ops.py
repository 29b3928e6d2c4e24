"""Count the kernels one fixed-shape decode step launches, per layer and by source (no GPU needed).

    .venv/bin/python scripts/count_decode_ops.py [--slots 8] [--preset tiny] [--json out.json]
    .venv/bin/python scripts/count_decode_ops.py --prefill 256 [--kv-cache-dtype fp8]   # one prefill step instead

With --prefill T, one request's prefill of T tokens in one step (engine.model.batch.build_step's index derivation is
the prologue) is counted the same way, after an identical warm-up prefill.

Runs the built-in V4-structured model (tiny widths: SWA, CSA and HCA layers, a hash layer, MXFP4 experts kept
packed) on the CPU with the Triton fast paths forced under triton's interpreter (DSV4_TRITON=1,
TRITON_INTERPRET=1, DSV4_MXFP4_MOE=1), warms a few requests into decode, then runs one bucketed decode step
(the graph path's fixed shapes, engine.model.decode_batch) under a TorchDispatchMode. Each aten op that launches a
kernel on a GPU (views, reshapes and allocations do not) counts once, each Triton launch counts once, and
both are attributed to the section that issued them: prologue (input derivation, embedding), layer i's
mhc / attn / moe (incl. each block's input norm), head (hc_head, norm, LM head).

What the CPU cannot run, and how it is counted:
- the MXFP4 MoE takes triton_kernels' matmul (dsv4_kernels.mxfp4_ogs) on CUDA: with `--ogs` (default) the step
  runs dsv4_kernels.mxfp4_ogs.ogs_moe with the two matmuls and the ragged metadata stubbed (each counted as the
  launches they make on the H200: matmul 1 each, `make_ragged_tensor_metadata` RAGGED_LAUNCHES), so its
  torch glue is counted as it runs; `--no-ogs` counts the engine's own kernel (dsv4_kernels.triton_moe) instead;
- FP8 dense projections on CUDA are an activation-quantiser launch + a DeepGEMM launch, where the CPU
  multiplies dequantised weights once: `--fp8` adds one launch per dense projection call (reported apart);
- anything that differs between CUDA and the CPU inside a torch op (cuBLAS splitting a GEMM, ...) is not seen.
The GPU bench's profile line (benchmarks/slice/) reports the kernels the GPU actually ran.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DSV4_TRITON", "1")
os.environ.setdefault("DSV4_MXFP4_MOE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch no kernel: views, metadata, allocation without a fill.
NO_KERNEL = {
    "view", "_unsafe_view", "expand", "t", "transpose", "slice", "select", "unsqueeze", "squeeze", "as_strided",
    "permute", "split", "split_with_sizes", "unbind", "alias", "detach", "empty", "empty_strided", "empty_like",
    "reshape", "narrow", "chunk", "lift_fresh", "_reshape_alias", "unflatten", "flatten", "view_as_real",
    "view_as_complex", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense_no",
    "diagonal", "movedim", "expand_as", "view_as", "set_", "resize_", "_to_copy_no", "result_type",
}
RAGGED_LAUNCHES = 2  # triton_kernels' make_ragged_tensor_metadata: its Triton launches on the H200 (memset + fill)


class Sections:
    """The current attribution label (a stack) and the counts under each."""

    def __init__(self):
        self.stack = ["prologue"]
        self.layer = -1
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.muted = 0
        _ACTIVE[:] = [self]

    @property
    def label(self) -> str:
        return self.stack[-1]

    def add(self, source: str, n: int = 1) -> None:
        if not self.muted:
            self.counts[self.label][source] += n

    @contextlib.contextmanager
    def section(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    @contextlib.contextmanager
    def mute(self):
        self.muted += 1
        try:
            yield
        finally:
            self.muted -= 1


class AtenCounter(TorchDispatchMode):
    def __init__(self, sections: Sections):
        super().__init__()
        self.sections = sections

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name not in NO_KERNEL and not self.sections.muted and not _aliases_input(name, args, out):
            self.sections.add(f"aten.{name}")
        return out


def _aliases_input(name: str, args, out) -> bool:
    """An out-of-place op that handed back its input's memory (`.to` to the same dtype, `.contiguous()` of a
    contiguous tensor, ...) launched nothing."""
    if name.endswith("_") or not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return False
    return out.numel() > 0 and out.data_ptr() == args[0].data_ptr() and out.dtype == args[0].dtype


def _wrap(obj, attr: str, wrapper_of):
    real = getattr(obj, attr)
    setattr(obj, attr, wrapper_of(real))
    return real


def _patch(sections: Sections, ogs: bool, fp8: bool) -> list:
    """Monkeypatches that label sections and count Triton launches; -> undo list of (obj, attr, real)."""
    import engine.model.attention as attention_mod
    import engine.model.linear as linear_mod
    import engine.model.model as model_mod
    import engine.model.moe as moe_mod
    from triton.runtime.interpreter import InterpretedFunction

    undo = []

    def labelled(name_of):
        def wrapper_of(real):
            def inner(*a, **k):
                with sections.section(name_of(*a, **k)):
                    return real(*a, **k)
            return inner
        return wrapper_of

    def layer_label(kind):
        return lambda *a, **k: f"layer{sections.layer}.{kind}"

    def hc_pre_of(real):
        def inner(self, lw, kind, streams, *rest):
            if kind == "attn":
                sections.layer += 1
            with sections.section(f"layer{sections.layer}.mhc"):
                return real(self, lw, kind, streams, *rest)
        return inner

    undo.append((model_mod.DeepseekV4Model, "_hc", _wrap(model_mod.DeepseekV4Model, "_hc", hc_pre_of)))
    for obj, attr, kind in ((attention_mod.AttentionBlock, "forward", "attn"), (moe_mod.MoEBlock, "forward", "moe")):
        undo.append((obj, attr, _wrap(obj, attr, labelled(layer_label(kind)))))
    undo.append((model_mod.DeepseekV4Model, "logits",
                 _wrap(model_mod.DeepseekV4Model, "logits", labelled(lambda *a, **k: "head"))))
    # mHC post and the blocks' input norms belong to the layer of the block they follow / feed.
    norm_label = layer_label("norm")
    undo.append((model_mod, "rms_norm", _wrap(model_mod, "rms_norm", labelled(
        lambda *a, **k: "head" if sections.label == "head" else norm_label()))))

    def mhc_of(real):
        def inner(streams):
            impl = real(streams)
            return _LabelledMhc(impl, sections)
        return staticmethod(inner)
    real_mhc = model_mod.DeepseekV4Model.__dict__["_mhc"]

    def cuda_mhc(streams):
        # CUDA takes dsv4_kernels.triton_mhc; the CPU engine keeps the reference (the interpreter is slow), so the
        # count forces the kernels in.
        from dsv4_kernels import triton_mhc
        return triton_mhc
    model_mod.DeepseekV4Model._mhc = mhc_of(cuda_mhc)
    undo.append((model_mod.DeepseekV4Model, "_mhc", real_mhc))

    def launch_of(real):
        def run(self, *a, **k):
            sections.add(f"triton.{self.fn.__name__}")
            with sections.mute():
                return real(self, *a, **k)
        return run
    undo.append((InterpretedFunction, "run", _wrap(InterpretedFunction, "run", launch_of)))

    if fp8:
        def linear_of(real):
            def inner(x, w, *groups):
                # CUDA: dsv4_kernels.deepgemm_linear -- fp8_gemm: quantiser + GEMM; fp8_grouped_gemm: one quantiser
                # launch over the groups (quant_act_1x128_grouped), a GEMM per group, the output's transposing
                # reshape. (Before that quantiser: a contiguous copy and one quantiser per group, 2 + 2G.)
                n = 2 if not groups else 2 + groups[0]
                sections.add("fp8 dense (CUDA: quant + DeepGEMM launches)", n)
                with sections.mute():
                    return real(x, w, *groups)
            return inner
        for attr in ("linear", "grouped_projection"):
            for mod in (linear_mod, attention_mod, moe_mod):
                if hasattr(mod, attr):
                    undo.append((mod, attr, _wrap(mod, attr, linear_of)))
        # The shared expert's down projection takes its input from the fused SwiGLU + quantiser on CUDA
        # (engine.model.moe.MoEBlock.shared_expert): run that kernel and count the GEMM after it as one launch.
        import dsv4_kernels.deepgemm_linear as dgl

        def gemm_quantized(xq, xs, w):
            sections.add("fp8 dense (CUDA: quant + DeepGEMM launches)")
            with sections.mute():
                return torch.zeros(xq.shape[0], w.shape[0], dtype=torch.bfloat16)
        undo.append((moe_mod, "uses_fp8_gemm", moe_mod.uses_fp8_gemm))
        undo.append((dgl, "fp8_gemm_quantized", dgl.fp8_gemm_quantized))
        moe_mod.uses_fp8_gemm = lambda h, w: True
        dgl.fp8_gemm_quantized = gemm_quantized
    if ogs:
        undo.extend(_stub_ogs(sections))
    return undo


class _LabelledMhc:
    """dsv4_kernels.mhc / dsv4_kernels.triton_mhc with hc_post labelled as the layer's mhc."""

    def __init__(self, impl, sections: Sections):
        self.impl, self.sections = impl, sections

    def __getattr__(self, name):
        fn = getattr(self.impl, name)

        def inner(*a, **k):
            with self.sections.section(f"layer{self.sections.layer}.mhc"):
                return fn(*a, **k)
        return inner


def _stub_ogs(sections: Sections) -> list:
    """Run dsv4_kernels.mxfp4_ogs.ogs_moe's torch glue with triton_kernels' launches stubbed (counted, not run)."""
    import engine.model.moe as moe_mod
    import dsv4_kernels.mxfp4_ogs as ogs_mod

    class Matmul:
        @staticmethod
        def matmul(a, w, bias, *, a_ragged_metadata=None, gather_indx=None, scatter_indx=None, gammas=None,
                   precision_config=None):
            sections.add("triton_kernels.matmul")
            n = w.shape[-1]
            with sections.mute():
                return torch.zeros(a_ragged_metadata, n, dtype=a.dtype, device=a.device)

    class Tensor:
        @staticmethod
        def make_ragged_tensor_metadata(counts, p):
            sections.add("triton_kernels.ragged_metadata", RAGGED_LAUNCHES)
            return p

    def fake_import():
        return Matmul, Tensor, None, lambda **k: None

    def prepare(w1, s1, w2, s2, w3, s3):
        e, inter, half_h = w1.shape
        return ogs_mod.OgsExperts(torch.empty(e, 2 * half_h, 2 * inter), None, torch.empty(e, inter, 2 * half_h),
                                  None, e, 2 * half_h, inter)

    saved = [(ogs_mod, "import_triton_kernels", ogs_mod.import_triton_kernels), (ogs_mod, "prepare", ogs_mod.prepare),
             (ogs_mod, "_scoped", ogs_mod._scoped), (moe_mod.MoEBlock, "takes_ogs", moe_mod.MoEBlock.takes_ogs)]
    ogs_mod.import_triton_kernels = fake_import
    ogs_mod.prepare = prepare
    ogs_mod._scoped = lambda extra, tokens=1: contextlib.nullcontext()
    moe_mod.MoEBlock.takes_ogs = lambda self, x: True
    return saved


@contextlib.contextmanager
def _flashmla_stub():
    """FlashMLA's decode path on the CPU: the path choice forced where the H200 takes it (a one-token-each fp8
    step whose geometry FlashMLA takes), flash_mla's launch stubbed (zeros out) and counted as one."""
    import engine.model.attention as attention_mod
    import dsv4_kernels.gpu as gpu

    real_path, real_import = attention_mod.AttentionBlock._path, gpu.import_flash_mla

    def path(self, quantised, fast_ops, batch, pool, dtype, ring):
        chosen = real_path(self, quantised, fast_ops, batch, pool, dtype, ring)
        entries = [pool.groups[f"kv{self.ratio}"].bind(self.layer)] if self.ratio > 1 else []
        if chosen == "fp8_triton" and attention_mod._one_token_each(batch) and dtype == torch.bfloat16 and \
                not attention_mod.attention_fp8.flashmla_unfit_reason(self.num_heads, ring, entries):
            return "fp8_flashmla"
        return chosen

    class FlashMla:
        @staticmethod
        def get_mla_metadata():
            return [object()]

        @staticmethod
        def flash_mla_with_kvcache(q, *a, **k):
            sink = _ACTIVE[-1] if _ACTIVE else None
            if sink is not None:
                sink.add("flash_mla (stubbed)")
                with sink.mute():
                    return torch.zeros(q.shape[0], q.shape[1], q.shape[2], 512, dtype=q.dtype), None
            return torch.zeros(q.shape[0], q.shape[1], q.shape[2], 512, dtype=q.dtype), None

    attention_mod.AttentionBlock._path, gpu.import_flash_mla = path, lambda: FlashMla
    try:
        yield FlashMla
    finally:
        attention_mod.AttentionBlock._path, gpu.import_flash_mla = real_path, real_import


_ACTIVE: list = []  # the Sections of the count in progress (the FlashMLA stub reports into it)


def build_engine(preset: str, slots: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 prefill_tokens: int = 0):
    """An EngineCore in bucketed decode mode with `slots` requests already decoding (prefill_tokens: an idle
    engine whose steps take that many tokens)."""
    import tempfile

    from engine.loading.load import load_engine
    from engine.loading.make_model import make_model
    from engine.execution.sampling_params import SamplingParams

    model_dir = make_model(preset, tempfile.mkdtemp(prefix="dsv4-count-"), quantize=True)
    engine = load_engine(model_dir, device="cpu", dtype=dtype, max_num_seqs=max(slots, 1),
                         max_cached_tokens=max(8192, 4 * prefill_tokens), kv_cache_dtype=kv_cache_dtype,
                         max_batch_tokens=max(2048, prefill_tokens),
                         keep_mxfp4_experts=True, decode_mode="bucketed", prefix_cache=False)
    if prefill_tokens:
        return engine
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(slots):
        engine.add_request(torch.randint(2, engine.cfg.vocab_size, (20,), generator=g).tolist(), params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # one decode step outside the count (first-use work)
    return engine


@contextlib.contextmanager
def _counting(engine, ogs: bool, fp8: bool):
    """Count every launch inside the block -> yields the Sections whose .counts fill in."""
    if fp8:
        for m in engine.model.moe:  # dequantised on the CPU; the stand-in FP8 path reads this flag
            if isinstance(m.shared[1], torch.Tensor):
                m.shared[1].pow2_act = True
    sections = Sections()
    undo = _patch(sections, ogs, fp8)
    try:
        with AtenCounter(sections):
            yield sections
    finally:
        for obj, attr, real in reversed(undo):
            setattr(obj, attr, real)


def count_step(engine, ogs: bool = True, fp8: bool = True) -> dict[str, collections.Counter]:
    """One decode step of `engine` (bucketed mode) -> {section: Counter(source -> launches)}."""
    with _counting(engine, ogs, fp8) as sections:
        chunks = engine.scheduler.schedule()
        if not all(c.num_tokens == 1 for c in chunks):
            raise ValueError("count_step needs every running request in decode")
        req = [c.request for c in chunks]
        logits = engine.decode_runner.run([r.request_id for r in req], [r.token_slice(c.start, c.start + 1)[0]
                                                                        for r, c in zip(req, chunks)],
                                          [c.start for c in chunks], [r.pages for r in req])
        if logits is None:
            raise ValueError("no decode bucket fits")
    return dict(sections.counts)


def count_prefill_step(engine, tokens: int, ogs: bool = True, fp8: bool = True) -> dict[str, collections.Counter]:
    """One prefill step of a new `tokens`-token request on an idle `engine` -> {section: Counter}."""
    from engine.execution.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.add_request(torch.randint(2, engine.cfg.vocab_size, (tokens,), generator=g).tolist(), params)
    while engine.has_work:  # an identical prefill outside the count (first-use work)
        engine.step()
    engine.add_request(torch.randint(2, engine.cfg.vocab_size, (tokens,), generator=g).tolist(), params)
    with _counting(engine, ogs, fp8) as sections:
        engine.step()
    return dict(sections.counts)


def per_layer(counts: dict[str, collections.Counter]) -> dict[str, dict[str, int]]:
    """{layerN: {mhc, norm, attn, moe, total}} plus prologue / head totals."""
    out: dict[str, dict[str, int]] = {}
    for label, c in counts.items():
        layer, _, part = label.partition(".")
        row = out.setdefault(layer, collections.Counter())
        row[part or "all"] += sum(c.values())
        row["total"] += sum(c.values())
    return {k: dict(v) for k, v in sorted(out.items())}


def by_source(counts: dict[str, collections.Counter], layer: str) -> list[tuple[str, str, int]]:
    rows = []
    for label, c in counts.items():
        if label.startswith(layer + "."):
            rows.extend((label.split(".", 1)[1], src, n) for src, n in c.items())
    return sorted(rows, key=lambda r: (r[0], -r[2], r[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--no-ogs", action="store_true", help="count dsv4_kernels.triton_moe instead of triton_kernels")
    ap.add_argument("--no-fp8", action="store_true", help="count dense projections as one CPU matmul each")
    ap.add_argument("--layer", default=None, help="list this layer's sources (e.g. layer1); default: the CSA layer")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "exact", "fp8"),
                    help="auto = exact on the CPU; fp8: the GPU default's cache formats (fp8_ds_mla + MXFP4 keys)")
    ap.add_argument("--flashmla-stub", action="store_true",
                    help="with fp8 and FlashMLA's geometry (--preset mini_v4): take the decode path the H200 takes "
                         "(engine.model.attention_fp8.flashmla_attend), FlashMLA's own launch stubbed and counted as one")
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="count one prefill step of T tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    engine = build_engine(args.preset, args.slots, getattr(torch, args.dtype), args.kv_cache_dtype, args.prefill)
    if args.prefill:
        counts = count_prefill_step(engine, args.prefill, ogs=not args.no_ogs, fp8=not args.no_fp8)
        what = f"prefill step of {args.prefill} tokens"
    else:
        with _flashmla_stub() if args.flashmla_stub else contextlib.nullcontext() as stub:
            if stub is not None:
                engine.step()  # a decode step on the stubbed path outside the count (first-use work, rope tables)
            counts = count_step(engine, ogs=not args.no_ogs, fp8=not args.no_fp8)
        what = f"decode step, {args.slots} slots"
    table = per_layer(counts)
    layers = [k for k in table if k.startswith("layer")]
    total = sum(r["total"] for r in table.values())
    print(f"{what}, preset {args.preset}: {total} launches; per layer:")
    for k, r in table.items():
        print(f"  {k:9s} " + ", ".join(f"{p} {n}" for p, n in sorted(r.items())))
    print(f"  mean per layer: {sum(table[k]['total'] for k in layers) / max(1, len(layers)):.1f}")
    show = args.layer or (layers[1] if len(layers) > 1 else layers[0])
    print(f"{show} by source:")
    for part, src, n in by_source(counts, show):
        print(f"  {part:5s} {n:4d}  {src}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"total": total, "per_layer": table,
                       "sources": {k: dict(v) for k, v in counts.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
