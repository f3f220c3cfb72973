"""The `cedserve.v1.PrefillWorker` gRPC service over a `PrefillEngine`.

`Prefill` checks the request (`validation`), makes sure the decode worker's transfer agent is a known
peer (one handshake per peer), submits it, and streams the job's events: `first_token` as soon as
the engine has it, then `done`, or `error`, which is also the call's final status (with the
`ErrorDetail` in trailing metadata, see `cedserve.serving.errors`). A client that goes away cancels the
request: its transfer is aborted and its blocks freed.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import grpc

from cedserve.common.errors import InvalidArgumentError, ServingError, UnavailableError
from cedserve.kv_transfer.errors import CompatibilityError, HandshakeError, KVTransferError
from cedserve.kv_transfer.link_probe import check_token
from cedserve.model.cache.events import KVEventBatch
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.job import PrefillFailure, PrefillJob
from cedserve.prefill_workers.validation import RequestLimits, TransferTarget, validate_prefill
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc
from cedserve.serving.drain import DrainController
from cedserve.serving.errors import abort, error_detail, fail_stream
from cedserve.serving.kv_events import KVEventFeed
from cedserve.serving.load import SeqCounter

if TYPE_CHECKING:
    from cedserve.prefill_workers.link_probe import LinkProber

log = logging.getLogger(__name__)
EVENT_POLL_S = 0.25


class PeerConnector(Protocol):
    """What the service needs of the transfer agent: its peers, and handshakes with decode workers."""

    @property
    def name(self) -> str: ...

    def peers(self) -> dict[str, bool]:
        """Handshaken peers by agent name -> alive."""
        ...

    def handshake(self, address: str, timeout_s: float = 5.0) -> str:
        """Connect and check compatibility; the peer's agent name. `CompatibilityError`, `HandshakeError`.
        Concurrent calls for one address share one exchange; a live connection is kept."""
        ...


class PeerBook:
    """Makes sure a request's decode agent is a live peer (thread-safe). Normally the decode worker
    handshook with us before reserving (a reservation names its sender); a handshake from this side
    happens for a peer we do not know or declared dead. The agent makes that safe to race: requests
    that find the peer missing at once share one handshake, and one that crosses the decode
    worker's own keeps the connection (see `NixlTransferAgent.handshake`)."""

    def __init__(self, agent: PeerConnector | None, timeout_s: float) -> None:
        self._agent = agent
        self._timeout_s = timeout_s

    def ensure(self, target: TransferTarget, request_id: str) -> None:
        """Handshake with the target's agent unless it is a live peer. `UnavailableError` if it cannot
        be reached, `InvalidArgumentError` if it is another model or layout."""
        if self._agent is None or self._agent.peers().get(target.agent_name):
            return
        self._handshake(target, request_id)

    def _handshake(self, target: TransferTarget, rid: str) -> None:
        assert self._agent is not None
        if not target.control_address:
            raise InvalidArgumentError(f"agent {target.agent_name!r} is not a known peer and the target has no "
                                       "control_address to handshake with", field="target.control_address",
                                       request_id=rid)
        try:
            name = self._agent.handshake(target.control_address, self._timeout_s)
        except CompatibilityError as exc:
            raise InvalidArgumentError(str(exc), field="target.agent_name", request_id=rid) from None
        except HandshakeError as exc:
            raise UnavailableError(str(exc), request_id=rid) from None
        if name != target.agent_name:
            raise InvalidArgumentError(f"{target.control_address} is agent {name!r}, not {target.agent_name!r}",
                                       field="target.agent_name", request_id=rid)


