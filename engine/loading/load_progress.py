"""Progress of a checkpoint load: a tqdm bar on a terminal, else a log line every tenth of the tensors.

Shown by the process that reports for the engine (rank 0 of a tensor-parallel group; the other ranks pass
enabled=False). `enabled=None` decides from the environment: $DSV4_LOAD_PROGRESS=1/0 forces it on/off;
otherwise it is on, except under pytest (quiet in tests unless asked). Either way a summary line (tensors,
bytes read, seconds) goes to the "dsv4.engine" logger at INFO when the load ends.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from dsv4_kernels.settings import LOAD_PROGRESS, settings

log = logging.getLogger("dsv4.engine")
ENV = LOAD_PROGRESS
LOG_STEPS = 10  # log lines per load when there is no terminal


def progress_wanted(enabled: bool | None) -> bool:
    """enabled, or when None: $DSV4_LOAD_PROGRESS if set, else not under pytest."""
    if enabled is not None:
        return enabled
    env = settings().load_progress
    if env is not None:
        return env
    return "PYTEST_CURRENT_TEST" not in os.environ


class LoadProgress:
    """`with LoadProgress(total, what) as p: ... p.advance(bytes_read_so_far)` once per tensor."""

    def __init__(self, total: int, what: str = "loading weights", enabled: bool | None = None):
        self.total, self.what, self.done, self.nbytes = total, what, 0, 0
        self.enabled = progress_wanted(enabled) and total > 0
        self._bar = None
        self._every = max(1, -(-total // LOG_STEPS))
        self._t0 = time.perf_counter()

    def __enter__(self) -> LoadProgress:
        if self.enabled and sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # no tqdm: the log lines below
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=self.what, unit="tensor", dynamic_ncols=True)
        return self

    def advance(self, nbytes: int) -> None:
        """One more tensor done; `nbytes`: bytes read from the files so far."""
        self.done += 1
        self.nbytes = nbytes
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{_gib(nbytes)} read", refresh=False)
        elif self.done % self._every == 0 and self.done < self.total:
            log.info("%s: %d/%d tensors, %s read", self.what, self.done, self.total, _gib(nbytes))

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.enabled and exc[0] is None:
            log.info(
                "%s: %d tensors, %s read in %.1f s",
                self.what,
                self.done,
                _gib(self.nbytes),
                time.perf_counter() - self._t0,
            )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
