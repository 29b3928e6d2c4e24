"""The pre-rendered text-only stream chunks (service.sse_chunks) are byte for byte what the pydantic chunk dumps."""

import time

import pytest

from service import openai_protocol as P
from service.http_stream import sse
from service.openai_job import Job
from service.sse_chunks import CREATED_MARK, TEXT_MARK, TextChunk
from service.text_stream import TextStream

TEXTS = [
    "a",
    " hello",
    'quote " and \\ backslash',
    "tab\tnew\nline\r",
    "\x00\x01\x1f\x7f",
    "é 漢字 🙂",
    "\u2028\u2029",
    "",
]


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.7)  # both paths read `created` from it


def job(prefix: str) -> Job:
    return Job(f"{prefix}-0123abcd", [1, 2], None, TextStream(None, [], False, True), 0.0, 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_matches_pydantic(text):
    render = P.CompletionRender(P.CompletionRequest(model="m", prompt="x", stream=True), 'my "model"', str)
    j = job("cmpl")
    fast = render.piece(j, 7, -0.5, text or "x")
    assert isinstance(fast, bytes)
    slow = sse(render._chunk(j, text or "x", logprobs=None, finish_reason=None, stop_reason=None, token_ids=None))
    assert fast == slow.encode()


@pytest.mark.parametrize("field", ["content", "reasoning_content"])
@pytest.mark.parametrize("text", TEXTS)
def test_chat_text_chunk_matches_pydantic(field, text):
    req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    render = P.ChatRender(req, "m", str)
    j = job("chatcmpl")
    fast = render.texts(j, field, text)
    slow = sse(render._chunk(j, P.DeltaMessage(**{field: text})))
    assert fast == slow.encode()


def test_chunks_with_more_than_text_are_models():
    req = P.CompletionRequest(model="m", prompt="x", stream=True, logprobs=1)
    j = job("cmpl")
    assert isinstance(P.CompletionRender(req, "m", str).piece(j, 7, -0.5, "a"), P.CompletionStreamResponse)
    j.finish_reason = "length"
    plain = P.CompletionRender(P.CompletionRequest(model="m", prompt="x", stream=True), "m", str)
    assert isinstance(plain.piece(j, 7, -0.5, "a"), P.CompletionStreamResponse)  # the last chunk: finish_reason


def test_template_refuses_a_marker_it_cannot_place():
    text = [P.CompletionResponseStreamChoice(text=TEXT_MARK)]
    assert TextChunk(P.CompletionStreamResponse(id="c", model="m", created=CREATED_MARK, choices=text))(" a")
    with pytest.raises(ValueError):  # the marker twice: which one is the text is not known
        TextChunk(P.CompletionStreamResponse(id="c", model=TEXT_MARK, created=CREATED_MARK, choices=text))


def _renders():
    chat = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    yield P.CompletionRender(P.CompletionRequest(model="m", prompt="x", stream=True), "m", str), "cmpl", "text"
    yield P.ChatRender(chat, "m", str), "chatcmpl", "content"


def test_a_used_render_is_freed_by_its_reference_count():
    """A render and its pre-rendered chunks form no reference cycle: a finished response's objects go when the last
    reference does, not at the cycle collector's next pass (a pass walks every in-flight request: the replica's
    token latency tail, BENCHMARKS frontdoor)."""
    import gc
    import weakref

    gc.disable()
    try:
        for render, prefix, field in _renders():
            assert render.texts(job(prefix), field, "a")  # the chunk template made and used
            ref = weakref.ref(render)
            del render
            assert ref() is None, "the render is in a reference cycle"
    finally:
        gc.enable()
