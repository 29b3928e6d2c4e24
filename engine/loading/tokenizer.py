"""Text <-> token ids for a model directory, on the `tokenizers` package alone (no transformers).

Reads `tokenizer.json` (the fast-tokenizer file every DeepSeek release ships) and, when present,
`tokenizer_config.json` for the BOS/EOS token strings and the chat template.
"""

from __future__ import annotations

import json
import os


def _token_str(value) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Thin wrapper: `encode` prepends BOS (like DeepSeek's add_bos_token=True), `decode` drops specials."""

    def __init__(self, tokenizer, bos_id: int | None, eos_id: int | None, chat_template: str | None = None):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self._one: dict[int, str] = {}  # decode_one's texts: id (skipping specials) or ~id (keeping them) -> text

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """text -> ids, BOS first. The file's own post-processor is bypassed so BOS is never doubled."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """ids -> text; BOS/EOS and other special tokens are dropped unless asked for."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_ints(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode` of a list already of Python ints (no conversion: the streamed detokenizer's two calls a token)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode_ints` of one id, remembered (a pure function of the id, at most two texts a vocabulary entry): the
        streamed detokeniser decodes each token once alone, as the context of the next (service.text_stream)."""
        key = token_id if skip_special_tokens else ~token_id
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text


def load_tokenizer(model_dir: str | os.PathLike) -> TextTokenizer | None:
    """The model dir's tokenizer, or None when it has no tokenizer.json."""
    from tokenizers import Tokenizer

    d = os.fspath(model_dir)
    path = os.path.join(d, "tokenizer.json")
    if not os.path.exists(path):
        return None
    tok = Tokenizer.from_file(path)
    tok_cfg: dict = {}
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as fh:
            tok_cfg = json.load(fh)
    bos = _token_str(tok_cfg.get("bos_token"))
    eos = _token_str(tok_cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_id = tok.token_to_id(eos) if eos else None
    # Without a tokenizer_config.json fall back to config.json's ids (DeepSeek: 0 / 1).
    if bos_id is None or eos_id is None:
        model_cfg_path = os.path.join(d, "config.json")
        if os.path.exists(model_cfg_path):
            with open(model_cfg_path) as fh:
                raw = json.load(fh)
            eos_raw = raw.get("eos_token_id")
            bos_id = bos_id if bos_id is not None else raw.get("bos_token_id")
            if eos_id is None:
                eos_id = eos_raw[0] if isinstance(eos_raw, list) and eos_raw else eos_raw
    return TextTokenizer(tok, bos_id, eos_id, tok_cfg.get("chat_template"))
