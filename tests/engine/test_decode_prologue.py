"""The fused decode prologue (dsv4_kernels.triton_decode_prologue through engine.model.decode_batch.PrologueLayout) derives
exactly the StepBatch of the torch derivation (derive_decode_batch_reference): every tensor, element for element,
same dtype and shape, on random page tables and positions (window edges, position 0, padding rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.loading.make_model import preset_config  # noqa: E402
from engine.model.batch import StepBatch  # noqa: E402
from engine.model.cache import CacheConfig, CachePool  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.decode_batch import (  # noqa: E402
    BlockTables,
    DecodeInputs,
    DecodeShape,
    PrologueLayout,
    derive_decode_batch,
    derive_decode_batch_reference,
)
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def _pool(preset: str, kv_cache_dtype: str = "auto", **overrides) -> CachePool:
    raw = preset_config(preset)
    raw.update(overrides)
    cfg = ModelConfig.from_dict(raw)
    return CachePool(
        cfg, CacheConfig(max_requests=8, max_tokens=8192, kv_cache_dtype=kv_cache_dtype), torch.float32, DEVICE
    )


def _flatten(batch: StepBatch, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        key = f"{prefix}{f.name}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            for name, item in v.items():
                out.update(
                    _flatten(item, f"{key}.{name}.") if dataclasses.is_dataclass(item) else {f"{key}.{name}": item}
                )
        elif dataclasses.is_dataclass(v):
            out.update(_flatten(v, key + "."))
        elif v is not None:
            out[key] = v
    return out


def _inputs(pool: CachePool, tables: BlockTables, shape: DecodeShape, n: int, seed: int) -> DecodeInputs:
    """n requests with random pages and positions (some on window edges), the rest padding."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, shape.context, (n,), generator=g).tolist()
    edges = [0, shape.context - 1, 127, 128, 3, 4, 255]
    positions[: len(edges)] = [min(p, shape.context - 1) for p in edges[:n]]
    page_tables = []
    for p in positions:
        pages = {}
        pool.grow(pages, p + 1)
        page_tables.append(pages)
    rows = tables.rows_for([f"r{i}" for i in range(n)], page_tables)
    tokens = torch.randint(0, pool.cfg.vocab_size, (n,), generator=g).tolist()
    return DecodeInputs(DecodeInputs.make(tokens, positions, rows, shape, tables.pad_row).packed.to(DEVICE))


