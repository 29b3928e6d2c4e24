"""/v1/chat/completions for DeepSeek V4 checkpoints: request -> V4 prompt, output -> OpenAI fields.

Used when the model is DeepSeek V4 and its tokenizer ships no chat template (V4's release has none) and the
request brings none either. Request mapping (what `dsv4 chat-render` prints is exactly `render(req).text`):
- `tools` attach to the first message when it is a system or developer message (replacing tools it may
  carry), otherwise to a new empty system message inserted first - as vLLM's V4 port does, so the prompt
  reads `{system}\\n\\n## Tools ...` as in DeepSeek's fixtures;
- `chat_template_kwargs.thinking` (alias `enable_thinking`, default false) selects thinking mode;
  `chat_template_kwargs.drop_thinking` (default true) is the encoder's `drop_thinking`;
- `reasoning_effort`: "high" or "max" (a 400 otherwise); only "max" changes the prompt (thinking mode);
- assistant messages carry `reasoning_content` (or vLLM's name for it, `reasoning`) and `tool_calls`;
  `tool` messages carry `tool_call_id`; V4 extensions pass through (`latest_reminder` role, `task`,
  `wo_eos`, message-level `tools` / `response_format`).
- `tool_choice` / `parallel_tool_calls`: the prompt stays the reference encoder's whatever they say (V4's
  format has no field for them; forcing a call by pre-filling the assistant turn with a DSML block would
  make the prompt differ from the reference, and cannot work in thinking mode, where the thought comes
  first). They filter the parsed output: "none" returns no calls, a named function only calls to it,
  "auto" / "required" all of them (a "required" turn without a call is returned as the model wrote it),
  parallel_tool_calls=false the first call only (chat_parsing.select_calls). "required" and a named
  function need `tools` (a 400 otherwise), and a named function must be one of them.
- `add_generation_prompt` is not used: the encoder opens the assistant turn after a user turn itself.
Output: the completion is decoded with special tokens kept (the markers may be special tokens) and
parsed into `reasoning_content` (thinking mode), `content` and `tool_calls`, with finish_reason
"tool_calls" when a call ends the turn; streams emit the same fields as deltas (service/chat_stream.py).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from service import openai_protocol as P
from service.chat_encoding import REASONING_EFFORTS, THINK_START, encode_messages
from service.chat_parsing import ToolCall, log_dropped, parse_completion, select_calls
from service.chat_stream import ChatStreamParser


@dataclass(frozen=True)
class V4Prompt:
    """A request's prompt text and how to read the completion."""

    text: str
    thinking: bool  # the prompt opens a thought (ends with <think>): the output starts with reasoning
    tool_choice: str | dict | None
    parallel_tool_calls: bool


