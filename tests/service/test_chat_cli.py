"""`dsv4 chat-render` / `dsv4 chat-parse`: the exact prompt bytes of a request, and the parse of a completion."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main
from tests.service.test_chat_encoding import CASES, load_case

REPO = Path(__file__).resolve().parents[2]
TOOL_COMPLETION = (
    'I need the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Zürich</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
)


def request_file(tmp_path, n: str) -> Path:
    case, _ = load_case(n)
    body = {
        "model": "x",
        "messages": case["messages"],
        "chat_template_kwargs": {"thinking": case["thinking_mode"] == "thinking"},
        **({"tools": case["tools"]} if "tools" in case else {}),
    }
    path = tmp_path / f"req_{n}.json"
    path.write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("n", CASES)
def test_chat_render_prints_the_fixture_bytes(tmp_path, capsysbinary, n):
    _, gold = load_case(n)
    assert main(["chat-render", "--request", str(request_file(tmp_path, n))]) == 0
    assert capsysbinary.readouterr().out == gold.encode("utf-8")  # nothing added, UTF-8


def test_chat_render_with_the_built_in_model(tmp_path, capsysbinary):
    from engine.loading.make_model import default_model_dir

    path = request_file(tmp_path, "2")
    assert main(["chat-render", "--request", str(path), "--model", default_model_dir()]) == 0
    assert capsysbinary.readouterr().out == load_case("2")[1].encode("utf-8")


def test_chat_render_bad_request(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"}))
    assert main(["chat-render", "--request", str(path)]) == 2
    assert "reasoning_effort" in capsys.readouterr().err


def run_parse(monkeypatch, capsysbinary, text: str, *flags: str) -> dict:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8"))
    assert main(["chat-parse", *flags]) == 0
    return json.loads(capsysbinary.readouterr().out.decode("utf-8"))


def test_chat_parse_tool_call(monkeypatch, capsysbinary):
    out = run_parse(monkeypatch, capsysbinary, TOOL_COMPLETION, "--thinking")
    assert set(out) == {"content", "reasoning_content", "tool_calls"}
    assert out["reasoning_content"] == "I need the weather." and out["content"] == ""
    (call,) = out["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Zürich", "days": 2}'}


def test_chat_parse_fixture_turn_without_thinking(monkeypatch, capsysbinary):
    _, gold = load_case("4")
    out = run_parse(monkeypatch, capsysbinary, gold[gold.rfind("<｜action｜>") + len("<｜action｜>") :])
    assert out == {"content": "Search", "reasoning_content": "", "tool_calls": []}


def test_console_round_trip_bytes(tmp_path):
    """The real process: stdout bytes of chat-render, stdin bytes of chat-parse (no locale in the way)."""
    env = {"PYTHONIOENCODING": "ascii", "LC_ALL": "C", "PATH": "/usr/bin:/bin"}
    path = request_file(tmp_path, "3")
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "chat-render", "--request", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        check=True,
    ).stdout
    assert out == load_case("3")[1].encode("utf-8")
    res = subprocess.run(
        [sys.executable, "-m", "service.cli", "chat-parse", "--thinking"],
        cwd=REPO,
        env=env,
        input=TOOL_COMPLETION.encode("utf-8"),
        capture_output=True,
        check=True,
    ).stdout
    assert (
        json.loads(res.decode("utf-8"))["tool_calls"][0]["function"]["arguments"] == '{"location": "Zürich", "days": 2}'
    )


def test_chat_render_follows_the_model(tmp_path, capsysbinary):
    """A model whose tokenizer has a chat template renders that (as the server does); a model that is not
    V4 and has none is an error."""
    import shutil

    from engine.loading.make_model import default_model_dir

    src, model = Path(default_model_dir()), tmp_path / "templated"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, model / name)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "héllo"}]}))
    assert main(["chat-render", "--request", str(req), "--model", str(model)]) == 0
    assert capsysbinary.readouterr().out == "<｜begin▁of▁sentence｜>[user]héllo".encode()
    raw = json.loads((model / "config.json").read_text())
    raw.update(model_type="other", architectures=["OtherForCausalLM"])
    (model / "config.json").write_text(json.dumps(raw))
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main(["chat-render", "--request", str(req), "--model", str(model)]) == 2
