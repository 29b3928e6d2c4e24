"""The peer: transformers' `DeepseekV4ForCausalLM` on the same slice, decode steps timed like the engine's.

bf16, its own random init with the hash table randomised, eager attention (the only one V4 supports),
timed once per experts implementation: "default" is what transformers picks by itself (`grouped_mm` on
CUDA in 5.2x: one grouped GEMM per projection), "eager" its Python loop over experts. Each variant gets a
fresh DynamicCache from a chunked prefill, then decode steps are timed.
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.timing import Clock, median, sync


def transformers_info() -> tuple[str, bool]:
    try:
        import transformers
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})", False
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except Exception:  # noqa: BLE001
        return f"{transformers.__version__} (no DeepseekV4ForCausalLM)", False
    return transformers.__version__, True


def bench_transformers(
    raw: dict,
    device,
    dtype,
    batch: int,
    ctx: int,
    chunk: int,
    warmup: int,
    steps: int,
    clock: Clock,
    seed: int,
    experts: tuple[str, ...] = ("default", "eager"),
) -> list[dict]:
    """Decode steps of transformers' DeepseekV4ForCausalLM at `batch` x `ctx`, once per experts
    implementation (see the module doc). -> one dict per variant (or with "skip")."""
    g = torch.Generator().manual_seed(seed)
    t = time.perf_counter()
    model = _build_peer(raw, device, dtype, seed, g)
    build_s = time.perf_counter() - t
    ids = torch.randint(2, raw["vocab_size"], (batch, ctx), generator=g).to(device)
    results = []
    for impl in experts:
        row: dict = {"experts": impl, "build_s": build_s}
        try:
            row["experts"] = _select_experts(model, impl)
            left = clock.left()
            if results and left < 60:
                raise TimeoutError(f"time budget ({left:.0f} s left)")
            row.update(_time_decode(model, ids, raw["vocab_size"], chunk, warmup, steps, clock, g, device))
            print(
                f"transformers experts={row['experts']} b={batch} ctx={ctx}: {row['step_ms']:.1f} ms/step "
                f"(model built {build_s:.0f} s, prefill {row['prefill_s']:.0f} s)",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            row["skip"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print(f"transformers experts={impl}: FAILED {row['skip']}", flush=True)
        finally:
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        results.append(row)
    del model
    return results


def _build_peer(raw: dict, device, dtype, seed: int, g: torch.Generator):
    """The model in eval mode, with a random hash table drawn from `g` (transformers inits it to zeros:
    every token -> expert 0)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "quantization_config"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=dtype)
    model.eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                v, k = buf.shape
                ids = torch.rand(v, model.num_experts, generator=g).argsort(dim=1)[:, :k]
                buf.copy_(ids.to(device=buf.device, dtype=buf.dtype))
    sync(device)
    return model


def _select_experts(model, impl: str) -> str:
    """Switch the experts implementation ("default": leave transformers' choice); -> its label."""
    if impl != "default":
        if not hasattr(model, "set_experts_implementation"):
            raise RuntimeError("this transformers has no set_experts_implementation")
        model.set_experts_implementation(impl)
    label = str(getattr(model.config, "_experts_implementation", None) or impl)
    return label + " (transformers' default)" if impl == "default" else label


def _time_decode(
    model, ids: torch.Tensor, vocab: int, chunk: int, warmup: int, steps: int, clock: Clock, g: torch.Generator, device
) -> dict:
    """Chunked prefill of `ids` into a fresh cache, then timed decode steps -> prefill_s, step_ms, n."""
    batch, ctx = ids.shape
    cache, out = None, None
    try:
        t = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, ctx, chunk):
                out = model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                if clock.left() < 20:
                    raise TimeoutError(f"prefill reached {s + chunk}/{ctx} tokens when the budget ran out")
            sync(device)
            prefill_s = time.perf_counter() - t
            times = []
            for i in range(warmup + steps):
                if i >= warmup + 1 and clock.left() < 2 * median(times) + 10:
                    break
                tok = torch.randint(2, vocab, (batch, 1), generator=g).to(device)
                sync(device)
                t = time.perf_counter()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                sync(device)
                times.append(time.perf_counter() - t)
        timed = times[warmup:] or times[-1:]
        return {"prefill_s": prefill_s, "step_ms": median(timed) * 1e3, "n": len(timed)}
    finally:
        cache = out = None  # the traceback of a failure must not keep the cache alive