def is_v4_model(model_dir: str) -> bool:
    """config.json names DeepSeek V4 (model_type deepseek_v4 or a DeepseekV4 architecture)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return False
    return raw.get("model_type") == "deepseek_v4" or any(
        str(a).startswith("DeepseekV4") for a in raw.get("architectures") or []
    )


def uses_v4_encoding(model_dir: str, tokenizer) -> bool:
    """Chat requests without their own template get the V4 encoding on this model."""
    return tokenizer is not None and not tokenizer.chat_template and is_v4_model(model_dir)


def _flag(kwargs: dict, name: str, default: bool, alias: str | None = None) -> bool:
    value = kwargs.get(name, kwargs.get(alias, default) if alias else default)
    if not isinstance(value, bool):
        raise ValueError(f"chat_template_kwargs.{name} must be true or false, got {value!r}")
    return value


def _tool_names(tools: list) -> list[str]:
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
        ):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}, got {t!r}')
        names.append(fn["name"])
    return names


def _check_tool_choice(choice, names: list[str]) -> None:
    if choice in (None, "auto", "none"):
        return
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise ValueError(f"tool_choice {choice!r} needs `tools`")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
            if name not in names:
                raise ValueError(f"tool_choice names function {name!r}, which is not among the tools {names}")
        return
    raise ValueError(f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r}')


def _message(m: P.ChatMessage) -> dict:
    d = m.model_dump(exclude_unset=True)
    if "reasoning_content" not in d and "reasoning" in d:
        d["reasoning_content"] = d.pop("reasoning")
    return d


def render(req: P.ChatCompletionRequest) -> V4Prompt:
    """The V4 prompt of a chat request; ValueError naming what is wrong (the server's 400)."""
    kwargs = req.chat_template_kwargs or {}
    thinking = _flag(kwargs, "thinking", False, alias="enable_thinking")
    drop_thinking = _flag(kwargs, "drop_thinking", True)
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {req.reasoning_effort!r}")
    names = _tool_names(req.tools or [])
    _check_tool_choice(req.tool_choice, names)
    messages = [_message(m) for m in req.messages]
    if req.tools:
        if messages[0].get("role") in ("system", "developer"):
            messages[0]["tools"] = req.tools
        else:
            messages.insert(0, {"role": "system", "tools": req.tools})
    text = encode_messages(
        messages, thinking=thinking, drop_thinking=drop_thinking, reasoning_effort=req.reasoning_effort
    )
    return V4Prompt(text, text.endswith(THINK_START), req.tool_choice, req.parallel_tool_calls)


def _delta_call(index: int, call: ToolCall) -> P.DeltaToolCall:
    # A call is sent once it is complete: id, name and all its arguments in one piece.
    return P.DeltaToolCall(
        index=index,
        id=new_call_id(),
        type="function",
        function=P.ToolCallFunction(name=call.name, arguments=call.arguments),
    )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(text: str, thinking: bool, tool_choice=None, parallel: bool = True) -> dict:
    """A completion text -> {"content", "reasoning_content", "tool_calls"} (OpenAI's shapes; `dsv4 chat-parse`)."""
    parsed = parse_completion(text, thinking)
    calls = select_calls(parsed.calls, tool_choice, parallel)
    log_dropped(parsed.calls, calls, tool_choice, parallel)
    return {
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
        "tool_calls": [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }


class V4ChatRender(P.ChatRender):
    """ChatRender whose message is parsed V4 output: reasoning_content, content, tool_calls."""

    def __init__(self, req: P.ChatCompletionRequest, model: str, token_str, prompt: V4Prompt):
        super().__init__(req, model, token_str)
        self.prompt = prompt
        self.stream = ChatStreamParser(prompt.thinking, prompt.tool_choice, prompt.parallel_tool_calls)

    def _finish(self, job, n_calls: int) -> str | None:
        # A call ends the assistant's turn: OpenAI says "tool_calls" where the model stopped by itself.
        return (
            "tool_calls" if job.finish_reason == "stop" and n_calls and job.stop_reason is None else job.finish_reason
        )

    def response(self, job) -> P.ChatCompletionResponse:
        p = self.prompt
        out = parse_output(job.text.sent, p.thinking, p.tool_choice, p.parallel_tool_calls)
        calls = [P.ToolCallOut(**c) for c in out["tool_calls"]]
        resp = super().response(job)
        choice = resp.choices[0]
        choice.message = P.ChatResponseMessage(
            content=out["content"] or (None if calls else ""),
            tool_calls=calls or None,
            reasoning_content=out["reasoning_content"] if p.thinking else None,
        )
        choice.finish_reason = self._finish(job, len(calls))
        return resp

    def piece(self, job, token_id: int | None, logprob: float | None, delta: str):
        req, done = self.req, job.finish_reason is not None
        d = self.stream.feed(delta, final=done)
        with_token = token_id is not None and (req.logprobs or req.return_token_ids)
        if not (d or with_token or done):
            return None
        if not (with_token or done or job.stop_reason or d.calls) and bool(d.reasoning) != bool(d.content):
            # one text field only: the pre-rendered event (service.sse_chunks), bytes
            return self.texts(job, "content" if d.content else "reasoning_content", d.content or d.reasoning)
        lps = (
            P.chat_logprobs(self.token_str, [token_id], [logprob], req.top_logprobs)
            if req.logprobs and token_id is not None
            else None
        )
        delta_msg = P.DeltaMessage(
            reasoning_content=d.reasoning or None,
            content=d.content or None,
            tool_calls=[_delta_call(i, c) for i, c in d.calls] or None,
        )
        return self._chunk(
            job,
            delta_msg,
            logprobs=lps,
            finish_reason=self._finish(job, len(self.stream.calls)) if done else None,
            stop_reason=job.stop_reason,
            token_ids=[token_id] if req.return_token_ids and token_id is not None else None,
        )
