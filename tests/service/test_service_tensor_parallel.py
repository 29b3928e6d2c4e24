"""`dsv4 serve --tensor-parallel-size 2 --expert-parallel` on a real local Ray cluster (CPU, gloo): 1 prefill +
1 decode worker, each two actors in a STRICT_PACK placement group, the gRPC router, TCP KV transfer.

The disaggregated tokens and logprobs equal one engine's; stopping the service releases the follower ranks
and the placement groups.
"""

import concurrent.futures

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

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def test_two_rank_workers_match_one_engine():
    init_ray(prepare_metrics_dir())
    handles = None
    try:
        cfg = ServiceConfig(
            model_dir=default_model_dir(),
            transfer="tcp",
            worker_num_cpus=0.1,
            router_port=0,
            ready_timeout_s=240.0,
            engine_options=(("max_batch_tokens", 16),),
            tensor_parallel_size=2,
            expert_parallel=True,
        )
        try:
            handles = start_service(cfg, http=False)
        except Exception as e:
            raise RuntimeError(f"service start failed: {e}\n{ray_logs_tail()}") from e
        placed = handles["placed"]
        assert all(len(pw.followers) == 1 and pw.group is not None for pw in placed.values())
        assert all(ray.get(pw.followers[0].ping.remote()) == "following" for pw in placed.values())
        client = RouterClient(handles["router_addr"], timeout_s=120, token=handles["token"])
        prompts = [[(5 * i + j) % 500 + 2 for j in range(4 + 9 * i)] for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.generate_full(p, PARAMS), prompts))
        client.close()
        want = LLM().generate(prompts, PARAMS)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
    finally:
        if ray.is_initialized():
            stop_service(handles)
        remove_metrics_dir()
