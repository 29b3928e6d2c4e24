"""Step 1 (CPU, this machine): the corpus split, the tokenizer, and the token arrays the trainer reads.

    python -m training.prepare --out .cache/dsv4_train

writes into --out: tokenizer.json + tokenizer_config.json (trained on the training split only),
train.npy / heldout.npy (uint16 token ids: every file as BOS + text + EOS, concatenated in sorted path order)
and manifest.json (Python version, stdlib root, the held-out rule, every file on each side with its token
count). The trainer needs only numpy + torch to read these, so the GPU machine needs no tokenizers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform

import numpy as np

from training.corpus import HELDOUT_PERCENT, MAX_FILE_BYTES, list_files, split_texts, stdlib_root
from training.mini_config import VOCAB_SIZE
from training.tokenizer_train import train_tokenizer


def encode_docs(tokenizer, docs: list[tuple[str, str]], bos: int, eos: int) -> tuple[np.ndarray, list[dict]]:
    """-> (uint16 [total] ids of BOS + text + EOS per doc, [{rel, tokens, bytes}] per doc)."""
    encodings = tokenizer.encode_batch([text for _, text in docs], add_special_tokens=False)
    parts, rows = [], []
    for (rel, text), enc in zip(docs, encodings):
        ids = np.asarray([bos, *enc.ids, eos], dtype=np.uint16)
        parts.append(ids)
        rows.append({"rel": rel, "tokens": int(ids.size), "bytes": len(text.encode("utf-8"))})
    return np.concatenate(parts), rows


def prepare(out_dir: str, root: str | None = None, vocab_size: int = VOCAB_SIZE) -> dict:
    from tokenizers import Tokenizer

    files = list_files(root)
    train, held = split_texts(files)
    os.makedirs(out_dir, exist_ok=True)
    train_tokenizer((text for _, text in train), vocab_size, out_dir)
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    bos, eos = 0, 1
    manifest = {
        "python": platform.python_version(),
        "stdlib_root": root or stdlib_root(),
        "rule": f"sha256(relative path) % 100 < {HELDOUT_PERCENT} is held out; .py files <= {MAX_FILE_BYTES} bytes,"
        " UTF-8, site-packages excluded",
        "vocab_size": tok.get_vocab_size(),
    }
    for name, docs in (("train", train), ("heldout", held)):
        ids, rows = encode_docs(tok, docs, bos, eos)
        np.save(os.path.join(out_dir, f"{name}.npy"), ids)
        manifest[name] = {
            "files": len(rows),
            "tokens": int(ids.size),
            "bytes": sum(r["bytes"] for r in rows),
            "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "docs": rows,
        }
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default=None, help="a source tree instead of this interpreter's stdlib")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    m = prepare(args.out, args.root, args.vocab_size)
    for side in ("train", "heldout"):
        s = m[side]
        print(
            f"{side}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB, {s['tokens'] / 1e6:.2f} M tokens "
            f"({s['bytes'] / s['tokens']:.2f} bytes/token)"
        )


if __name__ == "__main__":
    main()
