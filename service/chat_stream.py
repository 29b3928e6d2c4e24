"""Incremental V4 output parsing for streamed chat: text deltas in, reasoning / content / tool-call deltas out.

Each `feed` re-parses the whole output so far with `chat_parsing.scan(final=False)`, which returns only the
settled part (a tail that may be the start of `</think>`, `<think>`, the tool-call block or the
end-of-sentence token is held back, and an open tool-call block is held until it closes), and emits what
grew since the last call. So no byte of a marker or of DSML reaches the client wherever the chunk
boundaries fall, and the concatenated deltas equal the non-streaming parse of the same text (the final
`feed` is a full parse). Re-parsing is O(n) per token, O(n^2) per response, like the detokenizer before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from service.chat_parsing import ToolCall, log_dropped, scan, select_calls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamDelta:
    """What one `feed` adds: text deltas and the tool calls completed by it, as (index, call)."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[int, ToolCall], ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatStreamParser:
    """Feed text deltas of one completion (`final=True` with the last one); get `StreamDelta`s."""

    def __init__(self, thinking: bool, tool_choice=None, parallel_tool_calls: bool = True):
        self.thinking, self.tool_choice, self.parallel = thinking, tool_choice, parallel_tool_calls
        self.text = ""
        self.reasoning = self.content = ""  # sent so far
        self.calls: list[ToolCall] = []  # sent so far (after tool_choice selection)

    def _grown(self, sent: str, now: str, what: str) -> str:
        if now.startswith(sent):
            return now[len(sent):]
        log.error("stream parser: %s changed under a sent prefix (%r -> %r); not retracted", what, sent[-40:],
                  now[-40:])
        return ""

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        parsed = scan(self.text, self.thinking, final)
        kept = select_calls(parsed.calls, self.tool_choice, self.parallel)
        if final:
            for err in parsed.errors:
                log.warning("completion parse: %s", err)
            log_dropped(parsed.calls, kept, self.tool_choice, self.parallel)
        out = StreamDelta(self._grown(self.reasoning, parsed.reasoning, "reasoning"),
                          self._grown(self.content, parsed.content, "content"),
                          tuple(enumerate(kept))[len(self.calls):])
        self.reasoning += out.reasoning
        self.content += out.content
        self.calls.extend(c for _, c in out.calls)
        return out
