"""Start-up warm-up (engine.execution.warmup): the request ladder runs through the engine and leaves it as it found it
(no request, every page back, prefix cache empty), the engine then serves the same tokens as a cold one, and the
M values cover every 64-row block count. On the CPU the ladder runs, and the DeepGEMM recorder and sweep run
against stand-ins; on a GPU, load_engine(warmup=True) captures every graph (the sweep on real DeepGEMM runs in
python3 -m benchmarks.cold_start, `tools/gpu/stages.sh coldstart`, on a quantised model)."""

from __future__ import annotations

import pytest
import torch

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.execution.warmup import gemm_m_values, prompt_ladder, warm_engine, warmup_enabled
from engine.loading.make_model import default_model_dir
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig


@pytest.fixture(scope="module")
def weights():
    model_dir = default_model_dir()
    cfg = ModelConfig.from_model_dir(model_dir)
    return cfg, load_weights(model_dir, cfg, dtype=torch.float32, device="cpu")


def _engine(weights, prefix: bool = True) -> EngineCore:
    cfg, w = weights
    return EngineCore(
        cfg,
        w,
        cache_config=CacheConfig(max_requests=4, max_tokens=2048),
        scheduler_config=SchedulerConfig(max_batch_tokens=300, max_num_seqs=4),
        prefix_cache=prefix,
    )


def test_prompt_ladder_and_m_values():
    assert prompt_ladder(48, 4094) == [1, 2, 4, 7, 8, 15, 16, 31, 32, 47, 48]
    assert prompt_ladder(64, 4094) == [1, 2, 4, 7, 8, 15, 16, 31, 32, 63, 64]
    assert prompt_ladder(8192, 100) == [1, 2, 4, 7, 8, 15, 16, 31, 32, 63, 64, 99, 100]
    assert prompt_ladder(33, 4094) == [1, 2, 4, 7, 8, 15, 16, 31, 32, 33]  # (32 already covers 33's odd side)
    assert prompt_ladder(4, 4094) == [1, 2, 4]
    ms = gemm_m_values(1000)
    assert ms[:128] == list(range(1, 129)) and ms[-1] == 1000 and ms[128:132] == [129, 192, 193, 256]
    # both ends of every count of 64-row blocks: DeepGEMM's configuration is a function of it (and of
    # thresholds on its edges) above 128
    for j in range(3, (1000 + 63) // 64 + 1):
        assert 64 * (j - 1) + 1 in ms and min(64 * j, 1000) in ms
    assert len(ms) == 128 + 2 * ((1000 + 63) // 64 - 2) and gemm_m_values(5) == [1, 2, 3, 4, 5]


def test_warmup_leaves_the_engine_idle_and_exact(weights, monkeypatch):
    cfg, _ = weights
    warm, cold = _engine(weights), _engine(weights)
    idle = warm.pool.num_free_pages()
    report = warm_engine(warm)
    assert report.prompts == (1, 2, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 299, 300)
    assert report.gemm_shapes == 0 and report.graphs == 0  # CPU: no DeepGEMM, no graphs
    assert not warm.has_work and not warm.requests and not warm.held and not warm.imports
    assert warm.pool.num_free_pages() == idle, "a warm-up page was not returned"
    assert warm.prefix.cached_blocks == 0 and not warm.prefix.digest().hashes, "the prefix cache kept a warm-up prompt"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 70)]
    params = SamplingParams(max_new_tokens=6, temperature=0, logprobs=True)
    outs = []
    for eng in (warm, cold):
        ids = [eng.add_request(p, params) for p in prompts]
        while eng.has_work:
            eng.step()
        outs.append([(r.output, r.logprobs) for r in map(eng.pop_finished, ids)])
    assert outs[0] == outs[1]
    monkeypatch.setenv("DSV4_WARMUP", "1")
    assert not warmup_enabled(warm), "the CPU engine is never warmed by load_engine"
    monkeypatch.setenv("DSV4_WARMUP", "yes")
    with pytest.raises(ValueError, match="DSV4_WARMUP"):
        warmup_enabled(warm)


def test_ladder_steps_have_exactly_the_prompt_lengths(weights):
    """Each ladder prompt runs as one prefill step of its own length, though the prefix cache may end chunks at
    its block boundaries: the step sizes are what the warm-up compiles for. The scheduler's prefix cache is back
    afterwards (a served prompt's snapshot point is kept: inside its one step here)."""
    eng = _engine(weights)
    assert eng.prefix.block < 300, "the test needs a ladder prompt longer than one prefix block"
    schedule, steps = eng.scheduler.schedule, []

    def spy():
        chunks = schedule()
        steps.append(sum(c.num_tokens for c in chunks if c.request.in_prefill))
        return chunks

    eng.scheduler.schedule = spy
    report = warm_engine(eng)
    assert [n for n in steps if n > 0] == list(report.prompts)
    assert eng.scheduler.prefix is eng.prefix
    # served requests get the cache's snapshot points again (kept inside the chunk: one step, one in-step snapshot)
    taken = eng.prefix.stats.snapshots_in_step
    eng.add_request(list(range(2, 302)), SamplingParams(max_new_tokens=1))
    steps.clear()
    while eng.has_work:
        eng.step()
    assert steps[0] == 300 and eng.prefix.stats.snapshots_in_step == taken + 1


