"""The OpenAI-compatible HTTP layer end to end: a real router (grpc.aio, one in-process tiny engine) on an
ephemeral port, the FastAPI app under a real uvicorn server in a thread, driven by the official `openai`
client. Failure modes the real router cannot produce on demand (overload, hang) come from a fake router."""

import asyncio
import http.client
import json
import os
import shutil
import socket
import threading
import time

import grpc
import openai
import pytest
import uvicorn
from prometheus_client import REGISTRY

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.make_model import ASSISTANT_TOKEN, BOS_TOKEN, USER_TOKEN, default_model_dir
from engine.loading.tokenizer import load_tokenizer
from router.local_dispatch import LocalDispatcher
from router.protos import pb2, pb2_grpc
from router.server import RouterServer
from service.chat_parsing import parse_completion
from service.openai_app import build_app

MODEL = "tiny-http"
PROMPT_IDS = [5, 9, 200, 17, 3, 41, 77, 120]
GREEDY = dict(temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})


class FakeRouter(pb2_grpc.RouterServicer):
    """First prompt token 1: overloaded; 2: never answers; 4: one token, then nothing; anything else: an internal
    error."""

    async def Generate(self, request, context):
        first = request.prompt_token_ids[0]
        if first == 1:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router has 9 requests in flight")
        if first == 2:
            await asyncio.sleep(3600)
        if first == 4:
            yield pb2.GenerateResponse(request_id=request.request_id, token_id=7)
            await asyncio.sleep(3600)
        await context.abort(grpc.StatusCode.INTERNAL, "boom")
        yield  # a server-streaming handler must be a generator


class Backend:
    """The real router and the fake one, on one event-loop thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dispatcher = LocalDispatcher(1)
        self.router = RouterServer(self.dispatcher, health_interval_s=3600.0)
        self.addr = f"127.0.0.1:{self.run(self.router.start('127.0.0.1', 0))}"
        self.fake_addr = f"127.0.0.1:{self.run(self._start_fake())}"

    async def _start_fake(self) -> int:
        self.fake = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(FakeRouter(), self.fake)
        port = self.fake.add_insecure_port("127.0.0.1:0")
        await self.fake.start()
        return port

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def engine_requests(self) -> int:
        eng = self.dispatcher.engine("engine-0")
        return len(eng.requests) + len(eng.scheduler.waiting)

    def close(self):
        self.run(self.router.stop(0))
        self.run(self.fake.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.dispatcher.close()


class HTTPServer:
    """A real uvicorn server in a thread, on an ephemeral port bound before it starts."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def backend():
    b = Backend()
    yield b
    b.close()


@pytest.fixture(scope="module")
def srv(backend):
    s = HTTPServer(build_app(backend.addr, default_model_dir(), MODEL))
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_dir())


def greedy_ref(llm, ids, n, **kw):
    return llm.generate([ids], SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))[0]


def requests_total(status: str) -> float:
    return REGISTRY.get_sample_value("dsv4_requests_total", {"model_name": MODEL, "status": status}) or 0.0


def test_models_and_health(srv, backend):
    models = srv.client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 4096
    raw = srv.client.models.with_raw_response.list().text
    assert (
        models[0].root == MODEL and str(default_model_dir()) not in raw and "/" not in models[0].root
    )  # no server paths
    status, body = srv.get("/health")
    assert status == 200 and body["status"] == "ok" and body["workers"][0]["healthy"]
    # the engine's fast paths as it decided them at load: taken ones by name, fallen-back ones with why
    states = backend.dispatcher.engine("engine-0").model.fast_path_states
    assert body["workers"][0]["fast_paths"] == {
        "active": [p.name for p in states if p.active],
        "fell_back": {p.name: p.why for p in states if not p.active},
    }
    assert "flash_mla" in body["workers"][0]["fast_paths"]["fell_back"]  # a CPU engine: FlashMLA is CUDA only
    status, body = srv.get("/nope")
    assert status == 404 and "error" in body


