"""DeepSeek V4 prompt encoding (service/chat_encoding.py) and the request mapping (service/chat_v4.py).

tests/service/data/dsv4_chat/case_{1..4}.{json,txt} are the official fixtures published with the V4 weights
(`encoding/tests/test_input_N.json` / `test_output_N.txt`), rewritten as {thinking_mode, tools?, messages}:
inputs as mirrored in vLLM's tests/tokenizers_/fixtures/deepseek_v4/ (with DeepSeek's `reasoning_content`
where vLLM renamed it `reasoning`), outputs byte for byte (case 2's output, absent from vLLM's copy, as
quoted by several public ports of the encoder's tests). Case 5 (images) is out of scope (text-only model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service import chat_v4
from service.chat_encoding import BOS, EOS, MAX_EFFORT_PREAMBLE, encode_messages, render_tools
from service.chat_parsing import parse_completion
from service.openai_protocol import ChatCompletionRequest

DATA = Path(__file__).parent / "data" / "dsv4_chat"
CASES = ["1", "2", "3", "4"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo du jour",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def load_case(n: str) -> tuple[dict, str]:
    case = json.loads((DATA / f"case_{n}.json").read_text(encoding="utf-8"))
    return case, (DATA / f"case_{n}.txt").read_bytes().decode("utf-8")


def request_of(case: dict, **extra) -> ChatCompletionRequest:
    body = {
        "messages": case["messages"],
        "chat_template_kwargs": {"thinking": case["thinking_mode"] == "thinking"},
        **({"tools": case["tools"]} if "tools" in case else {}),
        **extra,
    }
    return ChatCompletionRequest.model_validate(body)


def render(messages, **kw) -> str:
    return chat_v4.render(ChatCompletionRequest.model_validate({"messages": messages, **kw})).text


@pytest.mark.parametrize("n", CASES)
def test_official_fixtures_encode(n):
    case, gold = load_case(n)
    messages = [dict(m) for m in case["messages"]]
    if "tools" in case:  # the official test attaches the case's tools to the first message
        messages[0] = {**messages[0], "tools": case["tools"]}
    assert encode_messages(messages, thinking=case["thinking_mode"] == "thinking") == gold


@pytest.mark.parametrize("n", CASES)
def test_official_fixtures_through_the_request_mapping(n):
    case, gold = load_case(n)
    prompt = chat_v4.render(request_of(case))
    assert prompt.text == gold
    assert not prompt.thinking  # each fixture ends with a closed assistant turn


def test_official_fixture_turns_parse_back():
    """The official test's parse checks: each assistant turn of the gold prompts parses to its message."""
    _, gold = load_case("1")
    marker = "<｜Assistant｜><think>"
    start = gold.find(marker) + len(marker)
    first = parse_completion(gold[start : gold.find("<｜User｜>", start)], thinking=True)
    assert first.reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert first.content == "" and [c.name for c in first.calls] == ["get_weather"]
    assert first.calls[0].arguments == '{"location": "Beijing", "unit": "celsius"}'
    last = parse_completion(gold[gold.rfind(marker) + len(marker) :], thinking=True)
    assert last.reasoning == "Got the weather data. Let me format a nice response."
    assert "22°C" in last.content and last.calls == []
    _, gold2 = load_case("2")
    last = parse_completion(gold2[gold2.rfind(marker) + len(marker) :], thinking=True)
    assert (last.reasoning, last.content, last.calls) == (
        "The user asks about the capital of France. It is Paris.",
        "The capital of France is Paris.",
        [],
    )
    assert "The user said hello" not in gold2  # dropped from the earlier turn


def test_generation_prompt_chat_and_thinking():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(msgs) == BOS + "<｜User｜>Hi<｜Assistant｜></think>"
    p = chat_v4.render(
        ChatCompletionRequest.model_validate({"messages": msgs, "chat_template_kwargs": {"thinking": True}})
    )
    assert p.text == BOS + "<｜User｜>Hi<｜Assistant｜><think>" and p.thinking


def test_tools_attach_to_system_developer_or_a_new_system_message():
    tools_section = render_tools([WEATHER])
    assert '{"name": "get_weather", "description": "Météo du jour"' in tools_section  # non-ASCII kept
    user = [{"role": "user", "content": "Hi"}]
    assert render(user, tools=[WEATHER]) == BOS + "\n\n" + tools_section + "<｜User｜>Hi<｜Assistant｜></think>"
    sys_first = [{"role": "system", "content": "S"}, *user]
    assert render(sys_first, tools=[WEATHER]) == BOS + "S\n\n" + tools_section + "<｜User｜>Hi<｜Assistant｜></think>"
    dev_first = [{"role": "developer", "content": "D"}]
    assert render(dev_first, tools=[WEATHER]) == BOS + "<｜User｜>D\n\n" + tools_section + "<｜Assistant｜></think>"


