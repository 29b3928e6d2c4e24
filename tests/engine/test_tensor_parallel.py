"""Tensor parallelism (TP 2) and expert parallelism (EP 2) over gloo on the CPU equal one rank.

Every multi-rank case runs a real 2-process group: the test process is rank 0 (it schedules and samples) and
`engine.execution.tp_launch` spawns rank 1. Compared with a one-rank engine on the same prompts, greedy and seeded-sampling
requests must produce the same tokens and the same logprobs and prompt logprobs within fp32 tolerance (the split
changes only the summation order of wo_b, the shared / routed experts and the LM head). Cases: unchunked prefill +
eager decode (TP 2); chunked prefill (7-token budget) + fixed-shape decode steps (TP 2 + EP 2, which exercises both
broadcast kinds); MXFP4 experts kept packed (EP 2 on the packed reference path); FP8 projections kept as e4m3 +
block scales, cut on the 128-grid; `dsv4 generate --tensor-parallel-size 2 --expert-parallel` in a subprocess
against the one-rank CLI; TP 2 + EP 2 against the transformers oracle; the hand-off between layouts (TP 2 prefill ->
one-rank decode and back, by page copy); o_groups = 1 at TP 2 (a group's heads across ranks) against the oracle;
prefix-cache hits (snapshot pages replicated from rank 0); a failed rank-0 step; and the weight split itself (shards
reassemble the checkpoint, FP8 block grid, EP ranks read only their experts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.make_model import default_model_dir, make_model
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext
from engine.model.sharding import shard_weights

TOL = 2e-5  # fp32: the only differences are summation orders of split reductions
LENS = [37, 130, 9, 2]  # 130 closes an HCA-128 entry inside prefill; the tiny window is 16
N_GEN = 8


def _prompts(vocab: int, lens=LENS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _params(n: int) -> list[SamplingParams]:
    greedy = SamplingParams(max_new_tokens=N_GEN, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    sampled = [
        SamplingParams(
            max_new_tokens=N_GEN, temperature=1.0, seed=50 + i, ignore_eos=True, logprobs=True, prompt_logprobs=True
        )
        for i in range(n)
    ]
    return [greedy] * n + sampled


def _assert_close(outs, ref, what: str) -> None:
    assert len(outs) == len(ref)
    for i, (a, b) in enumerate(zip(outs, ref)):
        assert a.token_ids == b.token_ids, f"{what}, request {i}: tokens {a.token_ids} vs one rank {b.token_ids}"
        assert a.finish_reason == b.finish_reason
        for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert abs(x - y) <= TOL, f"{what}, request {i}: logprob {j}: {x} vs one rank {y}"
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for j, (x, y) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), start=1):
            assert abs(x - y) <= TOL, f"{what}, request {i}: prompt logprob {j}: {x} vs one rank {y}"


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model_dir=None, prefix_cache=False)
    prompts = _prompts(llm.config.vocab_size)
    return prompts, llm.generate(prompts + prompts, _params(len(prompts)))


@pytest.mark.parametrize(
    "tp_kwargs",
    [
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, expert_parallel=True, max_batch_tokens=7, decode_mode="bucketed"),
    ],
    ids=["tp2", "tp2_ep2_chunked_bucketed"],
)
def test_two_ranks_equal_one(tp_kwargs, reference):
    prompts, ref = reference
    with LLM(model_dir=None, **tp_kwargs) as llm:
        outs = llm.generate(prompts + prompts, _params(len(prompts)))
        if tp_kwargs.get("decode_mode") == "bucketed":
            assert llm.engine.decode_runner.steps > 0  # the DECODE broadcast kind ran
    _assert_close(outs, ref, str(tp_kwargs))


def test_packed_mxfp4_experts_expert_parallel(tmp_path):
    """MXFP4 experts kept packed: EP ranks hold whole packed experts; pairs of the other rank are skipped."""
    model_dir = str(tmp_path / "q")
    make_model("tiny", model_dir, seed=4, quantize=True)
    prompts = _prompts(512, [21, 5], seed=9)
    params = _params(len(prompts))
    ref = LLM(model_dir, keep_mxfp4_experts=True, prefix_cache=False).generate(prompts + prompts, params)
    with LLM(model_dir, keep_mxfp4_experts=True, tensor_parallel_size=2, expert_parallel=True) as llm:
        assert llm.engine.model.moe[1].packed is not None and llm.engine.model.moe[1].packed.w1.shape[0] == 4
        outs = llm.generate(prompts + prompts, params)
    _assert_close(outs, ref, "packed MXFP4, TP 2 + EP 2")


def test_cli_generate_spawns_its_ranks():
    args = [
        "generate",
        "--device",
        "cpu",
        "--json",
        "--logprobs",
        "--prompt-logprobs",
        "--ignore-eos",
        "--max-new-tokens",
        "6",
        "--max-batch-tokens",
        "11",
        "--prompt-ids",
        "5,6,7,8,9,10,11,12,13,14,15,16,17",
        "--prompt-ids",
        "3,4",
        "--temperature",
        "0.8",
        "--seed",
        "7",
    ]

    def run(extra):
        proc = subprocess.run(
            [sys.executable, "-m", "service.cli", *args, *extra],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in proc.stdout.splitlines()]

    one = run([])
    two = run(["--tensor-parallel-size", "2", "--expert-parallel"])
    assert len(one) == len(two) == 2
    for a, b in zip(two, one):
        assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= TOL
        assert max(abs(x - y) for x, y in zip(a["prompt_logprobs"][1:], b["prompt_logprobs"][1:])) <= TOL


def test_two_ranks_match_the_oracle(tmp_path):
    """TP 2 + EP 2 with chunked prefill against transformers (same criteria as tests/engine/test_oracle.py)."""
    from tests.support.oracle import make_hf_checkpoint, teacher_forced

    model_dir = make_hf_checkpoint(
        tmp_path / "hf", seed=21, compress_ratios=[0, 4, 16, 4], num_hash_layers=1, index_topk=3
    )
    prompts = _prompts(128, [3, 19, 40], seed=21)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with LLM(model_dir, max_batch_tokens=9, tensor_parallel_size=2, expert_parallel=True) as llm:
        outs = llm.generate(prompts, params)
    diffs, greedy_bad = [], []
    for prompt, out in zip(prompts, outs):
        ref = teacher_forced(model_dir, prompt, out.token_ids)
        diffs += [abs(e - o) for e, o in zip(out.prompt_logprobs[1:], ref.prompt_lp[1:])]
        diffs += [abs(e - o) for e, o in zip(out.logprobs, ref.gen_lp)]
        greedy_bad += [j for j, t in enumerate(out.token_ids) if t != ref.gen_top[j] and ref.gen_gap[j] >= 1e-3]
    assert all(math.isfinite(d) for d in diffs)
    assert sum(d <= 2e-3 for d in diffs) / len(diffs) >= 0.99, max(diffs)
    assert not greedy_bad


def test_groups_spanning_ranks_match_the_oracle(tmp_path):
    """o_groups = 1 at TP 2 (a random-config sweep found `dsv4 generate` refusing it): each rank holds half of
    the one group's heads and its columns of wo_a; TP 2 + EP 2 still matches transformers."""
    from tests.support.oracle import make_hf_checkpoint, teacher_forced

    model_dir = make_hf_checkpoint(
        tmp_path / "hf", seed=22, o_groups=1, compress_ratios=[4, 0, 16], num_hidden_layers=3, index_topk=3
    )
    prompts = _prompts(128, [5, 33], seed=22)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with LLM(model_dir, max_batch_tokens=16, tensor_parallel_size=2, expert_parallel=True) as llm:
        outs = llm.generate(prompts, params)
    diffs = []
    for prompt, out in zip(prompts, outs):
        ref = teacher_forced(model_dir, prompt, out.token_ids)
        diffs += [abs(e - o) for e, o in zip(out.prompt_logprobs[1:], ref.prompt_lp[1:])]
        diffs += [abs(e - o) for e, o in zip(out.logprobs, ref.gen_lp)]
        assert out.token_ids == ref.gen_top
    assert max(diffs) <= 2e-3, max(diffs)


