"""The engine's MTP layer (engine.model.mtp, paged SWA in the swa cache group) against the plain-torch reference
(dsv4_kernels.mtp), fp32: over a prompt (in one step and chunked), and a 2-step chain (each step feeding its own
output streams and the previous draft)."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.mtp import MtpSpec, mtp_layer_reference
from engine.loading.make_model import make_model
from engine.loading.weights import load_weights
from engine.model.batch import build_step
from engine.model.cache import CacheConfig, CachePool
from engine.model.config import ModelConfig
from engine.model.model import DeepseekV4Model
from engine.model.mtp import MtpLayer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = make_model("tiny", tmp_path_factory.mktemp("mtp") / "m", seed=3, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    weights = load_weights(d, cfg, mtp=True)
    model = DeepseekV4Model(cfg, weights, "cpu")
    return cfg, weights, model, MtpLayer(model, weights, 0)


def _pool(cfg):
    pool = CachePool(
        cfg,
        CacheConfig(max_requests=2, max_tokens=1024, page_tokens=16, kv_cache_dtype="exact", mtp_layers=1),
        torch.float32,
        "cpu",
    )
    table = {}
    pool.grow(table, 200)
    return pool, table


def _reference(cfg, weights, tokens, hidden):
    w = {k[len("mtp.0.") :]: v for k, v in weights.items() if k.startswith("mtp.0.")}
    return mtp_layer_reference(
        w,
        MtpSpec.of(cfg),
        weights["embed.weight"],
        weights["head.weight"],
        torch.tensor(tokens),
        hidden,
        torch.arange(len(tokens)),
    )


@pytest.mark.parametrize("chunk", [None, 7])
def test_mtp_layer_matches_reference_with_a_chain(setup, chunk):
    cfg, weights, model, mtp = setup
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, cfg.vocab_size, (41,), generator=g).tolist()  # longer than the window (16)
    pool, table = _pool(cfg)
    n = len(prompt)
    hidden = model.forward_streams(build_step(pool, [prompt], [0], [table], [], "cpu"), pool)  # [n, hc, D]
    # MTP over positions 0..n-2: token t+1 with the target's streams at t, in chunks
    size = chunk or n - 1
    outs = []
    for s in range(0, n - 1, size):
        e = min(s + size, n - 1)
        outs.append(mtp.forward(build_step(pool, [prompt[s + 1 : e + 1]], [s], [table], [], "cpu"), pool, hidden[s:e]))
    out = torch.cat(outs)
    ref_out, ref_logits = _reference(cfg, weights, prompt[1:], hidden[: n - 1])
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp.logits(out), ref_logits, rtol=1e-4, atol=1e-4)
    # chain: draft 1 (at position n-1, after the last prompt token's successor), then draft 2 from its own streams
    tokens, hid, last = list(prompt[1:]), hidden[: n - 1], out[-1:]
    bonus = 5
    draft = bonus  # replaced by step 0's pick before step 1 reads it
    for step in range(2):
        pos = n - 1 + step
        tok = bonus if step == 0 else draft
        nxt = mtp.forward(
            build_step(pool, [[tok]], [pos], [table], [], "cpu"), pool, hidden[-1:] if step == 0 else last
        )
        tokens.append(tok)
        hid = torch.cat([hid, hidden[-1:] if step == 0 else last])
        ref_out, ref_logits = _reference(cfg, weights, tokens, hid)
        torch.testing.assert_close(nxt, ref_out[-1:], rtol=1e-5, atol=1e-5)
        logits = mtp.logits(nxt)
        torch.testing.assert_close(logits, ref_logits[-1:], rtol=1e-4, atol=1e-4)
        draft, last = int(logits.argmax()), nxt


def test_reference_is_causal_and_sees_the_hidden(setup):
    cfg, weights, _, _ = setup
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, cfg.vocab_size, (20,), generator=g).tolist()
    hid = torch.randn(20, cfg.hc_mult, cfg.hidden_size, generator=g)
    a, la = _reference(cfg, weights, tokens, hid)
    b, lb = _reference(cfg, weights, tokens[:12], hid[:12])
    torch.testing.assert_close(a[:12], b, rtol=1e-5, atol=1e-5)
    hid2 = hid.clone()
    hid2[5] += 1.0
    c, _ = _reference(cfg, weights, tokens, hid2)
    assert torch.equal(c[:5], a[:5]) and not torch.allclose(c[5], a[5])
    # beyond the window, row 5 no longer matters to attention (positions >= 5 + window see only later rows);
    # rows in the window do change
    assert not torch.allclose(c[6], a[6])
