"""Programmatic dependent launch (dsv4_kernels/triton_pdl.py): who gets launch_pdl, and the wait-first rule.

The CPU / interpreter and the switch off give {"PDL": False} and never launch_pdl; on an sm_90 GPU with
$DSV4_PDL=1 the kernels launch with PDL and still compute the same (GPU-only test). The static test keeps every
launch of the engine's own Triton kernels passing the helper's kwargs and every such kernel waiting first.
"""

import ast
from pathlib import Path

import pytest
import torch

from dsv4_kernels import settings as switches  # noqa: E402
from dsv4_kernels import triton_pdl  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_and_interpreter_get_no_pdl(monkeypatch):
    monkeypatch.setenv(switches.PDL, "1")
    kw = triton_pdl.pdl_kwargs(torch.zeros(1))
    assert dict(kw) == {"PDL": False} and "launch_pdl" not in kw
    assert dict(triton_pdl.pdl_kwargs(torch.zeros(1, device="meta"))) == {"PDL": False}
    if not torch.cuda.is_available():  # the interpreter: even a CUDA device gets no PDL
        assert not triton_pdl.device_has_pdl(torch.device("cuda", 0))


def test_switch_off_gives_no_pdl(monkeypatch):
    monkeypatch.delenv(switches.PDL, raising=False)
    assert not switches.settings().pdl  # off by default
    monkeypatch.setattr(triton_pdl, "device_has_pdl", lambda device: True)
    assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": False}
    monkeypatch.setenv(switches.PDL, "0")
    assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": False}
    monkeypatch.setenv(switches.PDL, "1")  # on, and a device that could: the launch kwargs
    assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": True, "launch_pdl": True}


def test_device_rule_without_a_gpu(monkeypatch):
    """Compute capability >= 9.0, asked once per device; never when the interpreter runs the kernels."""
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0) if index == 0 else (8, 0)

    monkeypatch.setattr(triton_pdl, "_INTERPRET", False)
    monkeypatch.setattr(triton_pdl, "triton_has_pdl", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    triton_pdl._device_has_pdl.cache_clear()
    try:
        assert triton_pdl.device_has_pdl(torch.device("cuda", 0))
        assert not triton_pdl.device_has_pdl(torch.device("cuda", 1))
        assert triton_pdl.device_has_pdl(torch.device("cuda", 0))
        assert asked == [0, 1]
        assert not triton_pdl.device_has_pdl(torch.device("cpu"))
    finally:
        triton_pdl._device_has_pdl.cache_clear()


def test_force_is_for_tools_only():
    try:
        triton_pdl.force(True)
        assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": True, "launch_pdl": True}
        triton_pdl.force(False)
        assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": False}
    finally:
        triton_pdl.force(None)
    assert dict(triton_pdl.pdl_kwargs(torch.zeros(1))) == {"PDL": False}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list)


def test_every_engine_kernel_waits_first_and_every_launch_passes_the_kwargs():
    """With PDL a kernel may start before its predecessor finished: tl_pdl_wait(PDL) must come before any memory
    access, i.e. first (after the docstring); a launch without **pdl_kwargs(...) would fail on the PDL argument
    anyway, this names it."""
    modules = sorted((ROOT / "dsv4_kernels").glob("triton_*.py"))
    kernels, launches = {}, []
    for path in modules:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                kernels[(path.name, node.name)] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel"):
                    launches.append((path.name, node))
    assert len(launches) >= 40
    for name, call in launches:
        kw = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        assert any(k.startswith("pdl_kwargs(") for k in kw), f"{name}: {ast.unparse(call.func)} lacks **pdl_kwargs"
    waiting = 0
    for (name, fn_name), fn in kernels.items():
        params = [a.arg for a in fn.args.args]
        if "PDL" not in params or fn_name == "tl_pdl_wait":
            continue
        body = fn.body
        first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
        assert ast.unparse(first) == "tl_pdl_wait(PDL)", f"{name}:{fn_name} does not wait first"
        waiting += 1
    launched = {ast.unparse(c.func.value) for _, c in launches}
    assert waiting >= len(launched) - 2  # names shared by two modules (_prologue_kernel, ...) count once


@pytest.mark.gpu
def test_pdl_launches_compute_the_same_in_a_cuda_graph(monkeypatch):
    """On an sm_90 GPU with the switch on, in one captured graph: a copy (a memcpy node), greedy pick's two chained
    PDL kernels, a torch kernel writing what they read, the PDL kernels again; torch's answer on every replay."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("GPU only: needs an sm_90+ CUDA device")
    from dsv4_kernels.triton_greedy import greedy_pick

    monkeypatch.setenv(switches.PDL, "1")
    src = torch.randn(4, 129280, device=DEVICE)
    assert dict(triton_pdl.pdl_kwargs(src)) == {"PDL": True, "launch_pdl": True}
    logits = src.clone()
    greedy_pick(logits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits.copy_(src)
        first = greedy_pick(logits)
        logits.neg_()
        second = greedy_pick(logits)
    for scale in (1.0, -3.0, 0.5):
        src.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first[0].long(), src.argmax(dim=-1))
        assert torch.equal(second[0].long(), (-src).argmax(dim=-1))
        lp = torch.log_softmax(-src, dim=-1).gather(1, second[0].long().unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(second[1], lp.double(), atol=1e-5, rtol=0)
