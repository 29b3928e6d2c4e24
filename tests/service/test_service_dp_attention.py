"""`dsv4 serve --tensor-parallel-size 2 --expert-parallel --data-parallel-attention` on a real local Ray cluster
(CPU, gloo): 1 prefill + 1 decode worker of two ranks each, every rank a worker of its own to the router (its
requests, KV pool and transfer endpoint), the ranks' engine loops in lockstep; TCP KV transfer.

Also with a one-rank prefill worker feeding the data-parallel decode ranks (`prefill_tensor_parallel_size=1`).
The disaggregated tokens and logprobs equal one engine's; both ranks of each pool serve; an idle group serves
again; stopping the service frees every rank and the placement groups. With two-rank prefill (the decode group is
the same in both layouts), a decode rank that dies ends its peer's loop (the group leaves the router together) and
the group is placed again.
"""

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

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def test_config_refuses_data_parallel_attention_without_ranks_and_experts_split():
    with pytest.raises(ValueError, match=r"data_parallel_attention needs.*sizes \[1, 1\]"):
        ServiceConfig(model_dir="m", data_parallel_attention=True)
    with pytest.raises(ValueError, match="expert_parallel False"):
        ServiceConfig(model_dir="m", tensor_parallel_size=2, data_parallel_attention=True)
    with pytest.raises(ValueError, match="decode_tensor_parallel_size must be an int >= 1, got 0"):
        ServiceConfig(model_dir="m", decode_tensor_parallel_size=0)


def test_role_layouts_apply_the_flags_to_roles_of_several_ranks():
    cfg = ServiceConfig(
        model_dir="m", decode_tensor_parallel_size=2, expert_parallel=True, data_parallel_attention=True
    )
    assert cfg.parallel("prefill") == (1, False, False) and cfg.parallel("decode") == (2, True, True)
    cfg = ServiceConfig(model_dir="m", tensor_parallel_size=2, prefill_tensor_parallel_size=1, expert_parallel=True)
    assert cfg.parallel("prefill") == (1, False, False) and cfg.parallel("decode") == (2, True, False)


@pytest.mark.parametrize("prefill_ranks", [2, 1], ids=["dp-prefill", "one-rank-prefill"])
def test_data_parallel_attention_ranks_serve_as_workers_and_match_one_engine(prefill_ranks):
    """prefill_ranks 1: a one-rank prefill worker feeds the data-parallel decode ranks (layouts differ per role)."""
    init_ray(prepare_metrics_dir())
    handles = None
    try:
        # round robin: the four requests reach both ranks of each pool whatever their loads
        cfg = ServiceConfig(
            model_dir=default_model_dir(),
            transfer="tcp",
            worker_num_cpus=0.1,
            router_port=0,
            ready_timeout_s=240.0,
            engine_options=(("max_batch_tokens", 16),),
            router_policy="round_robin",
            tensor_parallel_size=2,
            expert_parallel=True,
            data_parallel_attention=True,
            prefill_tensor_parallel_size=prefill_ranks,
        )
        try:
            handles = start_service(cfg, http=False)
        except Exception as e:
            raise RuntimeError(f"service start failed: {e}\n{ray_logs_tail()}") from e
        assert sorted(handles["prefill"]) == ["prefill-0", "prefill-0-dp1"][:prefill_ranks]
        assert sorted(handles["decode"]) == ["decode-0", "decode-0-dp1"]
        assert all(not pw.followers for pw in handles["placed"].values())
        assert (handles["placed"]["prefill-0"].group is not None) == (prefill_ranks == 2)
        client = RouterClient(handles["router_addr"], timeout_s=120, token=handles["token"])
        prompts = [[(5 * i + j) % 500 + 2 for j in range(4 + 9 * i)] for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.generate_full(p, PARAMS), prompts))
        again = client.generate_full(prompts[0], PARAMS)  # after the group went idle
        want = LLM().generate(prompts, PARAMS)
        for w, g in zip([*want, want[0]], [*got, again]):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
        pulls = {n: ray.get(h.transfer_summary.remote())["count"] for n, h in handles["decode"].items()}
        assert sum(pulls.values()) == 5 and all(pulls.values()), pulls
        for h in (*handles["prefill"].values(), *handles["decode"].values()):
            assert ray.get(h.stats.remote()).load.running == 0
        if prefill_ranks == 2:  # the decode group is the same in both layouts: its rank death is tested once
            dead_rank_restarts_its_group(handles, client, prompts, [w.token_ids for w in want])
        client.close()
    finally:
        if ray.is_initialized():
            stop_service(handles)
        remove_metrics_dir()


def dead_rank_restarts_its_group(handles, client, prompts, want_tokens) -> None:
    """A rank that dies fails its peer's next collective: the peer's loop ends and its ping says so (then its
    watchdog ends it), instead of a live-looking worker whose steps never return; the group is placed again as a
    whole (service.group_restart) and both its ranks serve again, with the same tokens."""
    ray.kill(handles["decode"]["decode-0-dp1"], no_restart=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(handles["decode"]["decode-0"].ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break  # already ended by its watchdog
        except Exception as e:  # noqa: BLE001
            assert "engine loop ended" in str(e), e
            break
        assert time.monotonic() < deadline, "decode-0 still answers 60 s after its peer rank died"
        time.sleep(0.2)
    router = handles["router"]
    deadline = time.monotonic() + 120
    while ray.get(router.group_restarts.remote(), timeout=30) < 1 or not all(
        w.healthy for w in client.health().workers
    ):
        assert time.monotonic() < deadline, "the data-parallel group is not back within 120 s"
        time.sleep(0.5)
    again = [client.generate_full(p, PARAMS) for p in prompts]
    assert [g.token_ids for g in again] == want_tokens
