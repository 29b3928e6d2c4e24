"""Triton greedy pick (dsv4_kernels/triton_greedy.py): the first argmax and its log-softmax, as torch computes them."""

import pytest
import torch

from dsv4_kernels.triton_greedy import greedy_pick  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def check(logits: torch.Tensor, **kw) -> torch.Tensor:
    both = greedy_pick(logits, **kw)
    assert both.dtype == torch.float64 and both.shape == (2, logits.shape[0]) and both.device == logits.device
    tokens, lps = reference(logits)
    assert torch.equal(both[0].long(), tokens), (both[0], tokens)
    torch.testing.assert_close(both[1], lps.double(), atol=1e-5, rtol=0, equal_nan=True)
    return both


@pytest.mark.parametrize("vocab,block_v", [(5000, 4096), (8193, 1024), (300, 64)])
def test_matches_torch_on_random_rows(vocab, block_v):
    gen = torch.Generator().manual_seed(vocab)
    for n in (1, 3, 17):
        logits = (torch.randn(n, vocab, generator=gen) * 4).to(DEVICE)
        check(logits, block_v=block_v)


def test_first_maximum_wins_across_blocks_and_huge_max():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8193, generator=gen)
    logits[0, 7000] = logits[0, 2100] = 50.0  # tie in blocks 6 and 2 (block_v 1024): the first index wins
    logits[1, 1025] = logits[1, 1030] = logits[1, 8192] = 9.0  # same block, and the last (partial) block
    logits[2, 5] = 1e30  # a huge max: every other exp underflows, log-prob 0
    logits[3] = -1e30
    logits[3, 8192] = 3.0  # the only non-tiny entry sits alone in the partial last block
    both = check(logits.to(DEVICE), block_v=1024)
    assert both[0].tolist() == [2100.0, 1025.0, 5.0, 8192.0]
    assert both[1, 2].item() == 0.0


def test_strided_rows_and_non_finite_rows_follow_torch():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(5, 3000, generator=gen)
    base[1] = float("-inf")  # all -inf: torch picks 0, log-prob NaN
    base[2, 2500] = float("nan")
    base[2, 100] = float("nan")  # first NaN wins, log-prob NaN
    base[3, 1700] = float("inf")  # +inf: picked, log-prob NaN (inf - inf)
    base[4, :2048] = float("-inf")  # -inf blocks contribute nothing to the sum
    wide = torch.zeros(5, 4000)
    wide[:, 500:3500] = base
    both = check(wide.to(DEVICE)[:, 500:3500], block_v=512)  # rows 4000 apart: the row stride is honoured
    assert both[0, 1:4].tolist() == [0.0, 100.0, 1700.0]
    assert torch.isnan(both[1, 1:4]).all() and torch.isfinite(both[1, [0, 4]]).all()


def test_empty_batch_and_bad_inputs():
    assert greedy_pick(torch.empty(0, 100, device=DEVICE)).shape == (2, 0)
    with pytest.raises(ValueError, match="fp32"):
        greedy_pick(torch.zeros(2, 10, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\(10,\)"):
        greedy_pick(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="unit last stride"):
        greedy_pick(torch.zeros(10, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="vocabulary"):
        greedy_pick(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        greedy_pick(torch.zeros(2, 10, device=DEVICE), block_v=100)
