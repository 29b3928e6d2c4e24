"""A byte-level BPE tokenizer trained on the training split, in the layout every dsv4 model dir uses.

Same ids as `engine.loading.make_model.write_tokenizer` (0 = BOS, 1 = EOS, 2/3 = chat role markers, then the
BPE vocabulary, then V4's other chat tokens), so chat rendering and the loader treat it like any other model
dir; only the merges differ: they are learnt from the Python sources instead of a few sentences.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.loading.make_model import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    THINK_TOKENS,
    USER_TOKEN,
    V4_SPECIAL_TOKENS,
    save_v4_tokenizer,
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str) -> None:
    """Train on `texts`; write tokenizer.json + tokenizer_config.json into `out_dir` (vocab <= vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS) - len(V4_SPECIAL_TOKENS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_v4_tokenizer(tok, vocab_size, out_dir)
