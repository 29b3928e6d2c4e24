"""Fixed-shape speculative steps (engine.execution.spec_fixed, engine.execution.mtp_graphs): a decode-only step runs
the verify step, acceptance, rollback, the MTP pass and the chained MTP steps on fixed shapes with one host read
(eager bucketed on the CPU, CUDA graphs on a GPU). Pinned here, fp32 on the CPU over two random checkpoints (one and
two MTP layers), K = 1..3: the tokens and drafts of the fixed-shape path equal, step by step, those of the varlen
path (`Speculator.mtp = None`: every step varlen) on the same steps, for greedy and sampled
requests in one batch whose members accept different numbers of drafts and finish mid-batch (max_tokens, a stop
token, an abort as a stop string makes); greedy output equals non-speculative output token for token. The GPU
test pins graphs against eager bucketed steps (same tokens, same drafts) and that the graphs were replayed."""

from __future__ import annotations

import random

import pytest
import torch

from engine.execution.mtp_graphs import MtpRunner
from engine.execution.sampling_params import SamplingParams
from engine.execution.speculative import Speculator
from engine.loading.make_model import make_model
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from tests.engine.test_spec_bucketed import _engine
from tests.engine.test_speculative import _prompts, _run

ABORT_AFTER = 5  # outputs of the "aborted" request: it is aborted once it holds this many (a stop string's way)


@pytest.fixture(scope="module", params=[(11, 1), (23, 2)], ids=["mtp1", "mtp2"])
def model(request, tmp_path_factory):
    seed, layers = request.param
    d = make_model("tiny", tmp_path_factory.mktemp("mtpg") / "m", seed=seed, mtp_layers=layers)
    cfg = ModelConfig.from_model_dir(d)
    return cfg, load_weights(d, cfg, mtp=True)


def _record_and_force(monkeypatch, refs: dict, corrupt: float) -> None:
    """After the MTP drafting of each step, its drafts (and sampled requests' q rows) are logged on the speculator
    (`log`: one {request id: (drafts, q)} a step), then a greedy request's drafts are replaced by its known greedy
    continuation, a draft corrupted where a hash of (request, output index) says so: both engines of a comparison
    get the same drafts, and requests accept different numbers of them."""
    original = Speculator._keep_drafts

    def draft(self, plans, drafts, q):
        original(self, plans, drafts, q)
        made = {}
        for p in plans:
            req = p.chunk.request
            rid = req.request_id
            q = self.draft_q.get(rid)
            made[rid] = (self.draft_tokens(rid), torch.stack(q) if q else None)
            if req.params.temperature == 0:
                n = len(req.output)
                want = refs[tuple(req.prompt)][n : n + len(self.drafts[rid])]
                bad = [random.Random(f"{rid}/{n + i}").random() < corrupt for i in range(len(want))]
                self.drafts[rid] = [(t + 1) % 512 if b else t for t, b in zip(want, bad)]
        self.__dict__.setdefault("log", []).append(made)

    monkeypatch.setattr(Speculator, "_keep_drafts", draft)


def _requests(refs_by_prompt, prompts):
    """Greedy requests ending at max_tokens (1..25), at a stop token, by an abort; one sampled request."""
    stop = refs_by_prompt[tuple(prompts[4])][6]
    return [
        SamplingParams(max_new_tokens=1, ignore_eos=True),
        SamplingParams(max_new_tokens=4, ignore_eos=True),
        SamplingParams(max_new_tokens=17, ignore_eos=True),
        SamplingParams(max_new_tokens=25, ignore_eos=True),
        SamplingParams(max_new_tokens=25, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=25, ignore_eos=True),  # aborted after ABORT_AFTER tokens
        SamplingParams(max_new_tokens=12, temperature=1.0, top_k=40, ignore_eos=True),
    ]


def _lockstep(engines, prompts, params) -> list[list]:
    """Run the engines side by side, one step each at a time (the same requests, ids r0..); request r5 is aborted
    once it holds ABORT_AFTER tokens. -> each engine's outputs (token ids, finish reason, accepted drafts) in
    request order."""
    for e in engines:
        for i, (p, q) in enumerate(zip(prompts, params)):
            e.add_request(p, q, request_id=f"r{i}", seed=100 + i)
    done: list[dict] = [{} for _ in engines]
    while any(e.has_work for e in engines):
        for e, out in zip(engines, done):
            e.step()
            held = e.requests.get("r5")
            if held is not None and len(held.output) >= ABORT_AFTER:
                out["r5"] = (list(held.output), "abort", held.accepted_tokens)
                e.abort("r5")
            for rid in [r for r, req in e.requests.items() if req.finished]:
                req = e.requests[rid]
                out[rid] = (list(req.output), req.finish_reason, req.accepted_tokens)
                e.pop_finished(rid)
    return [[out[f"r{i}"] for i in range(len(prompts))] for out in done]


