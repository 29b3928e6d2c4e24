"""Pre-rendered SSE events for the streamed chunk every token sends: one that carries only a text delta.

Why: building the pydantic chunk (response, choice, delta models) and dumping it costs ~5 us a token on the ingress's
event loop, and a step's tokens of all its streams go out one after another, so the last stream of a step waits for
all the others' (BENCHMARKS frontdoor's reading). The bytes of such a chunk differ only in `created` and the text, so
`TextChunk` dumps the render's own chunk once with marker values, cuts it around them, and fills in only those two
fields a token: the same bytes as `model_dump_json` (field order, nulls; the text escaped as pydantic escapes it:
`json.encoder.encode_basestring`, non-ASCII left as is; tests/service/test_sse_chunks.py compares them). Chunks with
anything else (logprobs, token ids, a finish reason, tool calls, the head and tail) are still built as models.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable

from pydantic import BaseModel

TEXT_MARK = "\x01dsv4-text\x01"  # stands for the text (control characters: in no request id or model name)
CREATED_MARK = 7_777_777_777_777  # stands for `created`
_escape: Callable[[str], str] = json.encoder.encode_basestring  # C: '"' + escaped + '"'


class TextChunk:
    """The SSE event (bytes) of `model`'s chunk with another text and the current `created`."""

    def __init__(self, model: BaseModel):
        """model: the chunk with TEXT_MARK as its text and CREATED_MARK as its `created`."""
        dumped = model.model_dump_json()
        created, text = str(CREATED_MARK), _escape(TEXT_MARK)
        head, sep, rest = dumped.partition(created)
        middle, sep2, tail = rest.partition(text)
        if not (sep and sep2) or text in head + middle + tail or created in middle + tail:
            raise ValueError(f"chunk template markers not found exactly once in {dumped!r}")
        self._head, self._middle, self._tail = "data: " + head, middle, tail + "\n\n"

    def __call__(self, text: str) -> bytes:
        # one join and one encode; `created` as pydantic's default (openai_protocol._now) makes it
        return f"{self._head}{int(time.time())}{self._middle}{_escape(text)}{self._tail}".encode()


class TextEvents:
    """One streamed response's text-only chunks (a `TextChunk` a text field, made on first use) as SSE bytes."""

    def __init__(self, build: Callable[[object, str], BaseModel]):
        """build(job, field): the response's chunk with TEXT_MARK as that field's text; a bound method of the render
        that owns these chunks, held weakly (a strong one would make each response a reference cycle, freed only by
        the cycle collector, whose passes walk every in-flight request: the token path's latency tail)."""
        self._build = weakref.WeakMethod(build)
        self._chunks: dict[str, TextChunk] = {}

    def __call__(self, job, field: str, text: str) -> bytes:
        chunk = self._chunks.get(field)
        if chunk is None:
            build = self._build()
            if build is None:
                raise RuntimeError("TextEvents outlived the render that owns it")
            model = build(job, field).model_copy(update={"created": CREATED_MARK})
            chunk = self._chunks[field] = TextChunk(model)
        return chunk(text)
