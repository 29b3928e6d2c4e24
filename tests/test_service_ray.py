"""The disaggregated service on a real local Ray cluster: 2 prefill + 2 decode actors, real NIXL or TCP
transfers, the real gRPC router. Same tokens and logprobs as one engine; dead workers are survived;
every page pool returns to idle."""

import concurrent.futures
import os
import time

import pytest

ray = pytest.importorskip("ray")

from deploy.service import ServiceConfig, init_ray, prepare_metrics_dir, start_service, stop_service  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.make_model import default_model_dir  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from router.client import RouterClient  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, prompt_logprobs=True)


@pytest.fixture(scope="module")
def service():
    metrics_dir = prepare_metrics_dir()
    init_ray(metrics_dir)
    cfg = ServiceConfig(model_dir=default_model_dir(), prefill_workers=2, decode_workers=2,
                        transfer=os.environ.get("DSV4_TEST_TRANSFER", "nixl"), worker_num_cpus=0.1,
                        engine_options=(("max_batch_tokens", 64),))
    handles = start_service(cfg, http=False)
    client = RouterClient(handles["router_addr"], timeout_s=120)
    yield handles, client
    client.close()
    stop_service(handles)


def prompts(n):
    return [[(7 * i + j) % 500 + 2 for j in range(3 + 11 * (i % 5))] for i in range(n)]


def test_disaggregated_matches_single_engine(service):
    handles, client = service
    ps = prompts(16)
    want = LLM().generate(ps, PARAMS)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: client.generate_full(p, PARAMS), ps))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.prompt_logprobs[0] is None
        assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
    used = {(g.prefill_worker, g.decode_worker) for g in got}
    assert {p for p, _ in used} == {"prefill-0", "prefill-1"} or len(used) >= 2


def test_pools_return_to_idle(service):
    handles, _ = service
    deadline = time.time() + 30
    while True:
        stats = ray.get([h.stats.remote() for h in (*handles["prefill"].values(), *handles["decode"].values())])
        if all(s.running == 0 and s.kv_usage == 0.0 for s in stats) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert all(s.running == 0 and s.kv_usage == 0.0 for s in stats), stats


def test_killed_prefill_worker_is_survived(service):
    handles, client = service
    ray.kill(handles["prefill"]["prefill-0"], no_restart=False)  # Ray restarts it (max_restarts=-1)
    ps = prompts(6)
    want = LLM().generate(ps, PARAMS)
    got = [client.generate_full(p, PARAMS) for p in ps]  # retried elsewhere if placed on the dead one
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    deadline = time.time() + 60
    while time.time() < deadline:  # the restarted worker comes back healthy
        if all(w.healthy for w in client.health(probe=True).workers):
            break
        time.sleep(1)
    assert all(w.healthy for w in client.health(probe=True).workers)
