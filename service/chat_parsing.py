"""DeepSeek V4 completion text -> OpenAI assistant fields: reasoning_content, content, tool_calls.

The grammar is the one the V4 encoder writes (service/chat_encoding.py):

    [reasoning </think>] content ["\\n\\n" <｜DSML｜tool_calls> invoke* </｜DSML｜tool_calls>] [<｜end▁of▁sentence｜>]

    invoke = <｜DSML｜invoke name="NAME"> ( <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter> )*
             </｜DSML｜invoke>

A parameter with string="true" is the raw string V; with string="false" V is JSON (numbers, booleans,
arrays, objects). `arguments` is built the way DeepSeek's reference decoder builds it: `{"K": V, ...}` with
", " / ": " separators, string values JSON-quoted (non-ASCII kept), JSON values inserted verbatim - so for
well-formed text the output equals the reference's byte for byte.

Where the reference raises, this parser degrades (a server must never 500 on what a model wrote):
- no `</think>` in thinking mode: everything is reasoning (a truncated thought);
- a stray `<think>` / `</think>` is dropped; text after the end-of-sentence token is dropped;
- in a tool-call block, each whole, well-formed invoke is a call; from the first broken or cut-off
  (max_tokens) invoke on, the text is plain content, byte for byte as the model wrote it (from the block's
  blank line when none of its calls was whole), and a warning is logged; a block cut off inside its
  closing tag keeps its calls;
- a string="false" value that is not JSON is passed on as a string (logged), so `arguments` is always JSON.

`Scanner` runs the same parse over an output fed in pieces and returns only what can no longer change (a
tail that may be the start of a marker, and an open invoke of a tool-call block, are held back), which lets
service/chat_stream.py stream without ever leaking a marker byte; `scan(text, final=False)` is one piece.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from service.chat_encoding import (
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    to_json,
)

log = logging.getLogger(__name__)

_BLOCK_LEAD = "\n\n"  # the encoder writes a blank line before a tool-call block; it belongs to the block
_TEXT_MARKERS = (THINK_END, THINK_START, TOOL_CALLS_OPEN, EOS)
_HOLD = (_BLOCK_LEAD + TOOL_CALLS_OPEN, *_TEXT_MARKERS)  # a tail that may still become one of these waits
_INVOKE_HEAD = re.compile(re.escape(INVOKE_OPEN) + r'\s+name="(.*?)">\s*', re.DOTALL)
_PARAM_HEAD = re.compile(re.escape(PARAM_OPEN) + r'\s+name="(.*?)"\s+string="(true|false)">', re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function name and its arguments as a JSON object string."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """What a (prefix of a) completion says. `final=False` scans hold back what may still change."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # degradations (malformed blocks, junk after EOS)


class _Malformed(ValueError):
    pass


def _held(text: str) -> int:
    """How many trailing characters of `text` could be the start of a marker (and must wait)."""
    for k in range(min(len(text), max(map(len, _HOLD)) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in _HOLD):
            return k
    return 0


def _value(name: str, raw: str, is_string: bool) -> str:
    if is_string:
        return to_json(raw)
    try:
        json.loads(raw)
    except ValueError:
        log.warning('tool parameter %r is marked string="false" but is not JSON: passed on as a string', name)
        return to_json(raw)
    return raw  # verbatim, as the reference decoder inserts it


def parse_invoke(text: str) -> ToolCall:
    """One complete `<｜DSML｜invoke ...>...</｜DSML｜invoke>` -> ToolCall; _Malformed otherwise."""
    head = _INVOKE_HEAD.match(text)
    if head is None:
        raise _Malformed(f"bad invoke header: {text[:80]!r}")
    pos, args, body_end = head.end(), {}, len(text) - len(INVOKE_CLOSE)
    while pos < body_end:
        p = _PARAM_HEAD.match(text, pos)
        if p is None:
            raise _Malformed(f"expected a parameter at {text[pos : pos + 60]!r}")
        end = text.find(PARAM_CLOSE, p.end())
        if end < 0 or end > body_end:
            raise _Malformed(f"unterminated parameter {p.group(1)!r}")
        name = p.group(1)
        if name in args:
            raise _Malformed(f"duplicate parameter {name!r}")
        args[name] = _value(name, text[p.end() : end], p.group(2) == "true")
        pos = end + len(PARAM_CLOSE)
        while pos < body_end and text[pos].isspace():
            pos += 1
    arguments = "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in args.items()) + "}"
    return ToolCall(head.group(1), arguments)


