"""The fused prologue on verify steps (dsv4_kernels.triton_decode_prologue with `queries` rows a slot, through
engine.model.verify_batch.derive_verify_batch) derives exactly the StepBatch of the torch derivation
(derive_verify_batch_reference): every tensor, element for element, same dtype and shape, on random page tables,
starts (some crossing SWA ring wraps and compressor window boundaries), request lengths (slots with fewer real rows
than `queries`) and padding slots; with the indexer and without, several sliding windows, ratios and page sizes."""

from __future__ import annotations

import pytest
import torch

from engine.model.batch import StepBatch
from engine.model.cache import CacheConfig, CachePool
from engine.model.decode_batch import BlockTables, DecodeShape
from engine.model.verify_batch import VerifyInputs, VerifyShape, derive_verify_batch, derive_verify_batch_reference
from tests.engine.test_decode_prologue import _assert_same
from tests.engine.test_speculative import model as model  # noqa: F401 (the module fixture: a tiny model with MTP)
from tests.support.triton_env import DEVICE  # sets TRITON_INTERPRET first; may skip

TINY = {"compress_ratios": [0, 4, 128, 4], "sliding_window": 16}  # the tiny preset's: CSA (indexer) and HCA


def _pool(page_tokens: int, kv_cache_dtype: str = "auto", max_tokens: int = 4096, **overrides) -> CachePool:
    """A tiny-preset pool whose scratch pages are not page 0 (so a kernel that wrote page 0 for them would differ)."""
    from engine.loading.make_model import preset_config
    from engine.model.config import ModelConfig

    raw = preset_config("tiny")
    raw.update(overrides)
    pool = CachePool(
        ModelConfig.from_dict(raw),
        CacheConfig(max_requests=8, max_tokens=max_tokens, page_tokens=page_tokens, kv_cache_dtype=kv_cache_dtype),
        torch.float32,
        DEVICE,
    )
    pool.scratch_pages = {name: 1 + i for i, name in enumerate(pool.groups)}  # only the tables and indices see them
    return pool


def _edge_starts(pool: CachePool, q: int, context: int) -> list[int]:
    """Starts whose q rows cross an SWA ring wrap, a ratio-4 and a ratio-r window end (r the largest ratio)."""
    window, ratio = pool.cfg.sliding_window, max(pool.cfg.ratios, default=4)
    edges = [0, window - 1, 2 * window - q + 1, 3, ratio - 2, 2 * ratio - 1, context - q]
    return [min(max(e, 0), context - q) for e in edges]


def _inputs(
    pool: CachePool, tables: BlockTables, shape: VerifyShape, n: int, seed: int
) -> tuple[torch.Tensor, list[int]]:
    """n requests of 1..queries tokens from random or edge starts (fresh pages each), the rest padding slots ->
    (packed on DEVICE, the requests' token counts)."""
    g = torch.Generator().manual_seed(seed)
    q, context = shape.queries, shape.decode.context
    starts = torch.randint(0, context - q + 1, (n,), generator=g).tolist()
    edges = _edge_starts(pool, q, context)
    pick = torch.randperm(len(edges), generator=g).tolist()
    for b in range(min(n, len(edges) - 2)):  # most slots on an edge, the rest random
        starts[b] = edges[pick[b]]
    counts = torch.randint(1, q + 1, (n,), generator=g).tolist()
    counts[:2] = [q, 1][:n]  # one full slot, one of a single row (q - 1 padding rows), the rest random
    page_tables = []
    for start in starts:
        pages: dict = {}
        pool.grow(pages, start + q)
        page_tables.append(pages)
    rows = tables.rows_for([f"r{seed}.{b}" for b in range(n)], page_tables)
    tokens = [torch.randint(0, pool.cfg.vocab_size, (c,), generator=g).tolist() for c in counts]
    packed = VerifyInputs.make(tokens, starts, rows, shape, tables.pad_row).packed
    return packed.to(DEVICE), counts


def _fused(monkeypatch, pool, tables, packed, shape, swa_only=False) -> StepBatch:
    import engine.model.verify_batch as verify_batch

    monkeypatch.setattr(verify_batch, "use_triton", lambda device: True)
    return derive_verify_batch(pool, tables, packed, shape, swa_only)


