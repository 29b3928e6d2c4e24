"""The Helm chart (deploy/helm/dsv4), checked offline by real tools for the default values and every
example values file: rendered and linted (strict) by the Helm library, values checked by the chart's
values.schema.json, core objects and every embedded pod template by `kubernetes-validate --strict`,
RayService / PodMonitor / PrometheusRule by their CRD schemas (tests/data/crds) with jsonschema, the
whole manifest stream by yamllint, the PrometheusRule by `promtool check rules`; the Serve config is
parsed by the builder it names (service.kuberay_app) and its worker counts checked against the Ray
resources the pods advertise.
"""

import importlib
import json
import os
import subprocess

import pytest
import yaml

from tests.support.deploy_fixtures import (
    CHART,
    RULES_FILE,
    VALUES_FILES,
    YAMLLINT_CONFIG,
    crd_schemas,
    debian_tool,
    documents,
    helm,
    load_values,
    manifest_stream,
    render,
    serve_config,
    venv_tool,
    with_monitoring,
)

CORE_KINDS = {"ConfigMap", "Secret", "Service", "ServiceAccount"}
ROLES = ("prefill", "decode")


@pytest.fixture(scope="module", params=VALUES_FILES, ids=os.path.basename)
def case(request):
    """(values, rendered templates, documents) of one values file, as a cluster with the operator renders."""
    values = load_values(request.param)
    rendered = render(with_monitoring(values))
    return values, rendered, documents(rendered)


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """group name -> pod template of a RayService (the head is "head")."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    return out


def run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


def test_helm_lint_strict_passes(case):
    values = case[0]
    report = helm().lint(CHART, with_monitoring(values), strict=True, namespace="llm")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 = info ("icon is recommended")
    assert not problems and not report["errors"], report


def test_values_schema_rejects_bad_values():
    helm_python = helm()
    with helm_python.Chart.load(CHART) as chart:
        for path in VALUES_FILES:
            chart.validate_schema(load_values(path))
        bad = [
            {"prefill": {"replica": 2}},
            {"decode": {"replicas": -1}},
            {"serve": {"transfer": "rdma"}},
            {"model": {"source": "nfs"}},
            {"upgradeStrategy": {"type": "BlueGreen"}},
            {"serve": {"engine": {"dtype": "fp16"}}},
            {"monitoring": {"podMonitor": {"interval": "soon"}}},
        ]
        for values in bad:
            with pytest.raises(helm_python.HelmValuesError, match="schema"):
                chart.render(values=values, name="dsv4", namespace="llm")


def test_values_schema_engine_options_are_service_options():
    from service.launcher import ENGINE_OPTION_KEYS

    with open(os.path.join(CHART, "values.schema.json")) as f:
        engine = json.load(f)["properties"]["serve"]["properties"]["engine"]
    assert set(engine["properties"]) <= set(ENGINE_OPTION_KEYS)


def test_renders_the_service_and_its_monitoring(case):
    values, _, docs = case
    assert len(by_kind(docs, "RayService")) == 1
    dashboards = by_kind(docs, "ConfigMap")
    assert len(dashboards) == 3 and all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    for cm in dashboards:
        (text,) = cm["data"].values()
        assert json.loads(text)["panels"]
    assert len(by_kind(docs, "PodMonitor")) == 1 and len(by_kind(docs, "PrometheusRule")) == 1


def test_monitoring_objects_need_the_operator_api():
    kinds = {d["kind"] for d in documents(render({}))}
    assert "PodMonitor" not in kinds and "PrometheusRule" not in kinds and "RayService" in kinds
    kinds = {d["kind"] for d in documents(render(with_monitoring({})))}
    assert {"PodMonitor", "PrometheusRule"} <= kinds


def test_core_objects_pass_kubernetes_validate_strict(case, tmp_path):
    """Core objects as rendered, and each pod template of the RayService as a core v1 PodTemplate."""
    _, _, docs = case
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    for rs in by_kind(docs, "RayService"):
        for group, template in pod_templates(rs).items():
            core.append(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{rs['metadata']['name']}-{group}"},
                    "template": template,
                }
            )
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    out = run([*venv_tool("kubernetes_validate"), "--strict", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") == len(core), out.stdout


def test_custom_resources_match_their_crd_schemas(case):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is missing: pip install -e '.[test]'")
    schemas = crd_schemas()
    custom = [d for d in case[2] if d["kind"] not in CORE_KINDS]
    assert custom
    for doc in custom:
        schema = schemas[(doc["apiVersion"], doc["kind"])]
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{doc['kind']}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_crd_schemas_reject_unknown_fields():
    """The strict emulation works: a typo in a RayService field is an error."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is missing: pip install -e '.[test]'")
    (rs,) = by_kind(documents(render({})), "RayService")
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4
    errors = list(jsonschema.Draft7Validator(crd_schemas()[("ray.io/v1", "RayService")]).iter_errors(rs))
    assert len(errors) == 2, [e.message for e in errors]


