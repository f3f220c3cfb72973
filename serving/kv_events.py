"""`KVEventFeed`: a thread-safe fan-out of a worker's `KVEventBatch`es. Pass `feed.publish` as the
cache manager's `event_sink`; serve `StreamKVEvents` with `feed.stream(since_seq, snapshot, context)`."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator

import grpc

from cedserve.model.cache.events import KVEventBatch, encode_batch
from cedserve.proto import worker_pb2 as wpb


class KVEventFeed:
    """Fan-out of a worker's KV event batches to any number of `StreamKVEvents` calls.

    `publish` is the cache manager's `event_sink` (called on the engine thread); each stream reads
    from its own queue, so a slow router never blocks the engine. Keeps the last `keep` batches for
    resumption by `since_seq`.
    """

    def __init__(self, keep: int = 1024, poll_s: float = 0.5) -> None:
        self._cond = threading.Condition()
        self._kept: collections.deque[KVEventBatch] = collections.deque(maxlen=keep)
        self._queues: list[collections.deque[KVEventBatch]] = []
        self._closed = False
        self._poll_s = poll_s

    def publish(self, batch: KVEventBatch) -> None:
        with self._cond:
            self._kept.append(batch)
            for q in self._queues:
                q.append(batch)
            self._cond.notify_all()

    def close(self) -> None:
        """End every stream (process shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, since_seq: int, snapshot: Callable[[], KVEventBatch],
               context: grpc.ServicerContext) -> Iterator[wpb.KVEventBatch]:
        """Batches with `seq >= since_seq` (0, or batches no longer kept: a `snapshot()` instead), then
        live ones until the call ends. `snapshot` must be safe to call from this thread."""
        queue: collections.deque[KVEventBatch] = collections.deque()
        with self._cond:
            self._queues.append(queue)
            backlog = self._backlog(since_seq)
        try:
            if backlog is None:
                snap = snapshot()
                backlog = [snap]
                _drop_upto(queue, snap.seq)
            yield from (_to_pb(b) for b in backlog)
            while context.is_active():
                batch = self._next(queue)
                if batch is None and self._closed:
                    return
                if batch is not None:
                    yield _to_pb(batch)
        finally:
            with self._cond:
                self._queues.remove(queue)

    def _backlog(self, since_seq: int) -> list[KVEventBatch] | None:
        if since_seq == 0 or not self._kept or self._kept[0].seq > since_seq:
            return None
        return [b for b in self._kept if b.seq >= since_seq]

    def _next(self, queue: collections.deque[KVEventBatch]) -> KVEventBatch | None:
        with self._cond:
            if not queue and not self._closed:
                self._cond.wait(self._poll_s)
            return queue.popleft() if queue else None


def _drop_upto(queue: collections.deque[KVEventBatch], seq: int) -> None:
    while queue and queue[0].seq <= seq:
        queue.popleft()


def _to_pb(batch: KVEventBatch) -> wpb.KVEventBatch:
    return wpb.KVEventBatch(worker_id=batch.worker_id, seq=batch.seq, events_msgpack=encode_batch(batch),
                            snapshot=batch.is_snapshot)
