"""Waiting for decode capacity: admitted requests that no decode worker has room for yet.

A request admitted by its effort class (router/admission.py) may still find every decode worker
full: placement sees no worker with free blocks for it (`NoCapacityError`), or the chosen worker
refuses its Reserve with RESOURCE_EXHAUSTED (its blocks or its waiting room are taken; its load
report was older than that). Such a request is not refused: it waits here, in one FIFO per effort
class, until room appears, its deadline passes, or it has waited `max_wait_s` (then
RESOURCE_EXHAUSTED with a retry delay: the bound).

Only the head of each class's FIFO tries placement again, and only when something may have changed:
a decode worker's load report arrived (`wake`, from `WorkerPool`'s load polls: room freed by
finished requests shows there; while requests wait, a request this router placed that ends, by
completing, failing or being cancelled, has its decode worker polled at once, `WorkerPool.poll_now`,
so the room it leaves is seen within a round trip rather than at the next period), or the request
ahead of it was placed (it passes the turn on, so
one report that shows room for several places them one after another, and the first that does
not fit stops the chain). Waiters behind the head sleep; a report never wakes every waiter at
once. A new request of a class whose FIFO is not empty joins its tail without trying first, so it
cannot overtake the ones waiting. The FIFO's length is bounded by the class's admission limit
(`max_running`): a waiting request holds its admission slot.

Not thread-safe: lives on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from cedserve.router.deadline import Deadline
from cedserve.router.errors import CAPACITY_WAIT, RequestError

CLASSES = ("low", "high", "max")


class CapacityWaiter:
    """One request's place in its class's FIFO."""

    def __init__(self, queue: deque[CapacityWaiter], request_id: str, max_wait_s: float) -> None:
        self._queue = queue
        self._turn = asyncio.Event()
        self.request_id = request_id
        self.give_up_s = time.monotonic() + max_wait_s
        self.max_wait_s = max_wait_s

    async def next_turn(self, deadline: Deadline, retry_after_s: float) -> None:
        """Until this waiter is the head and something may have changed. Raises `RequestError`:
        DEADLINE_EXCEEDED when the request's deadline passes first, RESOURCE_EXHAUSTED (with
        `retry_after_s`) once it has waited `max_wait_s`."""
        left = self.give_up_s - time.monotonic()
        remaining = deadline.remaining_s()
        expired = remaining is not None and remaining < left
        wait_s = min(left, remaining) if remaining is not None else left
        try:
            async with asyncio.timeout(max(0.0, wait_s)):  # (wait_for may swallow a cancel: workers.py)
                await self._turn.wait()
        except TimeoutError:
            if expired:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed while it "
                                   "waited for room on a decode worker", request_id=self.request_id) from None
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no decode worker had room for the request "
                               f"within {self.max_wait_s:g} s; retry later", retry_after_s=retry_after_s,
                               request_id=self.request_id, reason=CAPACITY_WAIT) from None
        self._turn.clear()

    def wake(self) -> None:
        self._turn.set()

    def leave(self, placed: bool) -> None:
        """Out of the FIFO. The next head tries at once when this one was placed (room may be left)
        or leaves holding a wake it did not use."""
        was_head = bool(self._queue) and self._queue[0] is self
        pass_on = was_head and (placed or self._turn.is_set())
        self._queue.remove(self)
        if pass_on and self._queue:
            self._queue[0].wake()


class CapacityQueue:
    """One FIFO of `CapacityWaiter`s per effort class (see the module docstring)."""

    def __init__(self, max_wait_s: dict[str, float]) -> None:
        self.max_wait_s = max_wait_s
        self._queues: dict[str, deque[CapacityWaiter]] = {klass: deque() for klass in CLASSES}

    def waiting(self, klass: str) -> int:
        return len(self._queues[klass])

    def any_waiting(self) -> bool:
        return any(self._queues.values())

    def wake(self) -> None:
        """A decode worker's load changed: the head of every class tries again."""
        for queue in self._queues.values():
            if queue:
                queue[0].wake()

    @asynccontextmanager
    async def wait_in_line(self, klass: str, request_id: str) -> AsyncIterator[CapacityWaiter]:
        """A place at the tail of `klass`'s FIFO for the block's duration; the block marks it placed
        by returning normally (the next head then tries at once)."""
        queue = self._queues[klass]
        waiter = CapacityWaiter(queue, request_id, self.max_wait_s.get(klass, 30.0))
        queue.append(waiter)
        placed = False
        try:
            yield waiter
            placed = True
        finally:
            waiter.leave(placed)
