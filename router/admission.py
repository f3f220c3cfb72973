"""Admission control: per-effort-class concurrency limits with a bounded wait queue.

Each class (low < 60, high 60-89, max >= 90 by effort level) admits up to `max_running` requests
at once and lets up to `max_queued` more wait. Beyond that the request is refused at once with
RESOURCE_EXHAUSTED and a retry hint: the measured mean service time of the class divided by its
concurrency, which is when a slot is expected to free up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import msgspec

from cedserve.model.config_table import fail
from cedserve.model.effort import effort_class
from cedserve.router.errors import ADMISSION, RequestError


class ClassLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_running: int = 64
    """Requests of the class in flight at once."""
    max_queued: int = 256
    """Requests of the class waiting for a slot; beyond it: RESOURCE_EXHAUSTED."""
    capacity_wait_s: float = 30.0
    """Longest an admitted request of the class waits for room on a decode worker (router/capacity.py)
    before RESOURCE_EXHAUSTED with a retry delay; its deadline, when shorter, ends the wait first."""

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0 or self.capacity_wait_s < 0:
            fail("router", "limits", f"max_running >= 1, max_queued >= 0 and capacity_wait_s >= 0, got {self}")


class _ClassGate:
    def __init__(self, limits: ClassLimits) -> None:
        self.limits = limits
        self.slots = asyncio.Semaphore(limits.max_running)
        self.waiting = 0
        self.running = 0
        self.mean_service_s = 1.0

    def retry_after_s(self) -> float:
        return max(0.05, self.mean_service_s / self.limits.max_running)


class Admission:
    """Gates requests by effort class; `queued_requests`/`running_requests` feed metrics."""

    def __init__(self, limits: dict[str, ClassLimits]) -> None:
        self._gates = {name: _ClassGate(limits.get(name, ClassLimits())) for name in ("low", "high", "max")}

    def running(self, klass: str) -> int:
        return self._gates[klass].running

    def capacity_wait_s(self) -> dict[str, float]:
        """Each class's `capacity_wait_s`."""
        return {name: gate.limits.capacity_wait_s for name, gate in self._gates.items()}

    def retry_after_s(self, klass: str) -> float:
        """When a slot of the class is expected to free up (the hint sent with RESOURCE_EXHAUSTED)."""
        return self._gates[klass].retry_after_s()

    def waiting(self, klass: str) -> int:
        return self._gates[klass].waiting

    @asynccontextmanager
    async def admit(self, effort: int, request_id: str) -> AsyncIterator[None]:
        gate = self._gates[effort_class(effort)]
        if gate.slots.locked() and gate.waiting >= gate.limits.max_queued:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"effort class {effort_class(effort)!r} is full ({gate.limits.max_running} running, "
                               f"{gate.waiting} queued); retry later", retry_after_s=gate.retry_after_s(),
                               request_id=request_id, reason=ADMISSION)
        gate.waiting += 1
        try:
            await gate.slots.acquire()
        finally:
            gate.waiting -= 1
        gate.running += 1
        start = time.monotonic()
        try:
            yield
        finally:
            gate.running -= 1
            gate.slots.release()
            gate.mean_service_s = 0.9 * gate.mean_service_s + 0.1 * (time.monotonic() - start)
