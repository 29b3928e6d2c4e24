"""`--model` resolution (engine.loading.model_source): local directories unchanged, Hugging Face repo ids served from
a real HF cache layout with downloads off (HF_HUB_OFFLINE=1; no test downloads), clear errors otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.load import load_engine
from engine.loading.make_model import default_model_dir
from engine.loading.model_source import (
    CONFIG_FILES,
    ENGINE_FILES,
    ModelNotAvailable,
    local_model_dir,
    parse_repo_id,
    resolve_model,
)
from tests.support.hf_cache import COMMIT, add_repo


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline HF cache holding the built-in tiny model as `org/tiny` (refs main and v1)."""
    cache = tmp_path / "hub"
    snapshot = add_repo(cache, "org/tiny", default_model_dir(), refs=("main", "v1"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snapshot


def test_local_directory_is_used_as_given():
    src = resolve_model(default_model_dir())
    assert src.local_dir == default_model_dir() and not src.from_hub and src.repo_id is None


@pytest.mark.parametrize("spec", ["org/tiny", "org/tiny@main", "org/tiny@v1", f"org/tiny@{COMMIT}"])
def test_repo_id_resolves_to_the_cached_snapshot(hub, spec):
    _, snapshot = hub
    src = resolve_model(spec)
    assert src.from_hub and src.repo_id == "org/tiny" and src.commit == COMMIT
    assert os.path.samefile(src.local_dir, snapshot)
    assert src.revision == (spec.split("@")[1] if "@" in spec else None)


def test_another_nodes_snapshot_path_resolves_to_this_cache(hub):
    """The launcher hands workers its local snapshot path; a node without it fetches that commit itself."""
    _, snapshot = hub
    src = resolve_model(f"/elsewhere/hub/models--org--tiny/snapshots/{COMMIT}")
    assert src.repo_id == "org/tiny" and src.revision == COMMIT and os.path.samefile(src.local_dir, snapshot)


def test_offline_and_not_cached_says_so(hub):
    cache, _ = hub
    with pytest.raises(ModelNotAvailable, match="HF_HUB_OFFLINE") as e:
        resolve_model("org/absent")
    assert "org/absent" in str(e.value) and str(cache) in str(e.value)
    with pytest.raises(ModelNotAvailable, match="org/tiny@v9"):
        resolve_model("org/tiny@v9")  # cached repo, unknown revision


@pytest.mark.parametrize("spec", ["/no/such/model/dir", "a/b/c", "org/tiny@", "./rel/dir", "org--x/y", "~/m"])
def test_neither_directory_nor_repo_id_is_a_value_error_naming_it(hub, spec):
    with pytest.raises(ValueError, match="neither an existing model directory nor a Hugging Face repo id") as e:
        resolve_model(spec)
    assert repr(spec) in str(e.value)


def test_a_file_is_not_a_model_directory(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(str(f))


def test_a_repo_without_config_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    add_repo(cache, "org/weights-only", default_model_dir(), skip=("config.json",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model("org/weights-only")


def test_parse_repo_id():
    assert parse_repo_id("deepseek-ai/DeepSeek-V4-Flash") == ("deepseek-ai/DeepSeek-V4-Flash", None)
    assert parse_repo_id("deepseek-ai/DeepSeek-V4-Flash@refs/pr/3") == ("deepseek-ai/DeepSeek-V4-Flash", "refs/pr/3")
    for bad in ("gpt2", "/abs/path", "a/b/c", "org/x@", "org/a..b"):
        assert parse_repo_id(bad) is None, bad


def test_only_the_engine_files_are_fetched():
    """The allow-list, applied by huggingface_hub's own filter to a release repo's file list."""
    from huggingface_hub.utils import filter_repo_objects

    release = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        *(f"model-{i:05d}-of-00046.safetensors" for i in range(1, 47)),
        "README.md",
        "LICENSE",
        "inference/model.py",
        "inference/convert.py",
        "figures/bench.png",
        "encoding/encoding_dsv4.py",
        ".gitattributes",
    ]
    got = set(filter_repo_objects(release, allow_patterns=list(ENGINE_FILES)))
    assert got == {f for f in release if f.endswith((".json", ".safetensors"))}
    assert set(filter_repo_objects(release, allow_patterns=list(CONFIG_FILES))) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_load_engine_and_llm_take_a_repo_id(hub):
    """Same tokens and logprobs from the cached repo id as from the directory it was made from."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True)
    ref = LLM(default_model_dir()).generate([[0, 5, 9, 11]], params)[0]
    out = LLM("org/tiny").generate([[0, 5, 9, 11]], params)[0]
    assert out.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-6)
    assert load_engine("org/tiny@v1").cfg == load_engine(default_model_dir()).cfg


def test_none_keeps_the_callers_default():
    assert local_model_dir(None) is None and local_model_dir("") is None