def _assert_same(got: StepBatch, want: StepBatch) -> None:
    a, b = _flatten(got), _flatten(want)
    assert a.keys() == b.keys()
    for key in b:
        if isinstance(b[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize(
    "preset,kv_cache_dtype,overrides",
    [
        ("tiny", "auto", {}),
        ("tiny", "fp8", {}),
        ("mini_v4", "auto", {}),
        ("mini_v4", "fp8", {}),
        ("tiny", "auto", {"sliding_window": 40}),  # a window that is no power of two
    ],
)
@pytest.mark.parametrize("slots,n,context", [(1, 1, 256), (8, 5, 384), (4, 4, 1000)])
def test_fused_prologue_equals_reference(preset, kv_cache_dtype, overrides, slots, n, context):
    shape = DecodeShape(slots, context)
    for seed in range(2):
        pool = _pool(preset, kv_cache_dtype, **overrides)
        tables = BlockTables(pool, 8, 1024, DEVICE)
        inputs = _inputs(pool, tables, shape, n, seed=seed + slots)
        _assert_same(
            PrologueLayout(pool, tables, shape).derive(inputs.packed),
            derive_decode_batch_reference(pool, tables, inputs, shape),
        )


@pytest.mark.parametrize("max_programs", [1, 2, 64])
def test_wide_sections_split_over_programs(monkeypatch, max_programs):
    """Sections wider than a block are walked by several programs a row (chunks_per_section; blocks chunk,
    chunk + NC, ...): 1, 2 (programs that each take several blocks) and 64 (one block a program) agree."""
    from dsv4_kernels import triton_decode_prologue as k

    monkeypatch.setattr(k, "MAX_PROGRAMS_PER_SECTION", max_programs)
    pool = _pool("mini_v4", sliding_window=600)
    tables = BlockTables(pool, 8, 1024, DEVICE)
    shape = DecodeShape(1, 1000)
    layout = PrologueLayout(pool, tables, shape)
    assert layout.max_width > 4 * k.BLOCK  # the window's sources: several blocks
    assert k.chunks_per_section(1, layout.max_width) == min(max_programs, -(-layout.max_width // k.BLOCK))
    inputs = _inputs(pool, tables, shape, 1, seed=3)
    _assert_same(layout.derive(inputs.packed), derive_decode_batch_reference(pool, tables, inputs, shape))


def test_padding_only_batch(monkeypatch):
    pool = _pool("tiny")
    tables = BlockTables(pool, 4, 512, DEVICE)
    shape = DecodeShape(4, 512)
    inputs = DecodeInputs(DecodeInputs.make([], [], [], shape, tables.pad_row).packed.to(DEVICE))
    monkeypatch.setenv("DSV4_TRITON", "1")
    fused = derive_decode_batch(pool, tables, inputs, shape)
    assert shape in tables.layouts  # took the fused path (descriptors cached per bucket)
    _assert_same(fused, derive_decode_batch_reference(pool, tables, inputs, shape))


def test_stacked_position_ropes_equal_each_rope():
    """engine.model.model's one-pass main + compress RoPE equals each Rope on its own, bit for bit."""
    from engine.model.config import RopeSpec
    from engine.model.model import DeepseekV4Model, Rope

    model = DeepseekV4Model.__new__(DeepseekV4Model)
    model.device, model._rope_stack = torch.device("cpu"), None
    model.ropes = {
        "main": Rope(RopeSpec(10000.0, 64), "cpu"),
        "compress": Rope(
            RopeSpec(160000.0, 64, yarn_factor=16.0, original_max_position=4096, attention_factor=1.2772588722239781),
            "cpu",
        ),
    }
    positions = torch.tensor([0, 1, 7, 4095, 4096, 65535, 1 << 20], dtype=torch.long)
    main, comp = model._position_ropes(positions)
    for got, want in ((main, model.ropes["main"](positions)), (comp, model.ropes["compress"](positions))):
        for a, b in zip(got, want):
            assert a.is_contiguous() and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bucketed_decode_with_fused_prologue_matches_eager(monkeypatch, kv_cache_dtype):
    """The whole bucketed decode path on the fused prologue (the rest of the model on its CPU paths): the same
    tokens and log-probs as content-sized eager steps, across HCA and ratio-4 window boundaries."""
    if DEVICE != "cpu":  # the engines here are CPU ones with the prologue forced through the interpreter
        pytest.skip("interpreter test; on a GPU the graphs engine runs this prologue (tests/engine/test_gpu_engine.py)")
    import engine.model.decode_batch as decode_batch
    from engine.loading.make_model import default_model_dir
    from tests.engine.test_decode_buckets import _engine, _prompts, _run_until

    monkeypatch.setattr(decode_batch, "use_triton", lambda device: True)
    model_dir = default_model_dir()
    eager = _engine(model_dir, "eager", kv_cache_dtype=kv_cache_dtype)
    bucketed = _engine(model_dir, "bucketed", kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts([125, 131, 9], eager.cfg.vocab_size, seed=5)
    _, want = _run_until(eager, prompts, new_tokens=12, steps=10)
    _, got = _run_until(bucketed, prompts, new_tokens=12, steps=10)
    assert bucketed.decode_runner.steps >= 8 and bucketed.decode_runner.block_tables.layouts
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    tol = 1e-5 if kv_cache_dtype == "auto" else 1e-3
    assert all(abs(a - b) <= tol for (_, _, a), (_, _, b) in zip(got, want) if a is not None)


def test_each_bucket_is_checked_once_against_the_reference(monkeypatch):
    """engine.model.prologue_check: a bucket's first fused derivation is compared with the torch reference, later
    ones are the kernel's alone."""
    import engine.model.decode_batch as decode_batch
    import engine.model.prologue_check as check

    monkeypatch.setattr(check, "_off_reason", None)
    monkeypatch.setattr(decode_batch, "use_triton", lambda device: True)
    reference = decode_batch.derive_decode_batch_reference
    calls = []
    monkeypatch.setattr(decode_batch, "derive_decode_batch_reference", lambda *a: calls.append(1) or reference(*a))
    pool = _pool("tiny")
    tables = BlockTables(pool, 8, 1024, DEVICE)
    shape = DecodeShape(4, 384)
    for seed in range(3):
        inputs = _inputs(pool, tables, shape, 2, seed=seed)
        _assert_same(derive_decode_batch(pool, tables, inputs, shape), reference(pool, tables, inputs, shape))
    assert len(calls) == 1 and tables.layouts[shape].checked and check.fused_prologue_off() is None


def test_a_fused_prologue_that_disagrees_is_turned_off(monkeypatch, caplog):
    """A kernel that writes one wrong element (here the SWA ring row of request 0) is caught on the bucket's first
    use: an ERROR names the tensor, that step gets the reference's batch, and every later step (any bucket) too,
    without calling the kernel again."""
    import engine.model.decode_batch as decode_batch
    import engine.model.prologue_check as check

    monkeypatch.setattr(check, "_off_reason", None)
    monkeypatch.setattr(decode_batch, "use_triton", lambda device: True)
    real = PrologueLayout.derive
    kernel_calls = []

    def wrong(self, packed):
        kernel_calls.append(1)
        batch = real(self, packed)
        batch.swa_write.ring_row[0] += 1
        return batch

    monkeypatch.setattr(PrologueLayout, "derive", wrong)
    pool = _pool("tiny")
    tables = BlockTables(pool, 8, 1024, DEVICE)
    shape = DecodeShape(4, 384)
    inputs = _inputs(pool, tables, shape, 3, seed=5)
    with caplog.at_level("ERROR", logger="dsv4.engine"):
        got = derive_decode_batch(pool, tables, inputs, shape)
    assert "swa_write.ring_row: 1 of 4 elements differ" in (check.fused_prologue_off() or "")
    assert any("disagrees" in r.getMessage() for r in caplog.records)
    _assert_same(got, derive_decode_batch_reference(pool, tables, inputs, shape))
    for other in (shape, DecodeShape(2, 256)):
        later = _inputs(pool, tables, other, 2, seed=6)
        _assert_same(
            derive_decode_batch(pool, tables, later, other), derive_decode_batch_reference(pool, tables, later, other)
        )
    assert len(kernel_calls) == 1
