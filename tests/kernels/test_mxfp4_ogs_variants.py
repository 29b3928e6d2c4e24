"""dsv4_kernels.mxfp4_ogs.variant_tokens: one token count per class of launch variant of triton_kernels' MoE matmuls
(what engine.execution.warmup's MoE sweep runs). CPU: the classes themselves; the GPU test in test_mxfp4_ogs.py checks
that after the sweep no step size compiles a new variant."""

import pytest

from dsv4_kernels.mxfp4_ogs import PREFILL_TOKENS, _ragged_blocks, variant_key, variant_tokens
from engine.execution.warmup import prompt_ladder


def test_every_step_size_shares_its_class_with_a_swept_one():
    swept = variant_tokens(4096, 16, 4)
    keys = {variant_key(t, 16, 4) for t in swept}
    assert len(keys) == len(swept) and swept == sorted(swept) and swept[0] == 1
    assert all(variant_key(t, 16, 4) in keys for t in range(1, 4097))
    assert max(swept) <= 4096 and variant_tokens(0, 16, 4) == []


def test_the_ladder_misses_row_block_classes_the_sweep_covers():
    """The H200 service run compiled `_matmul_..._128x256x128x1` mid-request after a ladder of powers of two and
    their odd neighbours: at 16 experts top-4 a step of 516-547 tokens gives a row-block count of 32 at
    block_m 128 (divisible by 16), which no ladder step meets."""
    assert _ragged_blocks(16, 520 * 4, 128) == 32 and _ragged_blocks(16, 512 * 4, 128) == 31
    ladder = {variant_key(t, 16, 4) for t in prompt_ladder(4096, 10**6)}
    assert variant_key(520, 16, 4) not in ladder
    assert variant_key(520, 16, 4) in {variant_key(t, 16, 4) for t in variant_tokens(4096, 16, 4)}


def test_prefill_constraints_and_sort_path_split_classes():
    assert variant_key(PREFILL_TOKENS - 1, 256, 6)[0] != variant_key(PREFILL_TOKENS, 256, 6)[0]
    big = variant_tokens(8192, 256, 6)
    assert PREFILL_TOKENS in big and len(big) < 400  # V4-Flash: a few hundred calls, not 8192


@pytest.mark.gpu
def test_row_blocks_match_triton_kernels():
    from dsv4_kernels import gpu

    if not gpu.has_triton_kernels():  # (it also installs the triton 3.6 shims triton_kernels imports need)
        pytest.skip("GPU only: triton_kernels needs a CUDA GPU with tokenspeed-triton-kernels (the gpu extra)")
    import triton_kernels.tensor_details.ragged_tensor as tk

    for e in (1, 16, 256):
        for p in (1, 5, 16, 17, 255, 256, 2049, 16384):
            for b in (16, 32, 64, 128):
                assert _ragged_blocks(e, p, b) == tk.RaggedTensorMetadata.n_blocks(e, p, b), (e, p, b)