# ---- the weight split itself (no processes) ------------------------------------------------------
def _full_weights():
    return load_weights(default_model_dir(), ModelConfig.from_model_dir(default_model_dir()))


@pytest.mark.parametrize("ep", [False, True])
def test_shards_reassemble_the_checkpoint(ep):
    cfg = ModelConfig.from_model_dir(default_model_dir())
    full = _full_weights()
    shards = [shard_weights(full, cfg, ParallelContext(2, r, ep), torch.float32) for r in range(2)]
    for name, t in full.items():
        parts = [s.get(name) for s in shards]
        if ".experts." in name and ep:
            e = int(name.split(".experts.")[1].split(".")[0])
            assert (parts[0] is not None) == (e < cfg.n_routed_experts // 2) and (parts[1] is None) == (
                parts[0] is not None
            )
            continue
        if parts[0].shape == t.shape:  # replicated
            assert all(torch.equal(p, t) for p in parts), name
            continue
        dim = next(d for d in range(t.dim()) if parts[0].shape[d] != t.shape[d])
        assert torch.equal(torch.cat(parts, dim)[tuple(slice(0, n) for n in t.shape)], t), name
    assert shards[0]["layers.0.attn.wq_b.weight"].shape[0] == cfg.num_heads // 2 * cfg.head_dim
    assert shards[0]["layers.0.attn.wo_b.weight"].shape[1] == cfg.o_groups // 2 * cfg.o_lora_rank
    assert "layers.0.attn.wkv.weight" in shards[1] and "layers.1.attn.indexer.wq_b.weight" in shards[1]


