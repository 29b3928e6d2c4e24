"""Faults that are not a process exit, on one real service: a local Ray cluster, 1 prefill + 2 decode workers (tcp
transfer), the real gRPC routers, the Ray Serve ingress hit by the official openai client. Streams run both ways:
through the router's own Generate (it owns the stream) and through the ingress (the router places, the ingress
replica owns the stream and learns from the routers' Health which worker is down).

The workers are built with test hooks (`inject_fault`: the engine's next step raises or never returns) and a
stall bound of STALL_S. Each test checks what a user sees: requests keep succeeding, streams in flight on the
broken worker complete elsewhere with the tokens of an undisturbed run (each once), and the worker comes back.
- a step that raises ends the engine loop: the requests on it are retried as a worker death (not INTERNAL), the
  watchdog ends the process, Ray restarts it (a new incarnation) and the router takes it back;
- a step that hangs: the worker reports the stall, the router marks it down and moves its streams, the watchdog
  ends the process after its grace;
- a worker process stopped with SIGSTOP (alive to Ray, no progress, cannot report anything): its stats probe times
  out, the router marks it down and moves the streams it held; new requests are served within 30 s.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from engine.execution.sampling_params import SamplingParams  # noqa: E402
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
from tests.support.ports import free_port  # noqa: E402

pytestmark = pytest.mark.ray

STALL_S = 3.0
LONG = SamplingParams(max_new_tokens=150, ignore_eos=True)
DECODES = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def svc():
    prepare_metrics_dir()
    handles = None
    try:
        init_ray(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        cfg = ServiceConfig(
            model_dir=default_model_dir(),
            prefill_workers=1,
            decode_workers=2,
            transfer="tcp",
            port=free_port(),
            metrics_port=free_port(),
            worker_num_cpus=0.1,
            ready_timeout_s=240.0,
            stall_timeout_s=STALL_S,
            worker_test_hooks=True,
            ingress_replicas=1,
            engine_options=(("max_batch_tokens", 64), ("max_num_seqs", 8)),
        )
        handles = start_service(cfg)
    except Exception as e:
        logs = ray_logs_tail()
        if ray.is_initialized():
            stop_service(handles, drain_s=0)
        raise RuntimeError(f"service setup failed: {type(e).__name__}: {e}\n\n{logs}") from e
    client = RouterClient(handles["router_addr"], timeout_s=180, token=handles["token"])
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="none", max_retries=0, timeout=120)
    yield handles, client, http
    client.close()
    stop_service(handles, drain_s=0)
    remove_metrics_dir()


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met after {timeout:.0f} s"
        time.sleep(0.25)


def all_healthy(client) -> bool:
    return all(w.healthy for w in client.health(probe=False).workers)


def incarnation(handles, wid: str) -> str:
    return ray.get(handles["decode"][wid].stats.remote(), timeout=30).incarnation


def complete(http, i: int):
    return http.completions.create(
        model="dsv4", prompt=[20 + i, 21, 22], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )


def open_streams(client, prompts):
    """Start a long stream per prompt; -> [(iterator, [first event])] once each has streamed a token."""
    streams = []
    for p in prompts:
        it = client.generate(p, LONG)
        streams.append((it, [next(it)]))
    return streams


def open_http_streams(http, prompts):
    """The same through the ingress (the service's path: the router places, the ingress replica reads the decode
    worker's stream); -> [(chunk iterator, [token ids])] once each has streamed a token."""
    streams = []
    for p in prompts:
        it = iter(
            http.completions.create(
                model="dsv4",
                prompt=p,
                max_tokens=LONG.max_new_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
        got: list[int] = []
        while not got:
            got.extend(next(it).choices[0].token_ids or [])
        streams.append((it, got))
    return streams


def finish_http(streams) -> list[list[int]]:
    out = []
    for it, got in streams:
        last = None
        for chunk in it:
            got.extend(chunk.choices[0].token_ids or [])
            last = chunk.choices[0].finish_reason or last
        assert last == "length", last
        out.append(got)
    return out


def finish(streams) -> list[list[int]]:
    out = []
    for it, got in streams:
        got.extend(it)
        assert got[-1].finished and got[-1].finish_reason == "length", got[-1]
        out.append([e.token_id for e in got])
    return out


def undisturbed(client, prompts) -> list[list[int]]:
    """The prompts' greedy tokens from a run no fault touched (side by side: a batch gives each the same tokens)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate_full(p, LONG).token_ids, prompts))


def test_step_exception_restarts_the_worker_and_requests_keep_succeeding(svc):
    handles, client, http = svc
    wait_until(lambda: all_healthy(client), 240, "every worker healthy")
    before = incarnation(handles, "decode-0")
    ray.get(handles["decode"]["decode-0"].inject_fault.remote("raise"), timeout=30)
    deaths = client.stats().worker_deaths_total
    i = 0
    # every request succeeds while decode-0's next step fails, its process ends and Ray restarts it
    while True:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda k: complete(http, k), range(i, i + 4)))
        assert all(r.usage.completion_tokens == 6 for r in results)
        i += 4
        try:
            if incarnation(handles, "decode-0") != before:
                break
        except ray.exceptions.RayActorError:  # restarting right now
            pass
        assert i < 200, "decode-0 never took a request (its injected failure never ran)"
    stats = client.stats()
    assert stats.worker_deaths_total > deaths and "INTERNAL" not in stats.errors_total, stats
    wait_until(lambda: all_healthy(client), 120, "the restarted decode-0 back in the router")
    assert all(complete(http, k).usage.completion_tokens == 6 for k in range(4))


def test_hung_step_marks_the_worker_down_and_its_streams_complete_elsewhere(svc):
    handles, client, http = svc
    wait_until(lambda: all_healthy(client), 240, "every worker healthy")
    prompts = [[60 + i, 61, 62, 63] for i in range(4)]
    http_prompts = [[70 + i, 61, 62, 63] for i in range(4)]
    http_streams = open_http_streams(http, http_prompts)  # both decode workers hold some (least loaded)
    streams = open_streams(client, prompts)
    held = [s[1][0].decode_worker for s in streams]
    hung = max(DECODES, key=held.count)
    before = incarnation(handles, hung)
    ray.get(handles["decode"][hung].inject_fault.remote("hang"), timeout=30)
    t0 = time.monotonic()
    wait_until(lambda: not {w.worker_id: w.healthy for w in client.health().workers}[hung], 60, f"{hung} down")
    assert time.monotonic() - t0 < STALL_S + 15
    tokens, http_tokens = finish(streams), finish_http(http_streams)
    wait_until(lambda: all_healthy(client), 240, f"{hung} restarted and back")
    assert incarnation(handles, hung) != before  # the watchdog ended the wedged process; Ray restarted it
    assert tokens == undisturbed(client, prompts)  # each stream complete, nothing lost or repeated
    assert http_tokens == undisturbed(client, http_prompts)


def test_stopped_worker_process_is_routed_around_and_its_streams_move(svc):
    handles, client, http = svc
    wait_until(lambda: all_healthy(client), 240, "every worker healthy")
    prompts = [[80 + i, 81, 82] for i in range(8)]
    http_prompts = [[90 + i, 81, 82] for i in range(4)]
    http_streams = open_http_streams(http, http_prompts)
    streams = open_streams(client, prompts)
    held = [s[1][0].decode_worker for s in streams]
    stopped = max(DECODES, key=held.count)
    assert held.count(stopped) >= 3, held
    pid = int(incarnation(handles, stopped).split("-")[0])
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda k: complete(http, 100 + k), range(4)))
        assert all(r.usage.completion_tokens == 6 for r in results)
        assert time.monotonic() - t0 < 30, f"new requests took {time.monotonic() - t0:.1f} s"
        tokens = finish(streams)  # including the ones the stopped worker held
        http_tokens = finish_http(http_streams)
        assert not {w.worker_id: w.healthy for w in client.health().workers}[stopped]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: all_healthy(client), 120, f"{stopped} back after SIGCONT")
    assert tokens == undisturbed(client, prompts)
    assert http_tokens == undisturbed(client, http_prompts)
    # the continued worker dropped the streams it held: every page back in its pool
    wait_until(
        lambda: all(
            s.running == 0 and s.kv_usage == 0.0
            for s in ray.get([h.stats.remote() for h in handles["decode"].values()], timeout=30)
        ),
        60,
        "decode pools idle",
    )