class PrefillService(wpb_grpc.PrefillWorkerServicer):
    """gRPC handlers; every one is thread-safe (the engine serialises the work)."""

    def __init__(self, engine: PrefillEngine, limits: RequestLimits, peers: PeerBook, feed: KVEventFeed,
                 drain: DrainController, identity: Callable[[], tuple[str, str]],
                 prober: LinkProber | None = None, token: str = "") -> None:
        self.engine = engine
        self.prober = prober
        self._token = token  # the KV-transfer token: ProbeLink's credential
        self.limits = limits
        self.peers = peers
        self.feed = feed
        self.drain = drain
        self._identity = identity  # () -> (agent name, control address)
        self._seq = SeqCounter()

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> Iterator[wpb.PrefillEvent]:
        try:
            job = self._submit(request)
        except ServingError as exc:
            detail = error_detail(exc, request.request_id)
            yield wpb.PrefillEvent(error=detail)
            fail_stream(context, detail)
            return
        context.add_callback(lambda: self.engine.cancel(job.request_id, "the caller went away"))
        yield from self._stream(job, context)

    def _submit(self, request: wpb.PrefillRequest) -> PrefillJob:
        if self.drain.draining:
            raise UnavailableError("worker is draining; retry on another prefill worker",
                                   retry_after_ms=self.engine.config.retry_after_ms, request_id=request.request_id)
        spec = validate_prefill(request, self.limits)
        if spec.target is not None:
            self.peers.ensure(spec.target, spec.request_id)
        return self.engine.submit(spec)

    def _stream(self, job: PrefillJob, context: grpc.ServicerContext) -> Iterator[wpb.PrefillEvent]:
        while True:
            try:
                event = wire_event(job.events.get(timeout=EVENT_POLL_S), job.request_id)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            kind = event.WhichOneof("event")
            if kind == "first_token":
                self.engine.metrics.phases["handoff"].observe(self.engine.clock() - job.first_token_s)
            yield event
            if kind == "error":
                fail_stream(context, event.error)
                return
            if kind == "done":
                return

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelReply:
        found = any(self.engine.cancel(key, "cancelled by Cancel") for key in (request.request_id, request.lease_id)
                    if key)
        return wpb.CancelReply(found=found)

    def GetLoad(self, request: wpb.LoadRequest, context: grpc.ServicerContext) -> wpb.LoadReport:
        stats = self.engine.stats()
        agent, control = self._identity()
        return wpb.LoadReport(worker_id=self.engine.config.worker_id, role="prefill", seq=self._seq.next(),
                              queued_tokens=stats.queued_tokens, running_requests=stats.running_requests,
                              free_blocks=stats.free_blocks, total_blocks=stats.total_blocks,
                              prefill_tokens_per_s=stats.tokens_per_s, agent_name=agent, control_address=control,
                              held_blocks=stats.held_blocks, cached_blocks=stats.cached_blocks)

    def StreamKVEvents(self, request: wpb.KVEventsRequest,
                       context: grpc.ServicerContext) -> Iterator[wpb.KVEventBatch]:
        yield from self.feed.stream(request.since_seq, self._snapshot, context)

    def _snapshot(self) -> KVEventBatch:
        return self.engine.call(self.engine.cache.snapshot_events)

    def ProbeLink(self, request: wpb.ProbeLinkRequest, context: grpc.ServicerContext) -> wpb.ProbeLinkReply:
        """Measure the KV link to a decode worker (`link_probe.py`); needs the KV-transfer token."""
        check_token(context, self._token, "ProbeLink")
        if self.prober is None:
            abort(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_UNAVAILABLE, message="this worker has no transfer agent"))
        assert self.prober is not None
        try:
            return self.prober.probe(request, context.time_remaining())
        except (ServingError, KVTransferError) as exc:
            abort(context, error_detail(exc))
            raise  # not reached: abort raised


def add_prefill_service(server: grpc.Server, service: PrefillService) -> None:
    wpb_grpc.add_PrefillWorkerServicer_to_server(service, server)  # type: ignore[no-untyped-call]


def wire_event(event: wpb.PrefillEvent | PrefillFailure, request_id: str) -> wpb.PrefillEvent:
    """A job's event as the wire carries it: a failure becomes its `ErrorDetail` here, in the
    service layer, the only place that maps domain errors to the wire."""
    if isinstance(event, PrefillFailure):
        return wpb.PrefillEvent(error=error_detail(event.error, request_id))
    return event
