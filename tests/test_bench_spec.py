"""`dsv4 bench spec --tiny` (benchmarks/spec.py) runs end to end on the CPU and writes its section, so the GPU run
does not fail on a typo; forced acceptance 1.0 makes every step emit K + 1 tokens a request."""

from service.cli import main


def test_bench_spec_tiny_runs_and_writes_its_section(tmp_path):
    out = tmp_path / "spec.md"
    assert (
        main(
            [
                "bench",
                "spec",
                "--tiny",
                "--k",
                "2",
                "--batches",
                "2",
                "--rates",
                "1.0",
                "--steps",
                "1",
                "--context",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert text.startswith("## Speculative decoding (MTP, K=2)")
    row = [line for line in text.splitlines() if "acceptance 1.0" in line][0].split("|")
    assert float(row[5]) == 3.0 and float(row[6]) == 1.0  # K + 1 tokens a step, every draft accepted


def test_spec_profile_tiny_reports_every_phase(tmp_path):
    """benchmarks/spec_profile.py (the GPU diagnostic of a speculative step) on the CPU: every phase of the fixed
    step shows up in its table (the wrappers reach the methods the engine calls)."""
    from benchmarks import spec_profile

    out = tmp_path / "profile.md"
    args = ["--tiny", "--k", "2", "--batches", "2", "--steps", "1", "--context", "8", "--out", str(out)]
    assert spec_profile.main(args) == 0
    text = out.read_text()
    for _, _, label in spec_profile.PHASES:
        assert f"| {label} |" in text or label in spec_profile.OVERLAP_ONLY, label


def test_spec_roofline_bounds_are_consistent():
    """benchmarks/spec_roofline.py: with no acceptance speculation only costs (bound < 1); sharing experts never reads
    more than independent routing; the draft's head weighs more on the 4-layer slice than on the 43-layer model."""
    from benchmarks.spec_roofline import bound

    assert max(bound(43, 1, 1, 0.0, 1024).bounds) < 1.0
    for layers in (4, 43):
        b = bound(layers, 16, 2, 0.8, 1024)
        assert b.verify_gb[1] <= b.verify_gb[0] and b.bounds[0] <= b.bounds[1]
    assert bound(4, 1, 1, 0.8, 1024).bounds[1] < bound(43, 1, 1, 0.8, 1024).bounds[1]
