"""The router's control plane on its public port: drain, and worker registration.

Drain (the pod's preStop hook runs `cedserve drain --address 127.0.0.1:<port>`; SIGTERM does the
same with `RouterConfig.drain_timeout_s`):

1. health `""` and the Generation service turn NOT_SERVING at once (readiness fails, the Service
   stops sending new connections); `liveness` stays SERVING;
2. new `Generate` calls fail with UNAVAILABLE ("router is draining"), so a client retries on another
   router; CountTokens and ListModels keep answering;
3. open `Generate` streams run to their end, until the drain's deadline;
4. `Drain` answers (drained, streams still open). After a preStop drain the process waits for
   SIGTERM; after SIGTERM it stops the server, which cancels what is still open.

Both services here (`cedserve.v1.Lifecycle`, `cedserve.v1.WorkerRegistry`) accept loopback peers
only (PERMISSION_DENIED otherwise) and therefore need no API key. `WorkerRegistry` adds, moves and
removes workers at runtime (source `registry`): the Ray launcher calls it from the actor that owns
the router process when a worker actor restarts at a new address. When the router has an internal
token (`worker_token`, which it sends to every worker it calls), the registry also requires that
token in `x-cedserve-token` (UNAUTHENTICATED otherwise): any local process could otherwise register
an address of its own and receive the token with the router's first call to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from cedserve.common.credentials import TOKEN_METADATA_KEY, token_metadata
from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc, registry_pb2, registry_pb2_grpc
from cedserve.router.config import WorkerEndpoint
from cedserve.router.workers import WorkerPool
from cedserve.serving.drain import is_loopback_peer
from cedserve.serving.server import LIVENESS_SERVICE

log = logging.getLogger(__name__)
GENERATE_METHOD = "/cedserve.v1.Generation/Generate"
DRAINING_MESSAGE = "router is draining (shutting down); retry on another router"
REGISTRY_SOURCE = "registry"


class RouterDrain:
    """Drain state of one router. Lives on the router's event loop."""

    def __init__(self, health_servicer: health.aio.HealthServicer, services: tuple[str, ...],
                 default_timeout_s: float) -> None:
        self.default_timeout_s = default_timeout_s
        self._health = health_servicer
        self._services = services
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._requested = asyncio.Event()
        self._finished = asyncio.Event()
        self._deadline_s = 0.0
        self._result = (False, 0)
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self._requested.is_set()

    @property
    def in_flight(self) -> int:
        """Generate streams open now."""
        return self._in_flight

    async def set_serving(self) -> None:
        for name in self._services:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    async def request(self, reason: str, timeout_s: float | None = None) -> None:
        """Start draining (idempotent; a later request can only shorten the deadline)."""
        deadline = time.monotonic() + (timeout_s if timeout_s else self.default_timeout_s)
        if self.draining:
            self._deadline_s = min(self._deadline_s, deadline)
            return
        self._deadline_s = deadline
        self._requested.set()
        log.info("router drain requested (%s): %d streams open, deadline in %.1f s", reason, self._in_flight,
                 deadline - time.monotonic())
        for name in self._services:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        while self._in_flight and time.monotonic() < self._deadline_s:
            # Re-check the deadline every 0.1 s: a later request may have shortened it.
            with contextlib.suppress(TimeoutError):  # (asyncio.timeout: wait_for may swallow a cancel)
                async with asyncio.timeout(min(0.1, max(0.0, self._deadline_s - time.monotonic()))):
                    await self._idle.wait()
        self._result = (self._in_flight == 0, self._in_flight)
        log.info("router drain %s (%d streams open)", "finished" if not self._in_flight else "timed out",
                 self._in_flight)
        self._finished.set()

    async def wait_finished(self, timeout_s: float | None) -> tuple[bool, int]:
        """(drained, streams still open); (False, -1) when `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._finished.wait()
        except TimeoutError:
            return False, -1
        return self._result

    def enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()


def _loopback_only(context: grpc.aio.ServicerContext) -> str | None:
    if is_loopback_peer(context.peer()):
        return None
    return "accepted only from a loopback peer"


class LifecycleService(lifecycle_pb2_grpc.LifecycleServicer):
    """`cedserve.v1.Lifecycle.Drain` for the router."""

    def __init__(self, drain: RouterDrain) -> None:
        self._drain = drain

    async def Drain(self, request: lifecycle_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> lifecycle_pb2.DrainReply:
        refusal = _loopback_only(context)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"Drain is {refusal}")
        timeout_s = request.timeout_s or self._drain.default_timeout_s
        await self._drain.request("Drain RPC", timeout_s)
        remaining = context.time_remaining()
        wait_s = timeout_s if remaining is None else min(timeout_s, max(0.0, remaining - 0.1))
        drained, in_flight = await self._drain.wait_finished(wait_s)
        return lifecycle_pb2.DrainReply(drained=drained, in_flight=max(in_flight, 0))


class RegistryService(registry_pb2_grpc.WorkerRegistryServicer):
    """`cedserve.v1.WorkerRegistry`: runtime add/move/remove of workers in the router's pool."""

    def __init__(self, pool: WorkerPool, token: str = "") -> None:
        self._pool = pool
        self._token = token

    async def Register(self, request: registry_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> registry_pb2.RegisterReply:
        await self._check(context)
        changed = []
        for i, w in enumerate(request.workers):
            try:
                endpoint = WorkerEndpoint(w.worker_id, w.address)
                if not w.worker_id:
                    raise ValueError("empty worker_id")
                old = self._pool.workers.get(w.worker_id)
                self._pool.add(endpoint, w.role, REGISTRY_SOURCE)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"workers[{i}]: {exc}")
            if old is None or old.endpoint != endpoint or old.role != w.role:
                changed.append(w.worker_id)
        return registry_pb2.RegisterReply(changed=changed)

    async def Deregister(self, request: registry_pb2.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> registry_pb2.DeregisterReply:
        await self._check(context)
        return registry_pb2.DeregisterReply(removed=[w for w in request.worker_ids if self._pool.remove(w)])

    async def ListWorkers(self, request: registry_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> registry_pb2.ListWorkersReply:
        await self._check(context)
        return registry_pb2.ListWorkersReply(workers=[
            registry_pb2.WorkerState(worker_id=h.worker_id, role=h.role, address=h.endpoint.address,
                                     source=h.source, healthy=h.healthy)
            for h in sorted(self._pool.workers.values(), key=lambda h: h.worker_id)])

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        refusal = _loopback_only(context)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"WorkerRegistry is {refusal}")
        if self._token:
            presented = dict(context.invocation_metadata() or ()).get(TOKEN_METADATA_KEY, "")
            text = presented.decode() if isinstance(presented, bytes) else str(presented)
            if not hmac.compare_digest(text.encode(), self._token.encode()):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "WorkerRegistry needs the internal token in "
                                    f"`{TOKEN_METADATA_KEY}` metadata (internal_token_file)")


