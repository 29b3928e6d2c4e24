"""`usage.prompt_tokens_details.cached_tokens` through the whole front door: OpenAI client -> HTTP app ->
gRPC router -> engine with a prefix cache, and the engine's real hit/query counters."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from engine.loading.make_model import default_model_dir
from service.openai_app import build_app
from tests.service.test_openai_http import MODEL, Backend, HTTPServer

PREFIX = [(7 * i + 3) % 500 + 2 for i in range(300)]  # the engine caches 256-token blocks


@pytest.fixture(scope="module")
def srv():
    backend = Backend()
    server = HTTPServer(build_app(backend.addr, default_model_dir(), MODEL))
    yield server
    server.close()
    backend.close()


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"role": "colocated", "worker": "engine-0"}) or 0.0


def test_cached_tokens_in_openai_usage(srv):
    hit0, query0 = _counter("dsv4_prefix_cache_hit_tokens_total"), _counter("dsv4_prefix_cache_query_tokens_total")
    first = srv.client.completions.create(model=MODEL, prompt=PREFIX + [11, 12], max_tokens=3)
    assert first.usage.prompt_tokens == 302 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = srv.client.completions.create(model=MODEL, prompt=PREFIX + [13, 14, 15], max_tokens=3)
    assert again.usage.prompt_tokens == 303 and again.usage.prompt_tokens_details.cached_tokens == 256
    stream = srv.client.completions.create(
        model=MODEL, prompt=PREFIX + [16], max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens == 256
    # the engine's real counters (what the dashboards divide): 3 prompts looked up, 2 x 256 tokens served
    assert _counter("dsv4_prefix_cache_query_tokens_total") - query0 == 302 + 303 + 301
    assert _counter("dsv4_prefix_cache_hit_tokens_total") - hit0 == 512