def test_prefill_only_warmup_holds_and_releases(weights):
    """A prefill worker's engine (decodes=False): the ladder's requests stop at their first token and are held as
    the worker's are, then released: nothing is left held, every page is back."""
    eng = _engine(weights)
    idle = eng.pool.num_free_pages()
    report = warm_engine(eng, decodes=False)
    assert report.prompts[-1] == 300 and report.graphs == 0
    assert not eng.held and not eng.requests and not eng.has_work
    assert eng.pool.num_free_pages() == idle


def test_warmup_with_padded_prefill(weights):
    """Prefill steps padded to buckets (prefill_mode "bucketed": the graph path without capture): the ladder runs
    through them, nothing is left behind (the padding writes only scratch pages), and the engine then serves what
    a cold content-sized engine serves. No graph is captured on the CPU."""
    cfg, w = weights
    warm = EngineCore(
        cfg,
        w,
        cache_config=CacheConfig(max_requests=4, max_tokens=2048),
        scheduler_config=SchedulerConfig(max_batch_tokens=300, max_num_seqs=4),
        prefill_mode="bucketed",
        prefill_min_tokens=32,
    )
    cold = _engine(weights)
    idle = warm.pool.num_free_pages()
    report = warm_engine(warm)
    assert warm.prefill_runner is not None and warm.prefill_runner.steps >= len(report.prompts) - 1
    assert report.prefill_graphs == 0 and warm.pool.num_free_pages() == idle and not warm.has_work
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 170)]
    params = SamplingParams(max_new_tokens=4, temperature=0, logprobs=True)
    outs = []
    for eng in (warm, cold):
        ids = [eng.add_request(p, params) for p in prompts]
        while eng.has_work:
            eng.step()
        outs.append([r.output for r in map(eng.pop_finished, ids)])
    assert outs[0] == outs[1]


def test_warmup_refuses_a_busy_engine(weights):
    eng = _engine(weights, prefix=False)
    eng.add_request([3, 4, 5], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_engine(eng)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the warm-up runs on CUDA engines")
def test_gpu_load_engine_warms_and_serves_what_a_cold_engine_serves(monkeypatch):
    """load_engine(warmup=True) on CUDA (what the workers call) captures every decode bucket before returning,
    and the warmed engine's greedy tokens equal a cold engine's (the same graphs, captured earlier)."""
    from engine.loading.load import load_engine

    outs, engines = [], []
    for mode in ("1", "0"):
        monkeypatch.setenv("DSV4_WARMUP", mode)
        eng = load_engine(
            None,
            device="cuda",
            dtype="bfloat16",
            max_batch_tokens=256,
            max_num_seqs=8,
            max_cached_tokens=16384,
            warmup=True,
        )
        runner = eng.decode_runner
        if mode == "1":
            assert len(runner.graphs) == len(runner.slots) * len(runner.contexts)
            assert eng.pool.num_free_pages() == eng.pool.idle_free_pages()
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 90, 300)]
        params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True)
        ids = [eng.add_request(p, params) for p in prompts]
        while eng.has_work:
            eng.step()
        outs.append([(r.output, r.logprobs) for r in map(eng.pop_finished, ids)])
        engines.append(eng)
    assert outs[0] == outs[1]


