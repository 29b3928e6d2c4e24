"""Rejection sampling of speculative decoding (engine.execution.spec_sampling): the emitted tokens follow the target
distribution whatever the draft distribution is. Chi-square goodness of fit on a 24-token vocabulary over 20000
seeded draws (deterministic: fixed seeds), a deliberately wrong sampler failing the same test; end to end on the
tiny model, sampled requests with speculation emit tokens whose target log-probs are distributed as without it;
seeded output is reproducible whatever shares the batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.execution import spec_sampling
from engine.execution.sampling import filtered_probs
from engine.execution.sampling_params import SamplingParams

V, N = 24, 20000


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `probs` (cells expecting < 5 pooled); Wilson-Hilferty p-value."""
    n = counts.sum()
    expect = probs.double() * n
    small = expect < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expect[~small], expect[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _requests(params: SamplingParams, n: int, base: int):
    return [SimpleNamespace(params=params, seed=base + i, output=[]) for i in range(n)]


def _logits(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.8),
]


def _emitted(params, target, draft, k: int, base: int) -> torch.Tensor:
    """N requests verifying k drafts drawn from `draft` against `target` (the same logits at every row) -> fp64
    [3, N * (k + 1)] (spec_sampling.verify_sampled)."""
    reqs = _requests(params, N, base)
    rows = [r for r in reqs for _ in range(k + 1)]
    index = [j for _ in reqs for j in range(k + 1)]
    draft_rows = [i for i, j in enumerate(index) if j < k]
    drafts, q = spec_sampling.draw_drafts(
        draft.expand(len(draft_rows), V).contiguous(), [rows[i] for i in draft_rows], [index[i] for i in draft_rows]
    )
    all_drafts = torch.full((len(rows),), -1, dtype=torch.int64)
    all_drafts[draft_rows] = drafts
    all_q = torch.zeros(len(rows), V)
    all_q[draft_rows] = q
    return spec_sampling.verify_sampled(target.expand(len(rows), V).contiguous(), all_drafts, all_q, rows, index)


def _target_probs(params, target):
    t = torch.tensor([params.temperature])
    return filtered_probs(target.view(1, V), t, torch.tensor([params.top_k]), torch.tensor([params.top_p]))[0]


@pytest.mark.parametrize("case", range(len(PARAMS)))
def test_first_and_second_emitted_tokens_follow_the_target(case):
    params = PARAMS[case]
    target = _logits(10 + case, 1.5)
    draft = 0.7 * target + _logits(20 + case, 1.2)  # overlapping, unlike: both outcomes often
    p = _target_probs(params, target)
    out = _emitted(params, target, draft, k=2, base=1000 * case)
    acc, tok = out[0].view(N, 3), out[1].view(N, 3).long()
    first = torch.bincount(tok[:, 0], minlength=V)
    assert _chi2_pvalue(first, p) > 1e-3
    # the second emitted token (the row after an accepted first draft): a draft or a residual draw, again ~ p
    second = torch.bincount(tok[acc[:, 0] == 1, 1], minlength=V)
    assert _chi2_pvalue(second, p) > 1e-3
    rate = float(acc[:, 0].mean())
    assert 0.05 < rate < 0.95  # both outcomes exercised
    assert (acc[:, 2] == 0).all()  # bonus rows are never "accepted"
    bonus = torch.bincount(tok[(acc[:, 0] == 1) & (acc[:, 1] == 1), 2], minlength=V)
    assert _chi2_pvalue(bonus, p) > 1e-3
    # log-probs are the raw target's (temperature 1, no filter)
    lps = torch.log_softmax(target, -1)[tok[:, 0]]
    torch.testing.assert_close(out[2].view(N, 3)[:, 0], lps.double())


def test_wrong_sampler_fails_the_same_test(monkeypatch):
    """Resampling from p instead of max(p - q, 0) after a rejection over-weights the draft's tokens."""
    params = PARAMS[0]
    target, draft = _logits(10, 1.5), _logits(20, 2.0)
    p = _target_probs(params, target)
    monkeypatch.setattr(spec_sampling, "residual", lambda p, q: p)
    tok = _emitted(params, target, draft, k=1, base=0)[1].view(N, 2).long()
    assert _chi2_pvalue(torch.bincount(tok[:, 0], minlength=V), p) < 1e-6