def test_token_prompt_matches_offline_llm(srv, llm, tok):
    ttft_before = REGISTRY.get_sample_value("dsv4_time_to_first_token_seconds_count", {"model_name": MODEL}) or 0
    itl_before = REGISTRY.get_sample_value("dsv4_inter_token_latency_seconds_count", {"model_name": MODEL}) or 0
    ok_before = requests_total("ok")
    ref = greedy_ref(llm, PROMPT_IDS, 8)
    r = srv.client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, **GREEDY)
    c = r.choices[0]
    assert c.token_ids == ref.token_ids and c.prompt_token_ids == PROMPT_IDS
    assert c.text == tok.decode(ref.token_ids) and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 8, 16)
    assert requests_total("ok") == ok_before + 1
    assert REGISTRY.get_sample_value("dsv4_time_to_first_token_seconds_count", {"model_name": MODEL}) == ttft_before + 1
    itl_after = REGISTRY.get_sample_value("dsv4_inter_token_latency_seconds_count", {"model_name": MODEL})
    assert itl_after == itl_before + 7  # one a token after the first


def test_text_prompt_matches_offline_llm(srv, llm, tok):
    ids = tok.encode("the quick brown fox")
    ref = greedy_ref(llm, ids, 6)
    c = srv.client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, **GREEDY).choices[0]
    assert c.prompt_token_ids == ids and ids[0] == tok.bos_id
    assert c.token_ids == ref.token_ids and c.text == tok.decode(ref.token_ids)


def collect_stream(stream):
    chunks = list(stream)
    body = [ch for ch in chunks if ch.choices]
    text = "".join(ch.choices[0].text for ch in body)
    ids = [t for ch in body for t in (ch.choices[0].token_ids or [])]
    return chunks, body, text, ids


def test_stream_equals_non_stream(srv):
    kw = dict(model=MODEL, prompt="hello world", max_tokens=10, logprobs=1, **GREEDY)
    full = srv.client.completions.create(**kw).choices[0]
    chunks, body, text, ids = collect_stream(
        srv.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert text == full.text and ids == full.token_ids
    assert body[0].choices[0].prompt_token_ids == full.prompt_token_ids
    assert body[-1].choices[0].finish_reason == full.finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    lps = [x for ch in body if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(full.logprobs.token_logprobs)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_logprobs_and_echo(srv, llm, tok):
    ref = greedy_ref(llm, PROMPT_IDS, 5, logprobs=True, prompt_logprobs=True)
    c = srv.client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=5, logprobs=2, echo=True, **GREEDY
    ).choices[0]
    lp = c.logprobs
    n = len(PROMPT_IDS) + 5
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:] + ref.logprobs, abs=1e-4)
    assert all(len(d) == 1 for d in lp.top_logprobs[1:])  # only the sampled token: see openai_protocol
    assert c.text == tok.decode(PROMPT_IDS, skip_special_tokens=False) + tok.decode(ref.token_ids)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_string_truncates_and_cancels(srv, backend):
    kw = dict(model=MODEL, prompt="jumps over the lazy dog", **GREEDY)
    full = srv.client.completions.create(max_tokens=16, **kw).choices[0].text
    # a printable 2-char stop string from the middle of the output
    mid = next(i for i in range(len(full) // 3, len(full) - 2) if full[i : i + 2].isprintable())
    stop = full[mid : mid + 2]
    want = full[: full.find(stop)]
    # max_tokens 3000 would take the engine minutes: a quick finish means the stop string cancelled it
    r = srv.client.completions.create(max_tokens=3000, stop=[stop, "\u2603never"], **kw)
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (want, "stop", stop)
    assert r.usage.completion_tokens <= 16
    _, body, text, _ = collect_stream(srv.client.completions.create(max_tokens=3000, stop=stop, stream=True, **kw))
    assert text == want and body[-1].choices[0].finish_reason == "stop"
    wait_until(lambda: backend.engine_requests() == 0)  # the abort reaches the engine asynchronously


def test_stop_token_ids(srv, llm, tok):
    ref = llm.generate([PROMPT_IDS], SamplingParams(max_new_tokens=8))[0].token_ids
    stop_id = next(t for t in ref[2:] if t not in tok.encode("") + [tok.eos_id])  # not BOS / EOS
    k = ref.index(stop_id)
    c = srv.client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "return_token_ids": True},
    ).choices[0]
    assert c.token_ids == ref[: k + 1] and c.text == tok.decode(ref[:k])  # the stop token's text is left out
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", stop_id)