def test_deepgemm_shapes_are_recorded_and_swept(monkeypatch):
    """dsv4_kernels.deepgemm_linear records (N, K) of every FP8 GEMM it runs, keeps no weight alive, and warm_shape
    runs that shape at each M (DeepGEMM and the quantiser are CUDA-only: stand-ins record the calls here)."""
    import types

    import dsv4_kernels.deepgemm_linear as dgl
    import dsv4_kernels.triton_fp8_quant as quant
    from dsv4_kernels.fp8_linear import Fp8Weight

    calls = []
    fake = types.SimpleNamespace(
        fp8_gemm_nt=lambda a, b, out: calls.append((a[0].shape[0], tuple(b[0].shape), tuple(out.shape)))
    )
    monkeypatch.setattr(dgl, "import_deep_gemm", lambda: fake)
    monkeypatch.setattr(
        quant,
        "quant_act_1x128",
        lambda x, pow2=True: (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], -(-x.shape[1] // 128))),
    )
    monkeypatch.setattr(dgl, "_SEEN", set())
    w = Fp8Weight(torch.randn(256, 384).to(torch.float8_e4m3fn), torch.ones(2, 3), pow2_act=False)
    dgl.fp8_gemm(torch.randn(5, 384, dtype=torch.bfloat16), w)
    assert dgl.seen_shapes() == [(256, 384, False, torch.device("cpu"), 1)] and calls == [(5, (256, 384), (5, 256))]
    calls.clear()
    dgl.warm_shape(256, 384, False, "cpu", [1, 64, 3])
    assert calls == [(1, (256, 384), (1, 256)), (3, (256, 384), (3, 256)), (64, (256, 384), (64, 256))]


def test_fp8_expert_gemms_swept_at_every_layout_row_count(monkeypatch):
    """An engine holding FP8 routed experts warms both grouped GEMMs at every M a step's layout can have (each
    multiple of the alignment up to the bound), so an exact layout's routing-dependent M is always among them
    (DeepGEMM is CUDA-only: a stand-in records the calls); an engine without FP8 experts sweeps nothing."""
    import types

    import dsv4_kernels.deepgemm_moe as dgm
    import engine.model.fast_paths as fp
    from dsv4_kernels import fp8_experts as fe
    from engine.execution.warmup import sweep_fp8_experts

    calls = []

    def grouped(a, b, out, m_indices):
        assert a[1].shape == (a[0].shape[0], a[0].shape[1] // 128) and a[1].stride(0) == 1  # MN-major scales
        assert m_indices.shape == (a[0].shape[0],) and out.shape == (a[0].shape[0], b[0].shape[1])
        calls.append((a[0].shape[0], tuple(b[0].shape[1:])))

    monkeypatch.setattr(
        dgm, "import_deep_gemm", lambda: types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=grouped)
    )
    monkeypatch.setattr(dgm, "m_alignment", lambda: 16)
    monkeypatch.setattr(dgm, "_SEEN", set())
    monkeypatch.setattr(fp, "use_fp8_expert_gemm", lambda device: True)
    e, h, inter, k, top = 4, 256, 128, 2, 40
    ex = fe.Fp8Experts(
        torch.zeros(e, 2 * inter, h).to(torch.float8_e4m3fn),
        torch.ones(e, 2, 2),
        torch.zeros(e, h, inter).to(torch.float8_e4m3fn),
        torch.ones(e, 2, 1),
    )
    eng = types.SimpleNamespace(
        model=types.SimpleNamespace(moe=[types.SimpleNamespace(fp8=ex)]),
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        cfg=types.SimpleNamespace(num_experts_per_tok=k),
    )
    n = sweep_fp8_experts(eng, top)
    ms = list(range(16, fe.padded_rows(top * k, e, 16) + 1, 16))
    assert n == len(calls) == 2 * len(ms)
    assert [m for m, _ in calls] == ms + ms and {w for _, w in calls} == {(2 * inter, h), (h, inter)}
    g = torch.Generator().manual_seed(0)
    for t in range(1, top + 1):  # every step's exact and bound row counts were warmed
        ids = torch.randint(0, e, (t, k), generator=g)
        assert {fe.contiguous_layout(ids, e, 16, exact=x).rows for x in (True, False)} <= set(ms)
    eng.model.moe[0].fp8 = None
    assert sweep_fp8_experts(eng, top) == 0


def test_grouped_projection_is_one_masked_gemm_or_falls_back(monkeypatch):
    """fp8_grouped_gemm: one m_grouped_fp8_gemm_nt_masked call over [G, GROUPED_ROWS, K] storage (every group's
    masked_m = T, recorded with its group count for the warm-up sweep); when that call raises, G plain GEMMs,
    from then on; above GROUPED_MAX_TOKENS, G plain GEMMs."""
    import types

    import dsv4_kernels.deepgemm_linear as dgl
    import dsv4_kernels.triton_fp8_quant as quant
    from dsv4_kernels.fp8_linear import Fp8Weight

    calls = []

    def masked(a, b, out, masked_m, expected_m):
        calls.append(("masked", tuple(a[0].shape), tuple(b[0].shape), tuple(b[1].shape), masked_m.tolist(), expected_m))
        out.copy_(torch.einsum("gmk,gnk->gmn", a[0].float(), b[0].float()))

    def plain(a, b, out):
        calls.append(("plain", tuple(a[0].shape), tuple(b[0].shape)))
        out.copy_(a[0].float() @ b[0].float().t())

    fake = types.SimpleNamespace(fp8_gemm_nt=plain, m_grouped_fp8_gemm_nt_masked=masked)
    monkeypatch.setattr(dgl, "import_deep_gemm", lambda: fake)

    def fake_quant(x, pow2=True, rows=None, rope=None):  # stand-in with the real one's padded-storage contract
        assert rope is None  # (the attention output's rope: not on this path)
        g, m, k = x.shape
        q = torch.zeros(g, rows or m, k).to(torch.float8_e4m3fn)
        q[:, :m] = x.to(torch.float8_e4m3fn)
        return q, torch.ones(g, rows or m, -(-k // 128))

    monkeypatch.setattr(quant, "quant_act_1x128_grouped", fake_quant)
    monkeypatch.setattr(dgl, "_SEEN", set())
    monkeypatch.setattr(dgl, "_GROUPED_BROKEN", [])
    g, t, r, k = 4, 3, 128, 256
    w = Fp8Weight(torch.randn(g * r, k).to(torch.float8_e4m3fn), torch.ones(g, 2), pow2_act=False)
    x = torch.randn(g, t, k).to(torch.float8_e4m3fn).to(torch.bfloat16)  # exact in e4m3: the stand-ins agree
    want = torch.einsum("gtk,grk->gtr", x.float(), w.weight.float().view(g, r, k))
    out = dgl.fp8_grouped_gemm(x, w, g)
    rows = dgl.GROUPED_ROWS  # whole M tiles of storage a group: the kernel's tile stores stay inside the group
    assert calls == [("masked", (g, rows, k), (g, r, k), (g, 1, 2), [t] * g, t)] and out.shape == (g, t, r)
    assert dgl.seen_shapes() == [(r, k, False, torch.device("cpu"), g)]
    torch.testing.assert_close(out.float(), want, atol=0.5, rtol=1e-2)

    def broken(*args):
        raise RuntimeError("no masked layout here")

    fake.m_grouped_fp8_gemm_nt_masked = broken
    calls.clear()
    torch.testing.assert_close(dgl.fp8_grouped_gemm(x, w, g).float(), want, atol=0.5, rtol=1e-2)
    assert [c[0] for c in calls] == ["plain"] * g and "no masked layout" in dgl._GROUPED_BROKEN[0]
    fake.m_grouped_fp8_gemm_nt_masked = masked
    calls.clear()
    dgl.fp8_grouped_gemm(x, w, g)
    assert [c[0] for c in calls] == ["plain"] * g  # the failure is remembered: no retry every step
    monkeypatch.setattr(dgl, "_GROUPED_BROKEN", [])
    monkeypatch.setattr(dgl, "GROUPED_MAX_TOKENS", t - 1)
    calls.clear()
    torch.testing.assert_close(dgl.fp8_grouped_gemm(x, w, g).float(), want, atol=0.5, rtol=1e-2)
    assert [c[0] for c in calls] == ["plain"] * g


def _dp_warm_rank(rank: int, port: int, max_batch_tokens: int, prompt: list[int], out) -> None:
    """One data-parallel attention rank (gloo): warm up with its group, then serve one prompt in lockstep."""
    from engine.execution.dp_attention import run_lockstep
    from engine.loading.load import load_engine
    from engine.model.parallel import init_distributed

    torch.set_num_threads(1)
    try:
        ctx = init_distributed(rank, 2, "cpu", port, expert_parallel=True, data_parallel_attention=True, timeout_s=120)
        eng = load_engine(
            None,
            device="cpu",
            dtype="float32",
            parallel=ctx,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=4,
            max_cached_tokens=2048,
            warmup=False,
        )
        idle = eng.pool.num_free_pages()
        report = warm_engine(eng, sweep_gemms=False)
        clean = not eng.has_work and not eng.requests and eng.pool.num_free_pages() == idle
        rid = eng.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
        run_lockstep(eng)
        out.put((rank, report.prompts, clean, eng.pop_finished(rid).output))
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        out.put((rank, f"{type(e).__name__}: {e}", False, None))


def test_data_parallel_ranks_warm_up_together():
    """Data-parallel attention ranks (each its own scheduler, their MoE layers exchanging every forward) warm up
    in lockstep: both run the ladder their pools and batch limits all allow (rank 1 takes at most 8 tokens a step
    here, rank 0 16: both run 1..8), every page returns, and the group then serves the tokens one engine serves."""
    import multiprocessing

    from engine.llm import LLM
    from engine.model.parallel import free_loopback_port

    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12]]
    want = LLM(None, prefix_cache=True, max_batch_tokens=8).generate(
        prompts, [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 2
    )
    mp = multiprocessing.get_context("spawn")
    out, port = mp.Queue(), free_loopback_port()
    procs = [mp.Process(target=_dp_warm_rank, args=(r, port, (16, 8)[r], prompts[r], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, lengths, clean, tokens in got:
        assert lengths == (1, 2, 4, 7, 8), (rank, lengths)
        assert clean, f"rank {rank} kept a warm-up request or page"
        assert tokens == want[rank].token_ids, rank
