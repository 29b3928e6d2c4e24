"""The chart's multi-GPU workers (issue 12): a pod's GPUs follow its workers' tensor-parallel size, the
parallel layout reaches the Serve builder (service.kuberay_app) unchanged, and the V4-Flash example for
8-GPU nodes fits an H200 by the engine's own start-up fit check. Rendered by the Helm library, as
tests/deploy/test_deploy_chart.py renders the chart."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.deploy_fixtures import CHART, EXAMPLES, documents, helm, load_values, render, serve_config

ROLES = ("prefill", "decode")
FLASH_EXAMPLE = [e for e in EXAMPLES if e.endswith("values-v4-flash-8gpu.yaml")][0]
H200_GIB = 140.4  # what an H200 reports (143771 MiB)


def rayservice(values: dict) -> dict:
    (rs,) = [d for d in documents(render(values)) if d["kind"] == "RayService"]
    return rs


def worker_groups(rs: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def pod_gpus(group: dict, key: str = "nvidia.com/gpu") -> tuple:
    res = group["template"]["spec"]["containers"][0]["resources"]
    return res["limits"].get(key), res["requests"].get(key)


@pytest.mark.parametrize(
    "workers_per_pod,tp,gpus_per_worker", [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 4, 1), (1, 8, 1), (2, 2, 0.5)]
)
def test_pod_gpus_follow_the_tensor_parallel_size(workers_per_pod, tp, gpus_per_worker):
    values = {
        "serve": {"gpusPerWorker": gpus_per_worker},
        "prefill": {"workersPerPod": workers_per_pod, "tensorParallelSize": tp, "expertParallel": tp > 1},
        "decode": {"tensorParallelSize": 2},
    }
    rs = rayservice(values)
    groups = worker_groups(rs)
    want = int(-(-workers_per_pod * tp * gpus_per_worker // 1))
    assert pod_gpus(groups["prefill"]) == (want, want)
    params = groups["prefill"]["rayStartParams"]
    assert params["num-gpus"] == str(want)
    assert json.loads(json.loads(params["resources"])) == {"dsv4_prefill": workers_per_pod * tp}  # a unit a rank
    decode = int(-(-2 * gpus_per_worker // 1))
    assert pod_gpus(groups["decode"]) == (decode, decode)  # the other role follows its own size
    args = serve_config(rs)["applications"][0]["args"]
    assert args["prefill_tensor_parallel_size"] == tp and args["decode_tensor_parallel_size"] == 2
    assert args["prefill_expert_parallel"] is (tp > 1) and args["decode_expert_parallel"] is False
    assert args["prefill_workers"] == workers_per_pod  # workers, not ranks


def test_builder_plans_the_ranks_the_pods_offer():
    """Each worker is tensor_parallel_size actors of one GPU and one role-resource unit each; the pods offer
    exactly that many."""
    from service import kuberay_app

    rs = rayservice(
        {
            "prefill": {"replicas": 2, "workersPerPod": 2, "tensorParallelSize": 2, "expertParallel": True},
            "decode": {"tensorParallelSize": 4},
        }
    )
    cfg = kuberay_app.parse_args(serve_config(rs)["applications"][0]["args"])
    for role, group in worker_groups(rs).items():
        plan = cfg.plan(role)
        ranks = plan.workers * plan.tensor_parallel_size
        offered = group["replicas"] * json.loads(json.loads(group["rayStartParams"]["resources"]))[f"dsv4_{role}"]
        assert offered == ranks * dict(plan.resources)[f"dsv4_{role}"]
        assert group["replicas"] * int(group["rayStartParams"]["num-gpus"]) == ranks * plan.num_gpus
    assert (cfg.prefill.tensor_parallel_size, cfg.prefill.expert_parallel) == (2, True)
    assert (cfg.decode.tensor_parallel_size, cfg.decode.expert_parallel) == (4, False)
    names = kuberay_app.actor_names(cfg, "/models/m")
    assert len(names) == 2 * 2 * 2 + 4 and sum(n.endswith("-rank3") for n in names) == 1


def test_builder_rejects_bad_parallel_args():
    from service import kuberay_app

    for bad in (
        {"decode_expert_parallel": True},
        {"prefill_tensor_parallel_size": 0},
        {"prefill_tensor_parallel_size": 2, "prefill_expert_parallel": "maybe"},
    ):
        with pytest.raises(ValueError):
            kuberay_app.parse_args(bad)
    cfg = kuberay_app.parse_args({"prefill_tensor_parallel_size": "2", "prefill_expert_parallel": "true"})
    assert cfg.prefill.tensor_parallel_size == 2 and cfg.prefill.expert_parallel is True


def test_data_parallel_attention_reaches_the_builder_and_names_every_rank_a_worker():
    """dataParallelAttention renders into the builder's args; the builder plans every rank as a worker actor
    (`<name>-dp<r>`, no followers), refuses it without expert parallelism, and keeps the TP layout's names."""
    from service import kuberay_app

    rs = rayservice({"decode": {"tensorParallelSize": 4, "expertParallel": True, "dataParallelAttention": True}})
    args = serve_config(rs)["applications"][0]["args"]
    assert args["decode_data_parallel_attention"] is True and args["prefill_data_parallel_attention"] is False
    cfg = kuberay_app.parse_args(args)
    assert cfg.decode.data_parallel_attention and not cfg.prefill.data_parallel_attention
    names = kuberay_app.actor_names(cfg, "/models/m")
    assert sum(n.endswith(("-dp1", "-dp2", "-dp3")) for n in names) == 3 and not any("-rank" in n for n in names)
    tp = kuberay_app.parse_args(dict(args, decode_data_parallel_attention=False))
    assert not any(n.endswith("-dp1") for n in kuberay_app.actor_names(tp, "/models/m"))
    assert kuberay_app.actor_names(tp, "/models/m") != names  # another layout: other workers
    for bad in (
        {"decode_tensor_parallel_size": 2, "decode_data_parallel_attention": True},
        {
            "decode_tensor_parallel_size": 2,
            "decode_expert_parallel": True,
            "decode_data_parallel_attention": "sometimes",
        },
    ):
        with pytest.raises(ValueError, match="data_parallel_attention"):
            kuberay_app.parse_args(bad)


