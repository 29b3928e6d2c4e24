"""Fault and abuse suite on one real service: a local Ray cluster, 1 prefill + 1 decode worker (tcp transfer,
so the transfer listener's token and address are checked too), the real gRPC router, two Ray Serve ingress
replicas, traffic over loopback only.

One worker per pool on purpose: a killed worker leaves its pool empty, so new requests must wait for Ray's
restart (and for the restarted worker to be re-introduced to its transfer peer) instead of failing. The
decode worker has SLOTS batch slots and the router queues at most QUEUED requests, so overload is reached
with a few dozen requests. Every attack runs while a watcher polls /health; each test asserts /health kept
answering within HEALTH_BOUND_S, what the client saw, and (last) that the pools are back to idle.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import socket
import struct
import time

import pytest

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

from engine.loading.make_model import default_model_dir  # noqa: E402
from kv_transfer.base import unpack_metadata  # noqa: E402
from router.client import RouterClient, RouterError  # noqa: E402
from service.launcher import ServiceConfig  # noqa: E402
from service.serve_front import serve_front  # noqa: E402
from tests.support.proc import listeners, listening  # noqa: E402
from tests.support.service_harness import (  # noqa: E402
    AUTH,
    LIMITS,
    QUEUED,
    SLOTS,
    HealthWatch,
    Http,
    Service,
    check_http_attacks,
    cluster_pids,
    running_service,
    wait_until,
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def svc():
    with running_service() as s:
        yield s


def undisturbed(svc, prompts) -> list:
    """Each prompt's 120 greedy tokens from a run no fault touched, side by side (a batch gives each prompt the same
    tokens as alone); -> the responses."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(lambda p: svc.complete(prompt=p, max_tokens=120, ignore_eos=True, return_token_ids=True), prompts)
        )


# ---- exposure and credentials -------------------------------------------------------------------------
def test_every_listener_of_the_local_cluster_is_loopback(svc):
    """Ray's own listeners included (GCS, raylet, every worker's gRPC port, the agents, Ray's Prometheus
    exporters, which listen on all interfaces unless the node is loopback: service.ray_cluster._loopback_node).
    The one exception Ray 2.60 leaves no option for: each Serve replica's inter-deployment gRPC server, bound to
    [::]:0 (ray.serve._private.replica; it checks Ray's token, and requests reach our app's API-key check).
    Requests first: a replica's TCP token feed listener (service.tcp_feed) starts with its first feed."""
    with concurrent.futures.ThreadPoolExecutor(4 * svc.cfg.ingress_replicas) as pool:
        done = list(pool.map(lambda k: svc.complete(prompt=f"warm {k}"), range(4 * svc.cfg.ingress_replicas)))
    assert all(r.status_code == 200 for r in done), [r.text for r in done]
    found = listeners(cluster_pids())
    assert sum(map(len, found.values())) >= 15, found  # GCS, raylet, agents, every actor: not a vacuous pass
    wide = {pid: [s for s in socks if s[0] != "127.0.0.1"] for pid, socks in found.items()}
    wide = {pid: socks for pid, socks in wide.items() if socks}
    replicas = {pid for pid in wide if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"ray::ServeReplica")}
    assert replicas == set(wide) and all(len(wide[p]) == 1 and wide[p][0][0] == "::" for p in replicas), wide
    assert len(replicas) == svc.cfg.ingress_replicas
    assert listening(svc.cfg.port) == ["127.0.0.1"]  # Serve's HTTP proxy where we put it


