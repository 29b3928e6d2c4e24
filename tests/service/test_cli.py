"""The `dsv4` command line: make-model, generate (ids and text), JSON output, errors.

Most tests call `service.cli.main(argv)` in-process (fast); one runs the real console script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from service.cli import main

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    [0, 17, 42, 7, 99, 3, 250],
    [0, 5],
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318, 319],
]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """main(argv) in-process -> (exit code, stdout, stderr); argparse's SystemExit becomes a code."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    rc = main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "3"])
    assert rc == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    return str(out)


@pytest.fixture(scope="module")
def reference(model_dir):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    return LLM(model_dir=model_dir).generate(PROMPTS, params)


def _json_lines(out: str) -> list[dict]:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]


def _assert_matches(rec: dict, ref, tol=1e-6):
    assert rec["token_ids"] == ref.token_ids
    assert len(rec["logprobs"]) == len(ref.logprobs)
    assert all(abs(a - b) <= tol for a, b in zip(rec["logprobs"], ref.logprobs))
    assert rec["prompt_logprobs"][0] is None
    assert len(rec["prompt_logprobs"]) == len(ref.prompt_logprobs)
    assert all(abs(a - b) <= tol for a, b in zip(rec["prompt_logprobs"][1:], ref.prompt_logprobs[1:]))


def _ids_args(prompts):
    args = []
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return args


def test_generate_json_matches_llm(model_dir, reference, capsys):
    rc, out, err = run_cli(
        [
            "generate",
            "--model",
            model_dir,
            *_ids_args(PROMPTS),
            "--max-new-tokens",
            6,
            "--ignore-eos",
            "--json",
            "--logprobs",
            "--prompt-logprobs",
        ],
        capsys,
    )
    assert rc == 0, err
    recs = _json_lines(out)
    assert len(recs) == len(PROMPTS)
    for rec, ref in zip(recs, reference):
        _assert_matches(rec, ref)


def test_generate_chunked_and_sampling_flags(model_dir, capsys):
    argv = [
        "generate",
        "--model",
        model_dir,
        *_ids_args(PROMPTS[:2]),
        "--max-new-tokens",
        5,
        "--ignore-eos",
        "--json",
        "--logprobs",
        "--temperature",
        0.9,
        "--top-p",
        0.9,
        "--top-k",
        20,
        "--seed",
        7,
        "--max-batch-tokens",
        5,
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err
    params = SamplingParams(
        max_new_tokens=5, temperature=0.9, top_p=0.9, top_k=20, seed=7, ignore_eos=True, logprobs=True
    )
    ref = LLM(model_dir=model_dir, max_batch_tokens=5).generate(PROMPTS[:2], params)
    recs = _json_lines(out)
    assert [r["token_ids"] for r in recs] == [o.token_ids for o in ref]
    rc2, out2, _ = run_cli(argv, capsys)  # same seed, same output
    assert rc2 == 0 and out2 == out


def test_generate_text_prompt(model_dir, capsys):
    from tokenizers import Tokenizer

    text = "The quick brown fox"
    rc, out, err = run_cli(
        ["generate", "--model", model_dir, "--prompt", text, "--max-new-tokens", 4, "--ignore-eos", "--json"], capsys
    )
    assert rc == 0, err
    (rec,) = _json_lines(out)
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids  # BOS + text
    assert ids[0] == 0 and len(ids) > 2
    ref = LLM(model_dir=model_dir).generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert rec["token_ids"] == ref.token_ids
    # Plain (non-JSON) output: one line per prompt.
    rc, out, err = run_cli(
        ["generate", "--model", model_dir, "--prompt", text, "--prompt", "Hello", "--max-new-tokens", 3], capsys
    )
    assert rc == 0, err
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt-ids", "1,2,999999"], "999999"),
        (["--prompt-ids", "5,-3"], "-3"),
        (["--prompt-ids", ""], "empty"),
        (["--prompt-ids", "1,2", "--prompt-ids", ""], "empty"),
        (["--prompt-ids", "1,x,3"], "1,x,3"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "{max_pos}"], "{max_pos}"),
    ],
)
def test_generate_bad_input(model_dir, args, needle, capsys):
    with open(os.path.join(model_dir, "config.json")) as fh:
        max_pos = json.load(fh)["max_position_embeddings"]  # prompt of 2 + max_pos new tokens is too long
    args = [a.format(max_pos=max_pos) for a in args]
    needle = needle.format(max_pos=max_pos)
    rc, out, err = run_cli(["generate", "--model", model_dir, *args], capsys)
    assert rc != 0
    assert needle in err, err
    assert "Traceback" not in err
    assert not out.strip()


def test_missing_model_dir(tmp_path, capsys):
    missing = tmp_path / "nope"
    rc, out, err = run_cli(["generate", "--model", missing, "--prompt-ids", "1,2"], capsys)
    assert rc != 0 and str(missing) in err and "Traceback" not in err


def test_make_model_unknown_preset(tmp_path, capsys):
    rc, out, err = run_cli(["make-model", "--preset", "gigantic", "--out", tmp_path / "m"], capsys)
    assert rc != 0
    assert "gigantic" in err and "Traceback" not in err


def test_installed_console_script(model_dir, reference):
    """The real `dsv4` executable (falls back to `python -m service.cli` when not installed)."""
    script = Path(sys.executable).parent / "dsv4"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        cmd
        + [
            "generate",
            "--model",
            model_dir,
            *_ids_args(PROMPTS),
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--json",
            "--logprobs",
            "--prompt-logprobs",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    recs = _json_lines(proc.stdout)
    assert len(recs) == len(PROMPTS)
    for rec, ref in zip(recs, reference):
        _assert_matches(rec, ref)


def test_bench_kernels_passthrough(capsys):
    """`dsv4 bench kernels` hands its arguments to the source tree's benchmarks package: --list names every op,
    an op's --help is its own parser, an unknown op is a clear error (no CUDA needed for any of these)."""
    from benchmarks.kernels import OPS

    assert main(["bench", "kernels", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(op in listed for op in OPS) and {"triton", "cache", "moe", "topk", "mhc", "fp8-gemm"} <= set(OPS)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", "topk", "--help"])
    assert exc.value.code == 0 and "dsv4 bench kernels topk" in capsys.readouterr().out
    assert main(["bench", "kernels", "no-such-op"]) == 2
    assert "unknown op 'no-such-op'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "slice", "--help"])
    assert "--experts" in capsys.readouterr().out