def test_fp8_weights_split_on_block_boundaries():
    cfg = dataclasses.replace(ModelConfig.from_model_dir(default_model_dir()), o_groups=4)  # 4 ranks fit
    w = torch.randn(512, 256).to(torch.float8_e4m3fn)
    s = torch.rand(4, 2) + 0.5
    weights = {
        "layers.0.attn.wq_b.weight": w,
        "layers.0.attn.wq_b.scale": s,
        "layers.0.attn.wo_b.weight": w,
        "layers.0.attn.wo_b.scale": s,
    }
    r1 = shard_weights(weights, cfg, ParallelContext(2, 1), torch.float32)
    assert torch.equal(r1["layers.0.attn.wq_b.weight"].float(), w[256:].float())  # column: rows, 2 scale blocks
    assert torch.equal(r1["layers.0.attn.wq_b.scale"], s[2:])
    # row-parallel wo_b: 128 of 256 columns = one whole scale block column
    assert torch.equal(r1["layers.0.attn.wo_b.scale"], s[:, 1:])
    # 4 ranks of 64 columns do not fall on the 128 grid: that tensor is dequantised, then cut
    r3 = shard_weights(
        {"layers.0.attn.wo_b.weight": w, "layers.0.attn.wo_b.scale": s}, cfg, ParallelContext(4, 3), torch.float32
    )
    deq = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert "layers.0.attn.wo_b.scale" not in r3 and torch.equal(r3["layers.0.attn.wo_b.weight"], deq[:, 192:])


@pytest.mark.parametrize("tp,o_groups", [(2, 1), (4, 2)])
def test_groups_spanning_ranks_cut_rows_then_heads(tp, o_groups):
    """Fewer output groups than ranks: rank r keeps its group's rows of wo_a and the columns of its own heads,
    and its group's columns of wo_b (shared with the group's other ranks)."""
    cfg = dataclasses.replace(ModelConfig.from_model_dir(default_model_dir()), o_groups=o_groups)
    rows, cols = o_groups * 8, 4 * 6  # 8 = o_lora_rank, a group's heads x head_dim = 24
    wo_a, wo_b = torch.randn(rows, cols), torch.randn(10, rows)
    weights = {"layers.0.attn.wo_a.weight": wo_a, "layers.0.attn.wo_b.weight": wo_b}
    parts = tp // o_groups
    for r in range(tp):
        shard = shard_weights(weights, cfg, ParallelContext(tp, r), torch.float32)
        group, part = r // parts, r % parts
        width = cols // parts
        assert torch.equal(
            shard["layers.0.attn.wo_a.weight"], wo_a[group * 8 : (group + 1) * 8, part * width : (part + 1) * width]
        )
        assert torch.equal(shard["layers.0.attn.wo_b.weight"], wo_b[:, group * 8 : (group + 1) * 8])


