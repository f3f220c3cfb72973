"""A worker's poll loop ends when the pool cancels it, even when its wake and the cancel land in the
same turn of the event loop. Python 3.11's `asyncio.wait_for` returned instead of raising then, the
poll loop ran on, and the pool's `close` (and a removed worker's retirement) waited for it forever:
`test_router_discovery.py` hung once for 600 s on the 2-core VM that way."""

from __future__ import annotations

import asyncio

import pytest

from cedserve.router.config import WorkerEndpoint
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.workers import WorkerPool

pytestmark = pytest.mark.unit


def test_a_cancel_beside_a_wake_ends_the_pause() -> None:
    async def scenario() -> None:
        pool = WorkerPool((), (), GlobalPrefixIndex(), poll_s=30.0)
        handle = pool.add(_endpoint(), "decode")  # not started: no poll task of its own
        pauses = []
        for _ in range(20):  # the race is the point: every try must end cancelled
            handle.wake.clear()
            task = asyncio.create_task(pool._pause(handle))
            await asyncio.sleep(0)  # the pause waits on the wake now
            handle.wake.set()
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=5.0)
            assert done, "the pause outlived its cancel"
            pauses.append(task.cancelled())
        assert all(pauses)
        await asyncio.wait_for(pool.close(), 5.0)

    asyncio.run(scenario())


def test_a_removed_worker_retires_while_its_stream_wakes_its_poll() -> None:
    """The same through the pool: `remove` cancels a running poll loop just after its wake was set (as a
    broken event stream sets it); the worker's retirement ends, and so does `close`. (The turn in which
    the two land is up to the loop here; the test above makes them land together.)"""

    async def scenario() -> None:
        pool = WorkerPool((), (), GlobalPrefixIndex(), poll_s=30.0, retire_grace_s=0.1)
        pool.start()
        handle = pool.add(_endpoint(), "decode")
        await asyncio.sleep(0.2)  # its poll failed (nothing listens) and waits in its pause
        handle.wake.set()
        assert pool.remove(handle.worker_id)
        await asyncio.wait_for(pool.close(), 5.0)
        assert all(t.done() for t in handle.tasks) and not pool._retiring

    asyncio.run(scenario())


def _endpoint() -> WorkerEndpoint:
    return WorkerEndpoint("decode-x", "127.0.0.1:1")  # nothing listens: its polls fail
