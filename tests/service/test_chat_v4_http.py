"""/v1/chat/completions with DeepSeek V4's chat format, end to end through the official `openai` client.

On the built-in model (real router, real engine): the prompt is the V4 encoding of the request (tools
included) and the message is the V4 parse of what the random model said, streamed or not. A scripted
router then plays back a known completion token by token (every token boundary is a chunk boundary), so
the client sees real reasoning, content and tool calls - and never a byte of DSML or a think marker.
"""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import openai
import pytest

from engine.loading.make_model import default_model_dir
from engine.loading.tokenizer import load_tokenizer
from router.protos import pb2, pb2_grpc
from service import chat_v4
from service.chat_parsing import parse_completion
from service.openai_app import build_app
from service.openai_protocol import ChatCompletionRequest
from tests.service.test_openai_http import Backend, HTTPServer

MODEL = "tiny-chat"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Zürich?"}]
SCRIPT = (
    "The user wants the weather in Zürich.</think>Let me check."
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Bern</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
LEAKS = ("｜", "DSML", "<think", "</think", "\ufffd")


class ScriptedRouter(pb2_grpc.RouterServicer):
    """Answers every request with `ids` (one message per token), ending with `finish_reason`."""

    ids: list[int] = []
    finish_reason = "stop"

    async def Generate(self, request, context):
        for k, t in enumerate(self.ids):
            last = k == len(self.ids) - 1
            yield pb2.GenerateResponse(
                request_id=request.request_id,
                token_id=t,
                finished=last,
                finish_reason=self.finish_reason if last else "",
            )


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def real():
    backend = Backend()
    srv = HTTPServer(build_app(backend.addr, default_model_dir(), MODEL))
    yield srv
    srv.close()
    backend.close()


@pytest.fixture(scope="module")
def scripted():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(ScriptedRouter(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    srv = HTTPServer(build_app(f"127.0.0.1:{port}", default_model_dir(), MODEL))
    yield srv
    srv.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def collect(stream):
    chunks = list(stream)
    body = [c for c in chunks if c.choices]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    calls: dict[int, dict] = {}
    for c in body:
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    return chunks, body, reasoning, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("thinking", [False, True])
def test_tools_on_the_built_in_model(real, tok, thinking):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "chat_template_kwargs": {"thinking": thinking}},
    )
    r = real.client.chat.completions.create(**kw)
    prompt = chat_v4.render(
        ChatCompletionRequest.model_validate(
            {"messages": MESSAGES, "tools": [WEATHER], "chat_template_kwargs": {"thinking": thinking}}
        )
    )
    assert "## Tools" in prompt.text and prompt.thinking == thinking
    assert r.model_extra["prompt_token_ids"] == tok.tokenizer.encode(prompt.text, add_special_tokens=False).ids
    ids = r.choices[0].model_extra["token_ids"]
    want = parse_completion(tok.decode(ids, skip_special_tokens=False), thinking)
    msg = r.choices[0].message
    assert (msg.content or "") == want.content and len(msg.tool_calls or []) == len(want.calls)
    assert msg.model_extra["reasoning_content"] == (want.reasoning if thinking else None)
    chunks, body, reasoning, content, calls = collect(
        real.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert (reasoning, content, len(calls)) == (want.reasoning if thinking else "", want.content, len(want.calls))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert body[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_scripted_tool_calls_non_streaming(scripted, tok):
    ScriptedRouter.ids = tok.tokenizer.encode(SCRIPT, add_special_tokens=False).ids + [tok.eos_id]
    ScriptedRouter.finish_reason = "stop"
    r = scripted.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather in Zürich."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather")] * 2
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Zürich", "days": 2}, {"city": "Bern"}]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_scripted_tool_calls_streamed_without_leaks(scripted, tok):
    ScriptedRouter.ids = tok.tokenizer.encode(SCRIPT, add_special_tokens=False).ids + [tok.eos_id]
    ScriptedRouter.finish_reason = "stop"
    chunks, body, reasoning, content, calls = collect(
        scripted.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )
    )
    assert reasoning == "The user wants the weather in Zürich." and content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Zürich", "days": 2}),
        ("get_weather", {"city": "Bern"}),
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    for c in body:
        d = c.choices[0].delta
        for text in (d.content or "", d.model_extra.get("reasoning_content") or ""):
            assert not any(m in text for m in LEAKS), text
    assert body[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == len(ScriptedRouter.ids)


def test_scripted_truncated_output_and_tool_choice_none(scripted, tok):
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], extra_body={"chat_template_kwargs": {"thinking": True}})
    first_end = SCRIPT.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
    for cut, calls_kept in ((SCRIPT.index("Zürich</"), 0), (len(SCRIPT) - 40, 1)):  # in the 1st / 2nd invoke
        ScriptedRouter.ids = tok.tokenizer.encode(SCRIPT[:cut], add_special_tokens=False).ids
        ScriptedRouter.finish_reason = "length"
        r = scripted.client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and len(msg.tool_calls or []) == calls_kept
        # the broken rest is plain content, as the model wrote it
        broken = SCRIPT[SCRIPT.index("\n\n<｜DSML｜") : cut] if not calls_kept else SCRIPT[first_end:cut]
        assert msg.content == "Let me check." + broken
        _, _, _, content, calls = collect(scripted.client.chat.completions.create(stream=True, **kw))
        assert content == msg.content and len(calls) == calls_kept
    ScriptedRouter.ids = tok.tokenizer.encode(SCRIPT, add_special_tokens=False).ids + [tok.eos_id]
    ScriptedRouter.finish_reason = "stop"
    r = scripted.client.chat.completions.create(tool_choice="none", **kw)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "Let me check."


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": [{"role": "developer", "content": ""}]}, "messages"),
    ],
)
def test_bad_v4_requests_are_400(real, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        real.client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra})
    assert info.value.body["param"] == param
