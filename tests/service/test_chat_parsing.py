"""V4 completion parsing (service/chat_parsing.py) and its streaming form (service/chat_stream.py).

The streaming parser is fed every split point of tool-call and thinking texts (and every character one
at a time): what it emits must add up to the full parse, and no delta may carry a byte of a marker.
"""

from __future__ import annotations

import json
import random

import pytest

from service.chat_encoding import EOS
from service.chat_parsing import ToolCall, parse_completion, scan, select_calls
from service.chat_stream import ChatStreamParser

D = "｜DSML｜"


def block(*invokes: str) -> str:
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def invoke(name: str, **params) -> str:
    ps = [
        f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>"
        for k, v in params.items()
    ]
    return f'<{D}invoke name="{name}">\n' + "\n".join(ps) + f"\n</{D}invoke>"


TOOL_TEXT = (
    "The user wants weather; call get_weather twice.</think>Checking both."
    + block(invoke("get_weather", city="Paris", days=3), invoke("search", q="東京 天気", opts={"n": [1, 2]}))
    + EOS
)
THINK_TEXT = "Let me think: 2 + 2 = 4 <not a tag>.</think>The answer is **4**.\n\nDone." + EOS
STRAY_TEXT = "<think>T <b>bold</b></think>A</think>B<think>C\n\nD" + EOS + "junk after the end"
TWO_BLOCKS_TEXT = "First." + block(invoke("a", x=1)) + "\n\nThen more." + block(invoke("b", y="z"), invoke("c")) + EOS
MALFORMED_TEXT = (
    "Hmm.</think>Calling." + f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x">1'
    f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>" + EOS
)
TRUNCATED_TEXT = "Hmm.</think>Calling." + f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" str'


def test_tool_calls_parse_with_non_string_parameters_decoded():
    p = parse_completion(TOOL_TEXT, thinking=True)
    assert p.reasoning == "The user wants weather; call get_weather twice."
    assert p.content == "Checking both." and p.errors == []
    assert [c.name for c in p.calls] == ["get_weather", "search"]
    # the reference decoder's exact text: string values JSON-quoted (non-ASCII kept), JSON values verbatim
    assert p.calls[0].arguments == '{"city": "Paris", "days": 3}'
    assert p.calls[1].arguments == '{"q": "東京 天気", "opts": {"n": [1, 2]}}'
    assert json.loads(p.calls[1].arguments) == {"q": "東京 天気", "opts": {"n": [1, 2]}}


def test_every_json_type_and_awkward_strings():
    text = (
        block(invoke("f", i=-7, x=1.5, t=True, n=None, a=[1, "b"], o={"k": "v"}, s='quote " and \\ and\nnewline', e=""))
        + EOS
    )
    call = parse_completion(text, thinking=False).calls[0]
    assert json.loads(call.arguments) == {
        "i": -7,
        "x": 1.5,
        "t": True,
        "n": None,
        "a": [1, "b"],
        "o": {"k": "v"},
        "s": 'quote " and \\ and\nnewline',
        "e": "",
    }
    empty = parse_completion(block(f'<{D}invoke name="noargs">\n</{D}invoke>') + EOS, thinking=False)
    assert empty.calls == [ToolCall("noargs", "{}")]


def test_chat_mode_plain_content():
    assert parse_completion("Hello <b>world</b>" + EOS, thinking=False).content == "Hello <b>world</b>"
    no_eos = parse_completion("Hello", thinking=False)
    assert (no_eos.content, no_eos.reasoning, no_eos.calls) == ("Hello", "", [])


def test_two_blocks_and_stray_markers():
    two = parse_completion(TWO_BLOCKS_TEXT, thinking=False)
    assert two.content == "First.\n\nThen more." and [c.name for c in two.calls] == ["a", "b", "c"]
    stray = parse_completion(STRAY_TEXT, thinking=True)
    assert (stray.reasoning, stray.content) == ("T <b>bold</b>", "ABC\n\nD")


def test_degradations_never_raise():
    truncated_thought = parse_completion("still thinking about it", thinking=True)
    assert (truncated_thought.reasoning, truncated_thought.content) == ("still thinking about it", "")
    stray = parse_completion("<think>T</think>A</think>B<think>C" + EOS + "junk", thinking=True)
    assert (stray.reasoning, stray.content) == ("T", "ABC") and len(stray.errors) == 1  # junk after EOS
    # a block that ends the thought without </think>: the reasoning ends there
    early = parse_completion("thinking" + block(invoke("f", a=1)) + EOS, thinking=True)
    assert (early.reasoning, early.content, [c.name for c in early.calls]) == ("thinking", "", ["f"])


@pytest.mark.parametrize("text", [MALFORMED_TEXT, TRUNCATED_TEXT])
def test_malformed_or_truncated_block_becomes_content(text, caplog):
    p = parse_completion(text, thinking=True)
    raw = text[text.index("</think>") + len("</think>") :].removesuffix(EOS)
    assert p.reasoning == "Hmm." and p.calls == [] and p.content == raw  # as the model wrote it
    assert "malformed tool-call block" in caplog.text


