"""engine.compile_watch: the kernels whose compile-cache files appeared since the last look, by name."""

import json
import os

from engine.compile_watch import CompileWatch, describe


def _triton_variant(root: str, key: str, name: str) -> None:
    d = os.path.join(root, key)
    os.makedirs(d)
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump({"name": name}, f)
    with open(os.path.join(d, f"{name}.cubin"), "wb") as f:
        f.write(b"\0")
    with open(os.path.join(d, f"__grp__{name}.json"), "w") as f:  # Triton's group index: not a variant
        json.dump({"child_paths": {}}, f)


def test_names_only_what_compiled_since_the_last_look(tmp_path):
    triton, dg = str(tmp_path / "triton"), str(tmp_path / "dg")
    os.makedirs(dg)
    _triton_variant(triton, "a0", "_sparse_attn_kernel")  # compiled by the warm-up: the baseline
    watch = CompileWatch({"triton": triton, "deep_gemm": dg})
    assert watch.since() == {}
    _triton_variant(triton, "a1", "_sparse_attn_kernel")
    _triton_variant(triton, "a2", "_sparse_attn_kernel")
    _triton_variant(triton, "b1", "_hc_pre_kernel")
    with open(os.path.join(dg, "kernel.cubin"), "wb") as f:
        f.write(b"\0")
    got = watch.since()
    assert got == {"_sparse_attn_kernel": 2, "_hc_pre_kernel": 1, "DeepGEMM kernels (files)": 1}
    assert describe(got).startswith("_sparse_attn_kernel x2") and watch.since() == {}  # the look moved on
    assert describe({}) == "nothing"


def test_missing_cache_directories_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "absent-too"))
    watch = CompileWatch()
    assert watch.dirs == {} and watch.since() == {}


def test_note_slow_step_counts_and_logs_only_slow_steps(tmp_path, caplog):
    """What a worker (and a colocated LocalWorker) calls after every step: nothing below SLOW_STEP_S; above, the
    compiled kernels go to the log and to dsv4_kernel_compiles_total under the engine's role and id."""
    from engine import metrics
    from engine.compile_watch import SLOW_STEP_S, note_slow_step

    triton = str(tmp_path / "triton")
    os.makedirs(triton)
    watch = CompileWatch({"triton": triton})
    counter = metrics.KERNEL_COMPILES.labels("colocated", "w-test")
    before = counter._value.get()
    _triton_variant(triton, "c1", "_close_kernel")
    note_slow_step(watch, "colocated", "w-test", SLOW_STEP_S / 2)  # fast: not looked at
    assert counter._value.get() == before and not caplog.records
    note_slow_step(None, "colocated", "w-test", 5.0)  # CPU engine: no watch
    with caplog.at_level("WARNING"):
        note_slow_step(watch, "colocated", "w-test", SLOW_STEP_S + 1)
    assert counter._value.get() == before + 1
    assert "colocated w-test: a step took" in caplog.text and "_close_kernel x1" in caplog.text