def test_chat_completion_uses_the_v4_encoding(srv, llm, tok):
    # The built-in model, like V4's release, has no chat template: chat uses V4's encoding (chat mode).
    prompt = BOS_TOKEN + USER_TOKEN + "Hello there" + ASSISTANT_TOKEN + "</think>"
    ids = tok.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    ref = greedy_ref(llm, ids, 6)
    msgs = [{"role": "user", "content": "Hello there"}]
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, **GREEDY)
    assert r.model_extra["prompt_token_ids"] == ids and r.choices[0].model_extra["token_ids"] == ref.token_ids
    want = parse_completion(tok.decode(ref.token_ids, skip_special_tokens=False), thinking=False).content
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = list(
        srv.client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=6, stream=True, logprobs=True, top_logprobs=1, **GREEDY
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == r.choices[0].message.content
    lps = [x.logprob for ch in stream if ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert len(lps) == 6 and stream[-1].choices[0].finish_reason == "length"


BAD_REQUESTS = [
    (dict(prompt=[3, 512, 4]), "out of vocabulary"),
    (dict(prompt=""), "empty"),
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5] * 10, max_tokens=4090), "maximum context length is 4096"),
    (dict(prompt=[5, 6], temperature=-1), "temperature"),
    (dict(prompt=[5, 6], top_p=0), "top_p"),
    (dict(prompt=[5, 6], n=2), "n=1"),
    (dict(prompt=[5, 6], logprobs=6), "logprobs"),
    (dict(prompt=[5, 6], max_tokens=0), "max_tokens"),
    (dict(prompt=[5, 6], extra_body={"max_tokens": "lots"}), "max_tokens"),  # pydantic's 422 -> 400
    (dict(prompt=[3, 512], stream=True), "out of vocabulary"),
    (dict(prompt=["a", "b"]), "batched"),
]


@pytest.mark.parametrize("kw, needle", BAD_REQUESTS)
def test_bad_requests_are_400(srv, kw, needle):
    before = requests_total("invalid")
    with pytest.raises(openai.BadRequestError) as info:
        srv.client.completions.create(model=MODEL, **{"max_tokens": 4, **kw})
    assert info.value.status_code == 400 and needle in info.value.message
    assert info.value.body["type"] == "BadRequestError"
    assert requests_total("invalid") == before + 1


def test_unknown_model_is_404_and_serving_goes_on(srv):
    with pytest.raises(openai.NotFoundError):
        srv.client.completions.create(model="gpt-9", prompt=[5], max_tokens=2)
    r = srv.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_model_without_tokenizer(backend, llm, tmp_path):
    src = default_model_dir()
    for name in ("config.json", "model.safetensors"):  # a model dir with no tokenizer files
        shutil.copy(os.path.join(src, name), tmp_path / name)
    s = HTTPServer(build_app(backend.addr, str(tmp_path), MODEL))
    try:
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            s.client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            s.client.completions.create(model=MODEL, prompt=[5, 6], stop="x", max_tokens=4)
        c = s.client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, logprobs=0, **GREEDY).choices[0]
        assert c.token_ids == greedy_ref(llm, PROMPT_IDS, 4).token_ids and c.text == ""
        assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
    finally:
        s.close()


def test_overload_unavailable_timeout(backend):
    fake = HTTPServer(build_app(backend.fake_addr, default_model_dir(), MODEL, request_timeout_s=1.0))
    dead_sock = socket.socket()
    dead_sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead = HTTPServer(build_app(f"127.0.0.1:{dead_sock.getsockname()[1]}", default_model_dir(), MODEL))
    try:
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError, match="in flight"):
                fake.client.completions.create(model=MODEL, prompt=[1, 5], max_tokens=2, stream=stream)
        with pytest.raises(openai.APIStatusError) as info:  # the 1 s request timeout answers, not the client's
            fake.client.completions.create(model=MODEL, prompt=[2, 5], max_tokens=2)
        assert info.value.status_code == 504
        # streaming: the first token is out, then the deadline passes waiting for the next: an in-band error
        body = json.dumps({"model": MODEL, "prompt": [4, 5], "max_tokens": 4, "stream": True}).encode()
        status, _, sse_text = raw(fake, "POST", "/v1/completions", body)
        events = [line[len("data: ") :] for line in sse_text.splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]"
        assert "timed out after 1 s" in json.loads(events[-2])["error"]["message"]
        assert any(json.loads(e).get("choices") for e in events[:-2])  # the token before it was streamed
        with pytest.raises(openai.InternalServerError) as info:
            fake.client.completions.create(model=MODEL, prompt=[3, 5], max_tokens=2)
        assert info.value.status_code == 500 and "boom" in info.value.message
        with pytest.raises(openai.InternalServerError) as info:
            dead.client.completions.create(model=MODEL, prompt=[3, 5], max_tokens=2)
        assert info.value.status_code == 503
        assert dead.get("/health")[0] == 503
    finally:
        fake.close()
        dead.close()
        dead_sock.close()


