"""The OpenAI-compatible HTTP front end: FastAPI routes over the gRPC router.

`build_app(router_addr, model_dir, model_name)` returns a self-contained app (plain uvicorn, tests). Ray
Serve needs the app object at import time, so `make_app(get_server)` builds routes that look their
`OpenAIServer` up per request: `service.serve_ingress` passes `current_server` (a module function, pickled by
reference, so Ray's cloudpickle round trip keeps it) and the replica's constructor calls `configure(...)`.

Flow: validate all that can be checked here (prompt empty / out of vocabulary / too long, sampling values,
text or chat without a tokenizer) for a precise 400 before any work is placed; then run the router's
events through `TextStream` (incremental detokenization, stop strings) on one path for streaming and
non-streaming, so both return the same tokens and text. Router errors map to INVALID_ARGUMENT 400,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, else 500. Each request has a deadline
(`request_timeout_s`, here and as the gRPC deadline), so nothing hangs. Leaving a router stream early
(stop string, client disconnect, timeout) cancels the gRPC call: the engine aborts it and frees its pages.
Beside it: the error answers (service.api_errors), one request's state (service.openai_job.Job) and the SSE /
disconnect plumbing (service.http_stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_kernels.settings import settings
from engine.execution.sampling_params import SamplingParams
from engine.loading.model_source import local_model_dir
from engine.loading.tokenizer import load_tokenizer
from engine.model.config import ModelConfig
from engine.telemetry import metrics
from engine.telemetry.batched_histogram import BatchedHistogram
from router.client import AsyncRouterClient, RouterError
from service import chat_v4
from service import openai_protocol as P
from service.api_errors import APIError, validation_error
from service.http_stream import ClientGone, SSEResponse, sse, unless_disconnected
from service.ingress_guard import GuardMiddleware, IngressOptions, Offloader, lone_surrogate
from service.openai_job import Job, JobEvents, Piece
from service.stream_deadline import StreamDeadline
from service.template_sandbox import TemplateTimeout
from service.text_stream import TextStream
from service.token_lane import TokenLane

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 300.0
_INT64 = 1 << 63


class OpenAIServer:
    """Per-process state behind the routes: model facts, tokenizer, and the router client."""

    def __init__(
        self,
        router_addr: str,
        model_dir: str,
        model_name: str,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        health_timeout_s: float = 5.0,
        options: IngressOptions | None = None,
        client_factory: Callable[[], AsyncRouterClient] | None = None,
    ):
        """client_factory: what runs requests instead of the router's Generate stream (a `DirectClient`: the
        router places, this process streams from the decode worker); called in the serving loop."""
        self.router_addr, self.model_dir, self.model_name = router_addr, model_dir, model_name
        # observed every token: the labelled children looked up once, counted here and added in batches (at each
        # request's end, at most a second apart during a stream: engine.telemetry.batched_histogram says why)
        self.ttft_histogram = BatchedHistogram(metrics.TTFT.labels(model_name))
        self.itl_histogram = BatchedHistogram(metrics.ITL.labels(model_name))
        self.client_factory = client_factory
        self.options = options or IngressOptions()
        self.offload = Offloader(self.options.offload_threads)
        self.request_timeout_s, self.health_timeout_s = request_timeout_s, health_timeout_s
        # A Hugging Face repo id, or a cache snapshot path of another node: fetch the config and tokenizer only.
        model_dir = local_model_dir(model_dir, with_weights=False) or model_dir
        cfg = ModelConfig.from_model_dir(model_dir)
        self.vocab_size = cfg.vocab_size
        # The workers' --max-model-len when set: defaults (max_tokens) and the 400 for a too-long request follow it.
        self.max_model_len = min(cfg.max_position_embeddings, self.options.max_model_len or cfg.max_position_embeddings)
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.tokenizer = load_tokenizer(model_dir)  # None: token-id prompts only
        # A token covers at most this many characters: longer text can never fit the context, and is refused
        # before the tokenizer spends seconds on it.
        longest = max(map(len, self.tokenizer.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.v4_chat = chat_v4.uses_v4_encoding(model_dir, self.tokenizer)  # DeepSeek V4's own chat format
        self._client: AsyncRouterClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> AsyncRouterClient:
        # grpc.aio channels belong to the loop that creates them: create it lazily in the serving loop.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = (
                self.client_factory()
                if self.client_factory is not None
                else AsyncRouterClient(
                    self.router_addr, timeout_s=self.request_timeout_s, token=self.options.router_token
                )
            )
            self._client_loop = loop
        return self._client

    def count(self, status: str) -> None:
        metrics.REQUESTS.labels(self.model_name, status).inc()

    # ---- validation -----------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(
                404, f"The model `{model}` does not exist (this server serves `{self.model_name}`).", "model"
            )

    def _check_chars(self, text: str, what: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{what} of {len(text)} characters cannot fit this model's maximum context length "
                f"of {self.max_model_len} tokens",
                what,
            )

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{what}: token id {bad[0]} is out of vocabulary (vocab_size {self.vocab_size})", what)

    def _prompt(self, prompt) -> tuple[list[int], str]:
        """-> (token ids, prompt text for echo)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400, f"batched prompts are not supported: got {len(prompt)}, send one per request", "prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(
                    400, f"model `{self.model_name}` has no tokenizer: send the prompt as token ids", "prompt"
                )
            if not prompt:
                raise APIError(400, "prompt is empty: at least one token is required", "prompt")
            self._check_chars(prompt, "prompt")
            return self.tokenizer.encode(prompt), prompt
        ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty: at least one token is required", "prompt")
        self._check_ids(ids, "prompt")
        return ids, self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    def _v4_prompt(self, req: P.ChatCompletionRequest) -> chat_v4.V4Prompt | None:
        """The V4 encoding of the request, or None when a chat template applies instead."""
        if not self.v4_chat or req.chat_template:
            if req.tools:
                raise APIError(400, "tools need the DeepSeek V4 chat encoding (no chat template)", "tools")
            return None
        try:
            return chat_v4.render(req)
        except ValueError as e:  # the message starts with the offending field ("tools[0] must ...")
            field = str(e).split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
            param = (
                field if field in ("tools", "tool_choice", "reasoning_effort", "chat_template_kwargs") else "messages"
            )
            raise APIError(400, str(e), param) from None

    def _chat_prompt(self, req: P.ChatCompletionRequest, v4: chat_v4.V4Prompt | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise APIError(
                400,
                f"model `{self.model_name}` has no tokenizer, which chat needs: use /v1/completions with token ids",
                "messages",
            )
        if v4 is not None:  # the V4 prompt starts with BOS itself
            return list(tok.tokenizer.encode(v4.text, add_special_tokens=False).ids)
        if req.chat_template and not self.options.allow_request_templates:
            raise APIError(
                400,
                "request-supplied chat templates are disabled on this server (start it with "
                "--allow-request-chat-template to enable them)",
                "chat_template",
            )
        template = req.chat_template or tok.chat_template
        if not template:
            raise APIError(
                400, f"model `{self.model_name}` has no chat template; pass `chat_template`", "chat_template"
            )
        bos, eos = (tok.tokenizer.id_to_token(i) if i is not None else "" for i in (tok.bos_id, tok.eos_id))
        try:
            text = P.render_chat(req, template, bos, eos, self.options.template_budget_s if req.chat_template else None)
        except TemplateTimeout as e:
            raise APIError(400, str(e), "chat_template") from None
        except Exception as e:  # non-text content, a template error or raise_exception(): the request's fault
            raise APIError(400, f"chat template failed: {type(e).__name__}: {e}", "messages") from None
        self._check_chars(text, "the rendered chat prompt")
        # The template writes BOS itself; encoding with special tokens would double it (as vLLM does).
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise APIError(400, "prompt is empty: the chat template produced no tokens", "messages")
        return list(ids)

    def _params(
        self, req, prompt_len: int, max_tokens: int | None, logprobs: bool, prompt_logprobs: bool
    ) -> SamplingParams:
        top_k = req.top_k or 0
        if top_k < -1 or top_k >= 1 << 31:
            raise APIError(400, f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
        if req.seed is not None and not -_INT64 <= req.seed < _INT64:
            raise APIError(400, f"seed must fit in 64 bits, got {req.seed}", "seed")
        stop_ids = list(req.stop_token_ids or [])
        self._check_ids(stop_ids, "stop_token_ids")
        if req.stop_list() and self.tokenizer is None:
            raise APIError(400, f"model `{self.model_name}` has no tokenizer: use stop_token_ids, not stop", "stop")
        if max_tokens is None:  # unset: whatever fits the context
            max_tokens = max(self.max_model_len - prompt_len, 1)
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=max(top_k, 0),
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop_token_ids=tuple(stop_ids),
            )
        except ValueError as e:
            raise APIError(400, str(e), str(e).split()[0]) from None
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                f"completion.",
                "max_tokens",
            )
        return params

    def _job(
        self,
        prefix: str,
        req,
        ids: list[int],
        params: SamplingParams,
        arrival: float,
        prompt_text="",
        keep_special: bool = False,
    ) -> Job:
        if req.model_extra:
            log.warning("ignoring unsupported request fields: %s", sorted(req.model_extra))
        text = TextStream(
            self.tokenizer,
            req.stop_list(),
            req.include_stop_str_in_output,
            req.skip_special_tokens and not keep_special,
        )  # V4 chat parses its markers
        return Job(
            f"{prefix}-{uuid.uuid4().hex}",
            ids,
            params,
            text,
            arrival,
            asyncio.get_running_loop().time() + self.request_timeout_s,
            prompt_text,
        )

    # ---- running ---------------------------------------------------------------------------------
    def _events(self, job: Job, lane: TokenLane | None = None) -> tuple[AsyncGenerator, JobEvents]:
        """Run `job` on the router -> (its events, what takes them into the job). lane: the stream's TokenLane."""
        client = self.client()
        if lane is not None and getattr(client, "takes_lane", False):
            events = client.generate(job.prompt_ids, job.params, job.rid, lane=lane)  # type: ignore[call-arg]
        else:
            events = client.generate(job.prompt_ids, job.params, job.rid)
        return events, JobEvents(job, self.eos_ids, self.ttft_histogram, self.itl_histogram)

    async def _collect(self, job: Job) -> None:
        events, taker = self._events(job)
        try:
            async with asyncio.timeout_at(job.deadline), contextlib.aclosing(events):
                # leaving early cancels the router call: pages are freed
                async for ev in events:
                    taker.take(ev)
                    if job.finish_reason is not None:
                        return
            raise _unfinished(job)
        finally:
            taker.flush()

    async def _first(self, job: Job, events, taker: JobEvents) -> Piece:
        async with asyncio.timeout_at(job.deadline):
            ev = await anext(events, None)
        if ev is None:
            raise _unfinished(job)
        return taker.take(ev)

    def _api_error(self, e: Exception) -> APIError:
        if isinstance(e, (APIError, RouterError)):
            return e if isinstance(e, APIError) else APIError.from_router(e)
        if isinstance(e, TimeoutError):
            return APIError(504, f"request timed out after {self.request_timeout_s:g} s")
        return APIError(500, "internal error (details are in the server log)")

    async def _respond(self, request: Request, job: Job, stream: bool, render) -> Response:
        """Run the job; -> the JSON response, or the SSE stream once the first token is in (so that
        overload and bad-request errors of the router still get their HTTP status)."""
        try:
            if not stream:
                await unless_disconnected(request, self._collect(job))
                resp = render.response(job)
                self.finish(job, "ok")
                return JSONResponse(resp.model_dump(mode="json"))
            lane = TokenLane()
            events, taker = self._events(job, lane)
            try:
                first = await unless_disconnected(request, self._first(job, events, taker))
            except BaseException:
                await events.aclose()
                taker.flush()
                raise
            return SSEResponse(
                self._sse_body(job, first, events, taker, render, lane),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                lane=lane,
            )
        except (RouterError, TimeoutError) as e:
            raise self._api_error(e) from None
        except ClientGone:
            self.count("aborted")
            return Response(status_code=499)  # nobody reads it

    async def _sse_body(
        self, job: Job, first: Piece, events: AsyncGenerator, taker: JobEvents, render, lane: TokenLane
    ) -> AsyncIterator[str | bytes]:
        """The stream's SSE events; the router's events are read here, each taken into the job (no generator layer
        between them: every layer is a hop a token on the replica's loop). While this waits, the lane may take a
        plain token into the job and write it (service.token_lane): the same steps as the loop below."""
        status = "aborted"  # what escapes (the client went away, server shutdown) is an abort
        deadline = StreamDeadline(job.deadline)  # one timer for the stream, not one a token
        if not job.text.stops:  # a stop string may end the output at any token: each goes through the loop
            logprobs = bool(job.params.logprobs)  # else the event carries none (service.direct_path._event)

            def render_token(token_id: int, logprob: float | None) -> bytes | None:
                c = render.piece(job, *taker.take_token(token_id, logprob if logprobs else None))
                return None if c is None else c if isinstance(c, bytes) else sse(c).encode()

            lane.body = lambda: not deadline.expired and job.finish_reason is None
            lane.render = render_token
        try:
            try:
                for c in render.head(job):
                    yield sse(c)
                piece = first
                while True:
                    c = render.piece(job, *piece)  # a text-only chunk comes as its SSE bytes already
                    if c is not None:
                        yield c if isinstance(c, bytes) else sse(c)
                    if job.finish_reason is not None:
                        break
                    lane.parked = True  # everything before the next event is written: the lane may take it
                    try:
                        ev = await deadline.wait(anext(events, None))  # only the wait, never a write to the client
                    finally:
                        lane.parked = False
                    if ev is None:
                        raise _unfinished(job)
                    piece = taker.take(ev)
                for c in render.tail(job):
                    yield sse(c)
                status = "ok"
            except Exception as e:  # RouterError, TimeoutError, APIError, or a bug
                err = self._api_error(e)
                if err.status == 500:
                    log.exception("request %s failed mid-stream", job.rid)
                status = err.label
                # The headers are out: the error goes in-band, then [DONE] (as vLLM does).
                yield sse(P.ErrorResponse(**P.error_body(err.status, err.message, err.param)))
            yield "data: [DONE]\n\n"
        finally:
            lane.parked, lane.render = False, None
            deadline.close()
            await events.aclose()  # leaving early cancels the router call: pages are freed
            taker.flush()
            self.finish(job, status)

    def finish(self, job: Job, status: str) -> None:
        if status == "ok":
            metrics.E2E.labels(self.model_name).observe(time.monotonic() - job.arrival)
        self.count(status)

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer else f"token_id:{t}"

    # ---- endpoints -------------------------------------------------------------------------------
    async def _guard(self, handler, req, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            bad = lone_surrogate(req.model_dump(exclude_none=True))
            if bad:
                raise APIError(
                    400,
                    f"{bad}: contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text",
                    bad,
                )
            return await handler(req, request, arrival)
        except APIError as e:
            self.count(e.label)
            if e.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
            return e.response()

    async def completions(self, req: P.CompletionRequest, request: Request) -> Response:
        return await self._guard(self._completions, req, request)

    async def chat_completions(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        return await self._guard(self._chat, req, request)

    async def _completions(self, req: P.CompletionRequest, request: Request, arrival: float) -> Response:
        self._check_model(req.model)
        ids, prompt_text = await self.offload.run(self._prompt, req.prompt)  # tokenising: off the loop
        want_lp = req.logprobs is not None
        params = self._params(req, len(ids), req.max_tokens, want_lp, want_lp and req.echo)
        job = self._job("cmpl", req, ids, params, arrival, prompt_text)
        render = P.CompletionRender(req, self.model_name, self.token_str)
        return await self._respond(request, job, req.stream, render)

    async def _chat(self, req: P.ChatCompletionRequest, request: Request, arrival: float) -> Response:
        self._check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        v4 = await self.offload.run(self._v4_prompt, req)  # rendering and tokenising: off the loop
        ids = await self.offload.run(self._chat_prompt, req, v4)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(ids), max_tokens, req.logprobs, False)
        job = self._job("chatcmpl", req, ids, params, arrival, keep_special=v4 is not None)
        render = (
            chat_v4.V4ChatRender(req, self.model_name, self.token_str, v4)
            if v4
            else P.ChatRender(req, self.model_name, self.token_str)
        )
        return await self._respond(request, job, req.stream, render)

    async def health(self) -> Response:
        """200 when the router answers and has a healthy prefill and decode worker; 503 otherwise."""
        try:
            rep = await asyncio.wait_for(self.client().health(), self.health_timeout_s)
        except (TimeoutError, RouterError) as e:
            log.warning("health: router %s is not reachable: %s", self.router_addr, str(e) or "timed out")
            return APIError(503, "the router is not reachable").response()
        if not rep.serving:
            return APIError(503, "the router has no healthy prefill and decode worker").response()
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_name,
                "workers": [
                    {
                        "id": w.worker_id,
                        "role": w.role,
                        "healthy": w.healthy,
                        "fast_paths": {
                            "active": list(w.fast_paths_active),
                            "fell_back": dict(f.split(": ", 1) for f in w.fast_path_fallbacks),
                        },
                    }
                    for w in rep.workers
                ],
            }
        )


