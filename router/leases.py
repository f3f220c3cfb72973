"""Keeping the router's open decode leases alive: `LeaseKeeper`.

A decode worker frees an unattached lease when its deadline passes (`decode.lease_ms`, 4 s by
default): that is the backstop for a router that died between Reserve and Decode (kill -9, a lost
Cancel). A request that is only slow must not lose its blocks to it, so while the router waits on a
lease (the prefill is queued, computes a long prompt, or transfers) it renews it. The keeper holds
every open lease by decode worker and, every quarter lease, sends each worker holding some one
`Renew` naming all of them (one small call per worker per period, whatever the number of requests).
A lease is open from its Reserve reply until its Decode call streams its first event (the worker
took the lease over: it no longer expires) or the attempt ends.

Why a call of its own rather than riding on something that already flows: load polls may be late
without consequence (busy is not dead, router/workers.py), which a renewal may not be; the KV event
stream flows the other way and stays open across requests. With a quarter-lease period a lease
survives two lost renewals in a row with a quarter lease to spare (a router's event loop late under
load, a worker's call queue); the timer runs only while leases are open.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from cedserve.proto import worker_pb2
from cedserve.router.metrics import RouterMetrics
from cedserve.router.workers import WorkerPool

log = logging.getLogger(__name__)

RENEWALS_PER_LEASE = 4
"""Renewals sent per lease period (see the module docstring)."""


class LeaseKeeper:
    """Open leases by decode worker, renewed on a timer while any are open. Lives on the router's
    event loop (not thread-safe)."""

    def __init__(self, pool: WorkerPool, lease_ms: int, metrics: RouterMetrics,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, got {lease_ms}")
        self.pool = pool
        self.lease_ms = lease_ms
        self.interval_s = lease_ms / 1000 / RENEWALS_PER_LEASE
        self.metrics = metrics
        """Renewals sent and failed, their round-trip time, leases found lost."""
        self.metadata = metadata
        self._open: dict[str, dict[str, str]] = {}  # decode worker id -> lease id -> request id
        self._timer: asyncio.Task[None] | None = None

    def hold(self, worker_id: str, request_id: str, lease_id: str) -> None:
        """The router waits on this lease: renew it until `drop`."""
        self._open.setdefault(worker_id, {})[lease_id] = request_id
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._run())

    def drop(self, worker_id: str, lease_id: str) -> None:
        """Stop renewing the lease (taken over by its Decode call, cancelled, or failed). Idempotent."""
        leases = self._open.get(worker_id)
        if leases is not None:
            leases.pop(lease_id, None)
            if not leases:
                del self._open[worker_id]

    def num_open(self) -> int:
        return sum(len(leases) for leases in self._open.values())

    async def _run(self) -> None:
        """Renew every `interval_s` while leases are open; ends when none are (`hold` restarts it)."""
        while self._open:
            await asyncio.sleep(self.interval_s)
            await self.renew_all()

    async def renew_all(self) -> None:
        """One `Renew` per decode worker holding open leases, concurrently."""
        await asyncio.gather(*(self._renew(worker_id, dict(leases)) for worker_id, leases in list(self._open.items())))

    async def _renew(self, worker_id: str, leases: dict[str, str]) -> None:
        handle = self.pool.workers.get(worker_id)
        if handle is None or handle.decode is None or not leases:
            return  # gone from the pool: its requests fail on their own calls
        refs = [worker_pb2.LeaseRef(request_id=rid, lease_id=lid) for lid, rid in leases.items()]
        self.metrics.lease_renewals.inc()
        start = time.monotonic()
        try:
            reply = await handle.decode.Renew(worker_pb2.RenewRequest(leases=refs, lease_ms=self.lease_ms),
                                              timeout=max(self.interval_s, 0.5), metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:  # the next period tries again
            self.metrics.lease_renewal_failures.labels(code=exc.code().name).inc()
            log.debug("renewal of %d leases on %s failed: %s", len(refs), worker_id, exc.code().name)
            return
        self.metrics.lease_renew_s.observe(time.monotonic() - start)
        # A lease dropped while its renewal was in flight (its Decode call took it over, its request
        # ended) is no loss: count only those the router still waits on.
        still_open = self._open.get(worker_id, {})
        lost = [lease_id for lease_id in reply.lost_lease_ids if lease_id in still_open]
        if lost:
            self.metrics.leases_lost.inc(len(lost))
            log.info("decode worker %s no longer holds %d leases this router waits on (their requests fail on "
                     "their next call)", worker_id, len(lost))
