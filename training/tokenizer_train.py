"""A byte-level BPE tokenizer trained on the training split, in the layout every dsv4 model dir uses.

Same ids as `engine.loading.make_model.write_tokenizer` (0 = BOS, 1 = EOS, 2/3 = chat role markers, then the
BPE vocabulary, then V4's other chat tokens), so chat rendering and the loader treat it like any other model
dir; only the merges differ: they are learnt from the Python sources instead of a few sentences.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from engine.loading.make_model import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, THINK_TOKENS, USER_TOKEN, V4_SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str) -> None:
    """Train on `texts`; write tokenizer.json + tokenizer_config.json into `out_dir` (vocab <= vocab_size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    tok.add_tokens([AddedToken(t, normalized=False) for t in THINK_TOKENS])
    tok.add_special_tokens(V4_SPECIAL_TOKENS)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} exceeds model vocab {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tok_cfg, fh, indent=2, ensure_ascii=False)