def test_single_rank_layout_keeps_its_worker_names():
    """Existing 1-GPU deployments: the new (default) parallel args do not change the workers' fingerprints, so
    an upgrade of the chart alone replaces no worker."""
    from service import kuberay_app

    base = {"model": "/models/m", "gpus_per_worker": 1, "prefill_resources": {"dsv4_prefill": 1}}
    with_defaults = dict(base, prefill_tensor_parallel_size=1, prefill_expert_parallel=False)
    assert kuberay_app.actor_names(kuberay_app.parse_args(base), "/models/m") == kuberay_app.actor_names(
        kuberay_app.parse_args(with_defaults), "/models/m"
    )


def test_schema_checks_the_parallel_values():
    helm_python = helm()
    with helm_python.Chart.load(CHART) as chart:
        for values in (
            {"prefill": {"tensorParallelSize": 0}},
            {"decode": {"expertParallel": "yes"}},
            {"serve": {"engine": {"kv_cache_dtype": "int4"}}},
            {"serve": {"engine": {"gpu_memory_utilization": 1.5}}},
            {"serve": {"engine": {"max_model_len": 0}}},
        ):
            with pytest.raises(helm_python.HelmValuesError, match="schema"):
                chart.render(values=values, name="dsv4", namespace="llm")


def test_v4_flash_example_is_1p1d_at_tp4_on_one_8_gpu_node():
    values = load_values(FLASH_EXAMPLE)
    rs = rayservice(values)
    groups = worker_groups(rs)
    assert {role: pod_gpus(g) for role, g in groups.items()} == {"prefill": (4, 4), "decode": (4, 4)}
    assert sum(g["replicas"] * int(g["rayStartParams"]["num-gpus"]) for g in groups.values()) == 8
    (app,) = serve_config(rs)["applications"]
    args = app["args"]
    assert args["model"] == "deepseek-ai/DeepSeek-V4-Flash@main"
    assert args["prefill_workers"] == args["decode_workers"] == 1
    assert all(args[f"{r}_tensor_parallel_size"] == 4 and args[f"{r}_expert_parallel"] is True for r in ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_v4_flash_example_flags_fit_an_h200(role):
    """The example's engine flags, parsed by the builder, pass the engine's start-up fit check for V4-Flash's
    release layout on one H200 per rank; the same flags at TP 1 do not (the reason for TP 4)."""
    from engine.loading.fit_check import check_fit, meta_from_stored
    from engine.loading.memory_plan import GIB, cap_context
    from engine.model.cache import CacheConfig
    from engine.model.parallel import ParallelContext
    from service import kuberay_app
    from tests.support.configs import flash_config
    from tests.support.flash_layout import flash_release_layout

    rs = rayservice(load_values(FLASH_EXAMPLE))
    plan = kuberay_app.parse_args(serve_config(rs)["applications"][0]["args"]).plan(role)
    opts = dict(plan.engine_options)
    cfg = cap_context(flash_config(quantization_config={"weight_block_size": [128, 128]}), opts["max_model_len"])
    meta = meta_from_stored(flash_release_layout(cfg), cfg, torch.bfloat16, True, True)
    cache = CacheConfig(max_requests=opts.get("max_num_seqs", 64), max_tokens=1, kv_cache_dtype=opts["kv_cache_dtype"])
    budget = int(opts["gpu_memory_utilization"] * H200_GIB * GIB)
    ctx = ParallelContext(plan.tensor_parallel_size, 0, plan.expert_parallel)
    fit = check_fit(None, cfg, cache, torch.bfloat16, opts["max_batch_tokens"], budget, ctx, True, True, meta=meta)
    assert budget - fit.need_bytes > 20 * GIB, fit.describe()  # room for a real KV pool beyond the minimum
    with pytest.raises(ValueError, match="does not fit"):
        check_fit(None, cfg, cache, torch.bfloat16, opts["max_batch_tokens"], budget, None, True, True, meta=meta)


def test_every_example_is_rendered_by_the_chart_tests():
    assert os.path.basename(FLASH_EXAMPLE) in {os.path.basename(e) for e in EXAMPLES}


def test_hub_source_lets_the_service_fetch_the_repo():
    """model.source hub: `--model org/name@revision`, HF_HUB_CACHE (and the token) in every Ray container, the
    cache volume mounted writable, no download init container."""
    rs = rayservice(
        {
            "model": {
                "source": "hub",
                "mountPath": "/cache",
                "hub": {"repo": "deepseek-ai/DeepSeek-V4-Flash", "revision": "v1"},
                "tokenSecret": {"name": "hf-token"},
            }
        }
    )
    assert serve_config(rs)["applications"][0]["args"]["model"] == "deepseek-ai/DeepSeek-V4-Flash@v1"
    cluster = rs["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for t in templates:
        spec, ray = t["spec"], t["spec"]["containers"][0]
        assert "initContainers" not in spec
        env = {e["name"]: e for e in ray["env"]}
        assert env["HF_HUB_CACHE"]["value"] == "/cache"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        (mount,) = [m for m in ray["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/cache", "readOnly": False}
        assert {"name": "model", "emptyDir": {"sizeLimit": "400Gi"}} in spec["volumes"]
    rs = rayservice({"model": {"source": "hub", "hub": {"repo": "org/name"}}})
    assert serve_config(rs)["applications"][0]["args"]["model"] == "org/name"
    with pytest.raises(Exception, match="model.hub.repo is required"):
        render({"model": {"source": "hub"}})
