"""The disaggregated service end to end on a real local Ray cluster: 2 prefill + 2 decode actors with
real NIXL transfers, the real gRPC router, the Ray Serve OpenAI endpoint hit by the official `openai`
client, and Prometheus metrics scraped over HTTP from the one per-node URL.

Checks: same tokens and logprobs as one engine for 16 concurrent mixed-length requests; streaming
gives the same tokens; bad input gets 400 and the server keeps serving; every stage has non-zero
metric counts; killing a prefill worker mid-load loses no request that was not in flight on it and new
requests succeed; afterwards every page pool is back to idle.
"""

import asyncio
import concurrent.futures
import contextlib
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from dsv4_kernels.settings import settings  # noqa: E402
from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.make_model import default_model_dir  # noqa: E402
from engine.telemetry.metrics import start_metrics_server  # noqa: E402
from router.client import RouterClient, RouterError  # noqa: E402
from service.launcher import (  # noqa: E402
    ServiceConfig,
    init_ray,
    prepare_metrics_dir,
    ray_logs_tail,
    remove_metrics_dir,
    start_service,
    stop_service,
)
from tests.support.ports import free_port  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def _teardown(started: dict) -> None:
    if ray.is_initialized():
        stop_service(started.get("handles"))
    if "metrics" in started:
        started["metrics"].shutdown()
        started["metrics"].server_close()
    remove_metrics_dir()


@pytest.fixture(scope="module")
def service():
    """2P2D + router + HTTP on a fresh local Ray cluster. A failed start tears down what came up and
    raises with the stage, the error and the ends of Ray's logs (raylet, GCS, workers, Serve)."""
    metrics_dir = prepare_metrics_dir()
    started: dict = {}
    stage = "ray.init"
    try:
        init_ray(metrics_dir)
        cfg = ServiceConfig(
            model_dir=default_model_dir(),
            prefill_workers=2,
            decode_workers=2,
            transfer=settings().test_transfer,
            worker_num_cpus=0.1,
            port=free_port(),
            metrics_port=free_port(),
            router_port=0,
            ready_timeout_s=240.0,
            engine_options=(("max_batch_tokens", 64),),
        )
        stage = f"metrics server on port {cfg.metrics_port}"
        started["metrics"], _ = start_metrics_server(cfg.metrics_port, "127.0.0.1")
        stage = f"workers, router, HTTP ingress on port {cfg.port}"
        started["handles"] = start_service(cfg)
    except Exception as e:
        logs = ray_logs_tail()
        _teardown(started)
        raise RuntimeError(f"service setup failed at {stage}: {type(e).__name__}: {e}\n\n{logs}") from e
    handles = started["handles"]
    client = RouterClient(handles["router_addr"], timeout_s=120, token=handles["token"])
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="none", max_retries=0, timeout=120)
    yield handles, client, http, cfg
    client.close()
    _teardown(started)


def prompts(n, seed=0):
    return [[(7 * i + 3 * seed + j) % 500 + 2 for j in range(3 + 11 * (i % 5))] for i in range(n)]


def test_disaggregated_matches_single_engine(service):
    handles, client, _, _ = service
    ps = prompts(16)
    want = LLM().generate(ps, PARAMS)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: client.generate_full(p, PARAMS), ps))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.prompt_logprobs[0] is None
        assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
    assert len({g.prefill_worker for g in got}) == 2 and len({g.decode_worker for g in got}) == 2


