"""`python -m benchmarks.slice ...`: the same as `dsv4 bench slice ...`."""

import sys

from benchmarks.slice.cli import main

sys.exit(main())