def add_control_services(server: grpc.aio.Server, drain: RouterDrain, pool: WorkerPool, token: str = "") -> None:
    lifecycle_pb2_grpc.add_LifecycleServicer_to_server(LifecycleService(drain), server)  # type: ignore[no-untyped-call]
    registry_pb2_grpc.add_WorkerRegistryServicer_to_server(  # type: ignore[no-untyped-call]
        RegistryService(pool, token), server)


def register_workers(address: str, workers: list[tuple[str, str, str]], timeout_s: float = 10.0,
                     token: str = "") -> list[str]:
    """Client of `WorkerRegistry.Register` (from the router's host, with the router's internal
    `token` when it has one): (worker id, role, address) each; returns the ids added or moved."""
    request = registry_pb2.RegisterRequest(workers=[
        registry_pb2.WorkerRegistration(worker_id=w, role=role, address=addr) for w, role, addr in workers])
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)  # type: ignore[no-untyped-call]
        reply: registry_pb2.RegisterReply = stub.Register(request, timeout=timeout_s, metadata=token_metadata(token))
    return list(reply.changed)


def list_workers(address: str, timeout_s: float = 10.0, token: str = "") -> list[dict[str, Any]]:
    """Client of `WorkerRegistry.ListWorkers`: the router's pool, one dict per worker."""
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)  # type: ignore[no-untyped-call]
        reply: registry_pb2.ListWorkersReply = stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=timeout_s,
                                                                metadata=token_metadata(token))
    return [{"worker_id": w.worker_id, "role": w.role, "address": w.address, "source": w.source,
             "healthy": w.healthy} for w in reply.workers]
