"""`ProbeLink`: measure the KV link from this prefill worker to a running decode worker.

What `cedserve bench kv-transfer --prefill-address --decode-address` (and the chart's `helm test`)
asks for; docs/kv_transfer.md, *Link probe between running workers*. One probe:

1. take `n = ceil(num_bytes / block_bytes)` scratch blocks here (RESOURCE_EXHAUSTED, nothing taken,
   when they are not free) and fill them with `pattern(seed)`;
2. `Reserve` n blocks on the decode worker through its normal path: no prompt (nothing matched or
   cached there), lease = the probe's time left, and no Decode call ever follows, so nothing joins a
   batch. Its RESOURCE_EXHAUSTED comes back as ours;
3. open the reservation and WRITE the blocks over this worker's NIXL agent in one
   `write_blocks(last=True)`; the sender's `TransferResult` gives the seconds (first chunk to DONE),
   the bytes and the descriptors;
4. `CheckProbe` on the decode worker: it hashes the received blocks, compares with our digest, and
   frees the lease;
5. on every path our blocks are freed once the transfer has let go of them (its `on_finish`), and a
   lease the decode worker did not free is cancelled there (it also ends with its deadline).

Probes run one at a time per worker; calls to the decode worker carry the KV-transfer token and use
the worker's `[internal_tls]`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Protocol

import grpc
import numpy as np
import torch

from cedserve.common.credentials import token_metadata
from cedserve.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    ServingError,
    UnavailableError,
)
from cedserve.common.tls import TLSConfig, open_channel
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.link_probe import DEFAULT_TIMEOUT_S, digest, pattern
from cedserve.kv_transfer.protocol import KVSender, Reservation
from cedserve.kv_transfer.state import TransferResult
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.model.cache.block_pool import scatter_rows
from cedserve.model.cache.errors import CacheExhaustedError
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.metrics import PrefillMetrics
from cedserve.prefill_workers.service import PeerBook
from cedserve.prefill_workers.validation import TransferTarget
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc
from cedserve.serving.drain import DrainController
from cedserve.serving.errors import detail_from_rpc_error, error_from_wire

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 2.0
FREE_WAIT_S = 2.0
"""How long the reply waits for our blocks to be back in the pool (so a caller polling load sees them)."""

_REMOTE_CODES: dict[grpc.StatusCode, wpb.ErrorCode] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: wpb.ERROR_CODE_RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: wpb.ERROR_CODE_DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND: wpb.ERROR_CODE_NOT_FOUND,
}


class ProbeAgent(Protocol):
    """What the prober needs of this worker's transfer agent."""

    @property
    def name(self) -> str: ...

    @property
    def control_address(self) -> str: ...

    def sender(self) -> KVSender: ...


class ScratchBlocks:
    """The probe's blocks on this worker. Freed exactly once, on the engine thread, once the probe
    let go of them (`release`) and no transfer can still read them (`opened` ... `finished`)."""

    def __init__(self, engine: PrefillEngine, owner: str, block_ids: list[int]) -> None:
        self.engine = engine
        self.owner = owner
        self.block_ids = block_ids
        self.freed = threading.Event()
        self._lock = threading.Lock()
        self._opened = self._finished = self._released = self._queued = False

    def opened(self) -> None:
        """A transfer reads the blocks from now until `finished`."""
        with self._lock:
            self._opened = True

    def finished(self, result: TransferResult | None = None) -> None:
        """The transfer's `on_finish` (any thread)."""
        with self._lock:
            self._finished = True
        self._maybe_free()

    def release(self) -> None:
        with self._lock:
            self._released = True
        self._maybe_free()

    def _maybe_free(self) -> None:
        with self._lock:
            if self._queued or not self._released or (self._opened and not self._finished):
                return
            self._queued = True
        self.engine.call_soon(self._free)

    def _free(self) -> None:
        self.engine.cache.free(self.owner)
        self.freed.set()


