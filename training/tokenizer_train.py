"""A byte-level BPE tokenizer trained on the training split, in the layout every dsv4 model dir uses.

Same ids as `engine.loading.make_model.write_tokenizer` (0 = BOS, 1 = EOS, 2/3 = chat role markers, then the
BPE vocabulary, then V4's other chat tokens), so chat rendering and the loader treat it like any other model
dir; only the merges differ: they are learnt from the Python sources instead of a few sentences.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.loading.make_model import train_v4_tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str) -> None:
    """Train on `texts`; write tokenizer.json + tokenizer_config.json into `out_dir` (vocab <= vocab_size)."""
    train_v4_tokenizer(texts, vocab_size, out_dir)
