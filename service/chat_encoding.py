"""DeepSeek V4's prompt format: chat messages -> the exact prompt text the checkpoint was trained on.

V4 ships no Jinja chat template; its format is defined by the Python encoder published with the weights
(`encoding/encoding_dsv4.py`, with fixtures `encoding/tests/test_input_*.json` / `test_output_*.txt`).
This is our own implementation of the same bytes (checked against those fixtures in
tests/service/test_chat_encoding.py):

    BOS [max-effort preamble] system-content ["\\n\\n" tools section]
    <｜User｜>user-content <｜Assistant｜>(<think> | </think>) [reasoning </think>] content
        ["\\n\\n" <｜DSML｜tool_calls> block] <｜end▁of▁sentence｜> ...

- `tool` messages become `<tool_result>...</tool_result>` blocks of a user turn (V4 has no tool role);
  consecutive user turns and tool results merge into one turn, parts joined by a blank line; results are
  put in the order of the calls of the preceding assistant turn (matched by `tool_call_id`).
- `developer` is a user turn (`<｜User｜>`) that may carry tools; `latest_reminder` is
  `<｜latest_reminder｜>content`; a user turn with `task` ends with that task's token.
- thinking mode: a turn after a user turn opens with `<think>`, else with `</think>`. With `drop_thinking`
  (the default) reasoning before the last user turn is dropped (and so are earlier developer turns) -
  unless any message carries tools, which keeps every turn's reasoning.
- `reasoning_effort="max"` in thinking mode prefixes the whole prompt with the max-effort preamble.

Messages are plain dicts in OpenAI's shape (`tool_calls[i].function.arguments` a JSON string or a dict).
Malformed messages raise ValueError naming the message (the HTTP layer turns that into a 400).
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# Tokens the V4 tokenizer must hold as single (added) tokens for the prompt to tokenise as trained.
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, *TASK_TOKENS.values())
REASONING_EFFORTS = ("high", "max")  # "high" adds nothing; "max" adds the preamble below

MAX_EFFORT_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{D}tool_calls>" block like the following:

<{D}tool_calls>
<{D}invoke name="$TOOL_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$TOOL_NAME2">
...
</{D}invoke>
</{D}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {S}), you MUST output your complete reasoning inside {S}...{E} BEFORE \
any tool calls or final response.

Otherwise, output directly after {E} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON as the encoder writes it: `json.dumps` defaults (", " / ": "), non-ASCII kept as is."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(tools: list[dict]) -> str:
    """OpenAI `tools` ([{"type": "function", "function": {...}}]) -> the tools section of a system turn."""
    try:
        schemas = "\n".join(to_json(t["function"]) for t in tools)
    except (TypeError, KeyError):
        raise ValueError('each tool must be {"type": "function", "function": {...}}') from None
    return (
        _TOOLS_SECTION.replace("{D}", DSML)
        .replace("{S}", THINK_START)
        .replace("{E}", THINK_END)
        .replace("{schemas}", schemas)
    )


def _call_arguments(call: dict) -> dict:
    """A tool call's arguments as a dict: a JSON object string, a dict, or else {"arguments": raw}."""
    try:
        fn = call["function"]
        name, raw = fn["name"], fn.get("arguments", "{}")
    except (TypeError, KeyError):
        raise ValueError(f"tool call {call!r} needs function.name and function.arguments") from None
    if not isinstance(name, str):
        raise ValueError(f"tool call function.name must be a string, got {name!r}")
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw)
    except (TypeError, ValueError):
        return {"arguments": raw}  # what the reference does with arguments that are not JSON
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {raw!r}")
    return args


def render_tool_calls(calls: list[dict]) -> str:
    """OpenAI tool calls -> the DSML block (without the blank line the assistant turn puts before it)."""
    invokes = []
    for call in calls:
        params = [
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else to_json(v)}{PARAM_CLOSE}"
            for k, v in _call_arguments(call).items()
        ]
        invokes.append(f'{INVOKE_OPEN} name="{call["function"]["name"]}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _text(content, where: str) -> str | None:
    """Message content -> text; a list of parts is joined with newlines (text parts only)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise ValueError(f"{where}: only text content parts are supported, got {p!r}")
            parts.append(p.get("text") or "")
        return "\n".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


# ---- preprocessing ------------------------------------------------------------------------------
def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool messages -> `tool_result` blocks of user turns; consecutive user turns merge into one."""
    merged: list[dict] = []
    for m in messages:
        role = m.get("role")
        prev = merged[-1] if merged else None
        joinable = prev is not None and prev.get("role") == "user" and "blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id") or "", "content": m.get("content", "")}
            if prev is not None and joinable:
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": m.get("content", "")}
            if prev is not None and joinable and prev.get("task") is None:
                prev["blocks"].append(block)
            else:
                merged.append(
                    {
                        "role": "user",
                        "content": m.get("content", ""),
                        "blocks": [block],
                        **{k: m[k] for k in ("task", "wo_eos", "mask") if k in m},
                    }
                )
        else:
            merged.append(dict(m))
    return merged


