"""One background I/O thread with a bounded queue, for the disk tier.

`submit` blocks while the queue is full (backpressure instead of unbounded memory: every queued
write holds a block's bytes). Jobs run in submission order, so a read queued after a write of the
same file sees it, and a delete queued after a read runs after it. A job's exception is set on its
future, never swallowed: the owner inspects futures from its own thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "Future[Any]"]


class IOWorker:
    """A daemon thread running submitted callables in order."""

    def __init__(self, queue_depth: int, name: str = "cedserve-cache-io") -> None:
        if queue_depth <= 0:
            raise ValueError(f"cache field `io_queue_depth`: must be positive, got {queue_depth}")
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_depth)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn`; blocks while `queue_depth` jobs are waiting. `RuntimeError` after `close`."""
        if self._closed:
            raise RuntimeError("cache I/O worker is closed")
        future: Future[T] = Future()
        self._queue.put((fn, future))
        return future

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the owner through the future
                future.set_exception(exc)
