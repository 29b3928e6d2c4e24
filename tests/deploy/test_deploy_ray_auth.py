"""The chart turns on Ray's token authentication (issue 32 item 8) and bounds HTTP requests at every Serve proxy.

Rendered offline by the Helm library (the RayService itself is checked against its CRD schema, authOptions
included, by tests/deploy/test_deploy_chart.py):
- by default `rayClusterConfig.authOptions` is token mode naming a Secret the chart creates, whose `auth_token`
  (the key KubeRay reads) is a fresh random 48-character token per install, never a fixed one;
- `rayAuth.secret.create: false` references an existing Secret instead (and its name is required);
- `rayAuth.enabled: false` (operators older than KubeRay 1.5.1) renders neither;
- every Ray container gets the Serve proxy callback and the HTTP limits of `serve.httpLimits`.
"""

from __future__ import annotations

import base64

import pytest

from service.http_limits import PROXY_CALLBACK, PROXY_CALLBACK_VAR, HttpLimits
from service.serve_front import HAPROXY_SERVE_ENV, PROXY_SERVE_ENV, REPLICA_SERVE_ENV, haproxy_env
from tests.support.deploy_fixtures import VALUES_FILES, documents, load_values, render

pytest.importorskip("helm_python")


def _docs(values: dict) -> tuple[dict, list[dict]]:
    docs = documents(render(values))
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    return rs, [d for d in docs if d["kind"] == "Secret"]


def _ray_containers(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster.get("workerGroupSpecs", [])]
    return [c for t in templates for c in t["spec"]["containers"] if c["name"].startswith("ray-")]


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.rsplit("/", 1)[-1])
def test_token_auth_is_on_with_a_random_token_from_the_charts_secret(path):
    values = load_values(path)
    tokens = set()
    for _ in range(2):
        rs, secrets = _docs(values)
        auth = rs["spec"]["rayClusterConfig"]["authOptions"]
        assert auth["mode"] == "token", auth
        (secret,) = [s for s in secrets if s["metadata"]["name"] == auth["secretName"]]
        token = base64.b64decode(secret["data"]["auth_token"]).decode()
        assert len(token) == 48 and token.isalnum(), token
        tokens.add(token)
    assert len(tokens) == 2  # random per install (an upgrade keeps the installed one through `lookup`)


def test_existing_secret_is_referenced_and_required():
    rs, secrets = _docs({"rayAuth": {"secret": {"create": False, "name": "my-ray-token"}}})
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "my-ray-token"}
    assert not [s for s in secrets if "auth_token" in s.get("data", {})]
    with pytest.raises(Exception, match="rayAuth.secret.name is required"):
        render({"rayAuth": {"secret": {"create": False}}})


def test_auth_can_be_left_off_for_old_operators():
    rs, secrets = _docs({"rayAuth": {"enabled": False}})
    assert "authOptions" not in rs["spec"]["rayClusterConfig"]
    assert not [s for s in secrets if "auth_token" in s.get("data", {})]


def test_every_ray_container_bounds_http_requests_and_takes_the_serve_settings(monkeypatch):
    limits = {"maxHeaderBytes": 32768, "headerTimeoutSeconds": 5, "bodyTimeoutSeconds": 30.5}
    rs, _ = _docs({"serve": {"httpLimits": limits}})
    containers = _ray_containers(rs)
    assert containers
    for c in containers:
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert env[PROXY_CALLBACK_VAR] == PROXY_CALLBACK
        for name, value in {**PROXY_SERVE_ENV, **REPLICA_SERVE_ENV}.items():  # the token path's Serve settings
            assert env[name] == value, name
        for name in HttpLimits().env():  # what the proxy process parses (dsv4_kernels.settings)
            monkeypatch.setenv(name, env[name])
        assert HttpLimits.from_env() == HttpLimits(max_header_bytes=32768, header_timeout_s=5.0, body_timeout_s=30.5)
        # HAProxy in front (the default): the same switches `dsv4 serve` gives Serve (service.serve_front), with the
        # image's launcher and the admin listeners on every interface for Prometheus, on the fixed default ports
        # (the tests' own default is 0, a free port: tests/conftest.py)
        monkeypatch.delenv("DSV4_HAPROXY_STATS_PORT", raising=False)
        monkeypatch.delenv("DSV4_HAPROXY_METRICS_PORT", raising=False)
        wanted = haproxy_env(HttpLimits.from_env(), "unused", "/home/ray/anaconda3/bin/dsv4-haproxy")
        for name, value in wanted.items():
            if name == "DSV4_HAPROXY_BINARY":  # the launcher finds the image's own
                assert name not in env
            elif name == "DSV4_HAPROXY_ADMIN_HOST":
                assert env[name] == "0.0.0.0"
            elif name == "RAY_SERVE_HAPROXY_NBTHREAD":  # the nodes' cores, not this machine's: the chart's value
                assert env[name] == "4"
            else:
                assert env[name] == value, name
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["haproxy-metrics"] == 9101


def test_the_python_proxy_front_door_leaves_haproxy_off():
    rs, _ = _docs({"serve": {"frontDoor": "proxy"}})
    for c in _ray_containers(rs):
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert not set(env) & set(HAPROXY_SERVE_ENV) and "RAY_SERVE_HAPROXY_BINARY_PATH" not in env
        assert "haproxy-metrics" not in {p["name"] for p in c["ports"]}
