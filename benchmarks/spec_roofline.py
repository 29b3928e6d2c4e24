"""The weight-read roofline of MTP speculative decoding on V4-Flash (`python -m benchmarks.spec_roofline`; no device).

Why: a decode step at small and medium batch is bound by the bytes it reads (weights above all), and speculation
changes those bytes in three ways: the verify step routes K + 1 tokens a request, so it reads more distinct
experts; each draft step reads the MTP layer and the whole bf16 LM head (1.06 GB on V4-Flash, shared with the
target: no cache holds it between steps); and a step emits 1 + a + ... + a^K tokens a request at per-draft
acceptance a. The bound on tokens/s per user against the one-token step is then

    bound = E[tokens a step] x bytes(one-token step) / (bytes(verify step) + K x bytes(draft step)),

time taken as proportional to bytes (benchmarks/slice/roofline.py: production formats, FP8 dense, MXFP4 experts,
fp8_ds_mla cache rows). Distinct experts a layer for n routed tokens, E experts, top-k: under independent routing
E (1 - (1 - k/E)^n) (the verify's K + 1 tokens of a request route like strangers: the most experts, the low
bound), or with a request's K + 1 tokens sharing their experts (the fewest: the high bound). Real routing of
consecutive tokens lies between. The MTP layer is counted as one SWA-only V4 block (score routing) + its
e/h projection + the head.
What it shows: the 4-layer slice the GPU benchmarks run (benchmarks/spec.py) carries the full head on 4 layers, so
a draft costs about as much as the layers themselves there; the full 43-layer model is the number a user sees.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.slice.roofline import cache_bytes, weight_bytes
from benchmarks.slice.slice_model import flash_slice_config
from engine.model.config import ModelConfig
from service.benchmarks_md import write_section

FLASH_LAYERS = 43
FLASH_HASH_LAYERS = 3


@dataclass(frozen=True)
class Bound:
    layers: int
    batch: int
    k: int
    acceptance: float
    tokens_per_step: float
    one_gb: float
    verify_gb: tuple[float, float]  # (independent routing, shared routing)
    draft_gb: float  # K draft steps

    @property
    def bounds(self) -> tuple[float, float]:
        """(low: independent routing, high: shared routing) tokens/s per user vs the one-token step."""
        return tuple(self.tokens_per_step * self.one_gb / (v + self.draft_gb) for v in self.verify_gb)  # type: ignore[return-value]


def config(layers: int) -> ModelConfig:
    raw = flash_slice_config(layers)
    raw["num_hash_layers"] = min(FLASH_HASH_LAYERS, layers) if layers == FLASH_LAYERS else raw["num_hash_layers"]
    return ModelConfig.from_dict(raw)


def distinct(cfg: ModelConfig, tokens: float) -> float:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def step_gb(cfg: ModelConfig, rows: int, routed_tokens: float, batch: int, context: int) -> float:
    """A step of `rows` token rows whose experts are those of `routed_tokens` independent tokens, `batch` requests
    each reading its cache at `context`."""
    touched = [distinct(cfg, routed_tokens)] * cfg.num_layers
    return (weight_bytes(cfg, rows, touched, "prod") + batch * cache_bytes(cfg, context, "prod")) / 1e9


def draft_gb(batch: int, rows: int, context: int) -> float:
    """One MTP step over `rows` token rows of `batch` requests: an SWA-only block (the slice's layer 0 without hash
    routing) + e/h projection (2D -> D, FP8) + the bf16 head (in weight_bytes of the one-layer model)."""
    raw = flash_slice_config(1)
    raw["num_hash_layers"] = 0
    cfg = ModelConfig.from_dict(raw)
    eh = 2 * cfg.hidden_size * cfg.hidden_size  # FP8 bytes
    return step_gb(cfg, rows, rows, batch, context) + eh / 1e9


def bound(layers: int, batch: int, k: int, acceptance: float, context: int) -> Bound:
    cfg = config(layers)
    rows = batch * (k + 1)
    one = step_gb(cfg, batch, batch, batch, context)
    verify = (step_gb(cfg, rows, rows, batch, context), step_gb(cfg, rows, batch, batch, context))
    draft = draft_gb(batch, rows, context) + (k - 1) * draft_gb(batch, batch, context)  # the pass, then the chain
    tokens = sum(acceptance**i for i in range(k + 1))
    return Bound(layers, batch, k, acceptance, tokens, one, verify, draft)


def render(args, bounds: list[Bound]) -> str:
    lines = [
        "## Speculative decoding's weight-read roofline on V4-Flash (`python -m benchmarks.spec_roofline`)",
        "",
        f"Command: `python -m benchmarks.spec_roofline --write`. Analytic (no device): bytes a step reads in the "
        f"release's formats (benchmarks/slice/roofline.py), context {args.context}; bound = tokens a step x "
        "bytes(one-token step) / (bytes(verify step) + bytes(K draft steps)), the tokens/s per user speculation can "
        "reach over the one-token step where steps are bound by reading memory. low: a request's K + 1 verify tokens "
        "route independently (most experts); high: they share their experts (fewest). Drafts: one SWA-only MTP block "
        "+ e/h projection + the 1.06 GB bf16 head each (benchmarks/spec_roofline.py docstring).",
        "",
        "| layers | batch | K | acceptance | tokens/step | one-token GB | verify GB (low / high) | drafts GB "
        "| bound x non-spec (low - high) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in bounds:
        lo, hi = b.bounds
        lines.append(
            f"| {b.layers} | {b.batch} | {b.k} | {b.acceptance:.1f} | {b.tokens_per_step:.2f} | {b.one_gb:.2f} | "
            f"{b.verify_gb[0]:.2f} / {b.verify_gb[1]:.2f} | {b.draft_gb:.2f} | {lo:.2f} - {hi:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, FLASH_LAYERS])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    args = ap.parse_args(argv)
    bounds = [
        bound(n, b, k, a, args.context) for n in args.layers for b in args.batches for k in args.ks for a in args.rates
    ]
    section = render(args, bounds)
    print(section)
    if args.out:
        Path(args.out).write_text(section)
    if args.write:
        write_section("spec_roofline", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
