"""The GPU decode/prefill benchmark of a V4-Flash slice, split by concept; benchmarks/slice/cli.py parses its flags
(`dsv4 bench slice`, `python -m benchmarks.slice`, or benchmarks/slice/run.sh with the carried transformers)."""
