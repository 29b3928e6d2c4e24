"""Bits per byte of a text under a model, through the engine's prompt logprobs (`dsv4 eval perplexity`).

A text is tokenised without specials and cut into windows of at most `window` tokens; each window is one
request `[BOS] + window` with `prompt_logprobs`, so every text token is scored exactly once (the first of each
window given BOS and nothing else: a longer window means more context and a lower figure). bits per byte =
sum of -log p over the text's tokens / ln 2 / the text's UTF-8 bytes: comparable across tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Perplexity:
    texts: int
    bytes: int
    tokens: int
    windows: int
    window: int
    nll_nats: float
    bits_per_byte: float
    nats_per_token: float

    def as_dict(self) -> dict:
        return asdict(self)


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    return [ids[i : i + window] for i in range(0, len(ids), window)]


def perplexity(llm, tokenizer, texts: list[str], window: int = 1024) -> Perplexity:
    """Score `texts` (one engine batch of all their windows); -> totals over all of them."""
    from engine.execution.sampling_params import SamplingParams

    if tokenizer.bos_id is None:
        raise ValueError("the model's tokenizer has no BOS token to start a window with")
    prompts, n_bytes, n_tokens = [], 0, 0
    for text in texts:
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids)
        prompts += [[tokenizer.bos_id, *w] for w in windows_of(ids, window)]
    if not n_bytes:
        raise ValueError("nothing to score: the texts are empty")
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    nll = 0.0
    for out in llm.generate(prompts, params):
        nll -= sum(out.prompt_logprobs[1:])
    return Perplexity(
        texts=len(texts),
        bytes=n_bytes,
        tokens=n_tokens,
        windows=len(prompts),
        window=window,
        nll_nats=nll,
        bits_per_byte=nll / math.log(2) / n_bytes,
        nats_per_token=nll / max(1, n_tokens),
    )
