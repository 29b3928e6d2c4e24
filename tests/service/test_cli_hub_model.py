"""`dsv4 generate --model org/name`: a Hugging Face repo id read from a real HF cache (downloads off,
HF_HUB_OFFLINE=1 set before the process starts, as a user would), printing what the directory prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main
from tests.support.hf_cache import COMMIT, add_repo

REPO = Path(__file__).resolve().parents[2]
PROMPT = [
    "--prompt-ids",
    "0,17,42,7",
    "--prompt-ids",
    "0,5",
    "--max-new-tokens",
    "5",
    "--ignore-eos",
    "--logprobs",
    "--json",
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A tiny model made by `dsv4 make-model`, and an HF cache holding it as org/tiny-cli."""
    root = tmp_path_factory.mktemp("hubcli")
    model = root / "tiny"
    assert main(["make-model", "--preset", "tiny", "--out", str(model), "--seed", "5"]) == 0
    add_repo(root / "hub", "org/tiny-cli", model)
    return model, root / "hub"


def _dsv4(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO),
        timeout=300,
    )


def test_generate_with_a_repo_id_equals_the_directory(hub, capsys):
    model, cache = hub
    capsys.readouterr()
    assert main(["generate", "--model", str(model), *PROMPT]) == 0
    expected = capsys.readouterr().out
    proc = _dsv4(["generate", "--model", f"org/tiny-cli@{COMMIT}", *PROMPT], cache)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    ref = [json.loads(line) for line in expected.splitlines() if line.strip()]
    assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref] and len(got) == 2
    for g, r in zip(got, ref):
        assert all(abs(a - b) <= 1e-6 for a, b in zip(g["logprobs"], r["logprobs"]))


def test_generate_offline_and_not_cached_is_a_clear_error(hub):
    _, cache = hub
    proc = _dsv4(["generate", "--model", "org/not-here", "--prompt-ids", "1,2"], cache)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "org/not-here" in proc.stderr and "HF_HUB_OFFLINE=1" in proc.stderr and str(cache) in proc.stderr


def test_generate_bad_model_spec_names_it(hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(["generate", "--model", "not/a/repo", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "'not/a/repo'" in err and "neither an existing model directory nor a Hugging Face repo id" in err


def test_chat_render_takes_a_repo_id(hub, tmp_path, monkeypatch, capsys):
    model, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    capsys.readouterr()
    assert main(["chat-render", "--request", str(req), "--model", str(model)]) == 0
    from_dir = capsys.readouterr().out
    assert main(["chat-render", "--request", str(req), "--model", "org/tiny-cli"]) == 0
    assert capsys.readouterr().out == from_dir


def test_serve_config_resolves_the_repo_once(hub, monkeypatch):
    """`dsv4 serve --model org/name`: the launcher's config carries the local snapshot path to the workers."""
    import argparse

    from service.launcher import add_serve_args, config_from_args

    _, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cfg = config_from_args(
        parser.parse_args(["--model", "org/tiny-cli", "--max-model-len", "1024", "--ready-timeout-seconds", "1200"])
    )
    assert os.path.isdir(cfg.model_dir) and cfg.model_dir.endswith(f"models--org--tiny-cli/snapshots/{COMMIT}")
    assert dict(cfg.engine_options)["max_model_len"] == 1024
    assert cfg.ready_timeout_s == 1200.0


def test_http_ingress_reads_a_repo_id_or_another_nodes_snapshot_path(hub, monkeypatch):
    """The OpenAI ingress needs only config and tokenizer: a repo id (KubeRay `model: org/name`) or the
    launcher's snapshot path on a node without it both resolve from this node's cache."""
    from service.openai_app import OpenAIServer

    model, cache = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = OpenAIServer("127.0.0.1:1", str(model), "m")
    for spec in ("org/tiny-cli", f"/other/node/hub/models--org--tiny-cli/snapshots/{COMMIT}"):
        server = OpenAIServer("127.0.0.1:1", spec, "m")
        assert (server.vocab_size, server.max_model_len, server.eos_ids) == (
            ref.vocab_size,
            ref.max_model_len,
            ref.eos_ids,
        )
        assert server.tokenizer.encode("hello world") == ref.tokenizer.encode("hello world")
