"""The GPU decode/prefill benchmark of a V4-Flash slice, split by concept; scripts/bench_gpu.py drives it."""