def _unfinished(job: Job) -> APIError:
    return APIError(500, f"request {job.rid}: router stream ended without a finish")


# ---- app ------------------------------------------------------------------------------------------
_configured: OpenAIServer | None = None


def configure(
    router_addr: str,
    model_dir: str,
    model_name: str,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    options: IngressOptions | None = None,
    client_factory: Callable[[], AsyncRouterClient] | None = None,
) -> OpenAIServer:
    """Set this process's server for apps built with `make_app()` (the Ray Serve replica calls it)."""
    global _configured
    _configured = OpenAIServer(
        router_addr, model_dir, model_name, request_timeout_s, options=options, client_factory=client_factory
    )
    return _configured


def current_server() -> OpenAIServer:
    if _configured is None:
        raise RuntimeError("service.openai_app.configure(...) has not been called in this process")
    return _configured


def make_app(get_server: Callable[[], OpenAIServer] = current_server, api_docs: bool | None = None) -> FastAPI:
    """The FastAPI app; each request resolves its `OpenAIServer` through `get_server()`. Interactive docs
    (/docs, /redoc, /openapi.json) only with api_docs (default: $DSV4_API_DOCS, dsv4_kernels.settings,
    which `dsv4 serve --api-docs` sets for the Serve replicas)."""
    if api_docs is None:
        api_docs = settings().api_docs
    docs: dict[str, Any] = {} if api_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="dsv4 OpenAI-compatible API", **docs)
    # Outermost: body limit and API key before anything buffers or parses the body.
    app.add_middleware(GuardMiddleware, options=lambda: get_server().options, error_body=P.error_body)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        rid = uuid.uuid4().hex[:12]
        log.exception("unhandled error %s on %s %s", rid, request.method, request.url.path)
        return APIError(500, f"internal error (id {rid}; details are in the server log)").response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError):
        # OpenAI clients expect 400 with {"error": ...}, not FastAPI's 422 {"detail": ...}.
        with contextlib.suppress(RuntimeError):
            get_server().count("invalid")
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health():
        return await get_server().health()

    @app.get("/v1/models")
    async def models():
        s = get_server()
        # root names the model, never the server's path to it (no filesystem layout in API answers)
        card = P.ModelCard(id=s.model_name, root=s.model_name, max_model_len=s.max_model_len)
        return JSONResponse(P.ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await get_server().completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await get_server().chat_completions(body, request)

    return app


def build_app(
    router_addr: str,
    model_dir: str,
    model_name: str,
    *,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    options: IngressOptions | None = None,
    api_docs: bool | None = None,
) -> FastAPI:
    """A self-contained app over the router at `router_addr` (for uvicorn and tests)."""
    server = OpenAIServer(router_addr, model_dir, model_name, request_timeout_s, options=options)
    app = make_app(lambda: server, api_docs)
    app.state.server = server
    return app
