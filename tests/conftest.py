"""Test-wide settings.

The suite runs tiny models on a 2-core CI machine, often next to Ray workers and gRPC servers started by
other tests: one intra-op thread avoids the spin-wait contention that makes tiny ops 10x slower.
"""

import torch

torch.set_num_threads(1)
