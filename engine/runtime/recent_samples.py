"""`RecentSamples`: latencies of the last `window_s` seconds and their quantiles, for the pool planner's signals.

Written on one thread (the engine thread's step hook, or the actor's loop) and read on another (the actor's
`signals` call): a lock guards the deque. Bounded by `max_samples` too, so a fast engine's step times cannot grow
it without end inside one window.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class RecentSamples:
    def __init__(self, window_s: float = 30.0, max_samples: int = 4096):
        if window_s <= 0 or max_samples < 1:
            raise ValueError(f"window_s must be > 0 and max_samples >= 1, got {window_s}, {max_samples}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, value)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value))

    def recent(self, now: float | None = None) -> list[float]:
        """The values of the last window_s seconds (older ones are dropped here)."""
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            return [v for _, v in self._samples]

    def quantile(self, q: float, now: float | None = None) -> tuple[float | None, int]:
        """(the q-quantile of the window's values, how many there are); (None, 0) when it is empty."""
        values = sorted(self.recent(now))
        if not values:
            return None, 0
        return values[min(len(values) - 1, int(q * len(values)))], len(values)