def _block_step(text: str, pos: int, final: bool) -> tuple[str, ToolCall | None, int]:
    """One step inside a tool-call block, from `pos` (after the opening tag or the last invoke).

    -> ("call", call, after it) | ("close", None, after the closing tag) | ("wait", None, pos) when the text
    so far cannot tell yet. _Malformed when it can never be right (with `final`: when it is not complete)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    rest = text[pos:]
    if rest.startswith(TOOL_CALLS_CLOSE):
        return "close", None, pos + len(TOOL_CALLS_CLOSE)
    if rest.startswith(INVOKE_OPEN):
        end = text.find(INVOKE_CLOSE, pos)
        if end >= 0:
            return "call", parse_invoke(text[pos : end + len(INVOKE_CLOSE)]), end + len(INVOKE_CLOSE)
        if final:
            raise _Malformed("unterminated invoke (output cut off?)")
        return "wait", None, pos
    if final and TOOL_CALLS_CLOSE.startswith(rest):  # cut off at the closing tag: the calls are whole
        return "cut", None, len(text)
    if not final and (TOOL_CALLS_CLOSE.startswith(rest) or INVOKE_OPEN.startswith(rest)):
        return "wait", None, pos
    raise _Malformed(f"expected an invoke or the end of the block at {rest[:60]!r}")


class Scanner:
    """The parse of an output fed in pieces: each `feed` returns only what became settled.

    It keeps only the unsettled tail of the text (a possible marker start, or the open invoke of a tool-call
    block), so the work per piece is the piece plus that tail, however long the output grows. A call is
    settled when its invoke closes; a block that turns out broken becomes content from where it broke (from
    its blank line if none of its calls was whole), as the model wrote it, up to the end of sentence."""

    def __init__(self, thinking: bool):
        # modes: "reasoning", "content", "block" (inside a tool-call block), "raw" (a broken block), "done"
        self.mode = "reasoning" if thinking else "content"
        self.buf = ""  # text not settled yet (it starts where the settled text ends)
        self.block_head = ""  # the opening of the current block, until one of its calls is whole
        self.errors: list[str] = []

    def _broken(self, err: _Malformed, buf: str, pos: int) -> tuple[str, int]:
        self.errors.append(f"malformed tool-call block kept as text: {err}")
        self.mode = "raw"
        head, self.block_head = self.block_head, ""
        return head + buf[pos:], 0

    def feed(self, piece: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """Add `piece` (`final`: the output is complete) -> (reasoning, content, calls) settled by it."""
        buf, pos = self.buf + piece, 0
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        calls: list[ToolCall] = []
        while self.mode != "done":
            if self.mode == "raw":  # a broken block: the model's text as it is, up to the end of sentence
                end = buf.find(EOS, pos)
                stop = end if end >= 0 else len(buf) - (0 if final else _held(buf[pos:]))
                out["content"].append(buf[pos:stop])
                pos = stop
                if end >= 0:
                    pos = end + len(EOS)
                    self.mode = "done"
                break
            if self.mode == "block":
                try:
                    step, call, after = _block_step(buf, pos, final)
                except _Malformed as e:
                    buf, pos = self._broken(e, buf, pos)
                    continue
                if step == "wait":
                    break
                if step == "call" and call is not None:  # a "call" step always carries its call
                    calls.append(call)
                    self.block_head = ""
                elif step == "cut" and self.block_head:  # cut off before any whole call
                    buf, pos = self._broken(_Malformed("block cut off before its first call"), buf, pos)
                    continue
                else:
                    if step == "cut":
                        self.errors.append("tool-call block cut off at its closing tag (its calls are whole)")
                    self.mode, self.block_head = "content", ""
                pos = after
                continue
            hits = [(i, m) for m in _TEXT_MARKERS if (i := buf.find(m, pos)) >= 0]
            if not hits:
                seg = buf[pos:]
                keep = 0 if final else _held(seg)
                out[self.mode].append(seg[: len(seg) - keep])
                pos = len(buf) - keep
                break
            idx, marker = min(hits)
            seg = buf[pos:idx]
            lead = _BLOCK_LEAD if marker == TOOL_CALLS_OPEN and seg.endswith(_BLOCK_LEAD) else ""
            out[self.mode].append(seg[: len(seg) - len(lead)])
            pos = idx + len(marker)
            if marker == EOS:
                self.mode = "done"
            elif marker == TOOL_CALLS_OPEN:  # a block ends the thought, even without </think>
                self.mode, self.block_head = "block", lead + marker
            elif marker == THINK_END:  # ends the thought (a stray one in content is dropped)
                self.mode = "content"
            # a stray <think> is dropped
        if self.mode == "done" and buf[pos:].strip():
            if not any(e.startswith("text after") for e in self.errors):
                self.errors.append(f"text after the end-of-sentence token dropped: {buf[pos : pos + 60]!r}")
            pos = len(buf)
        self.buf = buf[pos:]
        return "".join(out["reasoning"]), "".join(out["content"]), calls


def scan(text: str, thinking: bool, final: bool = True) -> Parsed:
    """Parse a completion (`final`) or the settled part of a prefix of one (not `final`)."""
    scanner = Scanner(thinking)
    reasoning, content, calls = scanner.feed(text, final)
    return Parsed(reasoning, content, calls, scanner.errors)


def parse_completion(text: str, thinking: bool) -> Parsed:
    """The whole completion text -> Parsed; degradations are logged."""
    parsed = scan(text, thinking, final=True)
    for err in parsed.errors:
        log.warning("completion parse: %s", err)
    return parsed


# ---- tool_choice / parallel_tool_calls ----------------------------------------------------------
def select_calls(calls: list[ToolCall], tool_choice, parallel: bool) -> list[ToolCall]:
    """The calls a response may carry under `tool_choice` and `parallel_tool_calls` (pure; prefix-stable,
    so a stream can apply it to the calls seen so far).

    The model's output cannot be constrained, so these act on what it wrote: "none" returns no calls, a
    named function only the calls to it, parallel_tool_calls=false only the first call."""
    kept = calls
    if tool_choice == "none":
        kept = []
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        kept = [c for c in kept if c.name == name]
    return kept if parallel else kept[:1]


def log_dropped(calls: list[ToolCall], kept: list[ToolCall], tool_choice, parallel: bool) -> None:
    if len(kept) != len(calls):
        log.warning(
            "dropped %d tool call(s) of %s (tool_choice=%r, parallel_tool_calls=%s)",
            len(calls) - len(kept),
            [c.name for c in calls],
            tool_choice,
            parallel,
        )
