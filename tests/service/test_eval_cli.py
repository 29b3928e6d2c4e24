"""`dsv4 eval perplexity|tasks` on the tiny random model: the figure against transformers' full forward, the
task scoring against known completions."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from service.cli import main
from service.eval_tasks import IDIOMS, find_tasks, score

TEXT = """import os


class Point:
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"


if __name__ == "__main__":
    for i in range(3):
        print(os.path.join("a", str(Point(i, i))))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.loading.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=5)


def _run(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_perplexity_matches_transformers(tiny, tmp_path, capsys):
    from engine.loading.tokenizer import load_tokenizer
    from tests.support.oracle import oracle_logprobs

    path = tmp_path / "sample.py"
    path.write_text(TEXT)
    window = 40
    got = _run(capsys, "eval", "perplexity", "--file", str(path), "--model", tiny, "--json", "--window", str(window))
    tok = load_tokenizer(tiny)
    ids = tok.tokenizer.encode(TEXT, add_special_tokens=False).ids
    nll = 0.0
    for start in range(0, len(ids), window):
        seq = [tok.bos_id, *ids[start : start + window]]
        lp = oracle_logprobs(tiny, seq)
        nll -= sum(float(lp[i - 1, seq[i]]) for i in range(1, len(seq)))
    want = nll / math.log(2) / len(TEXT.encode("utf-8"))
    assert got["tokens"] == len(ids) and got["windows"] == math.ceil(len(ids) / window) > 1
    assert got["bits_per_byte"] == pytest.approx(want, rel=1e-3)
    assert got["bits_per_byte"] > 1.0  # a random model: far from the text


def test_find_tasks():
    tasks = find_tasks("sample.py", TEXT)
    found = {t.idiom for t in tasks}
    assert found == {
        'if __name__ == "__main__":',
        "def __init__(self",
        "def __repr__(self)",
        "super().__init__(",
        "for i in range(",
        "os.path.join(",
    }
    for t in tasks:
        cut = dict(IDIOMS)[t.idiom]
        assert t.prompt.endswith(t.idiom[:cut]) and t.answer == t.idiom[cut:]
        assert TEXT[t.offset :].startswith(t.idiom)


class _Echo:
    """An 'engine' that answers each prompt with a given text (tokenised like the model would emit it)."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    def generate(self, prompts, params):
        assert len(prompts) == len(self.answers)
        return [
            SimpleNamespace(token_ids=self.tok.tokenizer.encode(a, add_special_tokens=False).ids) for a in self.answers
        ]


def test_score_counts_exact_matches(tiny):
    from engine.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny)
    tasks = find_tasks("sample.py", TEXT)
    right = score(_Echo(tok, [t.answer + "\n" for t in tasks]), tok, tasks)
    assert right.correct == right.tasks == len(tasks) and right.exact_match == 1.0
    wrong = score(_Echo(tok, [t.answer[:-1] for t in tasks]), tok, tasks)
    assert wrong.correct == 0 and len(wrong.failures) == min(10, len(tasks))


def test_tasks_cli(tiny, tmp_path, capsys):
    path = tmp_path / "sample.py"
    path.write_text(TEXT)
    got = _run(capsys, "eval", "tasks", "--file", str(path), "--model", tiny, "--json")
    assert got["tasks"] == len(find_tasks(str(path), TEXT))
    assert 0.0 <= got["exact_match"] <= 1.0 and sum(v[1] for v in got["by_idiom"].values()) == got["tasks"]


def test_eval_through_the_service_equals_the_engine(tmp_path, capsys):
    """`--url`: the same windows and tasks over /v1/completions of a live app (real router, one engine)."""
    from engine.loading.make_model import default_model_dir
    from service.openai_app import build_app
    from tests.service.test_openai_http import Backend, HTTPServer

    path = tmp_path / "sample.py"
    path.write_text(TEXT)
    model = default_model_dir()  # what the in-process router's engine serves
    backend = Backend()
    srv = HTTPServer(build_app(backend.addr, model, "tiny-eval"))
    try:
        url = ["--url", f"http://127.0.0.1:{srv.port}", "--served-model", "tiny-eval"]
        common = ["--file", str(path), "--model", model, "--json"]
        ppl_http = _run(capsys, "eval", "perplexity", *common, "--window", "40", *url)
        tasks_http = _run(capsys, "eval", "tasks", *common, *url)
    finally:
        srv.close()
        backend.close()
    ppl = _run(capsys, "eval", "perplexity", *common, "--window", "40")
    tasks = _run(capsys, "eval", "tasks", *common)
    assert ppl_http["windows"] == ppl["windows"] > 1
    # The same fp32 engine answers both: only how the windows are batched differs (HTTP requests arrive one by one,
    # LLM.generate takes them at once), which reorders sums by far less than 1e-4 of the figure.
    assert ppl_http["bits_per_byte"] == pytest.approx(ppl["bits_per_byte"], rel=1e-4)
    assert (tasks_http["tasks"], tasks_http["correct"]) == (tasks["tasks"], tasks["correct"])
    assert tasks_http["failures"] == tasks["failures"]