def test_same_seed_same_draws_whatever_the_batch():
    params = PARAMS[1]
    target, draft = _logits(3, 1.5), _logits(4, 2.0)
    reqs = _requests(params, 6, 77)
    d1, q1 = spec_sampling.draw_drafts(draft.expand(6, V).contiguous(), reqs, [5] * 6)
    d2, q2 = spec_sampling.draw_drafts(draft.expand(2, V).contiguous(), reqs[4:], [5] * 2)
    assert d1[4:].tolist() == d2.tolist()
    a = spec_sampling.verify_sampled(target.expand(6, V).contiguous(), d1, q1, reqs, [5] * 6)
    b = spec_sampling.verify_sampled(target.expand(2, V).contiguous(), d2, q2, reqs[4:], [5] * 2)
    assert a[:, 4:].tolist() == b.tolist()


# ---- end to end on the tiny model (its random MTP layer: about half the drafts accepted at temperature 1) ----


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine.loading.make_model import make_model
    from engine.loading.weights import load_weights
    from engine.model.config import ModelConfig

    d = make_model("tiny", tmp_path_factory.mktemp("specs") / "m", seed=11, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    return cfg, load_weights(d, cfg, mtp=True)


def _engine(model, k, mode="eager"):
    from engine.execution.runner import EngineCore
    from engine.execution.scheduler import SchedulerConfig
    from engine.execution.spec_policy import SpecPolicy
    from engine.model.cache import CacheConfig

    cfg, weights = model
    return EngineCore(
        cfg,
        weights,
        cache_config=CacheConfig(max_requests=64, max_tokens=8192, page_tokens=16, kv_cache_dtype="exact"),
        scheduler_config=SchedulerConfig(max_batch_tokens=4096, max_num_seqs=64),
        decode_mode=mode,
        speculative_tokens=k,
        speculative_policy=SpecPolicy(max_batch=64),
    )  # draft at every batch here


def _run(engine, requests):
    """requests: [(prompt, params, seed)] -> finished Requests in order."""
    ids = [engine.add_request(p, q, seed=s) for p, q, s in requests]
    while engine.has_work:
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def _z(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((ta.mean() - tb.mean()) / (ta.var() / len(a) + tb.var() / len(b)).sqrt())


@pytest.mark.parametrize("mode", ["eager", "bucketed"])
def test_sampled_requests_keep_the_target_distribution_end_to_end(model, monkeypatch, mode):
    """Tokens 2-4 of 192 seeded requests (token 1 comes from the prefill, the rest from verify steps): their raw
    target log-probs, a statistic whose distribution is the target's whatever the context, agree with speculation
    on and off (two-sample z < 4); greedy requests in the same batches stay token for token equal. Mode bucketed:
    fixed-shape verify steps and MTP drafting (engine.execution.mtp_graphs)."""
    prompt = [5, 6, 7, 8, 9]
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, logprobs=True)
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reqs = [(prompt, sampled, 500 + i) for i in range(192)] + [(prompt + [i], greedy, 0) for i in range(4)]
    spec_engine = _engine(model, 2, mode)
    off, on = _run(_engine(model, 0), reqs), _run(spec_engine, reqs)
    stats = spec_engine.speculator.stats
    assert 0.2 < stats["accepted"] / stats["drafted"] < 0.9  # acceptance and rejection both exercised
    if mode == "bucketed":
        assert spec_engine.speculator.mtp.steps > 0  # drafted on fixed shapes
    assert [r.output for r in on[192:]] == [r.output for r in off[192:]]
    lp = lambda rs: [x for r in rs[:192] for x in r.logprobs[1:]]  # noqa: E731
    assert abs(_z(lp(on), lp(off))) < 4
    assert sum(r.accepted_tokens for r in on[:192]) > 0
    # seeded: the same tokens again, in another batch
    again = _run(_engine(model, 2, mode), [reqs[i] for i in (7, 3, 150)] + [(prompt, sampled, 1)])
    assert [r.output for r in again[:3]] == [on[i].output for i in (7, 3, 150)]
    # companion: a verify that accepts every draft (emits q's tokens) fails the same statistic
    right = spec_sampling.verify_sampled_seeded  # (verify_sampled calls it too: both paths get the wrong one)

    def accept_all(logits, drafts, q, requests, accept_seeds, emit_seeds):
        out = right(logits, drafts, q, requests, accept_seeds, emit_seeds)
        tokens = torch.where(drafts >= 0, drafts, out[1].long())
        lps = torch.log_softmax(logits, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return torch.stack([(drafts >= 0).double(), tokens.double(), lps.double()])

    monkeypatch.setattr(spec_sampling, "verify_sampled_seeded", accept_all)
    assert abs(_z(lp(_run(_engine(model, 2, mode), reqs[:192])), lp(off))) > 6