def wait_until(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_client_disconnect_frees_the_engine(srv, backend):
    aborted = requests_total("aborted")
    kw = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=3000, temperature=0)
    stream = srv.client.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert backend.engine_requests() == 1
    stream.close()  # the engine would need minutes for 3000 tokens: only the abort can empty it
    wait_until(lambda: backend.engine_requests() == 0)
    wait_until(lambda: requests_total("aborted") == aborted + 1)
    # non-streaming: the client gives up while the engine is still generating
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request(
        "POST", "/v1/completions", json.dumps({**kw, "ignore_eos": True}), {"Content-Type": "application/json"}
    )
    wait_until(lambda: backend.engine_requests() == 1)
    conn.close()
    wait_until(lambda: backend.engine_requests() == 0)
    wait_until(lambda: requests_total("aborted") == aborted + 2)
    assert srv.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).usage.completion_tokens >= 1


def test_serve_app_imports():
    pytest.importorskip("ray.serve")
    from service import serve_ingress as serve_app

    paths = {getattr(r, "path", None) for r in serve_app.app.routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths
    assert callable(serve_app.deploy_http) and serve_app.OpenAIIngress.name == "dsv4-openai"
    # liveness: Serve replaces a replica whose loop cannot answer check_health in time; replicas are light
    cfg = serve_app.OpenAIIngress._deployment_config
    assert (cfg.health_check_period_s, cfg.health_check_timeout_s) == (
        serve_app.HEALTH_PERIOD_S,
        serve_app.HEALTH_TIMEOUT_S,
    )
    assert callable(serve_app.OpenAIIngress.func_or_class.check_health)
    assert serve_app.OpenAIIngress.ray_actor_options["num_cpus"] == serve_app.INGRESS_NUM_CPUS < 1


def raw(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        return resp.status, dict(resp.getheaders()), json.loads(data)
    return resp.status, dict(resp.getheaders()), data.decode(errors="replace")  # SSE, or nothing


STRICT_BAD = [
    (b'{"model": "tiny-http", "prompt": [5, 6], "max_tokens": "5"}', "max_tokens"),
    (b'{"model": "tiny-http", "prompt": [5, 6], "stream": "yes"}', "stream"),
    (b'{"model": "tiny-http", "prompt": [5, 6], "temperature": "0.5"}', "temperature"),
    (b'{"model": "tiny-http", "prompt": "a\\ud800b"}', "surrogate"),  # a lone UTF-16 surrogate
    (b'{"model": "tiny-http", "prompt": [5, 6], "stop": ["\\udfff"]}', "surrogate"),
    (b'{"model": "tiny-http", "prompt": [5, 6], "stop": [' + b", ".join([b'"s"'] * 17) + b"]}", "at most 16"),
    (b'{"model": "tiny-http", "prompt": [5, 6], "stop": "' + b"x" * 2000 + b'"}', "at most 1024"),
]


@pytest.mark.parametrize("body, needle", STRICT_BAD)
def test_strict_types_and_text_are_400(srv, body, needle):
    status, _, out = raw(srv, "POST", "/v1/completions", body)
    assert status == 400 and needle in out["error"]["message"] and out["error"]["type"] == "BadRequestError", out


def test_error_shapes_never_500(srv):
    status, _, out = raw(
        srv,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    )
    assert status == 400 and "unknown role" in out["error"]["message"] and out["error"]["param"] == "messages.0.role"
    status, _, out = raw(srv, "GET", "/v1/completions")
    assert status == 405 and out["error"]["type"] == "MethodNotAllowedError"
    status, _, out = raw(srv, "POST", "/v1/completions", b'{"model": "x", "prompt": [5,')
    assert status == 400 and out["error"]["param"] is None and "not valid JSON" in out["error"]["message"], out
    for path in ("/docs", "/openapi.json", "/redoc"):  # interactive docs are off unless asked for
        assert raw(srv, "GET", path)[0] == 404


def test_request_chat_template_is_off_by_default(srv):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="chat templates are disabled"):
        srv.client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, extra_body={"chat_template": "{{ messages[0].content }}"}
        )


