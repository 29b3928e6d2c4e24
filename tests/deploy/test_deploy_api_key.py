"""The chart hands the OpenAI API key to the service from a Secret (issue 10): with `serve.apiKeySecret.name`
every Ray container gets $DSV4_API_KEY from that Secret's key (the builder reads it into the ingress
options); without it no container has the variable. Rendered offline by the Helm library."""

from __future__ import annotations

import pytest

from tests.support.deploy_fixtures import VALUES_FILES, documents, load_values, render


def _ray_containers(docs):
    (svc,) = [d for d in docs if d["kind"] == "RayService"]
    cluster = svc["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster.get("workerGroupSpecs", [])]
    return [c for t in templates for c in t["spec"]["containers"] if c["name"].startswith("ray-")]


def _key_env(container):
    return [e for e in container.get("env", []) if e["name"] == "DSV4_API_KEY"]


def test_api_key_comes_from_the_secret():
    pytest.importorskip("helm_python")
    values = load_values(VALUES_FILES[0])
    containers = _ray_containers(documents(render(values)))
    assert containers and not any(_key_env(c) for c in containers)
    values.setdefault("serve", {})["apiKeySecret"] = {"name": "dsv4-api", "key": "token"}
    containers = _ray_containers(documents(render(values)))
    for c in containers:
        (env,) = _key_env(c)
        assert env["valueFrom"]["secretKeyRef"] == {"name": "dsv4-api", "key": "token"}, env
