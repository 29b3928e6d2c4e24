"""engine.telemetry.compile_watch: the kernels whose compile-cache files appeared since the last look, by name."""

import json
import os

import pytest

from engine.telemetry.compile_watch import CompileWatch, describe


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
    from engine.telemetry import metrics
    from engine.telemetry.compile_watch import SLOW_STEP_S, note_slow_step

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


def _spec(signature: dict, constants: dict | None = None, aligned: tuple[str, ...] = (), **options) -> str:
    """Triton's specialization_data JSON (the fields VariantLog reads): argument-index paths for constants and
    attributes, as the JIT writes them."""
    names = list(signature)
    constants = constants or {}
    return json.dumps(
        {
            "name": "k",
            "signature": signature,
            "constant_keys": [[names.index(n)] for n in constants],
            "constant_vals": list(constants.values()),
            "attrs_keys": [[names.index(n)] for n in aligned],
            "attrs_vals": [[["tt.divisibility", 16]] for _ in aligned],
            "options": {"num_warps": 4, "num_stages": 2, **options},
        }
    )


class _Fn:
    def __init__(self, name):
        self.name = name


def test_variant_log_names_what_differs_from_the_nearest_earlier_variant():
    from engine.telemetry.compile_watch import VariantLog

    log = VariantLog()
    sig = {"q_ptr": "*bf16", "b1": "i32", "grid_m": "i32", "D": "constexpr"}
    log.hook(
        fn=_Fn("_sparse_attn_kernel"),
        compile={"specialization_data": _spec(sig, {"D": {"constexpr": 512}}, ("q_ptr",))},
    )
    log.hook(
        fn=_Fn("_sparse_attn_kernel"),
        compile={
            "specialization_data": _spec(
                dict(sig, grid_m="constexpr"), {"D": {"constexpr": 512}, "grid_m": 1}, ("q_ptr",)
            )
        },
    )
    log.hook(fn=_Fn("_hc_pre_kernel"), compile={"specialization_data": _spec({"x_ptr": "*bf16"})})
    # the serving-time variant: nearest to the first one (one difference), not the second (two)
    log.hook(
        fn=_Fn("_sparse_attn_kernel"),
        compile={"specialization_data": _spec(dict(sig, b1="i64"), {"D": {"constexpr": 512}}, ("q_ptr", "grid_m"))},
    )
    log.hook(fn=_Fn("_odd_kernel"), compile={"specialization_data": "not json"})  # recorded by name only
    lines = log.explain(0)
    assert lines[0] == "_sparse_attn_kernel (its first variant in this process)"
    assert lines[1] == "_sparse_attn_kernel [grid_m: i32 -> =1]"
    assert lines[2] == "_hc_pre_kernel (its first variant in this process)"
    assert lines[3] == "_sparse_attn_kernel [b1: i32 -> i64, grid_m: i32 -> i32/16]"
    assert lines[4] == "_odd_kernel (its first variant in this process)" and len(lines) == 5
    assert log.explain(3) == lines[3:]


def test_note_slow_step_logs_variants_first_needed_while_serving(tmp_path, caplog):
    """Every step (fast ones too): a variant specialised after the watch started is logged once, with its
    difference from the warm-up's; a step with none logs nothing."""
    from engine.telemetry.compile_watch import VariantLog, note_slow_step

    log = VariantLog()
    sig = {"x_ptr": "*bf16", "n": "i32"}
    log.hook(fn=_Fn("_k"), compile={"specialization_data": _spec(sig)})  # the warm-up's
    watch = CompileWatch({}, variants=log)
    with caplog.at_level("WARNING"):
        note_slow_step(watch, "decode", "w-1", 0.01)
    assert not caplog.records
    log.hook(fn=_Fn("_k"), compile={"specialization_data": _spec(sig, aligned=("n",), num_stages=3)})
    with caplog.at_level("WARNING"):
        note_slow_step(watch, "decode", "w-1", 0.05)
        note_slow_step(watch, "decode", "w-1", 0.01)
    assert len(caplog.records) == 1
    assert "decode w-1: a kernel variant first needed while serving" in caplog.text
    assert "_k [n: i32 -> i32/16, num_stages: 2 -> 3]" in caplog.text


def test_install_variant_log_hooks_triton_once_and_chains():
    """The hook sits on triton.knobs.runtime.jit_cache_hook, keeps a hook already there, and returns None (the
    compile goes ahead)."""
    pytest.importorskip("triton")
    from triton import knobs

    import engine.telemetry.compile_watch as cw

    calls = []
    saved_hook, saved_log = knobs.runtime.jit_cache_hook, cw._VARIANT_LOG
    try:
        knobs.runtime.jit_cache_hook = lambda **kw: calls.append(kw["fn"].name)
        cw._VARIANT_LOG = None
        log = cw.install_variant_log()
        assert cw.install_variant_log() is log
        spec = {"specialization_data": _spec({"x_ptr": "*fp32"})}
        assert (
            knobs.runtime.jit_cache_hook(
                key="k", repr="r", fn=_Fn("_k"), compile=spec, is_manual_warmup=False, already_compiled=False
            )
            is None
        )
        assert calls == ["_k"] and [v.kernel for v in log.variants] == ["_k"]
    finally:
        knobs.runtime.jit_cache_hook, cw._VARIANT_LOG = saved_hook, saved_log
