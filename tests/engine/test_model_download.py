"""Fetching a repo id for real: `huggingface_hub` (unmodified) downloads from a Hub served on loopback
(tests/support/local_hub.py; no network). Each client runs in a fresh process, as a user's would, so the
library reads HF_ENDPOINT / HF_HUB_CACHE at import exactly as it does in production."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.make_model import default_model_dir
from tests.support.local_hub import LocalHub, repo_files

REPO = Path(__file__).resolve().parents[2]
COMMIT = "5" * 40
EXTRA = {
    "README.md": b"# tiny\n",
    "inference/model.py": b"print('reference code')\n",
    "figures/bench.png": b"\x89PNG" + bytes(4096),
}  # what a release repo also holds: never fetched
ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def hub():
    with LocalHub("org/tiny", repo_files(default_model_dir(), EXTRA), COMMIT) as h:
        yield h


def run(args: list[str], hub: LocalHub, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HUB_CACHE=str(cache),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)


def test_generate_fetches_only_the_engine_files_once(hub, tmp_path):
    cache = tmp_path / "hub"
    prompt = ["--prompt-ids", "0,17,42,7", "--max-new-tokens", "5", "--ignore-eos", "--logprobs", "--json"]
    first = run(["-m", "service.cli", "generate", "--model", "org/tiny", *prompt], hub, cache)
    assert first.returncode == 0, first.stderr
    assert hub.fetched() == ENGINE_FILES  # no README, reference code or figures
    assert "Fetching 5 files" in first.stderr  # huggingface_hub's progress bar
    ref = LLM(default_model_dir()).generate(
        [[0, 17, 42, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True)
    )[0]
    (out,) = [json.loads(line) for line in first.stdout.splitlines() if line.strip()]
    assert out["token_ids"] == ref.token_ids
    assert all(abs(a - b) <= 1e-6 for a, b in zip(out["logprobs"], ref.logprobs))

    hub.log.clear()
    second = run(["-m", "service.cli", "generate", "--model", "org/tiny", *prompt], hub, cache)
    assert second.returncode == 0, second.stderr
    assert not hub.fetched() and second.stdout == first.stdout  # downloaded once: the cache answers


def test_a_dropped_connection_resumes_where_it_stopped(tmp_path):
    """The connection drops halfway through a weight shard: the download continues with a Range request from the
    bytes already written (huggingface_hub writes 10 MiB chunks, so the shard is bigger than one), and the
    cached file is whole."""
    shard = bytes(range(256)) * (96 * 1024)  # 24 MiB
    files = repo_files(default_model_dir(), {**EXTRA, "extra-00001-of-00001.safetensors": shard})
    with LocalHub("org/tiny", files, COMMIT, drop_once=("extra-00001-of-00001.safetensors",)) as hub:
        proc = run(
            [
                "-c",
                "from engine.loading.model_source import resolve_model; "
                "print(resolve_model('org/tiny@main').local_dir)",
            ],
            hub,
            tmp_path / "hub",
        )
        assert proc.returncode == 0, proc.stderr
        ranges = [r for m, p, r in hub.log if m == "GET" and p.endswith("/extra-00001-of-00001.safetensors")]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(shard) // 2
    local = Path(proc.stdout.strip().splitlines()[-1])
    assert local.name == COMMIT and (local / "extra-00001-of-00001.safetensors").read_bytes() == shard


def test_an_unknown_repo_is_a_value_error(hub, tmp_path):
    proc = run(["-m", "service.cli", "generate", "--model", "org/absent", "--prompt-ids", "1,2"], hub, tmp_path / "hub")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "org/absent" in proc.stderr and "no Hugging Face repo" in proc.stderr, proc.stderr