def test_internal_listeners_are_loopback_and_need_the_token(svc):
    router_port = int(svc.handles["router_addr"].rsplit(":", 1)[1])
    assert listening(router_port) == ["127.0.0.1"]
    header, _ = unpack_metadata(ray.get(svc.handles["prefill"]["prefill-0"].transfer_metadata.remote()))
    assert header["host"] == "127.0.0.1" and listening(header["port"]) == ["127.0.0.1"]

    for token in (None, "wrong"):  # gRPC without (or with a wrong) cluster token
        with RouterClient(svc.handles["router_addr"], timeout_s=30, token=token) as c:
            for call in (lambda: c.health(), lambda: c.stats(), lambda: c.generate_full([5, 6, 7])):
                with pytest.raises(RouterError) as info:
                    call()
                assert info.value.code.name == "UNAUTHENTICATED"
    with RouterClient(svc.handles["router_addr"], timeout_s=30, token=svc.handles["token"]) as c:
        assert c.health().serving
        with pytest.raises(RouterError) as info:  # rejected inside the prefill actor: its message, not Ray's
            c.generate_full([10**6])
        assert info.value.code.name == "INVALID_ARGUMENT" and "out of vocabulary" in info.value.message
        assert not any(s in info.value.message for s in ("Traceback", "pid=", "ip=", "\x1b[")), info.value.message

    # the tcp transfer listener: a read request without the token gets no answer, only a closed connection
    with socket.create_connection(("127.0.0.1", header["port"]), timeout=10) as sock:
        frame = json.dumps({"op": "read", "rid": "x", "fingerprint": header["fingerprint"], "ranges": []}).encode()
        sock.sendall(struct.pack("<I", len(frame)) + frame)
        assert sock.recv(1) == b""


def test_api_key_docs_and_body_limit(svc):
    r = svc.complete(prompt=[5, 6, 7])
    assert r.status_code == 200
    for headers in (None, {"Authorization": "Bearer nope"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            r = svc.http.request(method, path, headers=headers or {}, json={"model": "dsv4", "prompt": [5]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", r.text
    health = svc.http.get("/health")
    assert health.status_code == 200  # probes need no key
    for w in health.json()["workers"]:  # each Ray worker's fast paths, from its stats through the router
        fast = w["fast_paths"]
        assert not set(fast["active"]) & set(fast["fell_back"]) and all(fast["fell_back"].values()), w
        assert "flash_mla" in fast["fell_back"], w  # the service runs on the CPU here: FlashMLA is CUDA only
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert svc.http.get(path).status_code == 404
    with HealthWatch(svc.base):
        big = b'{"model": "dsv4", "prompt": "' + b"a" * (2 << 20) + b'"}'
        r = svc.post("/v1/completions", big)
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit applies while the body streams in
            yield b'{"prompt": "'
            for _ in range(40):
                yield b"b" * 65536
            yield b'"}'

        r = svc.http.post("/v1/completions", data=chunks(), headers=AUTH)
        assert r.status_code == 413, r.text


def test_oversized_heads_and_slow_clients_are_refused_at_the_front_door(svc):
    assert serve_front(LIMITS).haproxy  # the default front door (the Python proxy's: tests/service/test_front_doors.py)
    check_http_attacks(svc, haproxy=True)


# ---- user-sized work never blocks the loop -------------------------------------------------------------
def test_template_and_tokeniser_abuse_keep_health_answering(svc):
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    with HealthWatch(svc.base):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow = [
                pool.submit(
                    svc.post, "/v1/chat/completions", {"model": "dsv4", "messages": msgs, "chat_template": bomb}
                )
                for _ in range(2)
            ]
            huge = pool.submit(svc.complete, prompt="lorem ipsum " * 80000)  # ~1 MB of text
            near = pool.submit(svc.complete, prompt="dolor sit amet " * 4000)  # tokenised, then too long
            for f in slow:
                r = f.result()
                assert r.status_code == 400 and "time budget" in r.json()["error"]["message"], r.text
            r = huge.result()
            assert r.status_code in (400, 413), r.text
            r = near.result()
            assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    r = svc.post(
        "/v1/chat/completions",
        {"model": "dsv4", "messages": msgs, "max_tokens": 2, "chat_template": "{{ 'x' * 1000000000 }}"},
    )
    assert r.status_code == 400 and "repetition" in r.json()["error"]["message"]
    assert svc.complete(prompt=[5, 6, 7]).status_code == 200


# ---- backpressure ------------------------------------------------------------------------------------
def test_overload_queues_then_429_with_retry_after(svc):
    n = SLOTS + QUEUED + 24  # some run, QUEUED wait at the router, the rest are turned away at once
    with HealthWatch(svc.base), concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(
            pool.map(lambda i: svc.complete(prompt=[5 + i % 50, 6, 7], max_tokens=64, ignore_eos=True), range(n))
        )
    ok = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code == 429]
    assert len(ok) + len(busy) == n, [(r.status_code, r.text[:200]) for r in results if r.status_code not in (200, 429)]
    assert len(ok) >= SLOTS + QUEUED and busy, (len(ok), len(busy))
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in ok)
    for r in busy:
        err = r.json()["error"]
        assert r.headers["Retry-After"] and err["type"] == "RateLimitError" and "retry later" in err["message"]
        assert not any(s in err["message"] for s in ("Traceback", "pid=", "ip=", "\x1b[")), err


def test_disconnects_mid_stream_free_everything(svc):
    import http.client

    streams = [svc.stream(prompt=[9, 8, 7, i + 2], max_tokens=2000) for i in range(SLOTS)]
    for resp in streams:  # in flight: each has produced tokens, and every decode slot is taken
        assert next(line for line in resp.lines if line.startswith("data:"))
    waiting = []  # two more wait at the router for a slot; their clients give up too
    for i in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", svc.cfg.port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {"model": "dsv4", "prompt": [3, 4, i + 2], "stream": True, "max_tokens": 2000, "ignore_eos": True}
            ),
            {"Content-Type": "application/json", **AUTH},
        )
        waiting.append(conn)
    wait_until(lambda: svc.queued() == 2, 60, "two requests queued")
    for conn in waiting:
        conn.close()
    for resp in streams:
        resp.close()
    wait_until(lambda: svc.queued() == 0, 60, "queue empty")
    wait_until(
        lambda: all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in svc.worker_stats()),
        60,
        "pools idle after disconnects",
    )


