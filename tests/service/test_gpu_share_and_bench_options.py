"""Workers sharing a GPU (`--worker-num-gpus`), `dsv4 bench serve`'s topology/token options, and the gpu_service
section built from a run's JSON (tools/gpu/service_run.sh; the GPU run itself is not part of CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.bench_serve import compare_tokens, parse_topologies
from service.cli import main as cli_main
from service.launcher import ServiceConfig, worker_engine_options, worker_gpus

ROOT = Path(__file__).resolve().parents[2]


def cfg(**kw) -> ServiceConfig:
    return ServiceConfig(model_dir="unused", **kw)


def test_worker_gpus_share_and_memory_budget():
    cuda = (("device", "cuda"),)
    assert worker_gpus(cfg()) == 0 and worker_gpus(cfg(worker_num_gpus=0.5)) == 0  # cpu engines reserve no GPU
    assert worker_gpus(cfg(engine_options=cuda)) == 1
    assert worker_gpus(cfg(engine_options=cuda, worker_num_gpus=0.5)) == 0.5
    with pytest.raises(ValueError, match="worker_num_gpus must be in"):
        worker_gpus(cfg(engine_options=cuda, worker_num_gpus=1.5))
    # a half GPU gets half the default budget; explicit sizes are left alone
    assert worker_engine_options(cfg(engine_options=cuda, worker_num_gpus=0.5))["gpu_memory_utilization"] == 0.45
    assert "gpu_memory_utilization" not in worker_engine_options(cfg(engine_options=cuda))
    assert "gpu_memory_utilization" not in worker_engine_options(
        cfg(engine_options=cuda + (("max_cached_tokens", 4096),), worker_num_gpus=0.5)
    )
    assert (
        worker_engine_options(cfg(engine_options=cuda + (("gpu_memory_utilization", 0.3),), worker_num_gpus=0.5))[
            "gpu_memory_utilization"
        ]
        == 0.3
    )


def test_prefill_expert_format_reaches_the_prefill_pool_only():
    """`dsv4 serve --prefill-expert-format fp8`: an engine option of the prefill pool; the decode pool's options
    lack it (an engine that decodes would otherwise hold both expert formats)."""
    import argparse

    from service.launcher import add_serve_args, config_from_args
    from service.service_config import role_engine_options

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--device", "cuda", "--prefill-expert-format", "fp8"])
    opts = dict(config_from_args(args).engine_options)
    assert opts["prefill_expert_format"] == "fp8"
    assert role_engine_options(opts, "prefill")["prefill_expert_format"] == "fp8"
    assert role_engine_options(opts, "decode") == {"device": "cuda"}
    assert "prefill_expert_format" not in dict(config_from_args(parser.parse_args([])).engine_options)
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-expert-format", "fp4"])


def test_topologies_and_token_comparison():
    assert parse_topologies("1P1D, colocated") == ["1P1D", "colocated"]
    with pytest.raises(ValueError, match="unknown"):
        parse_topologies("1P1D,3P3D")
    same = compare_tokens("1P1D", [(1, 2, 3), (4, 5)], [(1, 2, 3), (4, 5)])
    assert same["identical"] == 2 and same["first_difference"] is None
    diff = compare_tokens("1P1D", [(1, 2, 3), (4, 6)], [(1, 2, 3), (4, 5)])
    assert diff["identical"] == 1 and diff["first_difference"] == (1, 1)


def test_bench_serve_colocated_only_writes_json_not_benchmarks(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_text()
    out = tmp_path / "serve.json"
    rc = cli_main(
        [
            "bench",
            "serve",
            "--topologies",
            "colocated",
            "--num-requests",
            "3",
            "--concurrency",
            "2",
            "--min-prompt",
            "4",
            "--max-prompt",
            "12",
            "--max-new-tokens",
            "3",
            "--check-tokens",
            "2",
            "--no-write",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0 and (ROOT / "BENCHMARKS.md").read_text() == before
    data = json.loads(out.read_text())
    assert [r["topology"] for r in data["rows"]] == ["colocated 1 engine"] and data["rows"][0]["requests"] == 3
    assert data["tokens"] == [] and data["check_prompts"] == 2  # nothing to compare with colocated alone


def test_gpu_service_report_from_stage_json(tmp_path):
    (tmp_path / "env.json").write_text(
        json.dumps(
            {
                "device": "cuda",
                "gpu": "NVIDIA H200",
                "torch": "2.11.0",
                "ray": "2.60.0",
                "nixl": "1.5.1",
                "python": "3.12.3",
                "date": "2026-12-01",
                "model": "mini_v4: random weights",
            }
        )
    )
    row = {
        "requests": 64,
        "ttft_p50_ms": 40.0,
        "ttft_p99_ms": 90.0,
        "itl_p50_ms": 8.0,
        "itl_p99_ms": 20.0,
        "req_per_s": 10.0,
        "tok_per_s": 640.0,
    }
    (tmp_path / "serve.json").write_text(
        json.dumps(
            {
                "rows": [
                    {
                        **row,
                        "topology": "1P1D (nixl)",
                        "kv_gb_per_s": 2.0,
                        "kv_mb": 64.0,
                        "kv_transfers": 64,
                        "kv_pull_gb_per_s": 4.0,
                        "kv_wire_gb_per_s": 16.0,
                        "kv_ms_per_pull": {
                            "seconds": 0.52,
                            "pull_seconds": 0.5,
                            "wire_seconds": 0.125,
                            "scatter_seconds": 0.25,
                        },
                    },
                    {
                        **row,
                        "topology": "colocated 1 engine",
                        "ttft_p50_ms": 32.0,
                        "kv_gb_per_s": float("nan"),
                        "kv_mb": 0.0,
                        "kv_transfers": 0,
                    },
                ],
                "tokens": [{"topology": "1P1D", "requests": 8, "identical": 8, "first_difference": None}],
                "header": "Machine: x; model mini_v4; 64 requests",
                "engine_options": {"device": "cuda"},
                "worker_num_gpus": 0.5,
                "transfer": "nixl",
                "max_new_tokens": 64,
            }
        )
    )
    (tmp_path / "nixl_raw.json").write_text(
        json.dumps(
            {
                "rows": [
                    {
                        "bytes": 1 << 20,
                        "descriptors": 256,
                        "gb_per_s_median": 0.5,
                        "gb_per_s_best": 0.5,
                        "bytes_match": True,
                        "device": "cuda",
                    },
                    {
                        "bytes": 1 << 20,
                        "descriptors": 1,
                        "gb_per_s_median": 20.0,
                        "gb_per_s_best": 25.0,
                        "bytes_match": True,
                        "device": "cuda",
                    },
                ],
                "ucx_tls": "(default)",
                "transports": "cuda_ipc",
            }
        )
    )
    out = tmp_path / "gpu_service.md"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu" / "service_run.py"),
            "report",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    text = out.read_text()
    assert text.startswith("## Disaggregated service on one GPU")
    # a staged pull is one descriptor: compared with the 1-descriptor raw row of that size, not the 256 one
    assert "TTFT p50 1.25x" in text and "in 1 descriptor(s) (10.0% of it;" in text and "8 of 8 prompts" in text
    assert "4.00 GB/s over the backend's pull" in text and "16.00 GB/s over its READs alone" in text
    assert "0.52 on the decode worker, 0.50 in the backend's pull, 0.12 in its READs, 0.25 in the staged" in text
    assert "share GPU 0" in text and "cuda_ipc" in text and "kill stage did not complete" in text  # no fault.json
    # the kill stage: where the continued streams first differ from undisturbed ones, against the kill point
    (tmp_path / "fault.json").write_text(
        json.dumps(
            {
                "streams": 2,
                "max_new_tokens": 400,
                "kill_after": 16,
                "tokens_at_kill": [16, 17],
                "completed": 2,
                "clean_failures": 0,
                "unclean": [],
                "kept_streamed": 2,
                "identical_to_undisturbed": 0,
                "first_divergence": [40, 57],
                "streams_ended_s": 30.0,
                "restarted_s": 30.0,
                "idle_after_s": 0.1,
                "served_again_s": 30.2,
                "router_retries_total": 2,
                "killed_pid": 123,
            }
        )
    )
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu" / "service_run.py"),
            "report",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    text = out.read_text()
    assert "first differing token at 40, 57; the kill came after token 16: all after it" in text
    assert "Verdict: pass" in text  # the README's claim: every token kept, the whole budget; not identity
    fault = json.loads((tmp_path / "fault.json").read_text())
    (tmp_path / "fault.json").write_text(json.dumps({**fault, "kept_streamed": 1}))  # one lost a streamed token
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu" / "service_run.py"),
            "report",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    assert "1 of them kept every token streamed before the kill" in out.read_text()
    assert "Verdict: FAIL" in out.read_text()