def test_indivisible_group_is_a_clear_error():
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by --tensor-parallel-size 3"):
        LLM(model_dir=None, tensor_parallel_size=3)
    cfg = dataclasses.replace(ModelConfig.from_model_dir(default_model_dir()), n_routed_experts=7)
    with pytest.raises(ValueError, match="n_routed_experts = 7 is not divisible"):
        shard_weights({}, cfg, ParallelContext(2, 0, True), torch.float32)
    cfg = dataclasses.replace(ModelConfig.from_model_dir(default_model_dir()), num_heads=12, o_groups=3)
    with pytest.raises(
        ValueError, match="o_groups = 3 is neither divisible by nor a divisor of --tensor-parallel-size 2"
    ):
        shard_weights({}, cfg, ParallelContext(2, 0), torch.float32)


# ---- caches written outside a forward: prefix-cache hits and KV imports -----------------------------
def _copy_pages(src_pool, src_pages, dst_pool, dst_pages):
    """What a transfer backend does: the request's rows of every group, page by page (into rank 0's pool)."""
    for name, group in src_pool.groups.items():
        rows = group.spec.page_rows
        for sp, dp in zip(src_pages.get(name, []), dst_pages.get(name, [])):
            dst_pool.groups[name].tensor[:, dp * rows : (dp + 1) * rows] = group.tensor[:, sp * rows : (sp + 1) * rows]


def _drain(engine):
    while engine.has_work:
        engine.step()


def test_handoff_between_layouts():
    """TP 2 prefill -> one-rank decode, and one-rank prefill -> TP 2 decode, equal one engine doing both.

    Every rank holds the full (MQA) caches, so the prefill side's rank 0 pages are the whole request; on a
    TP decode side the copy lands in rank 0's pool and commit_import replicates it to rank 1."""
    from engine.loading.load import load_engine

    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=True, temperature=0.8, seed=3)
    prompts = _prompts(512, [23, 131, 4], seed=17)
    colocated = load_engine(prefix_cache=False)
    ids = [colocated.add_request(p, params, seed=70 + i) for i, p in enumerate(prompts)]
    _drain(colocated)
    want = [colocated.pop_finished(r) for r in ids]
    single = load_engine(max_batch_tokens=11)
    with LLM(model_dir=None, tensor_parallel_size=2, expert_parallel=True, max_batch_tokens=11) as llm:
        tp = llm.engine
        for prefill, decode, tag in ((tp, single, "tp2->tp1"), (single, tp, "tp1->tp2")):
            for i, p in enumerate(prompts):
                prefill.add_request(p, params, request_id=f"{tag}p{i}", prefill_only=True, seed=70 + i)
            _drain(prefill)
            for i in range(len(prompts)):
                req = prefill.held_request(f"{tag}p{i}")
                pages = decode.reserve_import(
                    req.prompt, params, f"{tag}d{i}", req.seed, req.output[0], req.logprobs[0]
                )
                _copy_pages(prefill.pool, req.pages, decode.pool, pages)
                prefill.release(f"{tag}p{i}")
                decode.commit_import(f"{tag}d{i}")
            _drain(decode)
            for i, w in enumerate(want):
                got = decode.pop_finished(f"{tag}d{i}")
                assert got.output == w.output, f"{tag} request {i}"
                assert max(abs(a - b) for a, b in zip(got.logprobs, w.logprobs)) <= TOL, f"{tag} request {i}"


def test_prefix_cache_hits_under_tensor_parallel(tmp_path):
    """A prefix-cache hit restores the SWA / compressor-state snapshot on rank 0; rank 1 gets those pages by
    broadcast before the step. Same tokens, logprobs and cached-token counts as one rank with the cache."""
    from tests.support.oracle import make_hf_checkpoint

    model_dir = make_hf_checkpoint(tmp_path / "hf", seed=21, compress_ratios=[0, 4, 16, 4], sliding_window=12)
    base = _prompts(128, [45], seed=5)[0]
    prompts = [base, base[:37] + [7, 9, 11, 13], base + [3, 4]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
    one = LLM(model_dir, page_tokens=16)
    ref = [one.generate([p], params)[0] for p in prompts]
    with LLM(model_dir, page_tokens=16, tensor_parallel_size=2) as llm:
        outs = [llm.generate([p], params)[0] for p in prompts]
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in ref]
    assert sum(o.cached_tokens for o in outs) > 0
    for i, (a, b) in enumerate(zip(outs, ref)):
        assert a.token_ids == b.token_ids, f"request {i}"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL, f"request {i}"


