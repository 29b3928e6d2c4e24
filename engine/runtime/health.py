"""A worker's engine health: the options a worker is built with, and the watchdog that ends a worker whose engine
loop is beyond repair.

Why end the process: a loop whose step raised has lost its engine thread (the engine's state after a failed step
is unknown), and a hung step (a stuck collective, a wedged kernel) cannot be interrupted from Python. Either way
the process lives on and Ray, which restarts actors only when their process ends, would never replace it. So the
watchdog exits the process: Ray restarts the actor (a new incarnation), the router's health loop re-introduces it.

Timing: a dead loop ends the process after DEAD_EXIT_GRACE_S (long enough for the failed requests' errors to
reach their callers, who retry them as a worker death). A stall is reported by `stats` / `ping` from
`stall_timeout_s` on (the router marks the worker down and moves its streams), and ends the process
STALL_EXIT_GRACE_S later (the router has seen it by then: it probes every second or so). Time the whole process
spent stopped (SIGSTOP) is not held against the step in progress: the router has moved its streams already, and a
continued process finishes its step and serves again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 300.0  # well above the slowest legitimate step (a first-use kernel compile: tens of s)
DEAD_EXIT_GRACE_S = 1.0
STALL_EXIT_GRACE_S = 5.0
EXIT_CODE = 70  # EX_SOFTWARE: "internal software error"
PAUSE_S = 1.0  # the watchdog woke this much later than asked: the process was paused, its time is no stall


@dataclass(frozen=True)
class HealthOptions:
    """stall_timeout_s: how long the engine thread may stay in one step or call before the worker is unhealthy;
    test_hooks: expose `inject_fault` (tests only; off in production); exit_on_failure: run the watchdog that ends
    the process (on in Ray actors, where a new process is the remedy; off for in-process use such as tests)."""

    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    test_hooks: bool = False
    exit_on_failure: bool = False

    def __post_init__(self):
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")


class LoopWatchdog:
    """Watches one EngineLoop from its own thread; calls `exit_process(EXIT_CODE)` once the loop has died (and
    was not stopped by `stop`) or has stalled for stall_timeout_s + STALL_EXIT_GRACE_S."""

    def __init__(
        self,
        loop,
        stall_timeout_s: float,
        name: str,
        exit_process: Callable[[int], object] = os._exit,
        interval_s: float = 0.25,
        stall_exit_grace_s: float = STALL_EXIT_GRACE_S,
    ):
        self.loop, self.stall_timeout_s, self.name = loop, stall_timeout_s, name
        self.stall_exit_grace_s = stall_exit_grace_s
        self._exit, self.interval_s = exit_process, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Before a deliberate shutdown of the loop: that is not a failure."""
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        last, credit, seen = time.monotonic(), 0.0, None
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            paused, last = now - last - self.interval_s, now
            if self.loop.busy_since != seen:  # a new piece of work: its own clock
                credit, seen = 0.0, self.loop.busy_since
            if paused > PAUSE_S:  # this whole process was stopped (SIGSTOP, a frozen VM): not the engine's stall
                credit += paused
            if not self.loop.alive:
                grace, why = DEAD_EXIT_GRACE_S, self.loop.problem(self.stall_timeout_s)
            else:
                why = self.loop.problem(self.stall_timeout_s + self.stall_exit_grace_s + credit)
                grace = 0.0
            if why is None:
                continue
            if self._stop.wait(grace):  # a shutdown raced the failure: nothing to do
                return
            log.error("%s: %s; ending the process so that it is restarted", self.name, why)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            time.sleep(0.05)  # let the log line reach its handler's file
            self._exit(EXIT_CODE)
            return