def sort_tool_results(messages: list[dict]) -> list[dict]:
    """Within each user turn, put tool results in the order of the last assistant turn's calls."""
    order: dict[str, int] = {}
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            order = {}
            for i, call in enumerate(m["tool_calls"]):
                cid = call.get("id") or (call.get("function") or {}).get("id") or ""
                if cid:
                    order[cid] = i
        elif m.get("role") == "user" and m.get("blocks"):
            results = [b for b in m["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))  # stable: ties keep order
                m["blocks"] = [next(ranked) if b["type"] == "tool_result" else b for b in m["blocks"]]
    return messages


def last_user_index(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def drop_earlier_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns are dropped."""
    last = last_user_index(messages)
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last:
            out.append(m)
        elif role == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return out


# ---- rendering ----------------------------------------------------------------------------------
def _user_turn(m: dict) -> str:
    blocks = m.get("blocks")
    if not blocks:
        return USER + (m.get("content") or "")
    parts = []
    for b in blocks:
        if b["type"] == "text":
            parts.append(b["text"])
        else:
            content = b["content"]
            if isinstance(content, list):  # the reference's handling of content parts in a tool result
                content = "\n\n".join(
                    p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in content
                )
            parts.append(f"<tool_result>{content}</tool_result>")
    if any(not isinstance(p, str) for p in parts):
        raise ValueError(f"user message content must be text, got {m.get('content')!r}")
    return USER + "\n\n".join(parts)


def _with_tools(text: str, m: dict) -> str:
    if m.get("tools"):
        text += "\n\n" + render_tools(m["tools"])
    if m.get("response_format"):
        text += "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" + to_json(
            m["response_format"]
        )
    return text


def _assistant_turn(i: int, messages: list[dict], thinking: bool, drop_thinking: bool, last_user: int) -> str:
    m = messages[i]
    calls = "\n\n" + render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
    reasoning = ""
    after_task = i > 0 and messages[i - 1].get("task") is not None
    if thinking and not after_task and (not drop_thinking or i > last_user):
        reasoning = (m.get("reasoning_content") or "") + THINK_END
    return reasoning + (m.get("content") or "") + calls + ("" if m.get("wo_eos") else EOS)


def render_message(
    i: int, messages: list[dict], thinking: bool, drop_thinking: bool, reasoning_effort: str | None
) -> str:
    """Message `i` of the (preprocessed) conversation, with what it hands over to the next turn."""
    m, role = messages[i], messages[i].get("role")
    last_user = last_user_index(messages)
    out = MAX_EFFORT_PREAMBLE if i == 0 and thinking and reasoning_effort == "max" else ""
    if role == "system":
        out += _with_tools(m.get("content") or "", m)
    elif role == "developer":
        if not m.get("content"):
            raise ValueError(f"messages[{i}]: a developer message needs content")
        out += _with_tools(USER + m["content"], m)
    elif role == "user":
        out += _user_turn(m)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + f"{m.get('content')}"
    elif role == "assistant":
        out += _assistant_turn(i, messages, thinking, drop_thinking, last_user)
    else:
        raise ValueError(
            f"messages[{i}]: unknown role {role!r} (system, developer, user, assistant, tool, latest_reminder)"
        )
    if i + 1 < len(messages) and messages[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = m.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"messages[{i}]: unknown task {task!r}; known: {sorted(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return out


def encode_messages(
    messages: list[dict],
    thinking: bool = False,
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    add_bos: bool = True,
) -> str:
    """The V4 prompt of a conversation (OpenAI-shaped dicts; tools on a system/developer message)."""
    if reasoning_effort not in (None, *REASONING_EFFORTS):
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {m!r}")
        if "content" in m and m.get("role") != "tool":  # tool results keep their parts (the reference's rule)
            m = {**m, "content": _text(m["content"], f"messages[{i}]")}
        msgs.append(dict(m))
    msgs = sort_tool_results(merge_tool_messages(msgs))
    drop = drop_thinking and not any(m.get("tools") for m in msgs)  # tools keep all reasoning
    if thinking and drop:
        msgs = drop_earlier_thinking(msgs)
    prompt = BOS if add_bos else ""
    for i in range(len(msgs)):
        prompt += render_message(i, msgs, thinking, drop, reasoning_effort)
    return prompt