# ---- faults heal -------------------------------------------------------------------------------------
def test_killed_decode_worker_in_flight_streams_migrate_then_heals(svc):
    """Kill the only decode worker while every slot streams: the router continues each request (prompt +
    the tokens streamed so far) once Ray has restarted the worker and it has been re-introduced to the
    prefill worker; the clients see one uninterrupted stream with the tokens of an undisturbed run."""
    prompts = [[11, 12, 13, i + 2] for i in range(SLOTS)]
    streams = [svc.stream(prompt=p, max_tokens=120, return_token_ids=True) for p in prompts]
    got = [[] for _ in prompts]

    def tokens(i, line):
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            body = json.loads(line[5:])
            assert "error" not in body, body
            got[i].extend(body["choices"][0].get("token_ids") or [])

    for i, resp in enumerate(streams):  # provably in flight: every stream has delivered a token before the kill
        line = next(x for x in resp.lines if x.startswith("data:") and "token_ids" in x)
        tokens(i, line)
    ray.kill(svc.handles["decode"]["decode-0"], no_restart=False)  # Ray restarts it (max_restarts=-1)
    with HealthWatch(svc.base):
        for i, resp in enumerate(streams):
            rest = [x for x in resp.lines if x.startswith("data:")]
            resp.close()
            assert rest[-1] == "data: [DONE]", rest[-3:]
            for line in rest:
                tokens(i, line)
    wait_until(lambda: svc.http.get("/health").status_code == 200, 60, "/health after the decode restart")
    for g, r in zip(got, undisturbed(svc, prompts)):  # the same greedy tokens as a run nobody interrupted
        assert r.status_code == 200 and g == r.json()["choices"][0]["token_ids"], (g, r.text)
    retries = 0
    for router in svc.handles["routers"]:  # the ingress replicas place retries on either router replica
        with RouterClient(ray.get(router.address.remote()), timeout_s=30, token=svc.handles["token"]) as c:
            retries += c.stats().retries_total
    assert retries >= SLOTS  # each stream was continued at least once
    ray.kill(svc.handles["decode"]["decode-0"], no_restart=False)  # again: each restart is re-introduced
    r = svc.complete(prompt=[34, 35, 36], max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text


def _front_door_pids(kind: str) -> set[int]:
    """This cluster's HAProxy managers ("manager") or HAProxy processes ("haproxy"), alive (zombies excluded)."""
    found = set()
    for pid in cluster_pids():
        try:
            argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
            state = next(x for x in open(f"/proc/{pid}/status").read().splitlines() if x.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "zombie" in state:
            continue
        if (kind == "manager" and argv0.startswith("ray::HAProxyManager")) or (
            kind == "haproxy" and os.path.basename(argv0) == "haproxy"
        ):
            found.add(pid)
    return found


def _answers(base: str) -> bool:
    try:
        return Http(base, timeout=10).get("/health").status_code == 200
    except requests.RequestException:
        return False


def test_killed_front_door_comes_back_and_leaves_no_haproxy_behind(svc):
    """SIGKILL Serve's HAProxyManager (the supervisor of the node's HAProxy) with streams in flight. Ray ends the
    worker's children with it, so that HAProxy's connections are cut (as a killed Python proxy's were: the front door
    holds the client connections; clients retry); no HAProxy is left behind serving a config nobody updates, Serve
    starts a new manager and HAProxy, and new requests are served within the wait."""
    if not serve_front(LIMITS).haproxy:
        pytest.skip("the front door is Serve's Python proxy")
    managers, old = _front_door_pids("manager"), _front_door_pids("haproxy")
    assert len(managers) == 1 and old, (managers, old)
    streams = [svc.stream(prompt=[40 + i, 41, 42], max_tokens=80, return_token_ids=True) for i in range(2)]
    for resp in streams:  # in flight: each has delivered a token before the kill
        assert resp.status_code == 200 and next(x for x in resp.lines if "token_ids" in x)
    os.kill(managers.pop(), signal.SIGKILL)
    for resp in streams:
        with contextlib.suppress(requests.RequestException):
            list(resp.lines)
        resp.close()
    wait_until(lambda: not old & _front_door_pids("haproxy"), 60, "the killed manager's HAProxy to end")
    wait_until(lambda: _answers(svc.base), 150, "/health through the restarted front door")
    assert _front_door_pids("manager") and _front_door_pids("haproxy")
    r = Service(svc.cfg, svc.handles).complete(prompt=[5, 6, 7])  # a fresh connection pool
    assert r.status_code == 200, r.text
    # the cut streams leave the workers (the replicas saw their clients go): pages back
    wait_until(lambda: all(s.running == 0 and s.kv_usage == 0.0 for s in svc.worker_stats()), 60, "pools idle")


def test_killed_router_loses_no_stream_and_new_requests_are_placed(svc):
    """Tokens stream from the decode worker to the ingress replica, past the routers: SIGKILL a router's process
    while streams flow (one decode slot left free for the new request); each stream completes with the tokens of an
    undisturbed run, a new request is served within 10 s (placed by the other replica), and Ray's restart of the
    killed router places requests again."""
    import os
    import signal

    routers = svc.handles["routers"]
    assert len(routers) == 2
    prompts = [[21, 22, 23, i + 2] for i in range(SLOTS - 1)]
    streams = [svc.stream(prompt=p, max_tokens=120, return_token_ids=True) for p in prompts]
    got = [[] for _ in prompts]

    def tokens(i, line):
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            body = json.loads(line[5:])
            assert "error" not in body, body
            got[i].extend(body["choices"][0].get("token_ids") or [])

    for i, resp in enumerate(streams):  # in flight before the kill
        tokens(i, next(x for x in resp.lines if x.startswith("data:") and "token_ids" in x))
    pid = ray.get(routers[0].pid.remote())
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    r = svc.complete(prompt=[61, 62, 63], max_tokens=4, ignore_eos=True)
    assert r.status_code == 200 and time.monotonic() - t_kill < 10, (r.status_code, time.monotonic() - t_kill)
    for i, resp in enumerate(streams):
        rest = [x for x in resp.lines if x.startswith("data:")]
        resp.close()
        assert rest[-1] == "data: [DONE]", rest[-3:]
        for line in rest:
            tokens(i, line)
    for g, r in zip(got, undisturbed(svc, prompts)):  # all 120 tokens, the same as a run nobody interrupted
        assert r.status_code == 200 and g == r.json()["choices"][0]["token_ids"], (len(g), r.text[:200])
    # Ray restarted the killed router (a new process): it places requests again, as the only one left
    assert ray.get(routers[0].pid.remote(), timeout=60) != pid
    addr = ray.get(routers[0].address.remote(), timeout=60)
    with RouterClient(addr, timeout_s=30, token=svc.handles["token"]) as c:
        wait_until(lambda: c.health().serving, 30, "the restarted router sees its workers")
        placed = c.place([5, 6, 7], None, "placed-by-restarted-router")
        assert placed.decode_worker == "decode-0" and placed.prefill_worker == "prefill-0", placed
    os.kill(ray.get(routers[1].pid.remote()), signal.SIGKILL)
    r = svc.complete(prompt=[64, 65, 66], max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text


def test_killed_only_prefill_worker_new_requests_wait_and_succeed(svc):
    ray.kill(svc.handles["prefill"]["prefill-0"], no_restart=False)
    with HealthWatch(svc.base), concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda i: svc.complete(prompt=[41 + i, 42, 43], max_tokens=5, ignore_eos=True), range(4))
        )
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    # killed twice more: each restart is re-introduced to the decode worker
    for _ in range(2):
        ray.kill(svc.handles["prefill"]["prefill-0"], no_restart=False)
        assert svc.complete(prompt=[51, 52, 53], max_tokens=3).status_code == 200


# ---- bad input: typed 4xx, never a 500, and serving goes on --------------------------------------------
def test_bad_input_is_typed_and_harmless(svc):
    cases = [
        ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "a\ud800b"}, 400, "surrogate"),
        ({"prompt": "x", "stop": ["s"] * 100}, 400, "stop"),
    ]
    for body, status, needle in cases:
        raw = json.dumps({"model": "dsv4", **body})  # ensure_ascii: the lone surrogate travels as \ud800
        r = svc.post("/v1/completions", raw)
        assert r.status_code == status and needle in r.text, r.text
    r = svc.post("/v1/chat/completions", {"model": "dsv4", "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "unknown role" in r.text
    r = svc.http.get("/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
    assert svc.complete(prompt=[5, 6, 7]).status_code == 200


# ---- gauges and leaks ------------------------------------------------------------------------------
def test_gauges_and_pools_return_to_idle(svc):
    def gauges():
        body = svc.http.get(f"http://127.0.0.1:{svc.cfg.metrics_port}/metrics").text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith(("dsv4_running_requests{", "dsv4_kv_cache_usage_ratio{", "dsv4_waiting_requests{"))
        }

    wait_until(
        lambda: all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in svc.worker_stats()),
        60,
        "pools idle",
    )
    wait_until(lambda: gauges() and all(v == 0.0 for v in gauges().values()), 30, "gauges at idle")
    g = gauges()
    assert any('role="prefill"' in k for k in g) and any('role="decode"' in k for k in g), g


def test_unplaceable_service_fails_fast_with_numbers(svc):
    from service.launcher import ServiceStartError, check_placement

    total = ray.cluster_resources()["CPU"]
    cfg = ServiceConfig(model_dir=default_model_dir(), prefill_workers=8, decode_workers=8, worker_num_cpus=total)
    with pytest.raises(ServiceStartError) as info:
        check_placement(cfg)
    msg = str(info.value)
    assert f"CPU: need {16 * total + 0.2:g} (16 workers x {total:g} + 2 HTTP replicas x 0.1)" in msg, msg
    assert f"the cluster has {total:g} in all" in msg
    check_placement(dataclasses.replace(cfg, prefill_workers=1, decode_workers=1, worker_num_cpus=0.01))
