"""TextStream (service/text_stream.py): the streamed deltas of random token sequences, with and without stop strings,
add up to the whole output decoded at once and cut at the first stop string; nothing sent is ever retracted; the
tokenizer's remembered one-id texts (TextTokenizer.decode_one) are its decode of that id."""

import random

import pytest

from engine.loading.tokenizer import load_tokenizer
from service.text_stream import TextStream

MODEL = "models/dsv4-mini-py"


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(MODEL)
    assert tok is not None
    return tok


def _expected(full: str, stops: list[str], include_stop: bool) -> str:
    hits = [(i, s) for s in stops if (i := full.find(s)) >= 0]
    if not hits:
        return full
    i, s = min(hits)
    return full[: i + (len(s) if include_stop else 0)]


@pytest.mark.parametrize("seed", range(12))
def test_deltas_add_up_to_the_whole_decode_cut_at_the_first_stop(tokenizer, seed):
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
    full = tokenizer.decode(ids, True)
    # stop strings taken from the text itself (so they occur), and one that does not
    stops = []
    for _ in range(rng.randrange(0, 3)):
        if len(full) > 2:
            a = rng.randrange(len(full) - 1)
            stops.append(full[a : a + rng.randrange(1, 6)])
    if rng.random() < 0.5:
        stops.append("\x00never\x00")
    stops = [s for s in stops if s]
    include_stop = rng.random() < 0.5
    stream = TextStream(tokenizer, stops, include_stop, True)
    out = ""
    for n, t in enumerate(ids):
        out += stream.add(t, n == len(ids) - 1)
        assert stream.sent == out  # what was sent, never retracted
        if stream.stop_hit is not None:
            break
    assert out == _expected(full, stops, include_stop), (stops, include_stop)


@pytest.mark.parametrize("include_stop", [False, True])
def test_characters_split_across_tokens_are_sent_whole(tokenizer, include_stop):
    text = "def naïve(x):  # é中文 — ünïcödé ✓\n    return x"
    ids = [i for i in tokenizer.encode(text) if tokenizer.decode([i], True)]  # BOS and other specials decode to ""
    stream = TextStream(tokenizer, ["✓"], include_stop, True)
    deltas = []
    for n, t in enumerate(ids):
        deltas.append(stream.add(t, n == len(ids) - 1))
        if stream.stop_hit is not None:  # the request ends there
            break
    assert all("\ufffd" not in d for d in deltas), deltas  # a byte token's half character is held, never sent
    assert "".join(deltas) == _expected(text, ["✓"], include_stop)


def test_decode_one_is_decode_of_the_one_id_skipping_specials_or_not(tokenizer):
    """The one-id texts TextStream takes from the tokenizer's memory (TextTokenizer.decode_one), every id, twice."""
    for _ in range(2):  # the second pass reads them back
        for i in range(tokenizer.vocab_size):
            for skip in (True, False):
                assert tokenizer.decode_one(i, skip) == tokenizer.decode_ints([i], skip), (i, skip)
