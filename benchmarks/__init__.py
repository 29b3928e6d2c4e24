"""Benchmarks of the dsv4 tree (not a product package: not installed, free to import every product package).

`benchmarks.timing` is the one place that times things (CUDA events / graphs, medians, the measured copy
bandwidth and matmul ceilings); `benchmarks.kernels` holds the kernel micro-benchmarks behind
`dsv4 bench kernels <op>`; `benchmarks.slice` the V4-Flash-slice engine benchmark (`dsv4 bench slice`).
"""