def test_a_call_is_settled_when_its_invoke_closes():
    first, second = invoke("a", x=1), invoke("b", y="z")
    cut = "Go." + block(first, second)[: -len(f"</{D}invoke>\n</{D}tool_calls>") - 3]  # second invoke cut off
    p = parse_completion(cut, thinking=False)
    assert p.calls == [ToolCall("a", '{"x": 1}')]
    assert p.content == "Go." + cut[cut.index(first) + len(first) :]  # the broken rest, as written
    at_close = parse_completion("Go." + block(first)[:-5], thinking=False)  # cut inside </｜DSML｜tool_calls>
    assert (at_close.content, at_close.calls) == ("Go.", [ToolCall("a", '{"x": 1}')])
    # streamed: the first call goes out as soon as its invoke closes, before the block does
    text = "Go." + block(first, second) + EOS
    parser = ChatStreamParser(thinking=False)
    upto = text.index(f"</{D}invoke>") + len(f"</{D}invoke>")
    assert [c.name for _, c in parser.feed(text[:upto]).calls] == ["a"]
    rest = parser.feed(text[upto:], final=True)
    assert [(i, c.name) for i, c in rest.calls] == [(1, "b")] and rest.content == ""


def test_duplicate_parameter_and_non_json_value():
    dup = block(
        f'<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
        f'<{D}parameter name="a" string="true">2</{D}parameter>\n</{D}invoke>'
    )
    assert parse_completion(dup + EOS, thinking=False).calls == []
    loose = block(f'<{D}invoke name="f">\n<{D}parameter name="a" string="false">not json</{D}parameter>\n</{D}invoke>')
    assert parse_completion(loose + EOS, thinking=False).calls == [ToolCall("f", '{"a": "not json"}')]


def test_select_calls():
    calls = [ToolCall("a", "{}"), ToolCall("b", "{}"), ToolCall("a", '{"x": 1}')]
    assert select_calls(calls, "auto", True) == calls == select_calls(calls, None, True)
    assert select_calls(calls, "required", True) == calls
    assert select_calls(calls, "none", True) == []
    assert select_calls(calls, {"type": "function", "function": {"name": "a"}}, True) == [calls[0], calls[2]]
    assert select_calls(calls, "auto", False) == [calls[0]]


# ---- streaming --------------------------------------------------------------------------------------
MARKER_BYTES = ("｜", "<think", "</think", "<｜", "DSML")


def stream(pieces: list[str], thinking: bool, **kw):
    """Feed `pieces` (the last one final) -> (deltas, reasoning, content, [(index, call)])."""
    parser = ChatStreamParser(thinking, **kw)
    deltas = [parser.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    return (
        deltas,
        "".join(d.reasoning for d in deltas),
        "".join(d.content for d in deltas),
        [ic for d in deltas for ic in d.calls],
    )


def splits_of(text: str):
    yield list(text)  # one character at a time
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rnd = random.Random(0)
    for _ in range(200):
        cuts = sorted(rnd.sample(range(1, len(text)), 3))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    "name, text, thinking",
    [
        ("tool_calls", TOOL_TEXT, True),
        ("thinking", THINK_TEXT, True),
        ("stray_markers", STRAY_TEXT, True),
        ("chat_tool_calls", TOOL_TEXT.split("</think>")[1], False),
        ("two_blocks", TWO_BLOCKS_TEXT, False),
    ],
)
def test_stream_every_split_point(name, text, thinking):
    full = parse_completion(text, thinking)
    for pieces in splits_of(text):
        deltas, r, c, calls = stream(pieces, thinking)
        assert (r, c, [call for _, call in calls]) == (full.reasoning, full.content, full.calls), pieces
        assert [i for i, _ in calls] == list(range(len(full.calls)))
        for d in deltas:
            for m in MARKER_BYTES:
                assert m not in d.reasoning and m not in d.content, (pieces, d)
            assert not d.content.endswith("\n\n<") and "\ufffd" not in d.content


@pytest.mark.parametrize("text", [MALFORMED_TEXT, TRUNCATED_TEXT])
def test_stream_malformed_matches_full_parse(text):
    full = parse_completion(text, thinking=True)
    for pieces in splits_of(text):
        deltas, r, c, calls = stream(pieces, thinking=True)
        assert (r, c, calls) == (full.reasoning, full.content, [])
        # nothing of the block is shown before it is known to be broken: its first bad invoke has closed
        # (MALFORMED_TEXT) or the output has ended (TRUNCATED_TEXT)
        fed = ""
        for piece, d in zip(pieces[:-1], deltas):
            fed += piece
            assert D not in d.content or f"</{D}invoke>" in fed, (pieces, d)


def test_stream_tool_choice_none_and_single_call():
    pieces = list(TOOL_TEXT)
    _, _, content, calls = stream(pieces, True, tool_choice="none")
    assert content == "Checking both." and calls == []
    _, _, _, calls = stream(pieces, True, parallel_tool_calls=False)
    assert [(i, c.name) for i, c in calls] == [(0, "get_weather")]


def test_scan_holds_back_only_possible_markers():
    assert scan("abc\n\n<｜DS", thinking=False, final=False).content == "abc"
    assert scan("abc\n\nx", thinking=False, final=False).content == "abc\n\nx"
    assert scan("abc</th", thinking=True, final=False).reasoning == "abc"
    assert scan("a < b", thinking=False, final=False).content == "a < b"
