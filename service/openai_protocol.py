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
Fields the engine cannot honour (penalties, logit_bias, suffix) are declared so that a non-default
value is a 400 naming the field instead of being silently ignored; unknown fields are ignored (and logged
by the server), as vLLM does.
Range checks of sampling values live in `engine.execution.sampling_params.SamplingParams`, the one place that knows
what the engine accepts; the server turns its ValueError into a 400.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.sse_chunks import TEXT_MARK, TextEvents

MAX_LOGPROBS = 5  # OpenAI's limit for completions' `logprobs`
MAX_STOP = 16  # stop strings per request (OpenAI allows 4): each costs a scan of the output per token
MAX_STOP_CHARS = 1024  # per stop string (the stream holds back len - 1 characters)
MAX_STOP_TOKEN_IDS = 256
CHAT_ROLES = (
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "latest_reminder",
)  # DeepSeek V4's own role (service/chat_encoding.py)


class _Model(BaseModel):
    # extra="allow": unknown request fields are kept in `model_extra` so the server can log them;
    # allow_inf_nan=False: a NaN or infinite sampling value is a 400, not a poisoned engine request.
    # strict=True: "5" is not 5 and "yes" is not true (a client sending those has a bug worth a 400).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


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

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are supported, got {len(stops)}")
        long = [len(x) for x in stops if len(x) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {long[0]}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _bounded_stop_ids(cls, v):
        if v is not None and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported, got {len(v)}")
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

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(CHAT_ROLES)}")
        return v


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # DeepSeek V4 encoding only (service/chat_v4.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # V4 thinking mode: "high" or "max"
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v


@functools.lru_cache(maxsize=16)  # templates can come with requests: keep a few compiled ones
def _compile_template(source: str):
    from jinja2 import ext

    from service.template_sandbox import LimitedSandbox

    def raise_exception(message):
        raise ValueError(message)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: time.strftime(f))
    return env.from_string(source)