def tool_turns(result_order: list[str]) -> list[dict]:
    calls = [
        {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for cid, c in (("a", "Paris"), ("b", "東京"))
    ]
    results = {"a": "sunny", "b": "雨"}
    return [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "R1", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": cid, "content": results[cid]} for cid in result_order),
        {"role": "assistant", "reasoning_content": "R2", "content": "Paris sunny, 東京 雨."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_multi_turn_tools_with_results_out_of_order():
    block = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">東京</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    want = (
        BOS
        + "S\n\n"
        + render_tools([WEATHER])
        + "<｜User｜>Weather?<｜Assistant｜><think>R1</think>"
        + block
        + EOS
        + "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>雨</tool_result>"
        + "<｜Assistant｜><think>R2</think>Paris sunny, 東京 雨."
        + EOS
        + "<｜User｜>Thanks!<｜Assistant｜><think>"
    )
    kw = dict(tools=[WEATHER], chat_template_kwargs={"thinking": True})
    # results come back in call order whatever order the client sent them in; tools keep all reasoning
    assert render(tool_turns(["b", "a"]), **kw) == render(tool_turns(["a", "b"]), **kw) == want


def test_thinking_dropped_and_kept():
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "reasoning_content": "T1", "content": "A1"},
        {"role": "developer", "content": "note"},
        {"role": "user", "content": "Q2"},
    ]
    dropped = render(msgs, chat_template_kwargs={"thinking": True})
    # earlier reasoning and the developer turn before the last user turn are dropped
    assert dropped == BOS + "<｜User｜>Q1<｜Assistant｜></think>A1" + EOS + "<｜User｜>Q2<｜Assistant｜><think>"
    kept = render(msgs, chat_template_kwargs={"thinking": True, "drop_thinking": False})
    assert kept == (
        BOS
        + "<｜User｜>Q1<｜Assistant｜><think>T1</think>A1"
        + EOS
        + "<｜User｜>note"
        + "<｜User｜>Q2<｜Assistant｜><think>"
    )
    chat = render(msgs)  # chat mode: no reasoning anywhere
    assert (
        chat
        == BOS + "<｜User｜>Q1<｜Assistant｜></think>A1" + EOS + "<｜User｜>note<｜User｜>Q2<｜Assistant｜></think>"
    )


def test_reasoning_effort():
    msgs = [{"role": "user", "content": "Q"}]
    think = {"chat_template_kwargs": {"thinking": True}}
    assert (
        render(msgs, reasoning_effort="max", **think) == BOS + MAX_EFFORT_PREAMBLE + "<｜User｜>Q<｜Assistant｜><think>"
    )
    assert render(msgs, reasoning_effort="high", **think) == render(msgs, **think)
    assert render(msgs, reasoning_effort="max") == render(msgs)  # the preamble is for thinking mode only
    with pytest.raises(ValueError, match="reasoning_effort"):
        render(msgs, reasoning_effort="low")


def test_unicode_arguments_and_content():
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "f", "arguments": json.dumps({"s": "😀 naïve", "n": [1, "é"], "o": {"k": None}})},
    }
    text = render(
        [{"role": "user", "content": "¿Qué? 你好"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    )
    assert (
        '<｜DSML｜parameter name="s" string="true">😀 naïve</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">[1, "é"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="o" string="false">{"k": null}</｜DSML｜parameter>'
    ) in text
    assert text.startswith(BOS + "<｜User｜>¿Qué? 你好<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>")


def test_reasoning_alias_and_content_parts():
    a = render(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "reasoning": "R", "content": "C"},
        ],
        chat_template_kwargs={"thinking": True},
    )
    assert a == BOS + "<｜User｜>a\nb<｜Assistant｜><think>R</think>C" + EOS


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": [{"role": "developer", "content": ""}]}, "developer message needs content"),
        ({"messages": [{"role": "function", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": None}]}]}, "text content parts"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "needs `tools`"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "not among the tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, r"tools\[0\]"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "yes"}}, "thinking"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
            "JSON object",
        ),
    ],
)
def test_bad_requests_raise_value_error(body, needle):
    with pytest.raises(ValueError, match=needle):
        chat_v4.render(ChatCompletionRequest.model_validate(body))
