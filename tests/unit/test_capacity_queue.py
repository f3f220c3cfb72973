"""The router's wait for decode capacity (router/capacity.py): one FIFO per effort class, only its
head tries again when a load report arrives, a placed head passes the turn on, and the wait ends
with DEADLINE_EXCEEDED at the request's deadline or RESOURCE_EXHAUSTED (with a retry delay) at the
class's bound."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cedserve.router.capacity import CapacityQueue
from cedserve.router.deadline import Deadline
from cedserve.router.errors import CAPACITY_WAIT, RequestError

pytestmark = pytest.mark.unit

NO_DEADLINE = Deadline()


class Room:
    """Decode capacity as placement sees it: `free` requests fit; `tries` records who asked when."""

    def __init__(self) -> None:
        self.free = 0
        self.tries: list[str] = []
        self.placed: list[str] = []

    def take(self, name: str) -> bool:
        self.tries.append(name)
        if self.free <= 0:
            return False
        self.free -= 1
        self.placed.append(name)
        return True


async def wait_and_place(queue: CapacityQueue, room: Room, name: str, klass: str = "high",
                         deadline: Deadline = NO_DEADLINE) -> str:
    async with queue.wait_in_line(klass, name) as waiter:
        while True:
            await waiter.next_turn(deadline, retry_after_s=0.25)
            if room.take(name):
                return name


async def settle() -> None:
    """Let every ready task run until they all wait again."""
    await asyncio.sleep(0.02)


def test_only_the_head_tries_and_a_placed_head_passes_the_turn_on() -> None:
    async def scenario() -> None:
        queue, room = CapacityQueue({"high": 30.0}), Room()
        tasks = [asyncio.create_task(wait_and_place(queue, room, f"r{i}")) for i in range(5)]
        await settle()
        assert queue.waiting("high") == 5 and room.tries == []  # nobody tries before a wake
        queue.wake()
        await settle()
        assert room.tries == ["r0"]  # one report, nothing free: only the head tried
        room.free = 2
        queue.wake()
        await settle()
        # r0 placed, passed the turn to r1 (placed), which passed it to r2 (no room): the chain stops
        assert room.placed == ["r0", "r1"] and room.tries == ["r0", "r0", "r1", "r2"]
        assert queue.waiting("high") == 3
        room.free = 10
        queue.wake()
        assert await asyncio.gather(*tasks) == ["r0", "r1", "r2", "r3", "r4"]  # FIFO order
        assert queue.waiting("high") == 0

    asyncio.run(scenario())


def test_a_wake_reaches_the_head_of_every_class_and_classes_do_not_block_each_other() -> None:
    async def scenario() -> None:
        queue, room = CapacityQueue({}), Room()
        low = asyncio.create_task(wait_and_place(queue, room, "low0", "low"))
        high = [asyncio.create_task(wait_and_place(queue, room, f"high{i}", "high")) for i in range(2)]
        await settle()
        room.free = 1
        queue.wake()
        await settle()
        assert sorted(room.placed) == ["high0"] or sorted(room.placed) == ["low0"]
        room.free = 5
        queue.wake()
        await asyncio.gather(low, *high)
        assert sorted(room.placed) == ["high0", "high1", "low0"]

    asyncio.run(scenario())


def test_the_deadline_ends_the_wait_and_the_next_head_keeps_an_unused_wake() -> None:
    async def scenario() -> None:
        queue, room = CapacityQueue({"high": 30.0}), Room()
        first = asyncio.create_task(wait_and_place(queue, room, "short", deadline=Deadline.after(0.1)))
        second = asyncio.create_task(wait_and_place(queue, room, "patient"))
        await settle()
        start = time.monotonic()
        with pytest.raises(RequestError) as info:
            await first
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.05 < time.monotonic() - start < 2
        assert queue.waiting("high") == 1
        room.free = 1
        queue.wake()
        assert await second == "patient"

    asyncio.run(scenario())


def test_past_the_bound_the_request_gets_resource_exhausted_with_a_retry_delay() -> None:
    async def scenario() -> None:
        queue, room = CapacityQueue({"high": 0.1}), Room()
        with pytest.raises(RequestError) as info:
            await wait_and_place(queue, room, "r0", deadline=Deadline.after(60))
        error = info.value
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s == 0.25
        assert error.reason == CAPACITY_WAIT and queue.waiting("high") == 0

    asyncio.run(scenario())


def test_a_head_that_leaves_cancelled_hands_its_unused_wake_to_the_next() -> None:
    async def scenario() -> None:
        queue, room = CapacityQueue({"high": 30.0}), Room()
        async with queue.wait_in_line("high", "gone") as gone:
            waiting = asyncio.create_task(wait_and_place(queue, room, "next"))
            await settle()
            room.free = 1
            gone.wake()  # a load report arrived; the head's client leaves before using it
        assert await asyncio.wait_for(waiting, 2) == "next"

    asyncio.run(scenario())
