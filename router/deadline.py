"""A request's deadline, independent of the transport that carried it.

gRPC clients set one with the call's timeout; HTTP clients with the `x-cedserve-timeout-s` header
(router/http_api.py). The generation core passes what is left of it to every worker call as that
call's timeout and as `deadline_unix_ms`, so a worker stops work nobody waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    at_monotonic_s: float | None = None
    """`time.monotonic()` by which the request must finish; None: no deadline."""

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline:
        """The deadline `timeout_s` seconds from now (None: none)."""
        return cls(None if timeout_s is None else time.monotonic() + timeout_s)

    def remaining_s(self) -> float | None:
        """Seconds left (never negative); None without a deadline."""
        if self.at_monotonic_s is None:
            return None
        return max(0.0, self.at_monotonic_s - time.monotonic())

    def for_call(self) -> tuple[float | None, int]:
        """(timeout for a worker call in seconds or None, `deadline_unix_ms` for its message or 0)."""
        remaining = self.remaining_s()
        if remaining is None:
            return None, 0
        return remaining, int((time.time() + remaining) * 1000)
