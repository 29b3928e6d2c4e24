"""`TextStream`: token ids -> text deltas with stop strings, for streaming and non-streaming OpenAI responses."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Token ids -> text deltas, with stop strings. Streaming and non-streaming responses both run it.

    Incremental detokenisation (vLLM's prefix / read offsets): a token decodes only the ids since the last
    emitted piece (`ids[prefix:]` against `ids[prefix:read]`), and stop strings are searched only in the new
    text and the len(longest) - 1 characters before it, so each token costs the same however long the
    output grows (the whole-output decode it replaces was O(n^2) on the event loop). Held back until they
    are final: a trailing U+FFFD (a UTF-8 character split across tokens, which the next token may complete)
    and, while stop strings are pending, the last len(longest)-1 characters, which could be the start of a
    stop string that must not reach the client.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool, skip_special: bool):
        self.tokenizer, self.stops, self.include_stop, self.skip_special = tokenizer, stops, include_stop, skip_special
        self.longest = max(map(len, stops), default=0)
        self.hold = self.longest - 1 if stops and not include_stop else 0
        self.ids: list[int]
        self.stop_hit: str | None
        self.ids, self.stop_hit = [], None  # stop_hit: the stop string that ended the text
        self.text = ""  # everything decoded so far (sent, held back, or cut by a stop string)
        self._sent = 0  # self.text[:_sent] has been sent (a length: no copy or compare of the whole output a token)
        self._prefix = self._read = 0  # ids[_prefix:_read] is the context of the next piece
        self._searched = 0  # self.text[:_searched] has been searched for stop strings
        # the token ids are kept as ints, so a TextTokenizer decodes them without converting each (two calls a token);
        # without a tokenizer nothing is decoded (`_decode`)
        self._decode_ids: Callable[[list[int], bool], str] | None = getattr(
            tokenizer, "decode_ints", getattr(tokenizer, "decode", None)
        )
        # one id's text, remembered by a TextTokenizer: the context decoded first is most often one token (the last)
        self._decode_one: Callable[[int, bool], str] | None = getattr(tokenizer, "decode_one", None)

    def _decode(self, final: bool) -> None:
        if self._decode_ids is None or self._read == len(self.ids):
            return
        prefix, read, ids = self._prefix, self._read, self.ids
        if read - prefix == 1 and self._decode_one is not None:
            before = self._decode_one(ids[prefix], self.skip_special)
        else:
            before = self._decode_ids(ids[prefix:read], self.skip_special)
        now = self._decode_ids(ids[prefix:], self.skip_special)
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, token_id: int | None, final: bool) -> str:
        if token_id is not None:
            self.ids.append(int(token_id))
        self._decode(final)
        text = self.text
        if self.stops:
            start = max(0, self._searched - self.longest + 1)
            hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
            self._searched = len(text)
            if hits:
                idx, s = min(hits)
                text, self.stop_hit, final = text[: idx + (len(s) if self.include_stop else 0)], s, True
        end = len(text) if final else max(0, len(text) - self.hold)
        delta = text[self._sent : end]  # "" when held back to before what was sent: sent text is never retracted
        if not final:
            delta = delta.rstrip("\ufffd")  # a split UTF-8 character waits for the token that completes it
        self._sent += len(delta)
        return delta

    @property
    def sent(self) -> str:
        """The text sent so far (the response's output text)."""
        return self.text[: self._sent]
