"""`python -m benchmarks.kernels <op> ...`: the same as `dsv4 bench kernels <op> ...`."""

import sys

from benchmarks.kernels import main

sys.exit(main())
