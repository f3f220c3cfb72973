"""Load-report bookkeeping: `RateMeter`, measured tokens/s over a sliding window; `SeqCounter`,
the sequence numbers of reports."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


class RateMeter:
    """Tokens (or steps) per second measured over the last `window_s` seconds. Thread-safe."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: collections.deque[tuple[float, float, int]] = collections.deque()  # (start, end, n)
        self._lock = threading.Lock()

    def record(self, amount: int, busy_s: float) -> None:
        """`amount` units done in the last `busy_s` seconds of work."""
        now = self._clock()
        with self._lock:
            self._samples.append((now - busy_s, now, amount))
            self._trim(now)

    def rate(self) -> float:
        """Units per second of busy time in the window (0.0 with no samples): a capacity, not a load."""
        with self._lock:
            self._trim(self._clock())
            busy = sum(end - start for start, end, _ in self._samples)
            done = sum(n for _, _, n in self._samples)
        return done / busy if busy > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][1] < now - self.window_s:
            self._samples.popleft()


class SeqCounter:
    """Monotonic sequence numbers for load reports (thread-safe)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._next += 1
            return self._next
