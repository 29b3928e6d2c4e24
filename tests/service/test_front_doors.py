"""The front doors of service.serve_front.

- Serve's Python proxy (`DSV4_HAPROXY=0`): a service deployed behind it streams, and its socket refuses oversized or
  slow heads and slow bodies with 413 / 408 in the API's error shape while /health keeps answering. (HAProxy, the
  default, is what every other service test runs behind: tests/service/test_service_faults.py.)
- `serve_front`'s choice and environments, and its fallback to the Python proxy without an HAProxy binary.
"""

from __future__ import annotations

import logging

import pytest

from dsv4_kernels import settings as settings_module
from service import serve_front as front_module
from service.http_limits import HttpLimits
from service.serve_front import HAPROXY_SERVE_ENV, PROXY_SERVE_ENV, REPLICA_SERVE_ENV, haproxy_threads, serve_front

LIMITS = HttpLimits(max_header_bytes=16384, header_timeout_s=2.0, body_timeout_s=5.0)


def test_haproxy_front_sets_serve_and_launcher_switches(monkeypatch):
    monkeypatch.setenv("DSV4_HAPROXY_METRICS_PORT", "19101")
    settings_module.reload()
    try:
        front = serve_front(LIMITS, haproxy=True)
    finally:
        monkeypatch.delenv("DSV4_HAPROXY_METRICS_PORT")
        settings_module.reload()
    assert front.haproxy
    for env in (front.controller_env, front.replica_env):
        assert env.items() >= HAPROXY_SERVE_ENV.items()
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"].endswith("dsv4-haproxy")
        assert env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == str(16384 + 1024)  # the head limit fits, a larger one not
        assert env["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "5" and env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101"
        assert env["DSV4_HAPROXY_ADMIN_HOST"] == "127.0.0.1" and env["DSV4_HTTP_HEADER_TIMEOUT_S"] == "2.0"
        assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == str(haproxy_threads(0))
    assert front.replica_env.items() >= REPLICA_SERVE_ENV.items()
    # the replicas' own HTTP servers bound the body time at their socket, as the Python proxy does
    assert front.replica_env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "service.http_limits:proxy_callback"


def test_haproxy_threads_one_per_two_cpus_unless_set():
    assert [haproxy_threads(0, cpus) for cpus in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 4, 4]
    assert haproxy_threads(6, 2) == 6


def test_python_proxy_front_has_no_haproxy_switches():
    front = serve_front(LIMITS, haproxy=False)
    assert not front.haproxy and front.controller_env.items() >= PROXY_SERVE_ENV.items()
    assert not any(k.startswith("RAY_SERVE_HAPROXY") or k in HAPROXY_SERVE_ENV for k in front.replica_env)


def test_no_haproxy_binary_falls_back_to_the_python_proxy(monkeypatch, caplog):
    monkeypatch.setattr(front_module, "haproxy_binary", lambda: None)
    with caplog.at_level(logging.WARNING, logger="service.serve_front"):
        front = serve_front(LIMITS, haproxy=True)
    assert not front.haproxy and "no HAProxy binary was found" in caplog.text


@pytest.mark.ray
def test_python_proxy_streams_and_refuses_attacks_in_the_api_shape(monkeypatch):
    from tests.support.service_harness import LIMITS as SERVICE_LIMITS
    from tests.support.service_harness import check_http_attacks, running_service

    monkeypatch.setenv("DSV4_HAPROXY", "0")
    settings_module.reload()
    try:
        with running_service() as svc:
            assert not serve_front(SERVICE_LIMITS).haproxy
            resp = svc.stream(prompt=[5, 6, 7], max_tokens=6)
            lines = [line for line in resp.lines if line.startswith("data: ")]
            assert resp.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3, lines
            check_http_attacks(svc, haproxy=False)
    finally:
        monkeypatch.delenv("DSV4_HAPROXY")
        settings_module.reload()
