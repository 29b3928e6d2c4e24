"""`Job`: one validated OpenAI request as the ingress runs it: what the router needs (prompt ids, sampling
parameters, request id, deadline) and what the response is built from as events arrive (tokens, logprobs,
finish and stop reasons, cached tokens); the response builders of service.openai_protocol read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.execution.sampling_params import SamplingParams
from service import openai_protocol as P
from service.text_stream import TextStream


@dataclass
class Job:
    """One validated request: what the router needs, and what the response is built from."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    arrival: float  # time.monotonic() at arrival
    deadline: float  # loop.time() by which it must be over
    prompt_text: str = ""  # for echo
    prompt_logprobs: list = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache

    def usage(self) -> P.UsageInfo:
        n, m = len(self.prompt_ids), len(self.token_ids)
        return P.UsageInfo(
            prompt_tokens=n,
            completion_tokens=m,
            total_tokens=n + m,
            prompt_tokens_details=P.PromptTokensDetails(cached_tokens=self.cached_tokens),
        )
