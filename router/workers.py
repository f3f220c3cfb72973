"""The router's view of its workers: channels, measured loads, and KV event streams.

For every worker one task polls `GetLoad` (a worker that fails three polls in a row is taken out of
placement and its index entries dropped; a poll that only times out is late, not failed, while the
worker's `grpc.health.v1` "liveness" check answers SERVING or, itself late, the worker answered
anything within `SILENT_DOWN_S`: busy is not dead, so a worker under load keeps its place and its
index entries, while a refused connection or a worker silent for that long counts as missed), and one
task follows `StreamKVEvents` into the global
prefix index, resuming from the last applied sequence number after a gap or a reconnect (the worker
replays, or sends a snapshot when its replay buffer no longer reaches back).

Membership changes at runtime: `add` (a new worker, or a known one at a new address: a restarted
pod or Ray actor), `remove` (its tasks stop, its index entries go, and its channel closes once the
calls still on it finish or `retire_grace_s` passes) and `sync` (make the workers of one source and
role exactly a given list: what Kubernetes discovery calls on every change). Each worker records
its `source` (static list, Kubernetes, registration RPC) so a source only ever removes its own.
A worker that answers `GetLoad` with UNIMPLEMENTED is a follower rank of a group (only the leader
serves the worker service) and is kept out of placement without further polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cedserve.common.tls import PLAINTEXT, TLSConfig, open_aio_channel
from cedserve.model.cache.events import decode_batch
from cedserve.proto import worker_pb2, worker_pb2_grpc
from cedserve.router.config import WorkerEndpoint
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.load_table import LoadTable
from cedserve.router.placement import DecodeLoad, PrefillLoad

log = logging.getLogger(__name__)
_MISSED_POLLS_DOWN = 3
"""Failed load polls in a row (refused, reset, or late with the liveness check failing too) that take
a worker out of placement."""
_LIVENESS_TIMEOUT_S = 1.0
LIVENESS_SERVICE = "liveness"
SILENT_DOWN_S = 30.0
"""A worker whose load polls and liveness checks both time out stays in placement (busy: 1,000
concurrent requests on one CPU decode worker made both late) until it has answered nothing for this
long (hung)."""


def poll_missed(code: grpc.StatusCode, liveness: bool | None, silent_s: float) -> bool:
    """Whether a failed load poll counts toward taking the worker out (`_MISSED_POLLS_DOWN` in a
    row): not when it only timed out and the liveness check answered SERVING (`liveness` True) or
    did not answer in time either (None) while the worker answered something `silent_s` ago, less
    than `SILENT_DOWN_S`."""
    if code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return not (liveness or (liveness is None and silent_s < SILENT_DOWN_S))


@dataclass
class WorkerHandle:
    endpoint: WorkerEndpoint
    role: str
    channel: grpc.aio.Channel
    prefill: worker_pb2_grpc.PrefillWorkerStub | None = None
    decode: worker_pb2_grpc.DecodeWorkerStub | None = None
    load: worker_pb2.LoadReport | None = None
    missed_polls: int = 0
    late_polls: int = 0
    """Load polls that timed out while the worker's liveness check answered (busy, not dead)."""
    last_seen_s: float = 0.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    source: str = "static"
    """Who added it: `static` (command line), `kubernetes` (discovery) or `registry` (Register RPC)."""
    follower: bool = False
    """Does not serve the worker service (a follower rank of a group): never placed on."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to poll now rather than after `poll_s` (its KV event stream broke: the worker may be gone;
    a request on it ended while others wait for capacity: `WorkerPool.poll_now`)."""

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def healthy(self) -> bool:
        return self.load is not None and self.missed_polls < _MISSED_POLLS_DOWN and not self.follower


