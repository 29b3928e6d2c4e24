"""Multi-rank workers on a real local Ray cluster (CPU, gloo ranks): 1 prefill worker and 2 decode workers of 2 ranks
each (tensor + expert parallel, a STRICT_PACK placement group each), the real gRPC router (round robin), tcp
transfer. One service for both checks (each start of it costs the 2-core CI box most of a minute):

- `dsv4 serve --tensor-parallel-size 2 --expert-parallel`: every worker's follower rank follows, and the
  disaggregated tokens and logprobs equal one engine's;
- a killed rank restarts its whole group while the others serve: killing one rank of decode-0 (a follower: Ray does
  not restart ranks) brings the whole worker back: the supervisor in the router's actor kills its other rank, frees
  its placement group and places it again; the router re-introduces it to the prefill worker and takes it back
  within 120 s. Meanwhile every request succeeds (the other decode worker serves; one that hit the broken worker is
  retried), and afterwards decode-0 serves again with the tokens of one engine.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

ray = pytest.importorskip("ray")

from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.make_model import default_model_dir  # noqa: E402
from router.client import RouterClient  # noqa: E402
from service.launcher import (  # noqa: E402
    ServiceConfig,
    init_ray,
    prepare_metrics_dir,
    ray_logs_tail,
    remove_metrics_dir,
    start_service,
    stop_service,
)

pytestmark = pytest.mark.ray

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
LOGPROBS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=True)


@pytest.fixture(scope="module")
def svc():
    init_ray(prepare_metrics_dir())
    handles = None
    try:
        cfg = ServiceConfig(
            model_dir=default_model_dir(),
            transfer="tcp",
            worker_num_cpus=0.1,
            decode_workers=2,
            router_port=0,
            ready_timeout_s=240.0,
            engine_options=(("max_batch_tokens", 16),),
            tensor_parallel_size=2,
            expert_parallel=True,
            router_policy="round_robin",
            stall_timeout_s=30.0,
        )
        try:
            handles = start_service(cfg, http=False)
        except Exception as e:
            raise RuntimeError(f"service start failed: {e}\n{ray_logs_tail()}") from e
        client = RouterClient(handles["router_addr"], timeout_s=180, token=handles["token"])
        yield handles, client
        client.close()
    finally:
        if ray.is_initialized():
            stop_service(handles)
        remove_metrics_dir()


def test_two_rank_workers_match_one_engine(svc):
    handles, client = svc
    placed = handles["placed"]
    assert sorted(placed) == ["decode-0", "decode-1", "prefill-0"]
    assert all(len(pw.followers) == 1 and pw.group is not None for pw in placed.values())
    assert all(ray.get(pw.followers[0].ping.remote()) == "following" for pw in placed.values())
    prompts = [[(5 * i + j) % 500 + 2 for j in range(4 + 9 * i)] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.generate_full(p, LOGPROBS), prompts))
    want = LLM().generate(prompts, LOGPROBS)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)


def test_killed_rank_restarts_its_whole_group_while_others_serve(svc):
    handles, client = svc
    router, placed = handles["router"], handles["placed"]
    prompts = [[(3 * i + j) % 400 + 2 for j in range(5 + i)] for i in range(6)]
    want = [r.token_ids for r in LLM().generate(prompts, PARAMS)]
    # both decode workers serve before the fault (round robin alternates them, unless a probe that timed out on a
    # loaded machine briefly took one out of rotation: then a later request reaches it)
    serving: set[str] = set()
    for p in prompts:
        serving.add(client.generate_full(p, PARAMS).decode_worker)
        if len(serving) == 2:
            break
    assert serving == {"decode-0", "decode-1"}
    before = ray.get(handles["decode"]["decode-0"].stats.remote(), timeout=30).incarnation

    ray.kill(placed["decode-0"].followers[0], no_restart=True)  # one rank of decode-0 dies
    t0 = time.monotonic()
    served = []
    while ray.get(router.group_restarts.remote(), timeout=30) < 1 or not all(
        w.healthy for w in client.health().workers
    ):
        assert time.monotonic() - t0 < 120, "decode-0 not back within 120 s"
        i = len(served) % len(prompts)
        res = client.generate_full(prompts[i], PARAMS)  # every request meanwhile succeeds
        assert res.token_ids == want[i]
        served.append(res.decode_worker)
        time.sleep(0.5)
    assert served and "decode-1" in served  # the other worker kept serving

    fresh = ray.get(router.placed_workers.remote(), timeout=30)["decode-0"]
    assert fresh.group is not None and len(fresh.followers) == 1
    assert ray.get(fresh.handle.stats.remote(), timeout=30).incarnation != before
    got = [client.generate_full(p, PARAMS) for p in prompts]
    assert [g.token_ids for g in got] == want
    assert "decode-0" in {g.decode_worker for g in got}  # the restarted group serves again


def test_two_rank_prefill_streams_a_long_prompt(svc):
    """A prompt spanning two of the 2-rank prefill worker's chunks (256 positions: its largest page) takes the
    streamed hand-off (service.ray_stream): its decode worker pulls more than once, and the tokens are one engine's."""
    handles, client = svc
    prompt = [(11 * j + 3) % 499 + 2 for j in range(300)]
    current = ray.get(handles["router"].worker_handles.remote())  # a group restart replaced decode-0's handle
    decode = {wid: h for wid, h in current.items() if wid.startswith("decode-")}
    before = ray.get([h.transfer_summary.remote() for h in decode.values()])
    got = client.generate_full(prompt, LOGPROBS)
    after = ray.get([h.transfer_summary.remote() for h in decode.values()])
    assert sorted(a["count"] - b["count"] for a, b in zip(after, before)) == [0, 2]  # one chunk, then the rest
    want = LLM().generate([prompt], LOGPROBS)[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