def _check(monkeypatch, pool: CachePool, shape: VerifyShape, n: int, seed: int, swa_only: bool = False) -> None:
    tables = BlockTables(pool, 8, max(1024, shape.decode.context), DEVICE)  # bucket tables cut from wider rows
    packed, counts = _inputs(pool, tables, shape, n, seed)
    if n < shape.decode.slots or min(counts, default=1) < shape.queries:  # the padding this case covers is there
        assert (packed[2] == tables.pad_row).any()
    got = _fused(monkeypatch, pool, tables, packed, shape, swa_only)
    assert (shape.decode, shape.queries, swa_only) in tables.verify_layouts  # the fused path ran, cached per bucket
    _assert_same(got, derive_verify_batch_reference(pool, tables, packed, shape, swa_only))


@pytest.mark.parametrize(
    "page_tokens,kv,overrides,slots,n,q,context",
    [
        (16, "auto", TINY, 4, 3, 2, 256),  # CSA + HCA + indexer, a padding slot
        (64, "fp8", TINY, 3, 3, 4, 384),  # fp8 SWA pages (64 rows a 16-row window), no padding slot
        (16, "auto", {"compress_ratios": [0, 128, 0, 128], "sliding_window": 40}, 5, 4, 3, 300),  # no indexer
        (32, "auto", {"compress_ratios": [0, 8, 16, 0], "sliding_window": 24}, 2, 1, 4, 200),  # other ratios
        (16, "auto", TINY, 2, 2, 1, 128),  # queries 1 (the reference applies its padding mask there too)
    ],
)
def test_fused_verify_prologue_equals_reference(monkeypatch, page_tokens, kv, overrides, slots, n, q, context):
    pool = _pool(page_tokens, kv, **overrides)
    _check(monkeypatch, pool, VerifyShape(DecodeShape(slots, context), q), n, seed=slots * 10 + q)


@pytest.mark.parametrize("q", [1, 3])
def test_fused_mtp_batch_equals_reference(monkeypatch, q):
    """swa_only (the MTP pass and chain steps): no plans nor visible entries, the same SWA indices."""
    _check(monkeypatch, _pool(16, "auto", **TINY), VerifyShape(DecodeShape(3, 192), q), 2, seed=q, swa_only=True)


def test_padding_only_verify_batch(monkeypatch):
    """The capture batch (engine.execution.verify_graphs): every slot padding, every row writing scratch pages."""
    _check(monkeypatch, _pool(16, "auto", **TINY), VerifyShape(DecodeShape(2, 128), 3), 0, seed=1)


def test_layout_refuses_a_bucket_wider_than_the_tables():
    """A bucket past the BlockTables' context would read its page tables from the next group's columns."""
    from engine.model.decode_batch import PrologueLayout

    pool = _pool(16, "auto", **TINY)
    tables = BlockTables(pool, 4, 512, DEVICE)
    PrologueLayout(pool, tables, DecodeShape(2, 512), 3, tables.pad_row)
    with pytest.raises(ValueError, match="wider page tables"):
        PrologueLayout(pool, tables, DecodeShape(2, 768), 3, tables.pad_row)