class WorkerPool:
    """All workers of one router. Not thread-safe: lives on the router's event loop."""

    def __init__(self, prefill: tuple[WorkerEndpoint, ...], decode: tuple[WorkerEndpoint, ...],
                 index: GlobalPrefixIndex, poll_s: float, metadata: tuple[tuple[str, str], ...] = (),
                 tls: TLSConfig = PLAINTEXT, retire_grace_s: float = 60.0) -> None:
        self.index = index
        self.poll_s = poll_s
        self.metadata = metadata
        self.tls = tls
        """Channels to workers dial TLS when enabled (`RouterConfig.internal_tls`)."""
        self.retire_grace_s = retire_grace_s
        """How long a removed worker's channel stays open for the calls still on it."""
        self.on_remove: list[Callable[[str], None]] = []
        """Called with the id of every removed worker (e.g. to forget its measured link rates)."""
        self.on_decode_load: list[Callable[[], None]] = []
        """Called after every decode load report is written (room may have freed: router/capacity.py)."""
        self.workers: dict[str, WorkerHandle] = {}
        self.loads = LoadTable()
        """The healthy workers' placement inputs, written here on every load report and health change."""
        self._started = False
        self._retiring: set[asyncio.Task[None]] = set()
        for role, endpoints in (("prefill", prefill), ("decode", decode)):
            for ep in endpoints:
                self.add(ep, role)

    def start(self) -> None:
        self._started = True
        for handle in self.workers.values():
            if not handle.tasks:
                self._start_tasks(handle)

    def _start_tasks(self, handle: WorkerHandle) -> None:
        handle.tasks.append(asyncio.create_task(self._poll_loads(handle)))
        handle.tasks.append(asyncio.create_task(self._follow_events(handle)))

    # ------------------------------------------------------------------ membership

    def add(self, endpoint: WorkerEndpoint, role: str, source: str = "static") -> WorkerHandle:
        """Add a worker (polled at once if the pool runs). A known id at another address or role is
        replaced: the old entry is removed first (a restarted worker starts with no prefix credit)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"worker {endpoint.worker_id!r}: role must be prefill or decode, got {role!r}")
        old = self.workers.get(endpoint.worker_id)
        if old is not None:
            if old.endpoint == endpoint and old.role == role:
                old.source = source
                return old
            self.remove(endpoint.worker_id)
        channel = open_aio_channel(endpoint.address, self.tls)
        handle = WorkerHandle(endpoint, role, channel, source=source)
        if role == "prefill":
            handle.prefill = worker_pb2_grpc.PrefillWorkerStub(channel)  # type: ignore[no-untyped-call]
        else:
            handle.decode = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
        self.workers[endpoint.worker_id] = handle
        if self._started:
            self._start_tasks(handle)
            log.info("%s worker %s at %s added (%s)", role, endpoint.worker_id, endpoint.address, source)
        return handle

    def remove(self, worker_id: str) -> bool:
        """Take a worker out now: no new placement, no prefix credit. Calls already on its channel may
        finish (for up to `retire_grace_s`). False when the id is unknown. Call on the pool's loop."""
        handle = self.workers.pop(worker_id, None)
        if handle is None:
            return False
        for task in handle.tasks:
            task.cancel()
        self.index.forget(worker_id)
        self.loads.drop(worker_id)
        for callback in self.on_remove:
            callback(worker_id)
        retire = asyncio.get_running_loop().create_task(self._retire(handle, self.retire_grace_s))
        self._retiring.add(retire)
        retire.add_done_callback(self._retiring.discard)
        log.info("%s worker %s at %s removed", handle.role, worker_id, handle.endpoint.address)
        return True

    def sync(self, role: str, endpoints: Sequence[WorkerEndpoint], source: str) -> tuple[list[str], list[str]]:
        """Make the `role` workers added by `source` exactly `endpoints` (others' untouched).
        Returns the ids (added or moved, removed)."""
        wanted = {ep.worker_id: ep for ep in endpoints}
        removed = [w for w, h in self.workers.items() if h.source == source and h.role == role and w not in wanted]
        for worker_id in removed:
            self.remove(worker_id)
        added = []
        for ep in wanted.values():
            old = self.workers.get(ep.worker_id)
            if old is None or old.endpoint != ep or old.role != role:
                added.append(ep.worker_id)
            self.add(ep, role, source)
        return added, removed

    async def _retire(self, handle: WorkerHandle, grace_s: float) -> None:
        for task in handle.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        handle.tasks.clear()
        await handle.channel.close(grace_s)

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
        self._started = False
        for handle in self.workers.values():
            await handle.channel.close()
        retiring = list(self._retiring)
        for task in retiring:  # removed workers: close their channels now
            task.cancel()
        for task in retiring:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every worker has answered a load poll; `TimeoutError` names the silent ones."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(h.healthy for h in self.workers.values()):
                return
            await asyncio.sleep(0.05)
        silent = [w for w, h in self.workers.items() if not h.healthy]
        raise TimeoutError(f"workers did not answer within {timeout_s:.0f} s: {silent}")

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens accepted by the healthy prefill workers and not computed yet (their loads)."""
        return sum(int(h.load.queued_tokens) for h in self.healthy("prefill") if h.load is not None)

    def queued_decode_requests(self) -> int:
        """Requests the healthy decode workers hold without a batch slot: leased or waiting for their KV
        or a slot, and preempted ones (their loads)."""
        return sum(int(h.load.queued_requests + h.load.preempted_requests)
                   for h in self.healthy("decode") if h.load is not None)

    def poll_now(self, worker_id: str) -> None:
        """Poll the worker's load now rather than at its next period (a request on it ended: room
        may have freed that a request waiting for capacity could take, router/capacity.py). Polls
        asked for while one is in flight coalesce into one more after it."""
        handle = self.workers.get(worker_id)
        if handle is not None:
            handle.wake.set()

    def healthy(self, role: str, exclude: frozenset[str] = frozenset()) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.role == role and h.healthy and h.worker_id not in exclude]

    async def _poll_loads(self, handle: WorkerHandle) -> None:
        stub = handle.prefill or handle.decode
        assert stub is not None
        while True:
            try:
                load = await stub.GetLoad(worker_pb2.LoadRequest(), timeout=max(1.0, 2 * self.poll_s),
                                          metadata=self.metadata)
                if handle.load is None and load.worker_id and load.worker_id != handle.worker_id:
                    log.warning("worker %s calls itself %r: its KV events will not credit it with prefix hits "
                                "(start it with --worker-id=%s)", handle.worker_id, load.worker_id, handle.worker_id)
                handle.load = load
                handle.missed_polls = 0
                handle.last_seen_s = time.monotonic()
                self._report(handle)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s at %s does not serve the %s worker service (a group's follower rank, "
                             "or a worker of the other role); not placing on it", handle.worker_id,
                             handle.endpoint.address, handle.role)
                    handle.follower = True
                    self.loads.drop(handle.worker_id)
                    for task in handle.tasks:
                        if task is not asyncio.current_task():
                            task.cancel()
                    return
                checked = exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                liveness = await self._liveness(handle) if checked else False
                if liveness:
                    handle.last_seen_s = time.monotonic()
                if not poll_missed(exc.code(), liveness, time.monotonic() - handle.last_seen_s):
                    # busy, not dead: its load report is late under load; keep placing on it (its last
                    # report stands) and keep its prefix-index entries
                    handle.late_polls += 1
                    log.debug("load poll of %s late (liveness %s)", handle.worker_id, liveness)
                    await self._pause(handle)
                    continue
                before = handle.missed_polls
                # unreachable and its health check refused too: the process is gone (killed, crashed),
                # not busy; out of placement now rather than after three polls
                gone = exc.code() == grpc.StatusCode.UNAVAILABLE and liveness is False
                handle.missed_polls = max(before + 1, _MISSED_POLLS_DOWN if gone else 0)
                if before < _MISSED_POLLS_DOWN <= handle.missed_polls:
                    log.warning("worker %s is down (%s); taking it out of placement", handle.worker_id, exc.code())
                    self.index.forget(handle.worker_id)
                    self.loads.drop(handle.worker_id)
            await self._pause(handle)

    async def _pause(self, handle: WorkerHandle) -> None:
        """`poll_s`, or less when something suggests the worker is gone (`WorkerHandle.wake`)."""
        # `asyncio.timeout`, not `wait_for`: Python 3.11's `wait_for` returns instead of raising when
        # the task is cancelled as the wait ends (a wake beside `remove`'s cancel), and the poll loop
        # then ran on: its retirement, and the pool's `close`, waited for it forever
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.poll_s):
                await handle.wake.wait()
        handle.wake.clear()

    def _report(self, handle: WorkerHandle) -> None:
        """Write a healthy worker's load report into `loads` (rates floored at one token/s; a decode
        worker that reports no step profile is taken to need 50 ms per step)."""
        load = handle.load
        if load is None or not handle.healthy or self.workers.get(handle.worker_id) is not handle:
            return  # not placeable, or already replaced by a newer handle of the same id
        rate = max(1.0, load.prefill_tokens_per_s)
        if handle.role == "prefill":
            self.loads.set_prefill(PrefillLoad(handle.worker_id, int(load.queued_tokens), rate))
        else:
            self.loads.set_decode(DecodeLoad(handle.worker_id, int(load.running_requests), int(load.free_blocks),
                                             list(load.step_s) or [0.05, 0.05], rate, int(load.queued_tokens)))
            for callback in self.on_decode_load:
                callback()

    async def _liveness(self, handle: WorkerHandle) -> bool | None:
        """Whether the worker's `grpc.health.v1` "liveness" service answers SERVING (served by its
        gRPC server itself, not its engine); None when it did not answer in time."""
        try:
            reply = await health_pb2_grpc.HealthStub(handle.channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=_LIVENESS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

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
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    handle.wake.set()  # the connection broke: poll it now, to learn at once if it died
            except ValueError as exc:
                log.warning("malformed KV events from %s: %s", handle.worker_id, exc)
            await asyncio.sleep(self.poll_s)