def test_openai_http_streaming_and_errors(service):
    _, _, http, _ = service
    prompt = prompts(3, seed=1)[2]
    want = LLM().generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = http.completions.create(model="dsv4", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    assert out.choices[0].token_ids == want
    streamed = []
    for chunk in http.completions.create(
        model="dsv4", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body=extra
    ):
        streamed.extend(chunk.choices[0].token_ids or [])
    assert streamed == want
    for bad in (dict(prompt=[10**6]), dict(prompt=[]), dict(prompt=prompt, temperature=-1.0)):
        with pytest.raises(openai.BadRequestError):
            http.completions.create(model="dsv4", max_tokens=4, **bad)
    text = http.completions.create(model="dsv4", prompt="Hello there", max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason in ("length", "stop")


def test_eval_through_the_service_equals_the_engine(service, tmp_path, capsys):
    """`dsv4 eval perplexity|tasks --url`: the windows' prompt logprobs come from the prefill pool over
    /v1/completions (echo + logprobs) and give the engine's own bits per byte; the completion tasks' greedy answers
    (prefill, hand-off, decode) score as the engine's."""
    import json
    import math

    from service.cli import main
    from tests.service.test_eval_cli import TEXT

    _, _, _, cfg = service
    path = tmp_path / "sample.py"
    path.write_text(TEXT)
    common = ["eval", "perplexity", "--file", str(path), "--model", cfg.model_dir, "--window", "40", "--json"]
    got = []
    for argv in ([*common, "--url", f"http://127.0.0.1:{cfg.port}"], common):
        assert main(argv) == 0
        got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    served, engine = got
    assert (served["tokens"], served["windows"]) == (engine["tokens"], engine["windows"]) and engine["windows"] > 1
    # Each prompt logprob may differ from the engine's by 1e-4 nats (the bound test_disaggregated_matches_single_engine
    # holds them to: the same fp32 model, batched with other windows, so sums run in another order); bits per byte
    # is their sum / ln 2 / bytes, so it may differ by at most that bound times tokens / ln 2 / bytes.
    bound = 1e-4 * engine["tokens"] / math.log(2) / engine["bytes"]
    assert abs(served["bits_per_byte"] - engine["bits_per_byte"]) <= bound
    tasks = ["eval", "tasks", "--file", str(path), "--model", cfg.model_dir, "--json"]
    got = []
    for argv in ([*tasks, "--url", f"http://127.0.0.1:{cfg.port}"], tasks):
        assert main(argv) == 0
        got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    served, engine = got
    assert (served["tasks"], served["correct"], served["failures"]) == (
        engine["tasks"],
        engine["correct"],
        engine["failures"],
    ) and engine["tasks"] > 1


def scrape(cfg) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cfg.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = values.get(name, 0.0) + float(value)
    return values


def total(values: dict, metric: str) -> float:
    return sum(v for k, v in values.items() if k == metric or k.startswith(metric + "{"))


def test_metrics_every_stage_from_one_url(service):
    _, _, _, cfg = service
    values = scrape(cfg)
    for metric in (
        "dsv4_request_queue_time_seconds_count",
        "dsv4_prefill_time_seconds_count",
        "dsv4_kv_transfer_time_seconds_count",
        "dsv4_kv_transfer_bytes_count",
        "dsv4_kv_transfer_bytes_sum",
        "dsv4_time_to_first_token_seconds_count",
        "dsv4_inter_token_latency_seconds_count",
        "dsv4_e2e_request_latency_seconds_count",
        "dsv4_generation_tokens_total",
        "dsv4_prompt_tokens_total",
        "dsv4_requests_total",
        "dsv4_router_decisions_total",
    ):
        assert total(values, metric) > 0, metric
    roles = {k for k in values if k.startswith("dsv4_kv_cache_usage_ratio{")}
    assert any('role="prefill"' in k for k in roles) and any('role="decode"' in k for k in roles)
    # every collector pass of the workers and the router, timed (engine.runtime.gc_pauses): young passes come
    # every few hundred allocations, so requests made some in each
    pauses = {k for k, v in values.items() if k.startswith("dsv4_gc_pause_seconds_count{") and v > 0}
    for component in ("prefill", "decode", "router"):
        assert any(f'component="{component}"' in k for k in pauses), (component, sorted(pauses))
        # ... and froze its warm heap: an actor's process is its own (gc_pauses.in_own_process)
        assert values.get(f'dsv4_gc_frozen_objects{{component="{component}"}}', 0) > 10_000, component


def test_killed_prefill_worker_mid_load(service):
    handles, client, _, _ = service
    ps = prompts(12, seed=2)
    want = {tuple(p): w.token_ids for p, w in zip(ps, LLM().generate(ps, PARAMS))}

    def run(p):
        try:
            return p, client.generate_full(p, PARAMS), None
        except RouterError as e:
            return p, None, e

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(run, p) for p in ps]
        time.sleep(0.3)
        ray.kill(handles["prefill"]["prefill-0"], no_restart=False)  # Ray restarts it (max_restarts=-1)
        results = [f.result() for f in futures]
    for p, got, err in results:
        if got is not None:
            assert got.token_ids == want[tuple(p)]
        else:  # only a request caught in flight on the killed worker may fail, and with UNAVAILABLE
            assert err.code.name == "UNAVAILABLE", err
    assert sum(got is not None for _, got, _ in results) >= len(ps) - 4
    for p in prompts(4, seed=3):  # new requests succeed
        assert client.generate_full(p, PARAMS).token_ids == LLM().generate([p], PARAMS)[0].token_ids
    deadline = time.time() + 60
    while time.time() < deadline and not all(w.healthy for w in client.health(probe=True).workers):
        time.sleep(1)
    assert all(w.healthy for w in client.health(probe=True).workers)


def test_pools_return_to_idle(service):
    handles = service[0]
    workers = (*handles["prefill"].values(), *handles["decode"].values())
    deadline = time.time() + 30
    while True:
        stats = ray.get([h.stats.remote() for h in workers])
        if all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in stats) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in stats), stats