@pytest.mark.parametrize(
    "k,kv,budget,corrupt,chain_buckets",
    [
        (1, "exact", 2048, 0.3, True),
        (2, "exact", 9, 0.3, True),
        (3, "exact", 2048, 0.2, True),
        (3, "fp8", 2048, 0.4, True),
        (3, "exact", 2048, 0.3, False),
    ],
)
def test_fixed_shape_drafts_equal_varlen_drafts(model, monkeypatch, k, kv, budget, corrupt, chain_buckets):
    """budget 9: chunked prefill, so steps mixing prefill and decode (varlen in both engines) come between
    fixed-shape ones. chain_buckets False: no chain bucket fits, so a step that drafts 2.. takes the varlen path
    whole."""
    cfg = model[0]
    prompts = _prompts(30 + k, [2, 5, 11, 18, 23, 9, 14], cfg.vocab_size)
    free = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * len(prompts)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, _run(_engine(model, 0, kv, mode="eager"), prompts, free))}
    params = _requests(refs, prompts)
    _record_and_force(monkeypatch, refs, corrupt)
    fixed, varlen = _engine(model, k, kv, budget=budget), _engine(model, k, kv, budget=budget)
    varlen.speculator.mtp = None
    if not chain_buckets:
        monkeypatch.setattr(MtpRunner, "chain_shape", lambda self, n, context: None)
    got, want = _lockstep([fixed, varlen], prompts, params)
    assert got == want
    for (tokens, reason, _), p, q in zip(got[:6], prompts, params):  # greedy: the non-speculative tokens
        ref = refs[tuple(p)]
        if q.stop_token_ids:
            end = next(i for i, t in enumerate(ref) if t in q.stop_token_ids or t in cfg.eos_token_ids)
            assert reason == "stop" and tokens == ref[: end + 1]
        elif reason == "abort":
            assert ABORT_AFTER <= len(tokens) <= ABORT_AFTER + k and tokens == ref[: len(tokens)]
        else:
            assert (tokens, reason) == (ref[: q.max_new_tokens], "length")
    logs = fixed.speculator.log, varlen.speculator.log
    assert len(logs[0]) == len(logs[1])
    for step, (a, b) in enumerate(zip(*logs)):
        assert {r: d for r, (d, _) in a.items()} == {r: d for r, (d, _) in b.items()}, f"step {step}"
        for rid in a:
            qa, qb = a[rid][1], b[rid][1]
            assert (qa is None) == (qb is None), f"step {step} {rid}"
            if qa is not None:
                torch.testing.assert_close(qa, qb, atol=1e-5, rtol=1e-4)
    s, mtp = fixed.speculator.stats, fixed.speculator.mtp
    assert varlen.speculator.verify.steps == 0  # the varlen engine never took the fixed path
    if chain_buckets:
        assert mtp.steps > len(logs[0]) // 2  # mostly fixed-shape steps
        assert (mtp.steps > fixed.speculator.verify.steps) == (k > 1)  # chain steps ran
    else:  # no chain bucket: drafting steps went varlen; only steps that did not draft (k = 1 has no chain) stayed
        assert mtp.steps == fixed.speculator.verify.steps
    assert 0 < s["accepted"] < s["drafted"]
    assert len({accepted for _, _, accepted in got[2:6]}) > 1  # requests accepted different numbers of drafts


def test_greedy_output_equals_non_speculative_over_seeds(model, monkeypatch):
    """The model's own (random) MTP drafts and forced ones, several prompt sets, K = 1..3: fixed-shape drafting
    leaves greedy output the non-speculative one."""
    cfg = model[0]
    for seed in range(3):
        g = random.Random(seed)
        prompts = _prompts(seed, [g.randrange(1, 40) for _ in range(4)], cfg.vocab_size)
        params = [SamplingParams(max_new_tokens=g.randrange(2, 20), ignore_eos=True) for _ in prompts]
        base = [o.token_ids for o in _run(_engine(model, 0, mode="eager"), prompts, params)]
        k = 1 + seed
        spec = _engine(model, k)
        assert [o.token_ids for o in _run(spec, prompts, params)] == base
        assert spec.speculator.mtp.steps > 0
    refs = {tuple(p): b for p, b in zip(prompts, base)}
    _record_and_force(monkeypatch, refs, 0.25)
    spec = _engine(model, 3)
    assert [o.token_ids for o in _run(spec, prompts, params)] == base
    assert 0 < spec.speculator.stats["accepted"] < spec.speculator.stats["drafted"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: CUDA graphs of the MTP pass and chain")
@pytest.mark.parametrize("k", [1, 3])
def test_graph_mtp_drafting_equals_eager_bucketed(tmp_path, monkeypatch, k):
    """bf16 on CUDA: with the warm-up's graphs (verify, MTP pass, chain) the engine emits the tokens and makes the
    drafts, step by step, that eager bucketed steps make; the MTP graphs were replayed, none captured mid-run."""
    from engine.execution.warmup import warm_engine

    d = make_model("tiny", tmp_path / "m", seed=11, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    gpu = (cfg, load_weights(d, cfg, dtype=torch.bfloat16, device="cuda", mtp=True))
    graphs = _engine(gpu, k, mode="graphs", device="cuda", dtype=torch.bfloat16, overlap=False)  # (forced drafts)
    warm_engine(graphs, sweep_gemms=False, decodes=True)  # before the log starts: its prompts are not compared
    captured = len(graphs.speculator.mtp.graphs)
    assert captured > 0
    prompts = _prompts(40 + k, [2, 5, 11, 18, 23, 9, 14], cfg.vocab_size)
    free = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * len(prompts)
    base = _engine(gpu, 0, mode="bucketed", device="cuda", dtype=torch.bfloat16)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, _run(base, prompts, free))}
    params = _requests(refs, prompts)
    _record_and_force(monkeypatch, refs, 0.3)
    eager = _engine(gpu, k, device="cuda", dtype=torch.bfloat16)
    mtp = graphs.speculator.mtp
    steps, replays = mtp.steps, mtp.replays
    got, want = _lockstep([graphs, eager], prompts, params)
    assert got == want
    logs = graphs.speculator.log, eager.speculator.log
    assert [{r: d for r, (d, _) in s.items()} for s in logs[0]] == [{r: d for r, (d, _) in s.items()} for s in logs[1]]
    assert mtp.replays - replays == mtp.steps - steps == eager.speculator.mtp.steps > 0  # every MTP step replayed
    assert len(mtp.graphs) == captured and eager.speculator.mtp.replays == 0
    assert graphs.speculator.stats["accepted"] > 0
