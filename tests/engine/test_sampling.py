"""Batched sampler: masks and seeded draws."""

import torch

from engine.execution.sampling import apply_top_k_top_p, draw_seed, sample


def test_top_k_top_p_masks():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    out = apply_top_k_top_p(logits, torch.tensor([5, 0, 0]), torch.tensor([1.0, 0.5, 1.0]))
    assert (out[0] > float("-inf")).sum() == 5
    assert torch.equal(out[0].topk(5).indices.sort().values, logits[0].topk(5).indices.sort().values)
    kept = out[1] > float("-inf")
    probs = logits[1].softmax(-1)
    assert probs[kept].sum() >= 0.5 and probs[kept].sum() - probs[kept].min() < 0.5  # smallest nucleus
    assert torch.equal(out[2], logits[2])


def test_seeded_sampling_is_reproducible_per_row():
    torch.manual_seed(1)
    logits = torch.randn(2, 100)
    t = torch.tensor([1.0, 1.0])
    k = torch.tensor([0, 0])
    p = torch.tensor([1.0, 1.0])

    def draw(seeds):
        return [sample(logits, t, k, p, [draw_seed(s, i) for s in seeds]).tolist() for i in range(20)]

    assert draw([1, 2]) == draw([1, 2])
    assert draw([1, 2]) != draw([3, 4])
    greedy = sample(logits, torch.zeros(2), k, p, [0, 0])
    assert torch.equal(greedy, logits.argmax(-1))


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [
        sample(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), [draw_seed(0, i)]).item()
        for i in range(3000)
    ]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_greedy_pick_is_argmax_and_its_logprob():
    """engine.execution.sampling.greedy_pick (what the decode graph computes for greedy requests): one fp64 [2, N]
    tensor of argmax tokens (exact) and their log-probs, equal to the separate torch ops."""
    from engine.execution.sampling import greedy_pick

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(7)) * 4
    both = greedy_pick(logits)
    assert both.dtype == torch.float64 and both.shape == (2, 5)
    tokens = logits.argmax(dim=-1)
    assert torch.equal(both[0].long(), tokens)
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert torch.equal(both[1].float(), want)


def test_sampling_inputs_match_separate_uploads():
    """sampling_inputs packs the rows' parameters into one upload: the same fp32 / int64 values as one tensor
    each (floats rounded once, to fp32), draw seeds up to 2**63 - 1 exact."""
    from engine.execution.sampling import sampling_inputs

    temps, top_ks, top_ps = [0.0, 0.7, 1.3, 1e-3], [0, 5, 40, 1], [1.0, 0.9, 0.123456789, 0.5]
    seeds = [draw_seed(s, i) for s, i in ((0, 0), (7, 3), (2**40, 9))] + [2**63 - 1]
    t, k, p, s = sampling_inputs(temps, top_ks, top_ps, seeds, "cpu")
    assert t.dtype == p.dtype == torch.float32 and k.dtype == s.dtype == torch.int64
    assert torch.equal(t, torch.tensor(temps, dtype=torch.float32)) and torch.equal(k, torch.tensor(top_ks))
    assert torch.equal(p, torch.tensor(top_ps, dtype=torch.float32)) and s.tolist() == seeds
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert sample(logits, t, k, p, s).tolist() == sample(logits, t, k, p, seeds).tolist()


def test_unfiltered_sampling_equals_filtering_with_no_limits():
    """filtered=False (no row asks for top-k / top-p < 1) skips the vocabulary sort and samples what the filter
    with no limits samples: the same draws on logits whose cumulative mass stays below 1 in fp32, and the
    distribution itself (test_sampling_follows_distribution's three tokens) either way."""
    logits = torch.randn(6, 400, generator=torch.Generator().manual_seed(2)) * 3
    t, k, p = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 2.0]), torch.zeros(6, dtype=torch.long), torch.ones(6)
    for i in range(30):
        seeds = [draw_seed(s, i) for s in range(6)]
        assert torch.equal(sample(logits, t, k, p, seeds, filtered=False), sample(logits, t, k, p, seeds))
    small = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [
        sample(
            small, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), [draw_seed(0, i)], filtered=False
        ).item()
        for i in range(3000)
    ]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
