"""Incremental V4 output parsing for streamed chat: text deltas in, reasoning / content / tool-call deltas out.

Each `feed` parses the output so far with `chat_parsing.Scanner`, which resumes after the last settled
marker (the marker search per token covers only the new text) and returns only the settled part: a tail
that may be the start of `</think>`, `<think>`, the tool-call block or the end-of-sentence token is held
back, and an open tool-call block is held until it closes. The parser emits what grew since the last
call, so no byte of a marker or of DSML reaches the client wherever the chunk boundaries fall, and the
concatenated deltas equal the non-streaming parse of the same text (the last `feed` is a final parse).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from service.chat_parsing import Scanner, ToolCall, log_dropped, select_calls

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
        self.tool_choice, self.parallel = tool_choice, parallel_tool_calls
        self.scanner = Scanner(thinking)
        self.parsed: list[ToolCall] = []  # every call parsed so far
        self.calls: list[ToolCall] = []  # the ones sent (after tool_choice selection)

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        reasoning, content, new = self.scanner.feed(delta, final)
        self.parsed += new
        kept = select_calls(self.parsed, self.tool_choice, self.parallel)  # prefix-stable
        out = StreamDelta(reasoning, content, tuple(enumerate(kept))[len(self.calls) :])
        self.calls.extend(c for _, c in out.calls)
        if final:
            for err in self.scanner.errors:
                log.warning("completion parse: %s", err)
            log_dropped(self.parsed, kept, self.tool_choice, self.parallel)
        return out
