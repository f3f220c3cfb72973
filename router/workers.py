"""The router's view of its workers: channels, measured loads, and KV event streams.

For every worker one task polls `GetLoad` (a worker that fails three polls in a row is taken out of
placement and its index entries dropped), and one task follows `StreamKVEvents` into the global
prefix index, resuming from the last applied sequence number after a gap or a reconnect (the worker
replays, or sends a snapshot when its replay buffer no longer reaches back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from cedserve.model.cache.events import decode_batch
from cedserve.proto import worker_pb2, worker_pb2_grpc
from cedserve.router.config import WorkerEndpoint
from cedserve.router.index import GlobalPrefixIndex

log = logging.getLogger(__name__)
_MISSED_POLLS_DOWN = 3


@dataclass
class WorkerHandle:
    endpoint: WorkerEndpoint
    role: str
    channel: grpc.aio.Channel
    prefill: worker_pb2_grpc.PrefillWorkerStub | None = None
    decode: worker_pb2_grpc.DecodeWorkerStub | None = None
    load: worker_pb2.LoadReport | None = None
    missed_polls: int = 0
    last_seen_s: float = 0.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def healthy(self) -> bool:
        return self.load is not None and self.missed_polls < _MISSED_POLLS_DOWN


class WorkerPool:
    """All workers of one router. Not thread-safe: lives on the router's event loop."""

    def __init__(self, prefill: tuple[WorkerEndpoint, ...], decode: tuple[WorkerEndpoint, ...],
                 index: GlobalPrefixIndex, poll_s: float, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.index = index
        self.poll_s = poll_s
        self.metadata = metadata
        self.workers: dict[str, WorkerHandle] = {}
        for role, endpoints in (("prefill", prefill), ("decode", decode)):
            for ep in endpoints:
                channel = grpc.aio.insecure_channel(ep.address)
                handle = WorkerHandle(ep, role, channel)
                if role == "prefill":
                    handle.prefill = worker_pb2_grpc.PrefillWorkerStub(channel)  # type: ignore[no-untyped-call]
                else:
                    handle.decode = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
                self.workers[ep.worker_id] = handle

    def start(self) -> None:
        for handle in self.workers.values():
            handle.tasks.append(asyncio.create_task(self._poll_loads(handle)))
            handle.tasks.append(asyncio.create_task(self._follow_events(handle)))

    async def stop_tasks(self) -> None:
        """Stop polling and event streams (channels stay open; `start` resumes, from the index's seq)."""
        for handle in self.workers.values():
            for task in handle.tasks:
                task.cancel()
            for task in handle.tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            handle.tasks.clear()

    async def close(self) -> None:
        await self.stop_tasks()
        for handle in self.workers.values():
            await handle.channel.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every worker has answered a load poll; `TimeoutError` names the silent ones."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(h.healthy for h in self.workers.values()):
                return
            await asyncio.sleep(0.05)
        silent = [w for w, h in self.workers.items() if not h.healthy]
        raise TimeoutError(f"workers did not answer within {timeout_s:.0f} s: {silent}")

    def healthy(self, role: str, exclude: frozenset[str] = frozenset()) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.role == role and h.healthy and h.worker_id not in exclude]

    async def _poll_loads(self, handle: WorkerHandle) -> None:
        stub = handle.prefill or handle.decode
        assert stub is not None
        while True:
            try:
                handle.load = await stub.GetLoad(worker_pb2.LoadRequest(), timeout=max(1.0, 2 * self.poll_s),
                                                 metadata=self.metadata)
                handle.missed_polls = 0
                handle.last_seen_s = time.monotonic()
            except grpc.aio.AioRpcError as exc:
                handle.missed_polls += 1
                if handle.missed_polls == _MISSED_POLLS_DOWN:
                    log.warning("worker %s is down (%s); taking it out of placement", handle.worker_id, exc.code())
                    self.index.forget(handle.worker_id)
            await asyncio.sleep(self.poll_s)

    async def _follow_events(self, handle: WorkerHandle) -> None:
        stub = handle.prefill or handle.decode
        assert stub is not None
        while True:
            since = self.index.last_seq(handle.worker_id)
            request = worker_pb2.KVEventsRequest(since_seq=0 if since is None else since + 1)
            try:
                async for msg in stub.StreamKVEvents(request, metadata=self.metadata):
                    if not self.index.apply(decode_batch(msg.events_msgpack)):
                        break  # a gap: reconnect from the last applied batch
            except grpc.aio.AioRpcError as exc:
                log.debug("KV event stream of %s ended: %s", handle.worker_id, exc.code())
            except ValueError as exc:
                log.warning("malformed KV events from %s: %s", handle.worker_id, exc)
            await asyncio.sleep(self.poll_s)
