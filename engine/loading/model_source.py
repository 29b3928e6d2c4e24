"""Where a model comes from: a local directory, or a Hugging Face repo id fetched once into the local HF cache.

`resolve_model(spec)` is the one place a `--model` value becomes the directory the engine reads:
- an existing directory is used as it is (exactly as before repo ids were accepted);
- `org/name` or `org/name@revision` (a branch, tag or commit) is fetched with
  `huggingface_hub.snapshot_download` into the HF cache ($HF_HUB_CACHE, $HF_HOME/hub or
  ~/.cache/huggingface/hub): only the files the engine reads (`ENGINE_FILES`), with huggingface_hub's
  progress bars; resumable: a dropped connection continues from the bytes already written (a Range request),
  a run started again fetches only the files not yet complete in the cache, and a repo already cached is not
  downloaded again. With HF_HUB_OFFLINE=1 the cache alone answers;
- a cache snapshot path (`.../models--org--name/snapshots/<commit>`) that this machine lacks is the repo at
  that commit: the launcher resolves once and hands workers the local path, and a worker on another node
  (whose disk does not have it) fetches that exact commit into its own cache;
- anything else is a ValueError naming it.
A local directory always wins over a repo id of the same spelling (as in transformers and vLLM).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("dsv4.engine")

# What the engine reads from a model repo (weights, their index, config, tokenizer, generation defaults):
# a release repo also holds the inference reference code, papers and figures, which are never fetched.
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
ENGINE_FILES = ("*.safetensors", "*.safetensors.index.json", *CONFIG_FILES)
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")
_TRUE = ("1", "on", "yes", "true")


class ModelNotAvailable(FileNotFoundError):
    """A repo id whose files are not in the local cache and cannot be fetched (offline, network, auth)."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`: the directory to read and, for a Hub repo, where it came from."""

    spec: str  # what was asked for
    local_dir: str  # the directory the engine reads (config.json, safetensors, tokenizer)
    repo_id: str | None = None  # "org/name" when fetched from (or found in the cache of) the Hub
    revision: str | None = None  # the revision asked for (None: the default branch)
    commit: str | None = None  # the snapshot's commit hash

    @property
    def from_hub(self) -> bool:
        return self.repo_id is not None

    def describe(self) -> str:
        if not self.from_hub:
            return self.local_dir
        return f"{self.repo_id}@{self.commit or self.revision or 'main'} ({self.local_dir})"


def parse_repo_id(spec: str) -> tuple[str, str | None] | None:
    """ "org/name[@revision]" -> (repo id, revision or None); None when `spec` is not spelled like one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, sep, revision = spec.partition("@")
    if sep and not revision:
        return None
    if repo.count("/") != 1 or repo.startswith((".", "~")):  # a namespace is required: "gpt2" may be a dir name
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, (revision or None)


def resolve_model(spec: str | os.PathLike, with_weights: bool = True) -> ModelSource:
    """`--model` value -> ModelSource (see the module docstring). with_weights=False fetches only the config
    and tokenizer files (the HTTP ingress needs no weights). Raises ValueError for a spec that is neither a
    directory nor a repo id (or a repo that does not exist), ModelNotAvailable when a repo's files are not
    cached and cannot be fetched."""
    text = os.fspath(spec)
    if not text:
        raise ValueError("--model is empty: give a model directory or a Hugging Face repo id (org/name)")
    if os.path.isdir(text):
        return ModelSource(text, text)
    snap = _SNAPSHOT.search(text)
    if snap is not None:  # another machine's cache path: the same commit, fetched into this machine's cache
        repo, revision = f"{snap['org']}/{snap['name']}", snap["commit"]
    else:
        parsed = parse_repo_id(text)
        if parsed is None:
            if os.path.exists(text):
                raise ValueError(f"--model {text!r} is a file, not a model directory")
            raise ValueError(
                f"--model {text!r} is neither an existing model directory nor a Hugging Face repo id "
                "(org/name or org/name@revision)"
            )
        repo, revision = parsed
    local = fetch(repo, revision, ENGINE_FILES if with_weights else CONFIG_FILES, spec=text)
    if not os.path.isfile(os.path.join(local, "config.json")):
        raise ValueError(
            f"--model {text!r}: the repo has no config.json at its top level ({local}); it is not a "
            "model the engine can read"
        )
    return ModelSource(text, local, repo, revision, os.path.basename(os.path.normpath(local)))


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, or as set after it was imported."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def cache_dir() -> str:
    """The HF hub cache this process uses ($HF_HUB_CACHE read now, else huggingface_hub's default)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or constants.HF_HUB_CACHE


def fetch(repo: str, revision: str | None, patterns: tuple[str, ...], spec: str | None = None) -> str:
    """snapshot_download of `patterns` -> the snapshot directory; errors say what to do about them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    spec, where, off = spec or repo, cache_dir(), offline()
    if not off:
        log.warning(
            "dsv4: fetching %s%s from the Hugging Face Hub into %s (only %s; resumable; cached files "
            "are not downloaded again)",
            repo,
            f"@{revision}" if revision else "",
            where,
            ", ".join(patterns),
        )
    try:
        return snapshot_download(
            repo, revision=revision, allow_patterns=list(patterns), cache_dir=where, local_files_only=off
        )
    except (GatedRepoError, RepositoryNotFoundError) as e:  # Gated is a RepositoryNotFound subclass in some versions
        raise ValueError(
            f"--model {spec!r}: no Hugging Face repo {repo!r} is readable (it does not exist, or it is "
            f"private or gated: set HF_TOKEN to a token with access): {type(e).__name__}"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"--model {spec!r}: repo {repo!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError as e:
        if off:
            raise ModelNotAvailable(
                f"--model {spec!r}: {repo}{'@' + revision if revision else ''} is not (completely) in the Hugging "
                f"Face cache {where} and downloads are off (HF_HUB_OFFLINE=1): fetch it once with network access "
                f"(or point HF_HUB_CACHE at a cache that has it)"
            ) from None
        raise ModelNotAvailable(
            f"--model {spec!r}: could not fetch {repo} from the Hugging Face Hub and it is not in "
            f"the cache {where}: {e}"
        ) from None
    except HfHubHTTPError as e:
        raise ModelNotAvailable(f"--model {spec!r}: the Hugging Face Hub refused {repo}: {e}") from None


def local_model_dir(spec: str | os.PathLike | None, with_weights: bool = True) -> str | None:
    """resolve_model(spec).local_dir; None stays None (the caller's built-in default)."""
    return None if spec is None or os.fspath(spec) == "" else resolve_model(spec, with_weights).local_dir


__all__ = [
    "ModelSource",
    "ModelNotAvailable",
    "resolve_model",
    "local_model_dir",
    "parse_repo_id",
    "fetch",
    "offline",
    "cache_dir",
    "ENGINE_FILES",
    "CONFIG_FILES",
]
