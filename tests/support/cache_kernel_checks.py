"""Shared assertions of the cache-writing kernel tests (SWA insert, indexer query, compressor entries).

The kernels round and quantise exactly as geometry's pack functions, so their bytes are compared in two ways:
- byte for byte against `pack(values the kernel itself returns)` (isolates the quantiser: must be exact);
- against `pack(reference values)`, where a value one bf16 / fp32 ulp away from the reference (fp32 sums in
  another order, rsqrt.approx on the GPU) may land on the other side of a rounding boundary: every decoded
  value must be within one quantisation step of the reference's, and almost all bytes must be equal.
"""

import torch

from dsv4_kernels import geometry as g
from tests.support import numerics

SENTINEL = 0xA5


def assert_close(out, expected, dtype):
    """atol relative to the output's scale (rounding before a rotation or the Hadamard rotation carries one
    ulp of the largest value into outputs near zero)."""
    numerics.assert_close(out, expected, dtype, scaled=True)


def sentinel_cache(shape, device) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=torch.uint8, device=device)


def expected_cache(cache_shape, layout, rows, packed, device) -> torch.Tensor:
    """A sentinel cache with only `packed` written at `rows` (-1 skipped), through geometry.write_rows."""
    expected = sentinel_cache(cache_shape, device)
    blocks = expected.view(-1, layout.block_bytes()) if cache_shape[1] < layout.block_bytes() else expected
    g.write_rows(blocks, layout, rows, packed)
    return expected


def quant_step(layout, rows: torch.Tensor) -> torch.Tensor:
    """float32 [N, width]: an upper bound of one quantisation step of every decoded value of packed rows."""
    values = g.unpack_rows(layout, rows).abs()
    if isinstance(layout, g.Fp8DsMlaLayout):
        scales = 2.0 ** (rows[:, layout.token_stride : layout.token_stride + layout.num_scales].float() - 127)
        step = torch.cat(
            [
                scales.repeat_interleave(64, 1) * 32.0,  # e4m3: <= 2**5 at the top binade
                values[:, layout.nope_dim :] * 2**-7,
            ],
            dim=1,
        )  # RoPE: bf16 ulp
        return torch.maximum(step, values * 2**-3)
    if layout.fmt == "mxfp4":
        scales = 2.0 ** (rows[:, layout.value_bytes :].float() - 127)
        return scales.repeat_interleave(32, 1) * 2.0  # the widest e2m1 gap (4 -> 6)
    scales = rows[:, layout.value_bytes :].contiguous().view(torch.float32)
    return scales.repeat_interleave(128, 1) * 32.0


def assert_bytes_near(layout, got: torch.Tensor, expected: torch.Tensor, min_equal: float = 0.99) -> None:
    """Packed rows from the kernel vs from the reference values: decoded within one step, bytes mostly equal."""
    assert got.shape == expected.shape and got.dtype == torch.uint8
    equal = (got == expected).float().mean().item()
    assert equal >= min_equal, f"only {equal:.4f} of the bytes equal the reference's"
    diff = (g.unpack_rows(layout, got) - g.unpack_rows(layout, expected)).abs()
    step = torch.maximum(quant_step(layout, got), quant_step(layout, expected))
    assert bool((diff <= step).all()), f"decoded values differ by more than one step: max {diff.max().item()}"
