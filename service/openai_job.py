"""`Job`: one validated OpenAI request as the ingress runs it: what the router needs (prompt ids, sampling
parameters, request id, deadline) and what the response is built from as events arrive (tokens, logprobs,
finish and stop reasons, cached tokens); the response builders of service.openai_protocol read it. `JobEvents`
takes the router client's events into it one by one, each giving the piece a response renders."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.execution.sampling_params import SamplingParams
from service import openai_protocol as P
from service.text_stream import TextStream

Piece = tuple[int | None, float | None, str]  # one event's token id, logprob and text delta


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


class JobEvents:
    """A job's events (the router client's `StreamEvent`s) taken into it one by one (`take` -> the event's piece).
    A plain call a token, not a generator layer between the events and the response: every layer a token passes is
    a hop on the replica's loop (service.openai_app reads the events itself)."""

    def __init__(self, job: Job, eos_ids: frozenset[int], ttft, itl):
        """ttft, itl: the time-to-first-token and inter-token histograms (engine.telemetry.batched_histogram)."""
        self.job, self.ttft, self.itl = job, ttft, itl
        self.stop_tokens = eos_ids | set(job.params.stop_token_ids)
        self._last: float | None = None  # time.monotonic() of the last token

    def take(self, ev) -> Piece:
        """Fill in the job from one event -> (token id, logprob, text delta); the job's finish_reason is set once
        the event ends the output (a finish, or a stop string in the text)."""
        job = self.job
        job.prompt_logprobs.extend(ev.prompt_logprobs)
        job.cached_tokens = max(job.cached_tokens, ev.cached_tokens)
        if ev.token_id is not None:
            self._count(ev.token_id, ev.logprob)
        # A stop token ends the output but is not part of its text (vLLM), unless asked for.
        by_token = ev.finished and ev.finish_reason == "stop" and ev.token_id in self.stop_tokens
        shown = None if by_token and not job.text.include_stop else ev.token_id
        delta = job.text.add(shown, ev.finished)
        if ev.finished:
            job.finish_reason = ev.finish_reason or "stop"
            if by_token and ev.token_id in job.params.stop_token_ids:
                job.stop_reason = ev.token_id
        if job.text.stop_hit is not None:  # stop string: done, and the engine stops with us
            job.finish_reason, job.stop_reason = "stop", job.text.stop_hit
        return ev.token_id, ev.logprob, delta

    def take_token(self, token_id: int, logprob: float | None) -> Piece:
        """`take` of a plain decode token given as its values (no finish, no prompt logprobs, no cached count: the
        token lane's, service.token_lane), without an event object."""
        self._count(token_id, logprob)
        job = self.job
        delta = job.text.add(token_id, False)
        if job.text.stop_hit is not None:
            job.finish_reason, job.stop_reason = "stop", job.text.stop_hit
        return token_id, logprob, delta

    def _count(self, token_id: int, logprob: float | None) -> None:
        job, now, last = self.job, time.monotonic(), self._last
        (self.ttft if last is None else self.itl).observe(now - (job.arrival if last is None else last), now)
        self._last = now
        job.token_ids.append(token_id)
        job.logprobs.append(logprob)

    def flush(self) -> None:
        """The histograms' batched observations into the shared metrics (at the request's end)."""
        self.ttft.flush()
        self.itl.flush()