def render_chat(
    req: ChatCompletionRequest, template: str, bos_token: str, eos_token: str, budget_s: float | None = None
) -> str:
    """The prompt text of a chat request (the contract of transformers' apply_chat_template, in a
    sandbox); ValueError for non-text content parts, jinja2 errors for a broken template, TemplateTimeout
    when `budget_s` (seconds; None = no budget) runs out."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            content = "\n".join(p.text or "" for p in content)  # vLLM joins text parts the same way
        messages.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})

    def render():
        return _compile_template(template).render(
            messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **(req.chat_template_kwargs or {}),
        )

    if budget_s is None:
        return render()
    from service.template_sandbox import run_with_budget

    return run_with_budget(render, budget_s)  # compiling counts too: the source came with the request


# ---- responses ----------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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


class ToolCallFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a JSON object, as text


class ToolCallOut(BaseModel):
    """A tool call of a response message."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class DeltaToolCall(BaseModel):
    """One tool call's piece of a stream delta (OpenAI's incremental shape: `index` says which call)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # V4 thinking mode
    tool_calls: list[ToolCallOut] | None = None


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
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    default = "BadRequestError" if 400 <= status < 500 else "InternalServerError"
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, default), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


# ---- rendering a job ----------------------------------------------------------------------------
# `job` is a `service.openai_job.Job`: prompt_ids / prompt_text / prompt_logprobs, token_ids / logprobs,
# text.sent (the output text so far), finish_reason, stop_reason, usage(). `token_str(id)` names a token.
# The engine reports only the sampled token's log-prob, so each `top_logprobs` entry holds that token.


def completion_logprobs(token_str, ids, lps, offset: int = 0) -> CompletionLogProbs:
    tokens = [token_str(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return CompletionLogProbs(
        text_offset=offsets,
        token_logprobs=list(lps),
        tokens=tokens,
        top_logprobs=[None if lp is None else {s: lp} for s, lp in zip(tokens, lps)],
    )


def chat_logprobs(token_str, ids, lps, top: int | None) -> ChatCompletionLogProbs:
    content = []
    for t, lp in zip(ids, lps):
        s = token_str(t)
        entry = ChatLogProb(token=s, logprob=lp, bytes=list(s.encode()))
        content.append(ChatLogProbsContent(**entry.model_dump(), top_logprobs=[entry] if top else []))
    return ChatCompletionLogProbs(content=content)


class CompletionRender:
    """/v1/completions bodies: the whole response, or stream chunks (echoed prompt first, then one chunk per
    token that has something to say, the finish reason on the last one, then the usage if asked)."""

    def __init__(self, req: CompletionRequest, model: str, token_str):
        self.req, self.model, self.token_str, self.offset = req, model, token_str, 0
        self.texts = TextEvents(self._text_chunk)  # text-only chunks, pre-rendered

    def response(self, job) -> CompletionResponse:
        req = self.req
        ids, lps, text = job.token_ids, job.logprobs, job.text.sent
        if req.echo:
            ids, lps, text = job.prompt_ids + ids, job.prompt_logprobs + lps, job.prompt_text + text
        choice = CompletionResponseChoice(
            text=text,
            finish_reason=job.finish_reason,
            stop_reason=job.stop_reason,
            logprobs=completion_logprobs(self.token_str, ids, lps) if req.logprobs is not None else None,
            token_ids=job.token_ids if req.return_token_ids else None,
            prompt_token_ids=job.prompt_ids if req.return_token_ids else None,
        )
        return CompletionResponse(id=job.rid, model=self.model, choices=[choice], usage=job.usage())

    def _text_chunk(self, job, _field: str) -> CompletionStreamResponse:
        return self._chunk(job, TEXT_MARK)

    def _chunk(self, job, text: str, **kw) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=job.rid, model=self.model, choices=[CompletionResponseStreamChoice(text=text, **kw)]
        )

    def head(self, job) -> list:
        req = self.req
        prompt_ids = job.prompt_ids if req.return_token_ids else None
        if not req.echo:
            return [self._chunk(job, "", prompt_token_ids=prompt_ids)] if prompt_ids else []
        lps = (
            completion_logprobs(self.token_str, job.prompt_ids, job.prompt_logprobs)
            if req.logprobs is not None
            else None
        )
        self.offset = len(job.prompt_text)
        return [self._chunk(job, job.prompt_text, logprobs=lps, prompt_token_ids=prompt_ids)]

    def piece(self, job, token_id: int | None, logprob: float | None, delta: str):
        req, done = self.req, job.finish_reason is not None
        with_token = token_id is not None and (req.logprobs is not None or req.return_token_ids)
        if not (delta or with_token or done):
            return None  # text held back and nothing else to say
        if not (with_token or done or job.stop_reason):  # text only: the pre-rendered event, bytes
            self.offset += len(delta)
            return self.texts(job, "text", delta)
        lps = None
        if req.logprobs is not None and token_id is not None:
            lps = completion_logprobs(self.token_str, [token_id], [logprob], self.offset)
        self.offset += len(delta)
        return self._chunk(
            job,
            delta,
            logprobs=lps,
            finish_reason=job.finish_reason,
            stop_reason=job.stop_reason,
            token_ids=[token_id] if req.return_token_ids and token_id is not None else None,
        )

    def tail(self, job) -> list:
        opts = self.req.stream_options
        if opts and opts.include_usage:  # OpenAI's shape: no choices, just the usage
            return [CompletionStreamResponse(id=job.rid, model=self.model, choices=[], usage=job.usage())]
        return []


class ChatRender:
    """/v1/chat/completions bodies; stream: the assistant role first, then content deltas."""

    def __init__(self, req: ChatCompletionRequest, model: str, token_str):
        self.req, self.model, self.token_str = req, model, token_str
        # chunks whose delta has one text field only (content; reasoning_content in V4 chat), pre-rendered
        self.texts = TextEvents(self._text_chunk)

    def response(self, job) -> ChatCompletionResponse:
        req = self.req
        choice = ChatCompletionResponseChoice(
            message=ChatResponseMessage(content=job.text.sent),
            finish_reason=job.finish_reason,
            stop_reason=job.stop_reason,
            token_ids=job.token_ids if req.return_token_ids else None,
            logprobs=chat_logprobs(self.token_str, job.token_ids, job.logprobs, req.top_logprobs)
            if req.logprobs
            else None,
        )
        return ChatCompletionResponse(
            id=job.rid,
            model=self.model,
            choices=[choice],
            usage=job.usage(),
            prompt_token_ids=job.prompt_ids if req.return_token_ids else None,
        )

    def _text_chunk(self, job, field: str) -> ChatCompletionStreamResponse:
        return self._chunk(job, DeltaMessage.model_validate({field: TEXT_MARK}))

    def _chunk(self, job, delta: DeltaMessage, **kw) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=job.rid, model=self.model, choices=[ChatCompletionResponseStreamChoice(delta=delta, **kw)]
        )

    def head(self, job) -> list:
        c = self._chunk(job, DeltaMessage(role="assistant", content=""))
        c.prompt_token_ids = job.prompt_ids if self.req.return_token_ids else None
        return [c]

    def piece(self, job, token_id: int | None, logprob: float | None, delta: str):
        req, done = self.req, job.finish_reason is not None
        with_token = token_id is not None and (req.logprobs or req.return_token_ids)
        if not (delta or with_token or done):
            return None
        if not (with_token or done or job.stop_reason):  # text only: the pre-rendered event, bytes
            return self.texts(job, "content", delta)
        lps = (
            chat_logprobs(self.token_str, [token_id], [logprob], req.top_logprobs)
            if req.logprobs and token_id is not None
            else None
        )
        return self._chunk(
            job,
            DeltaMessage(content=delta),
            logprobs=lps,
            finish_reason=job.finish_reason,
            stop_reason=job.stop_reason,
            token_ids=[token_id] if req.return_token_ids and token_id is not None else None,
        )

    def tail(self, job) -> list:
        opts = self.req.stream_options
        if opts and opts.include_usage:
            return [ChatCompletionStreamResponse(id=job.rid, model=self.model, choices=[], usage=job.usage())]
        return []