class LinkProber:
    """Runs `ProbeLink` (see the module docstring). Thread-safe; one probe at a time."""

    def __init__(self, engine: PrefillEngine, agent: ProbeAgent, peers: PeerBook, tls: TLSConfig, token: str,
                 drain: DrainController, metrics: PrefillMetrics) -> None:
        self.engine = engine
        self.agent = agent
        self.peers = peers
        self.tls = tls
        self.metadata = token_metadata(token)
        self.drain = drain
        self.metrics = metrics
        self._lock = threading.Lock()

    def probe(self, request: wpb.ProbeLinkRequest, time_left_s: float | None = None) -> wpb.ProbeLinkReply:
        """One probe; a `ServingError` (or `KVTransferError`) names what failed. `time_left_s`: the
        caller's deadline, which bounds the request's `timeout_ms`."""
        timeout_s = request.timeout_ms / 1000 or DEFAULT_TIMEOUT_S
        if time_left_s is not None:
            timeout_s = min(timeout_s, time_left_s)
        deadline_s = time.monotonic() + timeout_s
        try:
            self._validate(request)
            with self._lock:
                reply = self._probe(request, deadline_s)
        except Exception as exc:
            self.metrics.link_probes.labels(_outcome(exc)).inc()
            raise
        self.metrics.link_probes.labels("ok" if reply.verified else "mismatch").inc()
        self.metrics.link_probe_gbps.labels(reply.decode_agent).set(reply.gbps)
        return reply

    def _validate(self, request: wpb.ProbeLinkRequest) -> None:
        if not request.decode_address:
            raise InvalidArgumentError("the decode worker's address is empty", field="decode_address")
        if request.num_bytes == 0:
            raise InvalidArgumentError("num_bytes must be positive", field="num_bytes")
        if self.drain.draining:
            raise UnavailableError("worker is draining: no link probes")
        cache = self.engine.cache
        need = -(-request.num_bytes // cache.layout.block_bytes)
        free = self.engine.stats().free_blocks
        if need > free:
            raise ResourceExhaustedError(f"{request.num_bytes} bytes need {need} blocks of "
                                         f"{cache.layout.block_bytes} B; this prefill worker has {free} free "
                                         f"(of {cache.pool.num_blocks})", field="num_bytes")

    def _probe(self, request: wpb.ProbeLinkRequest, deadline_s: float) -> wpb.ProbeLinkReply:
        start = time.monotonic()
        rid = f"link-probe-{uuid.uuid4().hex[:16]}"
        block_bytes = self.engine.cache.layout.block_bytes
        num_blocks = -(-request.num_bytes // block_bytes)
        blocks = self._allocate(rid, num_blocks)
        try:
            data = pattern(request.seed, num_blocks * block_bytes)
            self._fill(blocks.block_ids, data)
            expected = digest(data)
            with open_channel(request.decode_address, self.tls) as channel:
                decode = _DecodeSide(wpb_grpc.DecodeWorkerStub(channel), request.decode_address,  # type: ignore[no-untyped-call]
                                     self.metadata, rid)
                lease = decode.reserve(num_blocks * self.engine.cache.block_size, self.agent, deadline_s)
                try:
                    reservation = decode.reservation(lease, num_blocks)
                    self.peers.ensure(_target(lease, reservation), rid)
                    result = self._send(reservation, blocks, deadline_s)
                    checked = decode.check(lease.lease_id, expected, deadline_s)
                except BaseException:
                    decode.cancel(lease.lease_id)
                    raise
        finally:
            blocks.release()
        blocks.freed.wait(FREE_WAIT_S)
        return wpb.ProbeLinkReply(
            num_bytes=result.num_bytes, num_blocks=num_blocks, block_bytes=block_bytes,
            transfer_s=result.duration_s, gbps=result.gbps, descriptors=result.num_descriptors,
            verified=checked.verified and checked.sha256 == expected, sha256=expected,
            received_sha256=checked.sha256, wall_s=time.monotonic() - start, prefill_agent=self.agent.name,
            decode_agent=lease.agent_name)

    def _allocate(self, owner: str, num_blocks: int) -> ScratchBlocks:
        try:
            ids = self.engine.call(lambda: self.engine.cache.allocate_scratch(owner, num_blocks))
        except CacheExhaustedError as exc:
            raise ResourceExhaustedError(f"this prefill worker cannot hold {num_blocks} probe blocks: {exc}",
                                         field="num_bytes", request_id=owner) from None
        return ScratchBlocks(self.engine, owner, ids)

    def _fill(self, block_ids: list[int], data: np.ndarray) -> None:
        storage = self.engine.cache.pool.storage
        scatter_rows(storage, block_ids, torch.from_numpy(data).view(len(block_ids), -1))
        if storage.is_cuda:
            torch.cuda.synchronize(storage.device)  # the NIXL WRITE must read the final bytes

    def _send(self, reservation: Reservation, blocks: ScratchBlocks, deadline_s: float) -> TransferResult:
        """WRITE our blocks into the reservation; the sender's result. Our blocks stay ours until the
        transfer's `on_finish` (`blocks.finished`), whatever happens here."""
        sender, rid = self.agent.sender(), reservation.request_id
        try:
            sender.open(reservation, timeout_s=max(deadline_s - time.monotonic(), 1e-3), on_finish=blocks.finished)
        except ValueError as exc:
            raise UnavailableError(f"cannot send to {reservation.receiver!r}: {exc}", request_id=rid) from None
        blocks.opened()
        try:
            sender.write_blocks(rid, blocks.block_ids, last=True)
            # The transfer's own deadline (above) ends it first; the slack covers its release.
            return sender.wait(rid, max(deadline_s - time.monotonic(), 0.0) + 5.0)
        except TimeoutError:
            sender.abort(rid, FailureCause.DEADLINE, "link probe timed out")
            raise DeadlineExceededError("the link probe's transfer did not end in time", request_id=rid) from None
        except BaseException:
            sender.abort(rid, FailureCause.CANCELLED, "link probe failed")
            raise


class _DecodeSide:
    """The decode worker's calls of one probe (token metadata on each; errors as `ServingError`)."""

    def __init__(self, stub: wpb_grpc.DecodeWorkerStub, address: str, metadata: tuple[tuple[str, str], ...],
                 request_id: str) -> None:
        self.stub, self.address, self.metadata, self.request_id = stub, address, metadata, request_id

    def reserve(self, prompt_tokens: int, agent: ProbeAgent, deadline_s: float) -> wpb.ReserveReply:
        left = _left(deadline_s, self.request_id)
        request = wpb.ReserveRequest(request_id=self.request_id, prompt_tokens=prompt_tokens,
                                     lease_ms=max(1, int(left * 1000)), sender_agent=agent.name,
                                     sender_control_address=agent.control_address, ship_state=False)
        try:
            reply: wpb.ReserveReply = self.stub.Reserve(request, timeout=left, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, "Reserve") from None
        return reply

    def reservation(self, lease: wpb.ReserveReply, num_blocks: int) -> Reservation:
        if not lease.HasField("reservation") or len(lease.reservation.block_ids) != num_blocks:
            got = len(lease.reservation.block_ids) if lease.HasField("reservation") else 0
            raise UnavailableError(f"decode worker at {self.address} reserved {got} blocks to receive, not "
                                   f"{num_blocks} (is it another block size?)", request_id=self.request_id)
        return reservation_from_pb(lease.reservation)

    def check(self, lease_id: str, expected: str, deadline_s: float) -> wpb.CheckProbeReply:
        request = wpb.CheckProbeRequest(request_id=self.request_id, lease_id=lease_id, sha256=expected)
        try:
            reply: wpb.CheckProbeReply = self.stub.CheckProbe(request, timeout=_left(deadline_s, self.request_id),
                                                              metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, "CheckProbe") from None
        return reply

    def cancel(self, lease_id: str) -> None:
        """Free the probe's lease there now (best effort: it also ends with its deadline)."""
        try:
            self.stub.Cancel(wpb.CancelRequest(request_id=self.request_id, lease_id=lease_id),
                             timeout=CANCEL_TIMEOUT_S, metadata=self.metadata)
        except grpc.RpcError as exc:
            log.warning("link probe %s: Cancel on %s failed (%s); the lease ends with its deadline",
                        self.request_id, self.address, exc.code().name)

    def _error(self, exc: grpc.RpcError, call: str) -> ServingError:
        detail = detail_from_rpc_error(exc)
        text = detail.message if detail is not None else exc.details()
        if detail is None:
            detail = wpb.ErrorDetail(code=_REMOTE_CODES.get(exc.code(), wpb.ERROR_CODE_UNAVAILABLE))
        detail.request_id = self.request_id
        return error_from_wire(detail, f"decode worker at {self.address}: {call}: {exc.code().name}: {text}")


def _target(lease: wpb.ReserveReply, reservation: Reservation) -> TransferTarget:
    return TransferTarget(worker_id="", agent_name=lease.agent_name, control_address=lease.control_address,
                          lease_id=lease.lease_id, num_cached_blocks=0, reservation=reservation)


def _left(deadline_s: float, request_id: str) -> float:
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError("the link probe ran out of time", request_id=request_id)
    return left


def _outcome(exc: BaseException) -> str:
    """The metric label of a failed probe: the error's kind."""
    if isinstance(exc, ServingError):
        return exc.kind.value
    return "transfer_failed" if isinstance(exc, KVTransferError) else "internal"
