"""`--max-model-len` end to end: engines capped at 64 positions behind the real gRPC router, and the OpenAI
app (real uvicorn) told the same cap: /v1/models reports it, a request without max_tokens gets the room left
under it (not the model's full context, which the engines would refuse), and a longer one is a 400."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import urllib.error
import urllib.request

import pytest
import uvicorn

from engine.loading.load import load_engine
from engine.loading.make_model import default_model_dir
from router.local_dispatch import LocalDispatcher
from router.server import RouterServer
from service.ingress_guard import IngressOptions
from service.openai_app import build_app
from tests.support.ports import free_port

CAP = 64


@pytest.fixture(scope="module")
def url():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    dispatcher = LocalDispatcher(1, functools.partial(load_engine, max_model_len=CAP, max_cached_tokens=4096))
    router = RouterServer(dispatcher, health_interval_s=3600.0)
    port = asyncio.run_coroutine_threadsafe(router.start("127.0.0.1", 0), loop).result(60)
    app = build_app(f"127.0.0.1:{port}", default_model_dir(), "m", options=IngressOptions(max_model_len=CAP))
    http_port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning", lifespan="off"))
    http = threading.Thread(target=server.run, daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise RuntimeError("uvicorn did not start")
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{http_port}"
    server.should_exit = True
    http.join(10)
    asyncio.run_coroutine_threadsafe(router.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    dispatcher.close()


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_report_the_cap(url):
    status, body = call(url, "/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == CAP


def test_default_max_tokens_fills_the_cap(url):
    """Chat leaves max_tokens unset by default: the ingress asks for what fits under the cap, and the engines
    (capped alike) accept and fill it."""
    status, body = call(
        url,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    usage = body["usage"]
    assert usage["completion_tokens"] == CAP - usage["prompt_tokens"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_longer_than_the_cap_is_400(url):
    status, body = call(url, "/v1/completions", {"model": "m", "prompt": list(range(5, 5 + CAP)), "max_tokens": 4})
    assert status == 400 and f"maximum context length is {CAP} tokens" in body["error"]["message"], body
