"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, stream chunks, errors).

Field names and defaults follow vLLM's OpenAI server (itself following OpenAI's API), so existing clients
and vLLM-aware tools work unchanged:
- completions: `max_tokens` 16, `temperature` 1.0, `top_p` 1.0; chat: `max_tokens` / `max_completion_tokens`
  unset = whatever fits the context;
- `top_k` None, 0 or -1 = off (vLLM spells "off" -1; the engine spells it 0);
- `n` must be 1 and `best_of` 1 or unset (one sequence per request is all the engine runs);
- `logprobs` (completions) and `top_logprobs` (chat) are 0..5. The engine reports only the log-prob of the
  sampled token, so every `top_logprobs` entry holds that one token (vLLM's shape for logprobs=0) rather
  than the k most likely ones;
- vLLM extensions: `top_k`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
  `skip_special_tokens`, `return_token_ids` (each choice carries `token_ids` and the prompt's ids come back
  as `prompt_token_ids`), and for chat `add_generation_prompt`, `chat_template`, `chat_template_kwargs`.
Fields the engine cannot honour (penalties, logit_bias, suffix, tools) are declared so that a non-default
value is a 400 naming the field instead of being silently ignored; unknown fields are ignored (and logged
by the server), as vLLM does.
Range checks of sampling values live in `engine.sampling_params.SamplingParams`, the one place that knows
what the engine accepts; the server turns its ValueError into a 400.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_LOGPROBS = 5  # OpenAI's limit for completions' `logprobs`


class _Model(BaseModel):
    # extra="allow": unknown request fields are kept in `model_extra` so the server can log them;
    # allow_inf_nan=False: a NaN or infinite sampling value is a 400, not a poisoned engine request.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False  # one extra chunk with `usage` (and no choices) before [DONE]


class _SamplingFields(_Model):
    """Fields shared by completions and chat."""

    model: str | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = False

    @field_validator("n")
    @classmethod
    def _one_sequence(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; use 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str]:
        s = self.stop
        stops = [s] if isinstance(s, str) else list(s or [])
        return [x for x in stops if x]  # "" would match everywhere; OpenAI ignores it too


class CompletionRequest(_SamplingFields):
    # str | token ids, or a batch of one of either (batches of more than one are rejected by the server).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v


# ---- responses ----------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # the first prompt token's is None
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # sampled token only (see top)


class CompletionResponseChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM)
    token_ids: list[int] | None = None  # return_token_ids
    prompt_token_ids: list[int] | None = None  # return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM puts it on the response for chat)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dsv4"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {...}}` (what the openai client reads the message from)."""

    error: ErrorInfo