# ---- the streamed hand-off (service.ray_stream): a prompt spanning several prefill chunks --------------------
LONG_PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)


def long_prompt(seed: int, n: int) -> list[int]:
    """n tokens, no prefix shared with the other tests' prompts (each worker steps 64 tokens, streams 256 a chunk)."""
    return [(13 * j + 5 * seed) % 499 + 2 for j in range(n)]


def labelled(values: dict, metric: str, label: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(metric + "{") and label in k)


def test_streamed_handoff_matches_single_engine(service):
    """Through the router's Generate (its RayDispatcher) and the HTTP ingress (service.direct_path): the chunks
    are pulled while the prefill runs (counted by the decode workers) and the tokens are one engine's."""
    _, client, http, cfg = service
    before = scrape(cfg)
    ps = [long_prompt(1, 600), long_prompt(2, 600)]
    want = LLM().generate(ps, LONG_PARAMS)
    got = client.generate_full(ps[0], LONG_PARAMS)
    assert got.token_ids == want[0].token_ids
    assert got.logprobs == pytest.approx(want[0].logprobs, abs=1e-4)
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = http.completions.create(model="dsv4", prompt=ps[1], max_tokens=6, temperature=0, extra_body=extra)
    assert out.choices[0].token_ids == want[1].token_ids
    after = scrape(cfg)
    chunks = total(after, "dsv4_kv_stream_chunks_total") - total(before, "dsv4_kv_stream_chunks_total")
    assert chunks >= 2  # one chunk at least a request (600 positions: pages end at 256 and 512)
    exposed = "dsv4_kv_handoff_exposed_seconds_count"
    assert labelled(after, exposed, 'streamed="true"') - labelled(before, exposed, 'streamed="true"') == 2


def test_handoff_overlap_measure_on_the_service(service):
    """benchmarks.kv_stream_ray.measure (the kv_pull section's Ray rows) on the service's workers, one request a mode."""
    from benchmarks.kv_pull_report import ray_stream_text
    from benchmarks.kv_stream_ray import measure
    from service.ray_stream import Workers

    handles, _, _, cfg = service
    workers = Workers("prefill-1", handles["prefill"]["prefill-1"], "decode-1", handles["decode"]["decode-1"])
    result = asyncio.run(measure(workers, prompt_tokens=600, requests=1, seed=11))
    assert result["generated"] == [2, 2, 2, 2]
    assert result["not streamed"]["streamed"] == [False] and result["not streamed"]["chunks"] == 0
    assert result["streamed"]["streamed"] == [True] and result["streamed"]["chunks"] >= 1
    for mode in ("not streamed", "streamed"):
        assert result[mode]["prefill_ms"] > 0 and result[mode]["exposed_ms"] > 0 and result[mode]["bytes"] > 0
        assert result[mode]["exposed_share"] == pytest.approx(result[mode]["exposed_ms"] / result[mode]["prefill_ms"])
    text = ray_stream_text(result | {"chunk_tokens": 256, "transfer": cfg.transfer})
    assert "| streamed | " in text and f"{result['streamed']['exposed_ms']:.2f}" in text


def test_abort_during_streamed_handoff_frees_both_workers(service):
    """The client leaves after the first chunk landed on the decode worker, while later chunks are prefilled: the
    prefill stream is cancelled and both workers are aborted; every page of every worker comes back."""
    from router.dispatch import DispatchRequest
    from service.ray_stream import RayStreamer, Workers

    handles = service[0]
    prefill, decode = handles["prefill"]["prefill-0"], handles["decode"]["decode-0"]
    workers = Workers("prefill-0", prefill, "decode-0", decode)
    handoffs: list = []
    streamer = RayStreamer(stream_min_chunks=2, on_handoff=handoffs.append)
    request = DispatchRequest("streamed-abort", tuple(long_prompt(3, 1024)), LONG_PARAMS)

    async def scenario():
        pulls = (await decode.transfer_summary.remote())["count"]
        events = streamer.run_placement(request, workers)
        first = asyncio.ensure_future(anext(events))
        while (await decode.transfer_summary.remote())["count"] == pulls:  # until a chunk is in the decode pages
            assert not first.done(), first
            await asyncio.sleep(0.005)
        running = (await prefill.stats.remote()).running
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return running

    assert asyncio.run(scenario()) == 1  # the prefill was still running when the client left
    assert handoffs == []  # the decode stream never opened
    stats = idle_workers([*handles["prefill"].values(), *handles["decode"].values()])
    assert all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in stats), stats


