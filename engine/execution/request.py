"""Request state inside one engine, and the outputs it reports."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.execution.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One step's news about one request (what a streaming API forwards)."""

    request_id: str
    token_id: int | None  # None when the step only advanced the prefill
    logprob: float | None
    finished: bool
    finish_reason: str | None
    prompt_logprobs: tuple  # logprobs of prompt tokens covered by this step's chunk (may be empty)
    cached_tokens: int = 0  # prompt tokens the request got from the prefix cache (same on every event)


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    drafted_tokens: int = 0  # speculative decoding: MTP draft tokens verified for this request
    accepted_tokens: int = 0  # of those, accepted (each saved one target step)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=lambda: [None])
    num_computed: int = 0  # tokens whose KV is in the cache
    pages: dict = field(default_factory=dict)  # cache group -> page ids
    finish_reason: str | None = None
    seed: int | None = None  # the params' seed, or a random one; travels with the request on a hand-off
    prefill_only: bool = False  # stop after the first token and hold the caches for a hand-off
    cached_tokens: int = 0  # prompt tokens whose caches came from the prefix cache (engine.execution.prefix_cache)
    drafted_tokens: int = 0  # speculative decoding (engine.execution.speculative): drafts verified, and accepted
    accepted_tokens: int = 0

    def __post_init__(self):
        if self.seed is None:
            self.seed = (
                self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_tokens[start:end] without building the whole list (decode steps read one token)."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:end] + (self.output[: end - n] if end > n else [])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_total_tokens(self) -> int:
        """Cache positions the request can ever need (its reservation)."""
        return len(self.prompt) + self.params.max_new_tokens

    def note_token(self, tok: int, eos_token_ids) -> None:
        """Set the finish reason the newly appended output token `tok` gives, if any: a stop token (the model's EOS
        unless ignored, or the params' stop ids), else the length limit."""
        p = self.params
        if not p.ignore_eos and (tok in eos_token_ids or tok in p.stop_token_ids):
            self.finish_reason = "stop"
        elif len(self.output) >= p.max_new_tokens:
            self.finish_reason = "length"

    def to_output(self) -> GenerationOutput:
        p = self.params
        return GenerationOutput(
            self.request_id,
            list(self.prompt),
            list(self.output),
            list(self.logprobs) if p.logprobs else None,
            list(self.prompt_logprobs) if p.prompt_logprobs else None,
            self.finish_reason or "length",
            self.cached_tokens,
            self.drafted_tokens,
            self.accepted_tokens,
        )