def test_expert_parallel_rank_reads_only_its_experts():
    from engine.model.sharding import skips_unowned

    cfg = ModelConfig.from_model_dir(default_model_dir())
    assert skips_unowned(cfg, ParallelContext(2, 1, False)) is None  # TP MoE: every rank slices every expert
    skip = skips_unowned(cfg, ParallelContext(2, 1, True))
    got = load_weights(default_model_dir(), cfg, skip=skip)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in got if ".experts." in n}
    assert experts == set(range(cfg.n_routed_experts // 2, cfg.n_routed_experts))
    assert "layers.0.ffn.shared_experts.w1.weight" in got and "embed.weight" in got


def _write_fp8_model(out_dir: str) -> str:
    """A tiny V4 in the release formats whose projections fall on the 128-grid at TP 2 (so they stay e4m3)."""
    import json

    from safetensors.torch import save_file

    from engine.loading.make_model import preset_config, quantize_weights, random_weights

    raw = preset_config("tiny")
    raw.update(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        compress_ratios=[4, 0],
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    os.makedirs(out_dir, exist_ok=True)
    weights = quantize_weights(random_weights(ModelConfig.from_dict(raw), 5))
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(raw, fh)
    return out_dir


def test_fp8_projections_stay_fp8_per_rank(tmp_path):
    """keep_fp8_weights: each rank holds its cut of wq_b / wo_a / wo_b / shared experts as e4m3 + block scales
    (engine.model.linear's FP8 path, here its CPU reference) and matches one rank. Activations are quantised per
    128-block along K on both sides, on the same blocks; an fp32 summation-order difference can still move a
    value across an e4m3 rounding step, hence a looser bound than the plain fp32 tests."""
    from dsv4_kernels.fp8_linear import Fp8Weight

    model_dir = _write_fp8_model(str(tmp_path / "fp8"))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    prompts = [[5, 9, 33, 7, 100, 200, 3, 4, 8], [44, 2]]
    ref = LLM(model_dir, keep_fp8_weights=True, prefix_cache=False).generate(prompts, params)
    with LLM(model_dir, keep_fp8_weights=True, tensor_parallel_size=2, expert_parallel=True) as llm:
        w = llm.engine.model.attn[0].w
        assert isinstance(w["wq_b.weight"], Fp8Weight) and w["wq_b.weight"].shape == (128, 128)
        assert isinstance(w["wo_b.weight"], Fp8Weight) and w["wo_b.weight"].shape == (256, 128)
        assert isinstance(llm.engine.model.moe[0].shared[0], Fp8Weight)
        outs = llm.generate(prompts, params)
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        diffs = [abs(x - y) for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:])]
        assert max(diffs) <= 5e-3


def test_failed_step_ends_the_group(monkeypatch):
    """Rank 0 fails inside a step (after broadcasting it): the follower, left inside the step's collectives,
    is terminated at once and the LLM refuses further work instead of hanging."""
    from engine.execution.runner import EngineCore

    llm = LLM(model_dir=None, tensor_parallel_size=2)
    follower = llm.ranks.processes[0]
    real = EngineCore.execute

    def failing(self, inputs):
        if self.parallel.is_driver and inputs.kind == "forward" and len(inputs.token_ids[0]) == 1:
            self.parallel.broadcast_object(inputs)  # as execute does, then fail before the forward
            raise RuntimeError("injected rank-0 failure")
        return real(self, inputs)

    monkeypatch.setattr(EngineCore, "execute", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert not follower.is_alive()
    with pytest.raises(RuntimeError, match="released"):
        llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))
    llm.close()


def test_tp_backend_override(monkeypatch):
    """DSV4_TP_BACKEND picks the group's backend (gloo on CUDA = ranks sharing a GPU, host-copied collectives)."""
    from engine.model.parallel import TP_BACKEND_ENV, process_backend

    monkeypatch.delenv(TP_BACKEND_ENV, raising=False)
    assert process_backend("cpu") == "gloo" and process_backend("cuda") == "nccl"
    monkeypatch.setenv(TP_BACKEND_ENV, "gloo")
    assert process_backend("cuda") == "gloo"
    for bad in ("nccl", "mpi"):
        monkeypatch.setenv(TP_BACKEND_ENV, bad)
        with pytest.raises(ValueError, match=TP_BACKEND_ENV):
            process_backend("cpu")