def idle_workers(handles_: list, timeout_s: float = 30.0) -> list:
    """The workers' stats once none holds a request or a page (or at the timeout)."""
    deadline = time.time() + timeout_s
    while True:
        stats = ray.get([h.stats.remote() for h in handles_])
        if all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in stats) or time.time() > deadline:
            return stats
        time.sleep(0.2)


def test_a_worker_dying_mid_streamed_handoff(service):
    """Either worker killed after a chunk landed on the decode side: the placement fails as that worker's WorkerDied
    (which the stream's owner retries or migrates), and the surviving worker holds no page of the request."""
    from router.dispatch import DispatchRequest, WorkerDied
    from service.ray_stream import RayStreamer, Workers

    handles, client, _, _ = service
    prefill, decode = handles["prefill"], handles["decode"]

    async def kill_mid_handoff(workers: Workers, victim, rid: str) -> BaseException:
        streamer = RayStreamer(stream_min_chunks=2)
        pulls = (await workers.decode.transfer_summary.remote())["count"]
        events = streamer.run_placement(DispatchRequest(rid, tuple(long_prompt(9, 1024)), LONG_PARAMS), workers)
        first = asyncio.ensure_future(anext(events))
        while (await workers.decode.transfer_summary.remote())["count"] == pulls:
            assert not first.done(), first
            await asyncio.sleep(0.005)
        ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=-1)
        with pytest.raises(WorkerDied) as died:
            await asyncio.wait_for(first, 60)
        await events.aclose()
        return died.value

    pair = Workers("prefill-0", prefill["prefill-0"], "decode-0", decode["decode-0"])
    assert asyncio.run(kill_mid_handoff(pair, decode["decode-0"], "dies-decode")).worker_id == "decode-0"
    assert all(s.kv_usage == 0.0 and s.running == 0 for s in idle_workers([prefill["prefill-0"]], 60))
    pair = Workers("prefill-1", prefill["prefill-1"], "decode-1", decode["decode-1"])
    assert asyncio.run(kill_mid_handoff(pair, prefill["prefill-1"], "dies-prefill")).worker_id == "prefill-1"
    assert all(s.kv_usage == 0.0 and s.running == 0 for s in idle_workers([decode["decode-1"]], 60))
    deadline = time.time() + 60
    while time.time() < deadline and not all(w.healthy for w in client.health(probe=True).workers):
        time.sleep(1)
    assert all(w.healthy for w in client.health(probe=True).workers)
    ps = [long_prompt(4, 600)]
    assert client.generate_full(ps[0], LONG_PARAMS).token_ids == LLM().generate(ps, LONG_PARAMS)[0].token_ids


def test_streamed_handoff_on_a_full_decode_worker_is_overloaded(service):
    """A decode worker with no room for the streamed reservation: retried for overload_retry_s, then Overloaded (the
    ingress puts the request back in a router's queue) before the prefill worker saw it; nothing is left held."""
    from engine.handoff import DecodeOverloaded
    from router.dispatch import DispatchRequest, Overloaded
    from service.ray_items import cause
    from service.ray_stream import RayStreamer, Workers

    handles = service[0]
    prefill, decode = handles["prefill"]["prefill-0"], handles["decode"]["decode-0"]
    fillers: list[str] = []
    try:
        while len(fillers) < 200:  # reservations until the worker is full (slots or pages)
            try:
                ray.get(
                    decode.reserve_streamed.remote(
                        f"filler-{len(fillers)}", long_prompt(100 + len(fillers), 2000), LONG_PARAMS
                    )
                )
            except ray.exceptions.RayTaskError as e:
                assert isinstance(cause(e), DecodeOverloaded), e
                break
            fillers.append(f"filler-{len(fillers)}")
        streamer = RayStreamer(overload_retry_s=0.3, stream_min_chunks=2)
        request = DispatchRequest("finds-no-room", tuple(long_prompt(5, 600)), LONG_PARAMS)
        with pytest.raises(Overloaded):
            asyncio.run(anext(streamer.run_placement(request, Workers("prefill-0", prefill, "decode-0", decode))))
        assert ray.get(prefill.stats.remote()).running == 0
    finally:
        ray.get([decode.abort.remote(rid) for rid in fillers])
    assert fillers
    stats = idle_workers([prefill, decode])
    assert all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in stats), stats
