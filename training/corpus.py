"""The training text: the Python standard library's own sources, which every fresh machine has offline.

Selection is reproducible from the file list alone: every `.py` file under `sysconfig.get_paths()["stdlib"]`
(installed third-party packages under site-packages / dist-packages excluded), sorted by relative path. The
held-out split is by file, from a hash of the relative path (not of the contents and not of a random draw), so
the same file lands on the same side on every machine and Python version that ships it: a file whose
sha256(path) falls in the lowest `HELDOUT_PERCENT` percent is held out and never trained on, nor seen by the
tokenizer trainer.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

HELDOUT_PERCENT = 5
MAX_FILE_BYTES = 256 * 1024  # a few generated tables / test data files are huge and not code anyone writes
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, '/'-separated
    path: str  # absolute path on this machine
    heldout: bool


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(rel: str) -> bool:
    """The fixed split: the path's sha256 as a number, mod 100, below HELDOUT_PERCENT."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def list_files(root: str | None = None) -> list[SourceFile]:
    """Every selected `.py` file under `root` (default: this interpreter's stdlib), sorted by relative path."""
    root = os.path.realpath(root or stdlib_root())
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            found.append(SourceFile(rel, path, is_heldout(rel)))
    return sorted(found, key=lambda f: f.rel)


def read_text(path: str) -> str | None:
    """A file's text as UTF-8, or None when it is not valid UTF-8 (a few stdlib tests carry other encodings)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def split_texts(files: list[SourceFile]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """-> ([(rel, text)] training, [(rel, text)] held out), in the sorted order of `files`."""
    train, held = [], []
    for f in files:
        text = read_text(f.path)
        if text is None or not text.strip():
            continue
        (held if f.heldout else train).append((f.rel, text))
    return train, held