def test_guarded_app_api_key_body_limit_and_template_budget(backend, tok):
    from service.ingress_guard import IngressOptions

    opts = IngressOptions(api_key="k3y", max_body_bytes=4096, allow_request_templates=True, template_budget_s=0.5)
    s = HTTPServer(build_app(backend.addr, default_model_dir(), MODEL, options=opts, api_docs=True))
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2)  # the client sends key "x"
        ok = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="k3y", max_retries=0, timeout=60)
        assert ok.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).usage.completion_tokens >= 1
        status, _, out = raw(
            s, "POST", "/v1/completions", b'{"prompt": "' + b"a" * 5000 + b'"}', {"Authorization": "Bearer k3y"}
        )
        assert status == 413 and out["error"]["type"] == "RequestTooLargeError"
        assert raw(s, "GET", "/health")[0] == 200 and raw(s, "GET", "/openapi.json")[0] == 200
        bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        with pytest.raises(openai.BadRequestError, match="time budget"):
            ok.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"chat_template": bomb},
            )
        r = ok.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"chat_template": "{{ messages[0].content }}", "ignore_eos": True},
        )
        n = len(tok.tokenizer.encode("hi", add_special_tokens=False).ids)  # the request's template ran: no markers
        assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 2
    finally:
        s.close()


def test_incremental_text_equals_whole_decode(tok):
    """TextStream decodes a window per token; the text must equal decoding the whole output at once, and a
    stop string must cut the text exactly where the whole text first contains it."""
    import random

    from service.text_stream import TextStream

    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        whole = tok.decode(ids)
        ts = TextStream(tok, [], False, True)
        out = "".join(ts.add(t, i == len(ids) - 1) for i, t in enumerate(ids))
        assert out == whole, (ids, out, whole)
        if len(whole) > 6:
            stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
            ts = TextStream(tok, [stop], False, True)
            out = ""
            for i, t in enumerate(ids):
                out += ts.add(t, i == len(ids) - 1)
                if ts.stop_hit:
                    break
            assert out == whole[: whole.find(stop)] and ts.stop_hit == stop


FUZZ_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    float("1e308"),
    "",
    "x",
    "5",
    "\ud800",
    [],
    [1, "a"],
    {},
    {"a": []},
    [[1, 2], [3]],
    "a" * 300,
    2**70,
    -(2**70),
    [None],
    {"role": "user"},
]


def test_fuzzed_bodies_never_500(srv):
    """Random fields of random types on both routes: every answer is JSON, typed, and never a 5xx."""
    import random

    rng = random.Random(7)
    fields = [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "echo",
        "logit_bias",
        "ignore_eos",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "top_logprobs",
        "max_completion_tokens",
        "return_token_ids",
        "skip_special_tokens",
        "presence_penalty",
        "best_of",
        "suffix",
    ]
    for trial in range(150):
        chat = trial % 2 == 1
        body = {"model": MODEL, "max_tokens": 2}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6]})
        for f in rng.sample(fields, rng.randint(1, 4)):
            body[f] = rng.choice(FUZZ_VALUES)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8  # bounded work; the type and range checks still see small and negative ones
        if body.get("max_tokens", 0) is None:
            # a valid request for "whatever fits the context" (4094 tokens here): ~a minute of 2-core CPU decode
            # that the 30 s client timeout cut off in CI
            body["max_tokens"] = 8
        for k in ("max_completion_tokens",):
            if isinstance(body.get(k), int) and body[k] > 8:
                body[k] = 8
        raw_body = json.dumps(body).encode()
        status, headers, out = raw(srv, "POST", "/v1/chat/completions" if chat else "/v1/completions", raw_body)
        assert status < 500, (status, body, out)
        if status != 200:
            assert out["error"]["code"] == status and out["error"]["type"] and out["error"]["message"], out
    for junk in (b"", b"null", b"[]", b'"x"', b"{", b"\xff\xfe", b'{"prompt": [5, 6], "model": 5}'):
        status, _, out = raw(srv, "POST", "/v1/completions", junk)
        assert 400 <= status < 500 and out["error"]["code"] == status, (junk, status, out)


def test_router_shutting_down_mid_stream_says_so():
    """The router stops while a stream is open (gRPC cancels every call with its own "Cancelling all calls"): the
    client's error chunk says the service is shutting down, in the OpenAI error shape."""
    b = Backend()
    s = HTTPServer(build_app(b.addr, default_model_dir(), MODEL))
    try:
        stream = s.client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4000, stream=True, **GREEDY)
        next(iter(stream))  # in flight
        b.run(b.router.stop(0))
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
        message = str(info.value)
        assert "shutting down" in message and "Cancelling all calls" not in message, message
    finally:
        s.close()
        b.close()