def test_rendered_manifests_pass_yamllint(case, tmp_path):
    path = tmp_path / "manifests.yaml"
    path.write_text(manifest_stream(case[1]))
    out = run([*venv_tool("yamllint"), "-c", YAMLLINT_CONFIG, "-f", "parsable", "--strict", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_rules_pass_promtool(case, tmp_path):
    promtool = debian_tool("promtool")
    (rule,) = by_kind(case[2], "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    for f in (str(path), RULES_FILE):
        out = run([promtool, "check", "rules", f])
        assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_rule_file_is_the_chart_default():
    (rule,) = by_kind(documents(render(with_monitoring({}))), "PrometheusRule")
    assert load_values(RULES_FILE) == rule["spec"], "run: python deploy/prometheus/render_rules.py"


def test_serve_config_matches_the_builder_and_the_pods(case):
    """serveConfigV2 names an importable builder, its args parse, and the pods advertise enough of the
    custom Ray resources (and GPUs) for the workers it asks for."""
    from service import kuberay_app as serve_entry

    values, _, docs = case
    (rs,) = by_kind(docs, "RayService")
    (app,) = serve_config(rs)["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    cfg = serve_entry.parse_args(app["args"])
    assert app["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] == cfg.metrics_dir
    cluster = rs["spec"]["rayClusterConfig"]
    head_params = cluster["headGroupSpec"]["rayStartParams"]
    assert head_params["num-gpus"] == "0"
    offered = {role: 0.0 for role in ROLES}
    gpus = {role: 0.0 for role in ROLES}
    if "resources" in head_params:
        for role in ROLES:
            offered[role] += json.loads(json.loads(head_params["resources"])).get(f"dsv4_{role}", 0)
    for group in cluster.get("workerGroupSpecs", []):
        role, params = group["groupName"], group["rayStartParams"]
        offered[role] += group["replicas"] * json.loads(json.loads(params["resources"]))[f"dsv4_{role}"]
        gpus[role] += group["replicas"] * float(params["num-gpus"])
        container = group["template"]["spec"]["containers"][0]
        gpu_key = values.get("gpu", {}).get("resourceKey", "nvidia.com/gpu")
        assert float(container["resources"]["limits"].get(gpu_key, 0)) == float(params["num-gpus"])
    for role in ROLES:
        plan, v = cfg.plan(role), values[role]
        elastic = v.get("elastic") and v["minReplicas"] < v["maxReplicas"]
        assert plan.workers == v.get("minReplicas" if elastic else "replicas", 1) * v.get("workersPerPod", 1)
        ranks = plan.workers * plan.tensor_parallel_size  # one actor (and placement bundle) a rank
        assert offered[role] >= ranks * dict(plan.resources)[f"dsv4_{role}"], (role, offered)
        assert gpus[role] >= ranks * plan.num_gpus, (role, gpus)


def test_every_pod_exports_metrics_on_the_scraped_port(case):
    _, _, docs = case
    (rs,), (monitor,) = by_kind(docs, "RayService"), by_kind(docs, "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    for group, template in pod_templates(rs).items():
        ray, *sidecars = template["spec"]["containers"]
        assert ray["name"] == f"ray-{group}"  # KubeRay's Ray container is the first
        assert scraped <= {p["name"] for p in ray["ports"]}, group
        assert selector.items() <= template["metadata"]["labels"].items()
        (exporter,) = [c for c in sidecars if c["name"] == "metrics-exporter"]
        assert exporter["command"][:3] == ["python", "-m", "service.kuberay_app"]


def test_every_ray_container_keeps_compiled_kernels_on_the_cache_volume(case):
    """DeepGEMM's and Triton's JIT caches point into the compileCache volume (engine.execution.warmup compiles into them
    before a worker reports ready; a volume that outlives the pod spares the next start that work)."""
    values, _, docs = case
    (rs,) = by_kind(docs, "RayService")
    mount = values.get("compileCache", {}).get("mountPath", "/var/cache/dsv4-kernels")
    for group, template in pod_templates(rs).items():
        ray = template["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in ray["env"]}
        assert env["DG_JIT_CACHE_DIR"] == f"{mount}/deep_gemm" and env["TRITON_CACHE_DIR"] == f"{mount}/triton"
        assert {"name": "kernel-cache", "mountPath": mount} in ray["volumeMounts"], group
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "kernel-cache"]
        want = values.get("compileCache", {}).get("volume", {"emptyDir": {}})
        assert {k: v for k, v in volume.items() if k != "name"} == {k: v for k, v in want.items() if v is not None}


def test_rdma_and_scheduling_settings_reach_the_worker_pods():
    values = load_values([p for p in VALUES_FILES if p.endswith("values-xpyd-multinode.yaml")][0])
    (rs,) = by_kind(documents(render(values)), "RayService")
    templates = pod_templates(rs)
    head = templates.pop("head")
    assert "nvidia.com/gpu" not in head["spec"]["containers"][0]["resources"]["limits"]
    assert "hostIPC" not in head["spec"] and "annotations" not in head["metadata"]
    for template in templates.values():
        spec, ray = template["spec"], template["spec"]["containers"][0]
        assert spec["hostIPC"] is True and spec["runtimeClassName"] == "nvidia"
        assert spec["priorityClassName"] == "llm-serving" and spec["tolerations"]
        assert ray["resources"]["limits"]["rdma/ib"] == 8 and ray["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert "IPC_LOCK" in ray["securityContext"]["capabilities"]["add"]
        env = {e["name"]: e.get("value") for e in ray["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and "UCX_NET_DEVICES" in env
        assert "k8s.v1.cni.cncf.io/networks" in template["metadata"]["annotations"]
        assert spec["initContainers"][0]["name"] == "model-download"
        assert {v["name"] for v in spec["volumes"]} >= {"dshm", "model", "dsv4-metrics"}
        assert ray["startupProbe"]["failureThreshold"] * ray["startupProbe"]["periodSeconds"] >= 3600
    assert rs["spec"]["upgradeStrategy"]["type"] == "NewClusterWithIncrementalUpgrade"


def test_token_secret_created_on_request():
    docs = documents(
        render(
            {
                "model": {
                    "source": "download",
                    "download": {"repo": "org/model"},
                    "tokenSecret": {"create": True, "value": "hf_x"},
                }
            }
        )
    )
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-model-token")]
    (rs,) = by_kind(docs, "RayService")
    init = pod_templates(rs)["decode"]["spec"]["initContainers"][0]
    refs = [e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e]
    assert refs == [{"name": secret["metadata"]["name"], "key": "token"}]


@pytest.mark.parametrize("elastic", ["prefill", "decode", None])
def test_elastic_pool_turns_on_the_autoscaler_and_the_planner(elastic):
    """A role with `elastic: true` and minReplicas < maxReplicas: the builder gets MIN:MAX workers (pods x
    workersPerPod) and starts the planner, the group starts at minReplicas pods, and KubeRay's in-tree autoscaler
    is on with its options (new worker actors ask for the role's resource, so they get new pods). Otherwise the
    autoscaler stays off and the counts are plain."""
    from service import kuberay_app

    values = {role: {"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "workersPerPod": 2} for role in ROLES}
    if elastic:
        values[elastic]["elastic"] = True
    values["autoscaling"] = {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative"}
    (rs,) = by_kind(documents(render(values)), "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    (app,) = serve_config(rs)["applications"]
    cfg = kuberay_app.parse_args(app["args"])
    assert cluster["enableInTreeAutoscaling"] is (elastic is not None)
    if elastic:
        assert cluster["autoscalerOptions"] == {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative"}
    else:
        assert "autoscalerOptions" not in cluster
    for role in ROLES:
        bounds = cfg.service.pool_bounds(role)
        if role == elastic:
            assert app["args"][f"{role}_workers"] == "2:6" and (bounds.min, bounds.max) == (2, 6)
            assert groups[role]["replicas"] == 1 and cfg.plan(role).workers == 2
        else:
            assert app["args"][f"{role}_workers"] == 4 and not bounds.elastic
            assert groups[role]["replicas"] == 2
        assert (groups[role]["minReplicas"], groups[role]["maxReplicas"]) == (1, 3)


def test_elastic_multi_rank_pool_is_refused_with_the_reason():
    from service import kuberay_app

    values = {"decode": {"elastic": True, "minReplicas": 1, "maxReplicas": 2, "tensorParallelSize": 2}}
    (rs,) = by_kind(documents(render(values)), "RayService")
    (app,) = serve_config(rs)["applications"]
    with pytest.raises(ValueError, match="elastic decode pool .*single-rank"):
        kuberay_app.parse_args(app["args"])


@pytest.mark.parametrize("replicas", [None, 3])
def test_router_replicas_reach_the_builder(replicas):
    """`serve.routerReplicas` (default 2, as `dsv4 serve --routers`) is the builder's `routers`: that many router
    actors, all handed to the ingress (tests/deploy/test_deploy_serve_entry.py runs them)."""
    from service import kuberay_app

    values = {"serve": {"routerReplicas": replicas}} if replicas else {}
    (rs,) = by_kind(documents(render(values)), "RayService")
    (app,) = serve_config(rs)["applications"]
    assert app["args"]["routers"] == (replicas or 2)
    assert kuberay_app.parse_args(app["args"]).service.routers == (replicas or 2)
    with pytest.raises(Exception, match="routerReplicas"):
        render({"serve": {"routerReplicas": 0}})
