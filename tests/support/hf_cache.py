"""A real Hugging Face hub cache on disk (no network): what `snapshot_download` leaves behind.

Layout (huggingface_hub's cache format): `<cache>/models--<org>--<name>/blobs/<hash>` holds each file once,
`snapshots/<commit>/<file>` are relative symlinks to the blobs, `refs/<branch>` holds the commit hash.
"""

from __future__ import annotations

import hashlib
import os

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(
    cache: str | os.PathLike,
    repo: str,
    source_dir: str | os.PathLike,
    commit: str = COMMIT,
    refs: tuple[str, ...] = ("main",),
    skip: tuple[str, ...] = (),
) -> str:
    """Put the files of `source_dir` into `cache` as repo `org/name` at `commit`; -> the snapshot dir."""
    org, name = repo.split("/")
    root = os.path.join(os.fspath(cache), f"models--{org}--{name}")
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for fname in sorted(os.listdir(source_dir)):
        if fname in skip:
            continue
        with open(os.path.join(source_dir, fname), "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(root, "blobs", digest), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), os.path.join(snapshot, fname))
    for ref in refs:
        with open(os.path.join(root, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot
