"""Batched sampling: greedy, temperature, top-k, top-p, with one seeded generator per request.

Masks and the draw are tensor ops over the whole batch; the only per-request work is drawing each
row's uniform noise from a generator seeded by (request seed, output index): torch's CPU generator, or on
CUDA Philox in a Triton kernel keyed by the same seed (dsv4_kernels.triton_sampling; one launch, no host noise).
Counter-based noise makes a seeded request reproducible regardless of which other requests share its batch,
and lets a decode worker continue a request that a prefill worker started with exactly the draws one engine
would make (CUDA engines agree with CUDA engines, CPU engines with CPU engines).
"""

from __future__ import annotations

import torch

from engine.model.batch import to_device_nonblocking
from engine.model.fast_paths import use_triton


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: fp32 [N, V]; top_k: int [N] (0 = off); top_p: fp32 [N] -> logits with dropped entries = -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop |= mass_before >= top_p.unsqueeze(1)  # the best token always survives (mass_before = 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def draw_seed(seed: int, index: int) -> int:
    """Seed of the noise for output token `index` of a request seeded with `seed` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def sampling_inputs(
    temperature: list[float], top_k: list[int], top_p: list[float], draw_seeds: list[int], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' sampling parameters on `device` -> (fp32 temperature, int64 top_k, fp32 top_p, int64 draw seeds),
    all [N], from one host-to-device copy that does not wait for the device (three blocking uploads each
    synchronised the stream before: the host then launched the sampling kernels only once the forward had
    ended). The floats travel as fp64 bits in the one int64 tensor and round to fp32 on the device exactly as
    they would on the host; draw seeds are < 2**63."""
    floats = torch.tensor([temperature, top_p], dtype=torch.float64).view(torch.int64)
    packed = to_device_nonblocking(torch.cat([floats, torch.tensor([top_k, draw_seeds], dtype=torch.int64)]), device)
    return (packed[0].view(torch.float64).float(), packed[2], packed[1].view(torch.float64).float(), packed[3])


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    draw_seeds: list[int] | torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """logits: fp32 [N, V] -> int64 [N]. Rows with temperature 0 are argmax; others use the exponential race
    argmax(p / E), E ~ Exp(1) drawn from a generator seeded with the row's draw seed (equivalent to
    sampling from p). draw_seeds: a list, or int64 [N] on the logits' device (sampling_inputs).
    filtered: False when no row asks for top-k or top-p < 1 (the caller knows from the host): the full
    distribution is sampled without apply_top_k_top_p's sort over the vocabulary (the default OpenAI request:
    temperature 1, top_p 1), which also keeps the far tail that the fp32 cumulative mass can round past 1.
    No device-to-host sync: an all-greedy batch is the caller's to short-cut (it knows from the host)."""
    greedy = temperature == 0
    tokens = logits.argmax(dim=-1)
    sampled = exponential_race(filtered_probs(logits, temperature, top_k, top_p, filtered), draw_seeds)
    return torch.where(greedy, tokens, sampled)


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, filtered: bool = True
) -> torch.Tensor:
    """fp32 [N, V] -> the distribution each row samples from: softmax(logits / temperature) after top-k / top-p
    (`sample`'s; rows with temperature 0 use temperature 1 here: the caller takes their argmax). Speculative
    decoding's rejection sampler compares these for the target and the draft (engine.execution.spec_sampling)."""
    temp = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    scaled = logits / temp.unsqueeze(1)
    return (apply_top_k_top_p(scaled, top_k, top_p) if filtered else scaled).softmax(dim=-1)


def exp_noise_rows(draw_seeds: list[int] | torch.Tensor, vocab: int, device) -> torch.Tensor:
    """Exp(1) noise fp32 [N, vocab] on `device`, row i a function of draw seed i alone (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and use_triton(device):
        # Philox on the device (dsv4_kernels.triton_sampling): per-row host generators cost ~80 ms a step at batch 64
        # and V4's vocabulary. Still a function of the draw seed alone, but another stream than the CPU's.
        from dsv4_kernels.triton_sampling import exp_noise  # imports triton: only on this path

        seeds = draw_seeds if isinstance(draw_seeds, torch.Tensor) else torch.tensor(draw_seeds, dtype=torch.int64)
        if seeds.device.type == "cpu":  # (a blocking upload would wait for the queued work)
            seeds = to_device_nonblocking(seeds, device)
        return exp_noise(seeds.to(device), vocab)
    host_seeds = draw_seeds.tolist() if isinstance(draw_seeds, torch.Tensor) else draw_seeds
    noise = (
        torch.stack([torch.rand(vocab, generator=torch.Generator().manual_seed(s)) for s in host_seeds])
        if len(host_seeds)
        else torch.empty(0, vocab)
    )
    return -torch.log(noise.clamp_min(1e-20)).to(device)


def exponential_race(probs: torch.Tensor, draw_seeds: list[int] | torch.Tensor) -> torch.Tensor:
    """probs: fp32 [N, V] (each row's weights, normalised or not) -> int64 [N]: argmax(probs / E), E ~ Exp(1)
    keyed by the row's draw seed: a draw from the normalised row."""
    return (probs / exp_noise_rows(draw_seeds, probs.shape[-1], probs.device)).argmax(dim=-1)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """logits: fp32 [N, V] -> fp64 [2, N]: each row's argmax token (exact in fp64) and its log-probability,
    as one tensor so the host reads both in one copy (and a CUDA graph can hold the whole computation).
    On CUDA one fused two-stage Triton reduction (dsv4_kernels.triton_greedy) instead of argmax + log_softmax."""
    if logits.is_cuda and use_triton(logits.device):
        from dsv4_kernels.triton_greedy import greedy_pick as triton_greedy_pick  # imports triton: only on this path

        return triton_greedy_pick(logits)
    tokens = logits.argmax(dim=-1)
    lps = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.stack([tokens.double(), lps.double()])


def draw_requests(logits: torch.Tensor, requests: list, ahead: int = 0) -> torch.Tensor:
    """Sample one token per row of fp32 logits [N, V] for `requests` (`sample`, no host sync)
    -> fp64 [2, N]: token ids (exact: < 2**53) and their log-probs. Each draw is keyed by the request's seed
    and the index of the token drawn: its output length, plus `ahead` tokens still unread on the device."""
    params = [r.params for r in requests]
    tokens = sample(
        logits,
        *sampling_inputs(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [draw_seed(r.seed, len(r.output) + ahead) for r in requests],
            logits.device,
        ),
        filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
    )
    lps = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.stack([tokens.double(), lps.double()])