@pytest.mark.parametrize("max_programs,q", [(2, 2), (6, 3), (64, 2)])
def test_wide_verify_sections_split_over_programs(monkeypatch, max_programs, q):
    """Sections wider than a block split over programs (chunks_per_section: NC a row): a row's SWA sources (3
    blocks) over its NC programs, a slot's visible rows (625 entries: 5 blocks) over its q rows' q * NC programs.
    (2, 2): one program a row, walking several blocks; (6, 3): 2 a row, 6 a slot, still walking; 64: a block each."""
    from dsv4_kernels import triton_decode_prologue as k

    monkeypatch.setattr(k, "MAX_PROGRAMS_PER_SECTION", max_programs)
    pool = _pool(16, "auto", compress_ratios=[0, 4, 4, 0], sliding_window=300)
    shape = VerifyShape(DecodeShape(1, 2500), q)
    assert k.chunks_per_section(shape.rows, 625) == min(max_programs // q, 5)
    _check(monkeypatch, pool, shape, 1, seed=4)


def test_fused_verify_step_logits_equal_reference(monkeypatch):
    """Engine level: a verify step's forward on the fused batch gives the reference batch's logits and cache bytes
    (the fused tensors are views of one flat buffer: other strides than the reference's)."""
    if DEVICE != "cpu":
        pytest.skip("the gpu-marked test below runs this on CUDA")
    _step_agrees(monkeypatch, _tiny_engine("cpu"), VerifyShape(DecodeShape(2, 256), 3), exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the compiled prologue at larger buckets")
@pytest.mark.parametrize("q,swa_only", [(2, False), (4, False), (4, True)])
def test_fused_verify_prologue_equals_reference_on_cuda(monkeypatch, q, swa_only):
    """The compiled kernel: 8 slots (6 requests) of q rows at a 4096 context, 128-row windows (mini_v4's)."""
    pool = _pool(16, "auto", max_tokens=65536, compress_ratios=[0, 4, 128, 4], sliding_window=128)
    _check(monkeypatch, pool, VerifyShape(DecodeShape(8, 4096), q), 6, seed=q, swa_only=swa_only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: a verify step on CUDA")
def test_fused_verify_step_logits_equal_reference_on_cuda(monkeypatch):
    """As test_fused_verify_step_logits_equal_reference, on CUDA (fp32; tolerances: a GPU reduction may order its
    sums differently between two launches)."""
    _step_agrees(monkeypatch, _tiny_engine("cuda"), VerifyShape(DecodeShape(4, 512), 4), exact=False)


def _tiny_engine(device: str):
    from engine.execution.runner import EngineCore
    from engine.loading.make_model import default_model_dir
    from engine.loading.weights import load_weights
    from engine.model.config import ModelConfig

    model_dir = default_model_dir()
    cfg = ModelConfig.from_model_dir(model_dir)
    return EngineCore(
        cfg,
        load_weights(model_dir, cfg, dtype=torch.float32, device=device),
        device=device,
        dtype=torch.float32,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16),
        decode_mode="bucketed",
    )


def _step_agrees(monkeypatch, engine, shape: VerifyShape, exact: bool) -> None:
    """One verify step on random cache contents, from the same start: the same logits and cache bytes after."""
    import engine.model.verify_batch as verify_batch

    runner = engine.decode_runner
    pool, tables, model = engine.pool, runner.block_tables, runner.model
    packed, _ = _inputs(pool, tables, shape, shape.decode.slots - 1, seed=9)
    packed = packed.to(model.device)
    g = torch.Generator(device=model.device).manual_seed(3)
    for group in pool.groups.values():
        group.tensor.copy_(torch.randn(group.tensor.shape, generator=g, device=model.device).to(group.tensor.dtype))
    before = {name: group.tensor.clone() for name, group in pool.groups.items()}

    def step(batch: StepBatch) -> tuple[torch.Tensor, dict]:
        for name, group in pool.groups.items():
            group.tensor.copy_(before[name])
        logits = model.logits(model.forward_streams(batch, pool))
        return logits, {name: group.tensor.clone() for name, group in pool.groups.items()}

    with torch.inference_mode():
        want, want_cache = step(derive_verify_batch_reference(pool, tables, packed, shape))
        monkeypatch.setattr(verify_batch, "use_triton", lambda device: True)
        got, got_cache = step(derive_verify_batch(pool, tables, packed, shape))
    assert shape.decode in {key[0] for key in tables.verify_layouts}  # the fused path ran
    assert torch.isfinite(want).all()
    assert any(not torch.equal(want_cache[name], before[name]) for name in before)  # the step wrote the caches
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    for name in before:
        torch.testing.assert_close(got_cache[name], want_cache[name], **tol, msg=name)


def test_speculation_on_fused_verify_prologue_equals_non_speculative(monkeypatch, model):
    """The whole bucketed speculative path (verify steps, the MTP pass and chain steps: swa_only batches) on the
    fused prologue, the rest of the model on its CPU paths: the greedy output is the non-speculative one, with forced
    drafts (accepted runs and rejections)."""
    if DEVICE != "cpu":  # CPU engines with the prologue forced through the interpreter
        pytest.skip(
            "interpreter test; on a GPU the graphs engine runs this prologue (tests/engine/test_spec_bucketed.py)"
        )
    import engine.model.verify_batch as verify_batch
    from engine.execution.sampling_params import SamplingParams
    from tests.engine.test_spec_bucketed import _engine
    from tests.engine.test_speculative import _forced, _prompts, _run

    prompts = _prompts(3, [5, 33], model[0].vocab_size)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14)]
    base = _run(_engine(model, 0, mode="eager"), prompts, params)
    _forced(monkeypatch, {tuple(p): o.token_ids for p, o in zip(prompts, base)}, 0.3, seed=2)
    monkeypatch.setattr(verify_batch, "use_triton", lambda device: True)
    spec = _engine(model, 2)
    assert [o.token_ids for o in _run(spec, prompts, params)] == [o.token_ids for o in base]
    layouts = spec.speculator.verify.decode.block_tables.verify_layouts
    assert {(q, swa_only) for _, q, swa_only in layouts} >= {(3, False), (3, True), (1, True)}  # verify, pass, chain
    assert (
        spec.speculator.stats["accepted"] > 0 and spec.speculator.stats["accepted"] < spec.speculator.stats["drafted"]
    )
